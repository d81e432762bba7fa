"""The overlapped execution mode: a step's work inside the backward pass.

The preconditioner installs it where the options ask for it (dp_kfac's
``overlap=True``) or where "auto" may choose it. It sees the run through a
narrow :class:`OverlapContext` (the layers, the parameters to reduce, the
communicator, the step's flags, the timer and the preconditioner's
per-layer decomposition), never the preconditioner itself.

One engine, two sources of gradient buckets:

* **Inside DDP** (a ``DistributedDataParallel`` model): the engine is DDP's
  communication hook (``register_comm_hook``). DDP buckets the gradients in
  backward order, rebuilds its buckets after the first iteration, skips the
  hook under ``no_sync`` and keeps ``gradient_as_bucket_view`` working; the
  hook receives each bucket in index order on every rank and returns a future
  that completes once the bucket is reduced.
* **Without DDP**: a ``register_post_accumulate_grad_hook`` on every
  trainable parameter counts down buckets the engine cuts itself by DDP's
  rule, in reverse registration order (:func:`backward_buckets`); a complete bucket
  is launched, buckets strictly in order, so every rank issues the same
  collectives whatever the timing of its hooks.

Either way, on the step's last micro-batch (``accumulation_steps``):

* **Gradient reduction, per bucket**, in two parts launched in this order (category
  ``grad_allreduce``): what the bucket's K-FAC layers need, and the rest. With
  ``grad_reduction="allreduce"`` the first is the all-reduce of the K-FAC layers'
  gradients and the rest the all-reduce of the others (two collectives only where a
  bucket holds both). With ``grad_reduction="owner"`` the first reduces the K-FAC layers' gradients
  onto their owners (uneven shards, one per owner, no padding; on gloo by alltoallv)
  and the rest is
  the all-reduce of the other gradients. A layer waits for the first part only: a
  large non-K-FAC gradient in its bucket (BERT's word embedding, last in the backward
  pass) stays on the wire while the layer is preconditioned and its update sent.
* **Preconditioning**, once the backward pass has launched every bucket (in the
  hook that launches the last one, or in ``step()``): the buckets' K-FAC parts
  are settled in order, and the layers each completes are preconditioned by their
  owners and exchanged (category ``precond_broadcast``): one fused broadcast per
  owner, or with the owner reduction one all-gather of uneven shards (one
  alltoallv on gloo). Not earlier: a hook runs on the backward pass's thread (on a
  GPU, its stream), so work there delays the launch of every later bucket, whose
  transfer is the step's critical path where it is large; after the last launch it
  runs in the shadow of the transfers still on the wire. With ``drain="ready"``
  (:meth:`~dpkfac.plan.traits.Traits.drains_in_hooks`), on a step without
  decompositions, each hook after a launch also settles the buckets whose K-FAC
  part it finds reduced (asked without blocking: :meth:`Communicator.completed`),
  in order up to the first still on the wire, and sends their layers then: the
  exchanges use the link while the backward pass runs, and the preconditioning
  holds back the later launches instead (the cost model weighs the two). Not on
  NCCL (:func:`~dpkfac.plan.hardware.drains_early`: the host runs ahead of the GPU,
  and exchanges interleaved with the other group's buckets in orders that differ
  between ranks could deadlock its kernels): there it is the last-launch drain. The
  exchanges run on a second process group over the same ranks: their launch times
  differ between ranks, and two groups keep each group's order identical on every
  rank.
* **Factors**, in that shadow too: the owner folds a layer's pending batch factors
  into the running averages right after its update is launched, or on a
  decomposition step right before it is decomposed (the decomposition reads the
  new average). A fold reads and writes both running factors; done in the hook
  that completed the layer's local gradients, it held back every later bucket
  (docs/design.md, section 3.5: BERT's last bucket by 7 ms more per factor step),
  which outweighs holding the batch factors to the last launch, as ``step()``
  without overlap holds them.
* **step()** launches what the hooks could not (own buckets holding a
  parameter without a gradient), does what the last hook did not, waits for
  the exchanges, applies the KL clip and writes the gradients
  (:meth:`OverlapEngine.finish`), and then waits for the other gradients
  (:meth:`OverlapEngine.settle_rest`), whose transfer ends the step.

Under DDP a non-owner's bucket keeps its local gradients of the layers it does
not own (DDP copies them into ``.grad``); ``step()`` overwrites them with the
owners' updates, so every rank ends the step with the same gradients.

Non-finite factors, without a host read in the hooks: the fold keeps the
previous running average on the device (``torch.where``) where a batch
factor holds NaN/Inf, and records the device flag. ``step()`` reads the flags
of the step together (one host read per factor step, as without overlap),
warns for each rejected factor, and where a layer had no running average yet
sets it back to None (its update was computed masked: the averaged gradient,
unpreconditioned, as without overlap). The update is therefore the same as
with ``overlap=False``; the guarantee "skip with a warning, never corrupt"
holds. ``pi_damping`` and ``eigh``'s own checks read the host on
decomposition steps, as without overlap.

Requirements: without DDP, exactly ``accumulation_steps`` backward passes
per ``step()`` (a further backward raises); under DDP, one synchronised
backward per ``step()`` (``no_sync`` on the other micro-batches; a second
synchronised one raises). With a ``grad_scaler``, ``step()`` takes the gradients
still scaled and runs before ``scaler.step``: the scaler then unscales the exchanged
updates and skips a step alike on every rank, which reverts its factor folds. The first
step (placement not
final) and steps of the fidelity probe run the ordinary ``step()`` (under DDP
the hook then all-reduces every bucket, as DDP's default hook does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpkfac.comm import Communicator, Handle
from dpkfac.curvature.layer import KFACLayer, MaskedFold, warn_non_finite
from dpkfac.device import HostReader
from dpkfac.plan.exchange import gradient_layout, waited_by_layers
from dpkfac.plan.fusion import ddp_buckets, ddp_first_cap
from dpkfac.plan.hardware import drains_early
from dpkfac.plan.roles import RankRoles
from dpkfac.stats import PhaseTimer
from dpkfac.strategies.base import (
    InFlightUpdates,
    Preconditioned,
    launch_gradients,
    launch_updates,
    on_items,
    precondition_layer,
    sent_updates,
)

__all__ = ["OverlapContext", "OverlapEngine", "StepFlags", "backward_buckets"]


@dataclass
class StepFlags:
    """What the preconditioner tells the overlap about the step its hooks run in.

    Set by the preconditioner before each step's backward pass (at the end of
    the previous ``step()``, at construction and when a checkpoint is loaded).

    Attributes:
        step: the step's index.
        overlapped: whether this step's work runs in the hooks (False: the
            first step, whose placement is not final, a fidelity-probe step,
            a step that must decompose after a resize: ``step()`` does it all).
        capture: whether batch factors are built this step.
        decompose: whether this is a decomposition step.
        damping: the step's damping.
        decay: the step's running-average decay.
        roles: this rank's view of the final plan (who preconditions and decomposes
            what), read from it once per placement.
    """

    step: int = 0
    overlapped: bool = False
    capture: bool = False
    decompose: bool = False
    damping: float = 0.0
    decay: float = 0.0
    roles: RankRoles | None = None


@dataclass
class OverlapContext:
    """What the overlapped execution mode may see of the run (never the preconditioner).

    Attributes:
        layers: the K-FAC layers, in module order.
        params: every parameter whose gradient the step averages, in module order.
        comm: the preconditioner's communicator.
        bucket_cap_bytes: the size cap of fused buckets (without DDP).
        accumulation_steps: backward passes per ``step()``.
        with_kl: whether the KL-clip terms travel with the updates.
        timer: the preconditioner's phase timer.
        host: the preconditioner's host reader.
        decompose: the preconditioner's per-layer decomposition (the factors this
            rank decomposes, with the given damping).
        note_buffers: records the bytes of batch factors awaiting their fold.
        ddp: the DistributedDataParallel model whose buckets the engine reduces
            from its communication hook (None: the engine's own hooks and buckets).
        scaled: the gradients are a loss scaler's, still scaled (``step()`` runs
            before ``scaler.unscale_``): a step whose exchanged gradients overflowed
            is skipped by the scaler, so its factor folds are reverted on every rank.
        flags: the current step's flags (the preconditioner updates them in place).
    """

    layers: Sequence[KFACLayer]
    params: Sequence[nn.Parameter]
    comm: Communicator
    bucket_cap_bytes: int
    accumulation_steps: int
    with_kl: bool
    timer: PhaseTimer
    host: HostReader
    decompose: Callable[[KFACLayer, float], None]
    note_buffers: Callable[[int], None]
    ddp: DistributedDataParallel | None = None
    scaled: bool = False
    flags: StepFlags = field(default_factory=StepFlags)


def backward_buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Consecutive buckets of ``params`` (already in backward order): one dtype and device each,
    cut by DDP's own rule (:func:`dpkfac.plan.fusion.ddp_buckets`: a bucket closes once it
    holds the cap, the first one at :func:`~dpkfac.plan.fusion.ddp_first_cap`, 1 MiB at the
    default cap), so the first reduction starts early in the backward pass, as DDP's does."""
    runs: list[list[int]] = []
    for i, p in enumerate(params):
        if runs and (params[runs[-1][0]].dtype, params[runs[-1][0]].device) == (p.dtype, p.device):
            runs[-1].append(i)
        else:
            runs.append([i])
    buckets: list[list[int]] = []
    for run in runs:
        sizes = [params[i].numel() * params[i].element_size() for i in run]
        cut = ddp_buckets(sizes, cap_bytes, ddp_first_cap(cap_bytes))
        buckets += [[run[j] for j in b] for b in cut]
    return buckets


