"""The runtime half of a distribution scheme: executing a plan over a communicator.

The preconditioner (:mod:`dpkfac.preconditioner`) is the one orchestrator.
At each point of an iteration it asks the strategy, and the strategy asks its
:class:`~dpkfac.plan.Plan` (``plan.captures(rank, layer)``, ...): roles are
stated once, by the scheme's pure half (:mod:`dpkfac.plan`), and read here
and by the cost model alike. A strategy owns the communication points of an
iteration (gradients, factors, decompositions, preconditioned updates); every
collective goes through its :class:`~dpkfac.comm.Communicator`, so bytes and
waiting time are accounted in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from torch import nn

from dpkfac.comm import Communicator, Handle
from dpkfac.curvature import Decomposition, KFACLayer
from dpkfac.curvature.decomposition import working_dtype
from dpkfac.curvature.layer import FACTORS
from dpkfac.options import KFACOptions, StrategyOptions
from dpkfac.plan import LayerShape, Placement, Plan, Scheme, Traits
from dpkfac.plan.exchange import (
    Transfer,
    decomposition_transfers,
    factor_transfers,
    gradient_layout,
    update_layout,
    update_shapes,
)
from dpkfac.plan.roles import RankRoles

#: The options class of a strategy: its scheme's ``Options``.
OptionsT = TypeVar("OptionsT", bound=StrategyOptions)
#: A layout's positions, and what a step puts in them.
I = TypeVar("I")
T = TypeVar("T")


@dataclass
class Preconditioned:
    """One layer's update direction after preconditioning.

    Attributes:
        matrix: (d_out, a_dim) update; the averaged gradient when not preconditioned.
        vg: ``⟨V, ∇W⟩`` for the KL clip, a device scalar in at least float32
            (0 when not preconditioned).
        preconditioned: whether ``matrix`` is a preconditioned gradient: a
            bool where this rank computed it, a boolean device scalar where it
            arrived by broadcast (reading it would cost a host sync).
    """

    matrix: torch.Tensor
    vg: torch.Tensor
    preconditioned: bool | torch.Tensor


def precondition_layer(layer: KFACLayer, grad: torch.Tensor, damping: float) -> Preconditioned:
    """One layer's update from its averaged gradient matrix, with ⟨V, ∇W⟩ for the KL clip.

    ⟨V, ∇W⟩ stays on the device (no host sync per layer), in at least float32
    so a half-precision model cannot overflow it. Without decompositions the
    update is the gradient itself, not preconditioned.
    """
    v = layer.preconditioned_grad(damping, grad)
    kl_dtype = torch.promote_types(grad.dtype, torch.float32)
    if v is None:
        return Preconditioned(grad, grad.new_zeros((), dtype=kl_dtype), False)
    return Preconditioned(v, (v.to(kl_dtype) * grad.to(kl_dtype)).sum(), True)


def sent_updates(
    roles: RankRoles, senders: Sequence[int], layers: Sequence[KFACLayer]
) -> list[list[KFACLayer]]:
    """Per rank of ``senders``, the layers whose update it sends (``roles.senders``, the
    plan's :meth:`~dpkfac.plan.Plan.update_senders`), those with a gradient, in module order.

    The same lists on every rank (a layer without a gradient this step sends
    nothing anywhere), so every rank sizes the exchange alike. One pass over
    the layers, not one per sender: a rank asks this every step, for up to P
    senders.
    """
    at = {r: i for i, r in enumerate(senders)}
    out: list[list[KFACLayer]] = [[] for _ in at]
    for x in layers:
        if x.module.weight.grad is None:
            continue
        for src in roles.senders[x.name]:
            if (i := at.get(src)) is not None:
                out[i].append(x)
    return out


def on_items(layout: Transfer[I], item: Callable[[I], T]) -> Transfer[T]:
    """A transfer of a layout (:func:`~dpkfac.plan.exchange.gradient_layout`,
    :func:`~dpkfac.plan.exchange.update_layout`) with this step's ``item`` at each position."""
    shards = tuple(tuple(item(i) for i in shard) for shard in layout.shards)
    return Transfer(layout.kind, shards, layout.root)


def update_buffers(
    layer: KFACLayer, result: Preconditioned | None, *, with_kl: bool
) -> list[torch.Tensor]:
    """The buffers one layer's update travels in, in a fused broadcast bucket, as
    :func:`~dpkfac.plan.exchange.update_shapes` lays them out.

    The sender passes its ``result``; a receiver passes None and gets empty
    buffers of the right shapes. With the KL clip on, the update travels with
    ⟨V, ∇W⟩ and its "preconditioned" flag, in at least float32.
    """
    shape, *kl = update_shapes(layer.helper.g_dim, layer.helper.a_dim, with_kl=with_kl)
    if result is not None:
        matrix = result.matrix.contiguous()
        if not kl:
            return [matrix]
        flag = result.preconditioned
        flag_value = (
            flag.to(result.vg.dtype)
            if isinstance(flag, torch.Tensor)
            else torch.full_like(result.vg, float(flag))
        )
        return [matrix, torch.stack([result.vg, flag_value])]
    grad = layer.helper.module.weight.grad
    assert grad is not None, "only a layer with a gradient is sent"
    matrix = grad.new_empty(shape)
    meta_dtype = torch.promote_types(matrix.dtype, torch.float32)
    return [matrix, *(matrix.new_zeros(s, dtype=meta_dtype) for s in kl)]


def received_updates(
    sent: Sequence[KFACLayer], buffers: Sequence[torch.Tensor], *, with_kl: bool
) -> dict[str, Preconditioned]:
    """The updates of one broadcast bucket, by layer name, as its buffers hold them.

    A bucket holds each layer's update matrix and, with the KL clip on, its
    two scalars (⟨V, ∇W⟩, and whether it is preconditioned) right after it.
    """
    step = 2 if with_kl else 1
    out: dict[str, Preconditioned] = {}
    for i, layer in enumerate(sent):
        matrix = buffers[i * step]
        if with_kl:
            meta = buffers[i * step + 1]
            out[layer.name] = Preconditioned(matrix, meta[0], meta[1] > 0.5)
        else:
            out[layer.name] = Preconditioned(matrix, matrix.new_zeros(()), True)
    return out


def launch_gradients(
    comm: Communicator,
    transfer: Transfer[torch.Tensor],
    *,
    cap_bytes: int | None = None,
    overlapped: bool = False,
) -> list[Handle]:
    """Launch one transfer of :func:`dpkfac.plan.exchange.gradient_transfers` (async): the one
    way gradients are reduced, from ``step()`` and from the overlapped engine alike.

    An all-reduce averages its gradients on every rank; a reduce-scatter averages each
    owner's onto it, in one call where they share a dtype, else by one rooted reduce per
    owner (no single flat buffer). ``overlapped``: as
    :meth:`~dpkfac.comm.Communicator.reduce_scatter_mean` takes it (the overlapped
    engine's buckets).
    """
    cat, (first, *_) = "grad_allreduce", transfer.shards
    if transfer.kind == "allreduce":
        return [
            comm.allreduce_mean(
                first, cat, cap_bytes=cap_bytes, async_op=True, overlapped=overlapped
            )
        ]
    assert transfer.kind == "reduce_scatter", transfer.kind
    shards = [list(s) for s in transfer.shards]
    if len({g.dtype for s in shards for g in s}) > 1:
        with comm.together():  # the owners' reduces crossing on the links
            return [
                comm.reduce_mean(s, r, cat, cap_bytes=cap_bytes, async_op=True)
                for r, s in enumerate(shards)
            ]
    handle = comm.reduce_scatter_mean(
        shards, cat, cap_bytes=cap_bytes, async_op=True, overlapped=overlapped
    )
    return [handle]


@dataclass
class InFlightUpdates:
    """An update exchange once launched: the layers each buffer list carries and the handles
    to wait for; :meth:`received` reads the updates once they are waited for."""

    parts: list[tuple[Sequence[KFACLayer], list[torch.Tensor]]]
    handles: list[Handle]

    def received(self, *, with_kl: bool) -> dict[str, Preconditioned]:
        """Every exchanged update (the sender's own included), by layer name."""
        out: dict[str, Preconditioned] = {}
        for sent, buffers in self.parts:
            out.update(received_updates(sent, buffers, with_kl=with_kl))
        return out


def launch_updates(
    comm: Communicator,
    owner_reduction: bool,
    sent_by: Sequence[Sequence[KFACLayer]],
    results: dict[str, Preconditioned],
    *,
    with_kl: bool,
    cap_bytes: int | None,
) -> InFlightUpdates:
    """Launch the update exchange of :func:`dpkfac.plan.exchange.update_transfers`: the one
    way every update travels, from ``step()`` and from the overlapped engine alike.

    Args:
        comm: the communicator of the update group (group position i is its rank i).
        owner_reduction: the plan's ``traits.owner_grad_reduction`` (the exchange's form).
        sent_by: per group position, the layers whose update it sends (:func:`sent_updates`).
        results: what this rank computed, by layer name (its own position's layers).
        with_kl: whether the KL-clip scalars travel with the updates.
        cap_bytes: the fused buffers' size cap.
    """
    parts: list[tuple[Sequence[KFACLayer], list[torch.Tensor]]] = []
    handles: list[Handle] = []

    def buffers(position: int, layers: Sequence[KFACLayer]) -> list[torch.Tensor]:
        mine = position == comm.rank
        return [
            b
            for x in layers
            for b in update_buffers(x, results[x.name] if mine else None, with_kl=with_kl)
        ]

    cat = "precond_broadcast"
    counts = tuple(len(s) for s in sent_by)
    # Several roots' broadcasts cross on the links only with their calls taking turns.
    with comm.together():
        for layout in update_layout(owner_reduction, counts):
            transfer = on_items(layout, lambda rj: sent_by[rj[0]][rj[1]])
            if transfer.kind == "broadcast":
                sent = buffers(transfer.root, transfer.shards[0])
                handles.append(
                    comm.broadcast(sent, transfer.root, cat, cap_bytes=cap_bytes, async_op=True)
                )
                parts.append((transfer.shards[0], sent))
                continue
            by = [buffers(r, shard) for r, shard in enumerate(transfer.shards)]
            for dtype in sorted({b.dtype for bs in by for b in bs}, key=str):  # one per dtype
                shards = [[b for b in bs if b.dtype == dtype] for bs in by]
                handles.append(comm.all_gather(shards, cat, cap_bytes=cap_bytes, async_op=True))
            parts += zip(transfer.shards, by, strict=True)
    return InFlightUpdates(parts, handles)


def layer_shape(layer: KFACLayer, batch_size: int, positions: int) -> LayerShape:
    """The cost-model view of a layer, with the batch statistics all ranks agreed on."""
    kind = "conv2d" if isinstance(layer.module, nn.Conv2d) else "linear"
    return LayerShape(
        layer.name,
        kind,
        layer.helper.a_dim,
        layer.helper.g_dim,
        positions=max(1, int(positions)),
        batch_size=max(1, int(batch_size)),
    )


class Strategy(Generic[OptionsT]):
    """Communication points of one distribution scheme, executing its plan.

    Args:
        comm: accounted collectives over the preconditioner's process group.
        method: decomposition class of the compute method ("eigen"/"inverse").
        options: this strategy's resolved or unresolved :attr:`Options`
            (default: all defaults); the preconditioner resolves "auto"
            (:meth:`configure`) before the first placement.
        decomposition_dtype: dtype decompositions run in (receive buffers use it too).
        bucket_cap_mb: size cap of fused buckets.
        kfac: the preconditioner's common options.
    """

    #: The scheme this strategy executes (its pure half).
    scheme: ClassVar[type[Scheme]]

    def __init__(
        self,
        comm: Communicator,
        method: type[Decomposition],
        options: StrategyOptions | None = None,
        *,
        decomposition_dtype: torch.dtype = torch.float32,
        bucket_cap_mb: float = 25.0,
        kfac: KFACOptions | None = None,
    ) -> None:
        options = self._checked(options)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.scheme.check_world_size(options, comm.size)
        #: This strategy's own options (resolved by :meth:`configure`).
        self.options: OptionsT = options
        self._traits: tuple[StrategyOptions, Traits] | None = None
        self.comm = comm
        self.method = method
        self.decomposition_dtype = decomposition_dtype
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        #: The preconditioner's common options (update schedule, compute method).
        self.kfac = KFACOptions() if kfac is None else kfac
        #: The run's plan: None until the options are resolved and the layers placed.
        self.plan: Plan | None = None
        #: This rank's view of the plan, read from it once per placement (None: no plan).
        self.roles: RankRoles | None = None
        #: Lazy factor sync: whether the running factors changed since they were averaged.
        self.unsynced = False
        #: Whether the plan is final (made from the shapes all ranks agreed on).
        self.placed = False
        self.factor_comm = comm
        self._decomposition_comm: Communicator | None = None
        self._update_comm: Communicator | None = None
        self._configured = False
        if self.scheme.resolved(options):
            self.configure(options)

    #: The scheme's registered name (set from ``scheme`` for every subclass).
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.scheme.name

    def _checked(self, options: StrategyOptions | None) -> OptionsT:
        """``options`` as the scheme checks them: an instance of ``scheme.Options``.

        Each subclass names its scheme's ``Options`` as its ``OptionsT``; a
        ClassVar cannot hold the type variable that would tie the two, hence the cast.
        """
        return cast(OptionsT, self.scheme.check(options))

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    @property
    def traits(self) -> Traits:
        """What this strategy does with its options, derived once per options (the step
        reads it several times; :meth:`configure` replaces the options)."""
        if self._traits is None or self._traits[0] is not self.options:
            self._traits = (self.options, self.scheme.traits(self.options))
        return self._traits[1]

    # --------------------------------------------------------------- the plan
    def configure(self, options: StrategyOptions) -> None:
        """Take resolved options and make the process groups their plan names (collective).

        Every rank calls it with the same options: at construction when
        nothing is left to choose, else once the preconditioner has resolved
        "auto" at the first step. The groups depend on the world size and the
        options only, not on the shapes.
        """
        self.options = self._checked(options)
        p = self.world_size
        factor_groups = self.scheme.factor_groups(p, self.options)
        decomposition_groups = self.scheme.decomposition_groups(p, self.options)
        update_groups = self.scheme.update_groups(p, self.options)
        # Creating a process group is a collective: every rank makes all of them, in order.
        factor_comm = self._own(factor_groups, self.comm.subgroups(factor_groups))
        assert factor_comm is not None, "the factor groups partition the ranks"
        self.factor_comm = factor_comm
        self._decomposition_comm = self._own(
            decomposition_groups, self.comm.subgroups(decomposition_groups)
        )
        self._update_comm = self._own(update_groups, self.comm.subgroups(update_groups))
        self._configured = True

    def _own(
        self, groups: Sequence[Sequence[int]], comms: dict[int, Communicator]
    ) -> Communicator | None:
        """The communicator of the group this rank is in (None: it is in none)."""
        mine = next((i for i, g in enumerate(groups) if self.rank in g), None)
        return None if mine is None else comms.get(mine)

    @property
    def configured(self) -> bool:
        """Whether the options are resolved and the process groups made."""
        return self._configured

    def place(
        self,
        layers: Sequence[KFACLayer],
        shapes: Sequence[LayerShape],
        *,
        final: bool = False,
        given: StrategyOptions | None = None,
    ) -> None:
        """Make the plan for these shapes and write its placement into the layers.

        Called at construction with nominal shapes (nothing while options are
        left to choose) and with ``final`` at the first ``step()`` with the
        shapes all ranks agreed on; the placement is then final.
        """
        if not self._configured:
            return
        self._adopt(self.scheme.plan(shapes, self.world_size, self.options, given=given))
        assert self.plan is not None
        for i, layer in enumerate(layers):
            placement = self.plan.placement
            layer.set_placement(
                placement.owner[i], placement.a_decomposer[i], placement.g_decomposer[i]
            )
        self.placed = self.placed or final

    def restore(self, layers: Sequence[KFACLayer], *, given: StrategyOptions | None = None) -> None:
        """Make the plan again from the placement a checkpoint wrote into the layers."""
        if not self._configured:
            return
        placement = Placement(
            tuple(x.owner for x in layers),
            tuple(x.factors["A"].decomposer for x in layers),
            tuple(x.factors["G"].decomposer for x in layers),
        )
        shapes = [layer_shape(x, 1, 1) for x in layers]
        self._adopt(
            self.scheme.plan(
                shapes, self.world_size, self.options, given=given, placement=placement
            )
        )

    def _adopt(self, plan: Plan) -> None:
        """Take ``plan`` as the run's, and read this rank's roles from it once."""
        self.plan = plan
        self.roles = plan.roles_of(self.rank)

    # ----------------------------------------------------------------- queries
    def captures(self, layer: KFACLayer) -> bool:
        """Whether this rank builds the layer's factors from its local batch.

        Until the placement is final every rank captures every layer, so the
        first step loses nothing; those the plan gives to others are then dropped.
        """
        return not self.placed or self.roles is None or layer.name in self.roles.captures

    def decomposes(self, layer: KFACLayer, which: str) -> bool:
        """Whether this rank computes the decomposition of factor ``which`` ("A"/"G")."""
        return self.roles is None or (layer.name, which) in self.roles.decomposes

    def preconditions(self, layer: KFACLayer) -> bool:
        """Whether this rank preconditions the layer's gradient."""
        return self.roles is not None and layer.name in self.roles.preconditions

    @property
    def replicated_state(self) -> bool:
        """Whether every rank holds every layer's factors and decompositions.

        False where owners alone hold factors (dp_kfac, grouped) or gradient
        workers alone hold decompositions (kaisa with f < 1): a checkpoint then
        gathers the pieces onto rank 0.
        """
        traits = self.traits
        return traits.captures_all and traits.preconditions_all

    # ---------------------------------------------------- communication points
    def factor_ready(self, layer: KFACLayer, which: str) -> None:
        """Called from the capture hooks right after a batch factor is built."""

    def reduce_gradients(
        self, layers: Sequence[KFACLayer], other_params: Sequence[nn.Parameter]
    ) -> None:
        """Average the gradients across ranks (fused buckets), as
        :func:`~dpkfac.plan.exchange.gradient_transfers` says: every one on every rank, as
        plain data parallelism, or under the owner reduction each K-FAC layer's onto its
        owner (the rank that sends its update) and the others on every rank."""
        roles = self.roles if self.traits.owner_grad_reduction else None
        owner_of: dict[int, int] = {}
        grads: list[torch.Tensor] = []
        for layer in layers:
            for p in layer.helper.parameters():
                if (g := p.grad) is not None:
                    grads.append(g)
                    if roles is not None:
                        owner_of[id(g)] = roles.senders[layer.name][0]
        grads += [g for p in other_params if (g := p.grad) is not None]
        if not self.comm.active:
            return
        layout = gradient_layout(
            self.traits.owner_grad_reduction,
            tuple(owner_of.get(id(g)) for g in grads),
            self.world_size,
        )
        transfers = [on_items(t, grads.__getitem__) for t in layout]
        handles = [
            h
            for t in transfers
            for h in launch_gradients(self.comm, t, cap_bytes=self.bucket_cap_bytes)
        ]
        for handle in handles:
            self.comm.wait(handle)

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Turn pending local batch factors into what ``update_factors`` should fold in.

        With ``traits.factor_comm == "allreduce"`` (d_kfac, kaisa, grouped) the batch
        factors are averaged over the factor group by fused all-reduces (triangle-packed with
        ``traits.triangle``), or, lazily (``traits.lazy_factor_sync``), folded into the local
        running averages, which :meth:`sync_factors` averages before the next decomposition.
        Where no factor is communicated (dp_kfac) this does nothing; a pipelined scheme
        (spd_kfac) launches its own from :meth:`factor_ready`.
        """
        traits = self.traits
        if traits.factor_comm != "allreduce":
            return
        if traits.lazy_factor_sync:
            self.unsynced = self.unsynced or any(
                layer.has_pending(w) for layer in layers for w in FACTORS
            )
            return
        items = [(layer, w) for layer in layers for w in FACTORS if layer.has_pending(w)]
        for transfer in factor_transfers(traits.factor_comm, items):
            (sent,) = transfer.shards
            tensors = [layer.pending_factor(w) for layer, w in sent]
            self.factor_comm.allreduce_mean(
                tensors,
                "factor_allreduce",
                triangle=traits.triangle,
                cap_bytes=self.bucket_cap_bytes,
            )
            for (layer, which), tensor in zip(sent, tensors, strict=True):
                layer.set_pending(which, tensor)

    def sync_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Called on decomposition steps before decomposing: make the running factors final.

        Lazy synchronisation (``traits.lazy_factor_sync``): average the running factors over
        the factor group, in place, when they changed since they last were.
        """
        traits = self.traits
        if traits.factor_comm != "allreduce" or not traits.lazy_factor_sync or not self.unsynced:
            return
        self.unsynced = False
        held = [t for layer in layers for w in FACTORS if (t := layer.factor(w)) is not None]
        for transfer in factor_transfers(traits.factor_comm, held):
            self.factor_comm.allreduce_mean(
                list(transfer.shards[0]),
                "factor_allreduce",
                triangle=traits.triangle,
                cap_bytes=self.bucket_cap_bytes,
            )

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        """Each decomposer broadcasts the due decompositions it computed to its group.

        Args:
            layers: all K-FAC layers.
            updated: (layer name, factor) pairs whose decompositions were due this step.
        """
        group = None if self.roles is None else self.roles.decomposition_group
        if group is None or self._decomposition_comm is None:
            return
        self.broadcast_decompositions(self._decomposition_comm, group, layers, updated)

    def share_preconditioned(
        self,
        layers: Sequence[KFACLayer],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        """Make every layer's update available on every rank: in each update group, the
        layer's preconditioner there broadcasts it.

        Args:
            layers: all K-FAC layers.
            results: what this rank computed, by layer name.
            with_kl: whether the KL-clip terms must travel with the updates.

        Returns:
            The update of every layer that has a gradient, by layer name.
        """
        roles = self.roles
        group = None if roles is None else roles.update_group
        comm = self._update_comm
        if roles is None or group is None or comm is None or not comm.active:
            return results
        sent_by = sent_updates(roles, group, layers)
        cap = self.bucket_cap_bytes
        exchange = launch_updates(
            comm,
            roles.traits.owner_grad_reduction,
            sent_by,
            results,
            with_kl=with_kl,
            cap_bytes=cap,
        )
        for handle in exchange.handles:
            comm.wait(handle)
        return exchange.received(with_kl=with_kl)

    # --------------------------------------------- helpers of the rooted schemes
    def broadcast_decompositions(
        self,
        comm: Communicator,
        members: Sequence[int],
        layers: Sequence[KFACLayer],
        updated: set[tuple[str, str]],
    ) -> None:
        """Each member broadcasts the due decompositions it computed, one fused bucket each.

        Args:
            comm: the communicator of the group (``members[i]`` is its rank i).
            members: ranks of the preconditioner's group, in group order.
            layers: all K-FAC layers.
            updated: (layer name, factor) pairs whose decompositions were due.
        """
        if not comm.active:
            return
        sent_by = [
            [
                (layer, w)
                for layer in layers
                for w in FACTORS
                if (layer.name, w) in updated and self._sends_decomposition(src, layer, w)
            ]
            for src in members
        ]
        pending = []
        with comm.together():  # every root's calls taking turns on the links
            for transfer in decomposition_transfers(sent_by):
                position, (items, *_) = transfer.root, transfer.shards
                src = members[position]
                tensors: list[torch.Tensor] = []
                for layer, which in items:
                    if src == self.rank:
                        decomposition = layer.decomposition(which)
                        assert decomposition is not None, "a due decomposition is computed first"
                        tensors += decomposition.tensors()
                    else:
                        # A receiver may hold no factor of the layer (grouped's
                        # gradient workers outside the owner's factor group).
                        weight = layer.helper.module.weight
                        factor_dtype = self.kfac.factor_dtype or weight.dtype
                        dtype = working_dtype(factor_dtype, self.decomposition_dtype)
                        tensors += [
                            torch.empty(shape, dtype=dtype, device=weight.device)
                            for shape in self.method.shapes(layer.dim(which))
                        ]
                handle = comm.broadcast(
                    tensors,
                    position,
                    "decomposition_broadcast",
                    cap_bytes=self.bucket_cap_bytes,
                    async_op=True,
                )
                pending.append((src, items, tensors, handle))
        count = len(self.method.shapes(1))
        for src, items, tensors, handle in pending:
            comm.wait(handle)
            if src == self.rank:
                continue
            for i, (layer, which) in enumerate(items):
                chunk = tensors[i * count : (i + 1) * count]
                layer.set_decomposition(which, self.method.from_tensors(chunk))

    def _sends_decomposition(self, src: int, layer: KFACLayer, which: str) -> bool:
        return self.roles is not None and self.roles.decomposers[(layer.name, which)] == src

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Strategy state that must survive a checkpoint (placement lives in the layers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
