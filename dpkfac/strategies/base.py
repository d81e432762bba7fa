"""The interface every distribution scheme implements.

The generic step loop in :mod:`dpkfac.preconditioner` never asks "which
strategy is this?"; it asks the strategy object questions (does this rank
build this layer's factors? decompose this factor? precondition this layer?)
and hands it the communication points of an iteration (gradients, factors,
decompositions, preconditioned gradients). Every collective goes through the
strategy's :class:`~dpkfac.comm.Communicator`, so bytes and waiting time are
accounted in one place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from dpkfac.assignment import LayerShape, Placement
from dpkfac.comm import Communicator
from dpkfac.curvature import Decomposition, KFACLayer
from dpkfac.curvature.decomposition import working_dtype
from dpkfac.curvature.layer import FACTORS
from dpkfac.options import KFACOptions, StrategyOptions

if TYPE_CHECKING:
    from dpkfac.costmodel.hardware import Hardware
    from dpkfac.preconditioner import KFACPreconditioner


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


@dataclass(frozen=True)
class Traits:
    """What a strategy does at each point of an iteration, in the cost model's terms.

    The cost model prices a strategy from these and from its
    :meth:`Strategy.placement`, never from its name, so a new strategy is
    predicted as soon as it states its traits.

    Attributes:
        captures_all: every rank builds every layer's factors (False: only
            the layer's owner does, from its local batch).
        factor_comm: how batch factors are averaged: "none" (never sent),
            "allreduce" (fused all-reduces in ``step()``) or "pipelined"
            (launched from the capture hooks, one collective per fusion bucket).
        triangle: factors travel as packed upper triangles.
        decomposition_broadcast: decompositions are broadcast from their decomposers.
        preconditions_all: every rank preconditions every layer (False: the
            owner does and broadcasts the result).
        owner_grad_reduction: K-FAC layers' gradients are reduced onto their
            owners instead of all-reduced.
        lazy_factor_sync: with ``factor_comm="allreduce"``, the running
            averages are all-reduced on decomposition steps only, instead of
            the batch factors on every factor step.
        overlapped_precondition: gradient reduction, preconditioning and the
            broadcast of preconditioned updates are launched from gradient
            hooks during the backward pass (dp_kfac's ``overlap``), so their
            communication overlaps it as far as the hardware overlaps.
    """

    captures_all: bool
    factor_comm: Literal["none", "allreduce", "pipelined"]
    triangle: bool
    decomposition_broadcast: bool
    preconditions_all: bool
    owner_grad_reduction: bool = False
    lazy_factor_sync: bool = False
    overlapped_precondition: bool = False


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


def update_buffers(
    layer: KFACLayer, result: Preconditioned | None, *, with_kl: bool
) -> list[torch.Tensor]:
    """The buffers one layer's update travels in, in a fused broadcast bucket.

    The sender passes its ``result``; a receiver passes None and gets empty
    buffers of the right shapes. With the KL clip on, the update travels with
    ⟨V, ∇W⟩ and its "preconditioned" flag, in at least float32.
    """
    if result is not None:
        flag = result.preconditioned
        flag_value = (
            flag.to(result.vg.dtype)
            if isinstance(flag, torch.Tensor)
            else torch.full_like(result.vg, float(flag))
        )
        matrix = result.matrix.contiguous()
        meta = torch.stack([result.vg, flag_value])
    else:
        grad = layer.module.weight.grad
        matrix = grad.new_empty(layer.helper.g_dim, layer.helper.a_dim)
        meta = matrix.new_zeros(2, dtype=torch.promote_types(matrix.dtype, torch.float32))
    return [matrix, meta] if with_kl else [matrix]


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


class Strategy(ABC):
    """Placement queries and communication points of one distribution scheme.

    Class-level methods (``traits``, ``placement``, ``placement_uses_batch``,
    ``setup_collectives``) are pure functions of shapes and options: the cost
    model calls them without building anything. Instances do the work of one
    run over a communicator.

    Args:
        comm: accounted collectives over the preconditioner's process group.
        method: decomposition class of the compute method ("eigen"/"inverse").
        options: this strategy's :attr:`Options` (default: all defaults).
        decomposition_dtype: dtype decompositions run in (receive buffers use it too).
        bucket_cap_mb: size cap of fused buckets.
        kfac: the preconditioner's common options (what a strategy that
            chooses its own configuration from the cost model prices).
    """

    name: ClassVar[str]
    #: The dataclass of this strategy's own options.
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions

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
        options = self.Options() if options is None else options
        if not isinstance(options, self.Options):
            raise TypeError(
                f"strategy {self.name!r} takes {self.Options.__name__}, "
                f"got {type(options).__name__}"
            )
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.options = options
        self.comm = comm
        self.method = method
        self.decomposition_dtype = decomposition_dtype
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        #: The preconditioner's common options (update schedule, compute method).
        self.kfac = KFACOptions() if kfac is None else kfac
        self.placed = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    # ------------------------------------------------- pure, class-level facts
    @classmethod
    @abstractmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        """What this strategy does with these options (see :class:`Traits`)."""

    @classmethod
    @abstractmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        """Who owns, decomposes and preconditions each layer.

        A pure function of its inputs: every rank computes the same answer,
        and the cost model calls it to predict the run.
        """

    @classmethod
    def resolve_options(
        cls,
        options: StrategyOptions,
        hardware: Hardware,
        *,
        shapes: Sequence[LayerShape] = (),
        world_size: int = 1,
        kfac: KFACOptions | None = None,
    ) -> StrategyOptions:
        """The options a run on ``hardware`` ends up with (the cost model's view of a run).

        A strategy that measures something at start-up (spd_kfac's hardware
        model) fills it in from the hardware being predicted, one that
        chooses its configuration (grouped's ``"auto"``) makes the choice the
        run would make for these shapes, world size and schedule; the others
        return their options unchanged.
        """
        return options

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        """What a run with these (resolved) options chose, in a few words ("" if nothing)."""
        return ""

    @classmethod
    def factor_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        """Groups of ranks within which a layer's batch factors are built and averaged.

        A layer is captured by the group of its owner, every member on its
        local batch, and its factors are averaged within that group (when
        ``Traits.factor_comm`` is not "none"). Every rank is in exactly one
        group: the whole world where every rank captures every layer,
        singletons where the owner alone does.
        """
        if cls.traits(options).captures_all:
            return [list(range(world_size))]
        return [[r] for r in range(world_size)]

    @classmethod
    def placement_uses_batch(cls, options: StrategyOptions) -> bool:
        """Whether :meth:`placement` reads ``batch_size``/``positions`` of the shapes.

        When it does, the preconditioner makes all ranks agree on those
        (element-wise maximum over ranks) before placing, since each rank
        measured them on its own first batch.
        """
        return False

    @classmethod
    def setup_collectives(cls, options: StrategyOptions, num_factors: int) -> list[tuple[str, int]]:
        """One-time collectives of the strategy itself, as (kind, bytes), in order."""
        return []

    @classmethod
    def preconditioners(
        cls, owner: int, world_size: int, options: StrategyOptions
    ) -> tuple[int, ...]:
        """The ranks that precondition (and hold the decompositions of) a layer of ``owner``."""
        if cls.traits(options).preconditions_all:
            return tuple(range(world_size))
        return (owner,)

    @classmethod
    def decomposition_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        """Groups of ranks within which decompositions are broadcast from their decomposer.

        Each rank is in at most one group; a decomposition travels to the
        group of its decomposer only.
        """
        if cls.traits(options).decomposition_broadcast:
            return [list(range(world_size))]
        return []

    @classmethod
    def update_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        """Groups of ranks within which preconditioned updates are broadcast.

        In each group, a layer's update is sent by the one member among the
        layer's :meth:`preconditioners`.
        """
        if cls.traits(options).preconditions_all:
            return []
        return [list(range(world_size))]

    @property
    def replicated_state(self) -> bool:
        """Whether every rank holds every layer's factors and decompositions.

        False where owners alone hold factors (dp_kfac, grouped) or gradient
        workers alone hold decompositions (kaisa with f < 1): a checkpoint then
        gathers the pieces onto rank 0.
        """
        traits = self.traits(self.options)
        return traits.captures_all and traits.preconditions_all

    # --------------------------------------------------------------- placement
    def place(self, layers: Sequence[KFACLayer], shapes: Sequence[LayerShape]) -> None:
        """Write :meth:`placement` into the layers.

        Called at construction with nominal shapes and once more at the first
        ``step()`` with the shapes all ranks agreed on.
        """
        placement = self.placement(shapes, self.world_size, self.options)
        for i, layer in enumerate(layers):
            layer.set_placement(placement.owner[i], placement.a_owner[i], placement.g_owner[i])

    def finalise_placement(self, layers: Sequence[KFACLayer], shapes: Sequence[LayerShape]) -> None:
        """Place with the shapes all ranks agreed on at the first step; placement is final.

        A collective where the strategy makes choices that need process groups
        (grouped's "auto"): every rank calls it, from the first ``step()``.
        """
        self.place(layers, shapes)
        self.placed = True

    # ----------------------------------------------------------------- queries
    @abstractmethod
    def captures(self, layer: KFACLayer) -> bool:
        """Whether this rank builds the layer's factors from its local batch."""

    def decomposes(self, layer: KFACLayer, which: str) -> bool:
        """Whether this rank computes the decomposition of factor ``which`` ("A"/"G")."""
        owner = layer.factors[which].owner
        return owner is None or owner == self.rank

    @abstractmethod
    def preconditions(self, layer: KFACLayer) -> bool:
        """Whether this rank preconditions the layer's gradient."""

    # ------------------------------------------------- work inside the backward
    def register_hooks(self, pre: KFACPreconditioner) -> None:
        """Called once at the end of the preconditioner's construction.

        A strategy that works inside the backward pass (dp_kfac's ``overlap``)
        registers its gradient hooks here; the default does nothing.
        """

    def overlapped_updates(self, layers: Sequence[KFACLayer]) -> dict[str, Preconditioned] | None:
        """This step's updates, if the strategy computed them during the backward pass.

        Called by ``step()`` after placement. None (the default): ``step()``
        reduces, folds, decomposes, preconditions and shares as usual.
        Otherwise every rank's update of every layer with a gradient, by
        layer name, and ``step()`` only applies the KL clip and writes them.
        """
        return None

    # ---------------------------------------------------- communication points
    def factor_ready(self, layer: KFACLayer, which: str) -> None:
        """Called from the capture hooks right after a batch factor is built."""

    def reduce_gradients(
        self, layers: Sequence[KFACLayer], other_params: Sequence[nn.Parameter]
    ) -> None:
        """Average all gradients across ranks (fused buckets), as plain data parallelism."""
        grads = [
            p.grad for layer in layers for p in layer.helper.parameters() if p.grad is not None
        ]
        grads += [p.grad for p in other_params if p.grad is not None]
        self.comm.allreduce_mean(grads, "grad_allreduce", cap_bytes=self.bucket_cap_bytes)

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Turn pending local batch factors into what ``update_factors`` should fold in."""

    def sync_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Called on decomposition steps before decomposing: make the running factors final."""

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        """Make decompositions available where they are needed for preconditioning.

        Args:
            layers: all K-FAC layers.
            updated: (layer name, factor) pairs whose decompositions were due this step.
        """

    def share_preconditioned(
        self,
        layers: Sequence[KFACLayer],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        """Make every layer's update available on every rank.

        Args:
            layers: all K-FAC layers.
            results: what this rank computed, by layer name.
            with_kl: whether the KL-clip terms must travel with the updates.

        Returns:
            The update of every layer that has a gradient, by layer name.
        """
        return results

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
        pending = []
        for position, src in enumerate(members):
            items = [
                (layer, w)
                for layer in layers
                for w in FACTORS
                if (layer.name, w) in updated and layer.factors[w].owner == src
            ]
            if not items:
                continue
            tensors: list[torch.Tensor] = []
            for layer, which in items:
                if src == self.rank:
                    tensors += layer.decomposition(which).tensors()
                else:
                    # A receiver may hold no factor of the layer (grouped's
                    # gradient workers outside the owner's factor group).
                    weight = layer.module.weight
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

    def broadcast_updates(
        self,
        comm: Communicator,
        members: Sequence[int],
        sends: Callable[[int], list[KFACLayer]],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        """Each member broadcasts the updates of its layers, one fused bucket per member.

        With the KL clip on, each update travels with two scalars, ⟨V, ∇W⟩ and
        whether it is preconditioned, in at least float32 (a half-precision
        model would overflow the first).

        Args:
            comm: the communicator of the group (``members[i]`` is its rank i).
            members: ranks of the preconditioner's group, in group order.
            sends: the layers a member sends (those with a gradient).
            results: what this rank computed, by layer name.
            with_kl: whether the KL-clip scalars travel too.

        Returns:
            Every sent layer's update, by layer name.
        """
        out: dict[str, Preconditioned] = {}
        handles = []
        for position, src in enumerate(members):
            sent = sends(src)
            if not sent:
                continue
            buffers: list[torch.Tensor] = []
            for layer in sent:
                mine = results[layer.name] if src == self.rank else None
                buffers += update_buffers(layer, mine, with_kl=with_kl)
            handle = comm.broadcast(
                buffers,
                position,
                "precond_broadcast",
                cap_bytes=self.bucket_cap_bytes,
                async_op=True,
            )
            handles.append((sent, buffers, handle))
        for sent, buffers, handle in handles:
            comm.wait(handle)
            out.update(received_updates(sent, buffers, with_kl=with_kl))
        return out

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Strategy state that must survive a checkpoint (placement lives in the layers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