@dataclass
class _Launched:
    """One gradient bucket whose reduction is in flight.

    A bucket's collectives come in two parts, launched in this order: ``kfac``, what
    its K-FAC layers' preconditioning waits for (with the owner reduction the
    reduce-scatter onto the owners, else the all-reduce of their gradients), and
    ``rest``, the all-reduce of its other gradients, which no layer needs before
    ``step()``.
    They are waited for separately, so a layer is preconditioned and its update
    exchanged while a large bucket of other gradients (BERT's word embedding, the
    last in the backward pass) is still on the wire.

    Attributes:
        index: the bucket's position in the step's launch order.
        params: the bucket's parameters.
        grads: the tensors reduced in place, one per parameter (``.grad``, or
            DDP's views of its bucket, which DDP copies into ``.grad`` at the
            end of the backward pass).
        kfac: the communicator's handles of the K-FAC part.
        rest: the handles of the other gradients' all-reduce (empty where the bucket
            holds none).
        kfac_future: under DDP, completes once ``kfac`` is settled (None: settle the
            handles with :meth:`Communicator.wait`).
        future: under DDP, completes once the whole bucket is settled (what DDP waits for).
    """

    index: int
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    kfac: list[Handle]
    rest: list[Handle]
    kfac_future: torch.futures.Future[torch.Tensor] | None = None
    future: torch.futures.Future[torch.Tensor] | None = None


class _StepState:
    """What one overlapped step has done so far."""

    def __init__(self, n_buckets: int) -> None:
        # Own buckets only: gradients per parameter, parameters left per bucket.
        self.fired: dict[int, int] = {}
        self.left: list[int] = []
        # Parameters of each layer still without their reduced gradient.
        self.unreduced: dict[str, int] = {}
        # The reduced gradient of each K-FAC layer's parameter, once its bucket's K-FAC part
        # is settled.
        self.reduced: dict[int, torch.Tensor] = {}
        self.launched: list[_Launched] = []
        self.ddp_buckets: set[int] = set()
        # Buckets whose K-FAC part is settled (their layers preconditioned and sent).
        self.done = 0
        self.folded: set[str] = set()  # layers whose batch factors are folded
        # Layers sent from a hook before the last launch, their folds left to the drain after it.
        self.unfolded: list[KFACLayer] = []
        self.prepared: set[str] = set()  # layers also decomposed (on decomposition steps)
        self.results: dict[str, Preconditioned] = {}
        self.sends: list[InFlightUpdates] = []
        # The factors folded this step, per layer, with their device finiteness flags.
        self.folds: list[tuple[KFACLayer, MaskedFold]] = []
        self.n_buckets = n_buckets
        # Whether the hooks before the last launch drain the buckets already reduced.
        self.early = False


class OverlapEngine:
    """Gradient hooks and the end of step of the overlapped mode (module docstring).

    Args:
        ctx: what the mode may see of the run.
    """

    def __init__(self, ctx: OverlapContext) -> None:
        self.ctx = ctx
        self.comm = ctx.comm
        self.bcast_comm = self.comm.duplicate("exchange")
        self.layers = list(ctx.layers)
        self.layers_of: dict[int, list[KFACLayer]] = {}
        for layer in self.layers:
            for p in layer.helper.parameters():
                self.layers_of.setdefault(id(p), []).append(layer)
        self.k = ctx.accumulation_steps
        self._drains_early = drains_early(self.comm.backend)
        self.state: _StepState | None = None
        self._unsettled: list[_Launched] = []  # buckets whose other gradients finish() left
        self.inactive = False  # this step runs the ordinary step()
        self.params = list(ctx.params)[::-1]  # the order a sequential backward produces them
        self.buckets: list[list[int]] = []
        if ctx.ddp is not None:
            self._plain = self.comm.ddp_hook()

            def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                return self._ddp_hook(state, bucket)

            # DDP checks the hook's annotations as objects; this module's are strings.
            hook.__annotations__ = {
                "state": object,
                "bucket": dist.GradBucket,
                "return": torch.futures.Future[torch.Tensor],
            }
            try:
                ctx.ddp.register_comm_hook(None, hook)
            except RuntimeError as err:
                raise ValueError(
                    "dpkfac: the overlapped mode runs as the DistributedDataParallel model's "
                    f"communication hook, but the model refused it ({err}); a model can hold one "
                    "hook: leave it to the preconditioner or use overlap=False"
                ) from err
            return
        self.buckets = backward_buckets(self.params, ctx.bucket_cap_bytes)
        self.bucket_of = {id(self.params[i]): b for b, idx in enumerate(self.buckets) for i in idx}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _roles(self) -> RankRoles:
        roles = self.ctx.flags.roles
        assert roles is not None, "the overlapped mode runs with a final plan only"
        return roles

    def _sender(self, layer: KFACLayer) -> int:
        """The rank that preconditions and sends the layer (its owner), from the plan."""
        (owner,) = self._roles().senders[layer.name]
        return owner

    # ------------------------------------------------------------------ hooks
    def _begin(self) -> None:
        self.inactive = not self.ctx.flags.overlapped
        if self.inactive:
            return
        st = _StepState(len(self.buckets))
        st.left = [len(b) for b in self.buckets]
        st.early = self._early()
        for x in self.layers:
            n = len(set(map(id, x.helper.parameters())))
            st.unreduced[x.name] = n
        self.state = st

    @torch.no_grad()
    def _hook(self, param: nn.Parameter) -> None:
        """A parameter's gradient is accumulated (own buckets, without DDP)."""
        if self.state is None and not self.inactive:
            self._begin()
        st = self.state
        if st is None:
            return
        key = id(param)
        n = st.fired[key] = st.fired.get(key, 0) + 1
        if n < self.k:
            return
        if n > self.k:
            raise RuntimeError(
                f"dpkfac: dp_kfac with overlap=True needs exactly accumulation_steps="
                f"{self.k} backward passes per step(), but a parameter received gradient "
                f"number {n} since the last step()"
            )
        st.left[self.bucket_of[key]] -= 1
        self._launch_own(ready_only=True)
        if len(st.launched) == st.n_buckets:  # the backward pass launched every bucket
            self._drain()
        elif st.early:
            self._drain(reduced_only=True)

    @torch.no_grad()
    def _ddp_hook(self, _: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook: reduce the bucket as the step's mode says."""
        if self.state is None and not self.inactive:
            self._begin()
        st = self.state
        if st is None:  # an ordinary step: average the bucket, as DDP's default hook
            return self._plain(None, bucket)
        index = bucket.index()
        if index in st.ddp_buckets:
            raise RuntimeError(
                "dpkfac: dp_kfac with overlap=True under DistributedDataParallel needs one "
                "synchronised backward pass per step(), but DDP reduced bucket "
                f"{index} twice since the last step(): run the other micro-batches of an "
                "accumulated step under model.no_sync()"
            )
        st.ddp_buckets.add(index)
        params = list(bucket.parameters())
        grads = list(bucket.gradients())
        launched = self._launch(params, grads)
        buffer = bucket.buffer()
        # One future per part, so each handle is unpacked by one callback only.
        launched.kfac_future = self.comm.settled(launched.kfac, buffer)
        rest = self.comm.settled(launched.rest, buffer)
        launched.future = torch.futures.collect_all([launched.kfac_future, rest]).then(
            lambda _: buffer
        )
        if bucket.is_last():  # DDP launched every bucket; it waits for them after this hook
            self._drain()
        elif st.early:
            self._drain(reduced_only=True)
        return launched.future

    # ------------------------------------------------------------- the work
    def _launch(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> _Launched:
        """Launch the next bucket's reduction (:meth:`_reduce`) and note it launched."""
        st = self.state
        assert st is not None
        index = len(st.launched)
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        self._instant("bucket ready", bucket=index, params=len(params), bytes=nbytes)
        kfac, rest = self._reduce(index, params, grads)
        launched = _Launched(index, params, grads, kfac, rest)
        st.launched.append(launched)
        return launched

    def _reduce(
        self, index: int, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> tuple[list[Handle], list[Handle]]:
        """Launch one bucket's reduction, its K-FAC part first (:class:`_Launched`), as
        :func:`~dpkfac.plan.exchange.gradient_transfers` says with ``kfac_first``: the K-FAC
        layers' gradients by an all-reduce, or with the owner reduction by a reduce-scatter
        onto their owners, and then an all-reduce of the rest."""
        owners = tuple(
            self._sender(layers[0]) if (layers := self.layers_of.get(id(p))) else None
            for p in params
        )
        kfac: list[Handle] = []
        rest: list[Handle] = []
        layout = gradient_layout(
            self._roles().traits.owner_grad_reduction, owners, self.comm.size, kfac_first=True
        )
        for positions in layout:
            part = "kfac" if waited_by_layers(positions, owners.__getitem__) else "rest"
            with self._tags(bucket=index, part=part):
                handles = launch_gradients(
                    self.comm,
                    on_items(positions, grads.__getitem__),
                    overlapped=True,
                )
            (kfac if part == "kfac" else rest).extend(handles)
        return kfac, rest

    # ------------------------------------------------------------- timeline
    def _tags(self, **args: object) -> AbstractContextManager[None]:
        """Tag the collectives launched inside with ``args`` on the timeline, if any."""
        timeline = self.ctx.timer.timeline
        return nullcontext() if timeline is None else timeline.tags(**args)

    def _instant(self, name: str, **args: object) -> None:
        timeline = self.ctx.timer.timeline
        if timeline is not None:
            timeline.instant(name, "overlap", **args)

    def _launch_own(self, *, ready_only: bool) -> None:
        """Reduce the next own buckets in order (complete ones only when ``ready_only``)."""
        st = self.state
        assert st is not None
        while len(st.launched) < st.n_buckets:
            b = len(st.launched)
            if ready_only and st.left[b] > 0:
                return
            params: list[torch.Tensor] = [
                self.params[i] for i in self.buckets[b] if self.params[i].grad is not None
            ]
            grads = [g for p in params if (g := p.grad) is not None]
            self._launch(params, grads)

    def _early(self) -> bool:
        """Whether this step's hooks before the last launch drain the buckets already reduced
        (:meth:`~dpkfac.plan.traits.Traits.drains_in_hooks`: ``drain="ready"``, on a step
        without decompositions; never on NCCL: :func:`~dpkfac.plan.hardware.drains_early`),
        decided once per step in :meth:`_begin`, not in every hook."""
        return self._drains_early and self._roles().traits.drains_in_hooks(self.ctx.flags.decompose)

    def _drain(self, *, reduced_only: bool = False) -> None:
        """Settle the K-FAC parts of the launched buckets in order (waiting for each),
        preconditioning and sending the layers each completes; every rank thus launches
        the exchanges in the same order, whenever each does.

        ``reduced_only``: a hook before the last launch (``drain="ready"``) stops at the
        first bucket whose K-FAC part is still on the wire (asked without blocking,
        :meth:`_reduced`), and leaves the folds of the layers it sends to the drain after
        the last launch, as without it (module docstring, "Factors").
        """
        st = self.state
        assert st is not None
        while st.done < len(st.launched):
            launched = st.launched[st.done]
            if reduced_only and not self._reduced(launched):
                return
            self._settle(launched)
            st.done += 1
            with self._tags(bucket=launched.index):
                layers = self._completed(launched)
                self._send(layers)
                if reduced_only:
                    st.unfolded += layers
                else:
                    self._fold_captured(layers)
        if not reduced_only:
            unfolded, st.unfolded = st.unfolded, []
            self._fold_captured(unfolded)

    def _reduced(self, launched: _Launched) -> bool:
        """Whether a bucket's K-FAC part has completed (and, under DDP, been unpacked by its
        future's callback), asked without blocking or reading the device."""
        if launched.kfac_future is not None and not launched.kfac_future.done():
            return False
        return all(self.comm.completed(handle) for handle in launched.kfac)

    def _settle(self, launched: _Launched) -> None:
        """Wait for a bucket's K-FAC part (timed as grad_comm) and note its layers' reduced
        gradients."""
        st = self.state
        assert st is not None
        if launched.kfac_future is not None:
            with self.ctx.timer.phase("grad_comm", bucket=launched.index, part="kfac"):
                launched.kfac_future.wait()
        else:
            with self._tags(bucket=launched.index, part="kfac"):
                for handle in launched.kfac:
                    self.comm.wait(handle)
        self._instant("bucket K-FAC gradients reduced", bucket=launched.index)
        for p, g in zip(launched.params, launched.grads, strict=True):
            if id(p) in self.layers_of:
                st.reduced[id(p)] = g

    def _settle_rest(self, launched: _Launched) -> None:
        """Wait for the rest of a bucket (timed as grad_comm): under DDP the bucket's future."""
        with self._tags(bucket=launched.index, part="rest"):
            if launched.future is not None:
                with self.ctx.timer.phase("grad_comm", bucket=launched.index, part="rest"):
                    launched.future.wait()
                return
            for handle in launched.rest:
                self.comm.wait(handle)

    def _completed(self, launched: _Launched) -> list[KFACLayer]:
        """The layers whose last unreduced parameter was in this bucket, in module order."""
        st = self.state
        assert st is not None
        done: set[str] = set()
        for p in launched.params:
            for layer in self.layers_of.get(id(p), ()):
                st.unreduced[layer.name] -= 1
                if st.unreduced[layer.name] == 0:
                    done.add(layer.name)
        return [x for x in self.layers if x.name in done]

    def _fold(self, layer: KFACLayer) -> None:
        """Fold the owner's pending batch factors into the running averages (once a step),
        after the last bucket's launch (module docstring, "Factors")."""
        st = self.state
        assert st is not None
        if layer.name in st.folded:
            return
        flags = self.ctx.flags
        if flags.capture and not st.folded:
            # Batch factors are pending on capture steps only, and all of them wait for the
            # step's first fold (no capture follows the last launch): that is their peak.
            self.ctx.note_buffers(sum(x.pending_nbytes() for x in self.layers))
        st.folded.add(layer.name)
        self._instant("fold", layer=layer.name)
        records = layer.fold_masked(flags.decay, keep=self.ctx.scaled)
        st.folds += [(layer, record) for record in records]

    def _prepare(self, layer: KFACLayer) -> None:
        """Fold (if not yet this step) and, on decomposition steps, decompose (once a step)."""
        st = self.state
        assert st is not None
        self._fold(layer)
        if layer.name in st.prepared:
            return
        st.prepared.add(layer.name)
        if self.ctx.flags.decompose:
            self.ctx.decompose(layer, self.ctx.flags.damping)

    def _valid(self, layer: KFACLayer) -> torch.Tensor | None:
        """Device flag: no factor of the layer was built from scratch out of a non-finite batch."""
        st = self.state
        assert st is not None
        flags = [r.finite for x, r in st.folds if x is layer and not r.had_running]
        if not flags:
            return None
        return torch.stack(flags).all()

    def _grad_matrix(self, layer: KFACLayer) -> torch.Tensor:
        """The layer's reduced gradient as (d_out, a_dim): its bucket's copy, which under DDP
        reaches ``.grad`` only at the end of the backward pass."""
        st = self.state
        assert st is not None
        grad = layer.helper.grad_matrix(lambda p: st.reduced.get(id(p), p.grad))
        assert grad is not None, "only a layer with a gradient is preconditioned"
        return grad

    def _precondition(self, layer: KFACLayer) -> Preconditioned:
        """As ``KFACPreconditioner._precondition`` for one layer (its gradient is averaged)."""
        with self.ctx.timer.phase("precondition", layer=layer.name):
            grad = self._grad_matrix(layer)
            res = precondition_layer(layer, grad, self.ctx.flags.damping)
            valid = self._valid(layer)
            if res.preconditioned is False or valid is None:
                return res
            return Preconditioned(
                torch.where(valid, res.matrix, grad),
                torch.where(valid, res.vg, 0.0),
                valid.clone(),
            )

    def _send(self, layers: Sequence[KFACLayer]) -> None:
        """Precondition the layers a settled bucket completed, where this rank owns them, and
        launch the exchange of their updates (on the second group), as ``step()`` exchanges
        them (:func:`~dpkfac.strategies.base.launch_updates`)."""
        st = self.state
        assert st is not None
        rank = self.comm.rank
        roles = self._roles()
        sent_by = sent_updates(roles, range(self.comm.size), layers)
        decompose = self.ctx.flags.decompose
        for layer in sent_by[rank]:
            if decompose:  # the decomposition reads this step's average: fold first
                self._prepare(layer)
            st.results[layer.name] = self._precondition(layer)
        if self.comm.active and any(sent_by):
            with self._tags(part="updates"):
                st.sends.append(
                    launch_updates(
                        self.bcast_comm,
                        roles.traits.owner_grad_reduction,
                        sent_by,
                        st.results,
                        with_kl=self.ctx.with_kl,
                        cap_bytes=self.ctx.bucket_cap_bytes,
                    )
                )

    def _fold_captured(self, layers: Sequence[KFACLayer]) -> None:
        """Fold the batch factors of those of ``layers`` this rank captures (after their
        updates are on their way: preconditioning reads the decompositions only)."""
        captures = self._roles().captures
        for layer in layers:
            if layer.name in captures:
                self._prepare(layer)

    # ------------------------------------------------------------- step()
    def finish(self, *, defer_rest: bool = False) -> dict[str, Preconditioned] | None:
        """Wait for what is left and return every layer's update (None: not overlapped).

        ``defer_rest``: leave the gradients of no K-FAC layer on the wire (unless a loss
        scaler's overflow check reads them here); :meth:`settle_rest` waits for them once
        the caller has written the updates. Their transfer (BERT's word embedding) ends the
        step's critical path, and the KL clip and the write-back need only the updates.
        """
        self.settle_rest()
        st, self.state = self.state, None
        inactive, self.inactive = self.inactive, False
        if st is None:
            if inactive or not self.ctx.flags.overlapped or self.ctx.ddp is not None:
                return None
            self._begin()  # no backward this step (or no hook fired): do it all here
            st, self.state = self.state, None
            if st is None:
                return None
        self.state = st
        try:
            if self.ctx.ddp is None:
                self._launch_own(ready_only=False)
            # Every K-FAC part first, in order (where the last hook did not): the last
            # buckets' layers are preconditioned and their updates exchanged while the other
            # gradients are still on the wire.
            self._drain()
            for layer in self.layers:
                if layer.name in self._roles().captures:
                    self._prepare(layer)  # layers without gradients still fold their factors
            self._unsettled = list(st.launched)
            if not defer_rest or self.ctx.scaled:  # the overflow check reads them
                self.settle_rest()
            final = self._collect(st)
            self._check_factors(st, final)
        finally:
            self.state = None
        return final

    def settle_rest(self) -> None:
        """Wait for the gradients of no K-FAC layer that :meth:`finish` left on the wire."""
        unsettled, self._unsettled = self._unsettled, []
        for launched in unsettled:
            self._settle_rest(launched)

    def _collect(self, st: _StepState) -> dict[str, Preconditioned]:
        """Wait for the exchanges; the updates in the form ``share_preconditioned`` gives."""
        if not self.comm.active:
            return st.results
        out: dict[str, Preconditioned] = {}
        for exchange in st.sends:
            with self._tags(part="updates"):
                for handle in exchange.handles:
                    self.bcast_comm.wait(handle)
            out.update(exchange.received(with_kl=self.ctx.with_kl))
        return out

    def _check_factors(self, st: _StepState, final: dict[str, Preconditioned]) -> None:
        """Read the step's finiteness flags at once; warn, and undo first averages of NaN/Inf.

        With a loss scaler, the same read says whether the exchanged gradients
        overflowed, a value identical on every rank (the updates and the averaged
        gradients are): the scaler then skips the step, and every rank reverts
        the step's folds (and, on a decomposition step, decomposes the factors
        it restored), without a warning, as the ordinary ``step()`` skips them.
        """
        if not st.folds:
            return
        device = st.folds[0][1].finite.device
        checks = [r.finite.to(device) for _, r in st.folds]
        if self.ctx.scaled:
            checks.append(self._all_finite(final).to(device))
        finite = self.ctx.host.flags(torch.stack(checks))
        if self.ctx.scaled and not finite[-1]:
            for layer, record in reversed(st.folds):
                layer.revert_fold(record)
            if self.ctx.flags.decompose:
                for layer in dict.fromkeys(layer for layer, _ in st.folds):
                    self.ctx.decompose(layer, self.ctx.flags.damping)
            return
        for (layer, record), ok in zip(st.folds, finite, strict=False):
            if not ok:
                warn_non_finite(layer.name, record.which, stacklevel=5)
                layer.undo_fold(record)

    def _all_finite(self, final: dict[str, Preconditioned]) -> torch.Tensor:
        """Device flag: every exchanged update and every averaged gradient of the parameters
        of no K-FAC layer is finite (the values every rank holds alike)."""
        tensors = [res.matrix for res in final.values()]
        tensors += [
            g for p in self.params if id(p) not in self.layers_of and (g := p.grad) is not None
        ]
        device = tensors[0].device if tensors else self.comm.device
        flags = [torch.isfinite(t).all().to(device) for t in tensors]
        return (
            torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)
        )
