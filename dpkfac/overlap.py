"""The overlapped execution mode: a step's work inside the backward pass.

The preconditioner installs it when the plan's traits ask for it
(``Traits.overlapped_precondition``: dp_kfac's ``overlap=True``). It sees the
run through a narrow :class:`OverlapContext` (the layers, the parameters to
reduce, the communicator, the step's flags, the timer and the preconditioner's
per-layer decomposition), never the preconditioner itself.

What happens where, on the last micro-batch of a step (``accumulation_steps``):

* **Gradient buckets.** The trainable parameters, in reverse registration
  order (the order a sequential network's backward produces them), are cut
  into fused buckets of one dtype under the preconditioner's
  ``bucket_cap_mb``. A ``register_post_accumulate_grad_hook`` on every
  parameter counts down its bucket; a complete bucket is all-reduced
  asynchronously (category ``grad_allreduce``), buckets strictly in plan
  order, so every rank issues the same collectives in the same order
  whatever the timing of its hooks.
* **Factors.** When the last parameter of a layer has its gradient (its G
  hook, on the output tensor, fired before), the layer's owner folds the
  pending batch factors into the running averages and, on decomposition
  steps, decomposes them, while the layer's bucket is still in flight.
* **Preconditioning.** Every later hook polls the launched buckets without
  blocking (``Work.is_completed()``, in order). Once a bucket is reduced, for
  each rank in turn, the layers whose last bucket it is are preconditioned by
  that owner and broadcast from it asynchronously (category
  ``precond_broadcast``, one fused broadcast per bucket and owner). The
  broadcasts run on a second process group over the same ranks: their launch
  time depends on when each rank's poll sees its bucket complete, and two
  groups keep each group's order identical on every rank.
* **step()** launches what the hooks could not (buckets holding a parameter
  without a gradient), waits for the buckets and broadcasts left, applies the
  KL clip and writes the gradients (:meth:`OverlapEngine.finish`).

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

Requirements: exactly ``accumulation_steps`` backward passes per
``step()`` (a further backward raises), a model not wrapped in DDP (the
overlap does the reduction), no ``grad_scaler``. The first step (placement
not final) and steps of the fidelity probe run the ordinary ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dpkfac.comm import Communicator, Handle
from dpkfac.curvature.layer import KFACLayer, MaskedFold, warn_non_finite
from dpkfac.device import HostReader
from dpkfac.plan import Plan
from dpkfac.plan.fusion import size_cap_buckets
from dpkfac.stats import PhaseTimer
from dpkfac.strategies.base import (
    Preconditioned,
    precondition_layer,
    received_updates,
    update_buffers,
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
        plan: the final plan (who preconditions and decomposes what).
    """

    step: int = 0
    overlapped: bool = False
    capture: bool = False
    decompose: bool = False
    damping: float = 0.0
    decay: float = 0.0
    plan: Plan | None = None


@dataclass
class OverlapContext:
    """What the overlapped execution mode may see of the run (never the preconditioner).

    Attributes:
        layers: the K-FAC layers, in module order.
        params: every parameter whose gradient the step averages, in module order.
        comm: the preconditioner's communicator.
        bucket_cap_bytes: the size cap of fused buckets.
        accumulation_steps: backward passes per ``step()``.
        with_kl: whether the KL-clip terms travel with the updates.
        timer: the preconditioner's phase timer.
        host: the preconditioner's host reader.
        decompose: the preconditioner's per-layer decomposition (the factors this
            rank decomposes, with the given damping).
        note_buffers: records the bytes of batch factors awaiting their fold.
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
    flags: StepFlags = field(default_factory=StepFlags)


def backward_buckets(params: Sequence[nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Consecutive buckets of ``params`` (already in backward order): one dtype and device each,
    split at ``cap_bytes`` by :func:`dpkfac.plan.fusion.size_cap_buckets`."""
    runs: list[list[int]] = []
    for i, p in enumerate(params):
        if runs and (params[runs[-1][0]].dtype, params[runs[-1][0]].device) == (p.dtype, p.device):
            runs[-1].append(i)
        else:
            runs.append([i])
    buckets: list[list[int]] = []
    for run in runs:
        sizes = [params[i].numel() * params[i].element_size() for i in run]
        buckets += [[run[j] for j in b] for b in size_cap_buckets(sizes, cap_bytes)]
    return buckets


class _StepState:
    """What one overlapped step has done so far."""

    def __init__(self, n_buckets: int) -> None:
        self.fired: dict[int, int] = {}
        self.left: list[int] = []
        self.layer_left: dict[str, int] = {}
        self.handles: list[Handle] = []
        self.done = 0  # buckets processed (reduced, their layers preconditioned and sent)
        self.prepared: set[str] = set()
        self.results: dict[str, Preconditioned] = {}
        self.sends: list[tuple[list[KFACLayer], list[torch.Tensor], Handle]] = []
        # The factors folded this step, per layer, with their device finiteness flags.
        self.folds: list[tuple[KFACLayer, MaskedFold]] = []
        self.n_buckets = n_buckets


class OverlapEngine:
    """Gradient hooks and the end of step of the overlapped mode (module docstring).

    Args:
        ctx: what the mode may see of the run.
    """

    def __init__(self, ctx: OverlapContext) -> None:
        self.ctx = ctx
        self.comm = ctx.comm
        self.bcast_comm = self.comm.duplicate()
        self.layers = list(ctx.layers)
        self.params = list(ctx.params)[::-1]  # the order a sequential backward produces them
        self.buckets = backward_buckets(self.params, ctx.bucket_cap_bytes)
        self.bucket_of = {id(self.params[i]): b for b, idx in enumerate(self.buckets) for i in idx}
        self.layers_of: dict[int, list[KFACLayer]] = {}
        for layer in self.layers:
            for p in layer.helper.parameters():
                self.layers_of.setdefault(id(p), []).append(layer)
        # A layer is sent once the last bucket holding one of its parameters is reduced.
        self.last_bucket = {
            x.name: max(self.bucket_of[id(p)] for p in x.helper.parameters()) for x in self.layers
        }
        self.k = ctx.accumulation_steps
        self.state: _StepState | None = None
        self.inactive = False  # this step runs the ordinary step()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _plan(self) -> Plan:
        plan = self.ctx.flags.plan
        assert plan is not None, "the overlapped mode runs with a final plan only"
        return plan

    # ------------------------------------------------------------------ hooks
    def _begin(self) -> None:
        self.inactive = not self.ctx.flags.overlapped
        if self.inactive:
            return
        st = _StepState(len(self.buckets))
        st.left = [len(b) for b in self.buckets]
        st.layer_left = {x.name: len(set(map(id, x.helper.parameters()))) for x in self.layers}
        self.state = st

    @torch.no_grad()
    def _hook(self, param: nn.Parameter) -> None:
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
        for layer in self.layers_of.get(key, ()):
            st.layer_left[layer.name] -= 1
            if st.layer_left[layer.name] == 0 and self._plan().captures(self.comm.rank, layer.name):
                self._prepare(layer)
        self._launch(ready_only=True)
        self._poll(block=False)

    # ------------------------------------------------------------- the work
    def _launch(self, *, ready_only: bool) -> None:
        """All-reduce the next buckets in plan order (complete ones only when ``ready_only``)."""
        st = self.state
        assert st is not None
        while len(st.handles) < st.n_buckets:
            b = len(st.handles)
            if ready_only and st.left[b] > 0:
                return
            grads = [g for i in self.buckets[b] if (g := self.params[i].grad) is not None]
            st.handles.append(
                self.comm.allreduce_mean(grads, "grad_allreduce", async_op=True, overlapped=True)
            )

    def _poll(self, *, block: bool) -> None:
        """Process reduced buckets in order; without ``block`` stop at the first one in flight."""
        st = self.state
        assert st is not None
        while st.done < len(st.handles):
            handle = st.handles[st.done]
            if not block and not all(w.is_completed() for w in handle.works):
                return
            self.comm.wait(handle)  # done: only unpacks (timed as grad_comm)
            self._send(st.done)
            st.done += 1

    def _prepare(self, layer: KFACLayer) -> None:
        """Fold the owner's pending batch factors; decompose on decomposition steps."""
        st = self.state
        assert st is not None
        if layer.name in st.prepared:
            return
        st.prepared.add(layer.name)
        flags = self.ctx.flags
        if flags.capture:  # batch factors are pending on capture steps only
            self.ctx.note_buffers(sum(x.pending_nbytes() for x in self.layers))
        st.folds += [(layer, record) for record in layer.fold_masked(flags.decay)]
        if flags.decompose:
            self.ctx.decompose(layer, flags.damping)

    def _valid(self, layer: KFACLayer) -> torch.Tensor | None:
        """Device flag: no factor of the layer was built from scratch out of a non-finite batch."""
        st = self.state
        assert st is not None
        flags = [r.finite for x, r in st.folds if x is layer and not r.had_running]
        if not flags:
            return None
        return torch.stack(flags).all()

    def _precondition(self, layer: KFACLayer) -> Preconditioned:
        """As ``KFACPreconditioner._precondition`` for one layer (its gradient is averaged)."""
        with self.ctx.timer.phase("precondition"):
            grad = layer.helper.grad_matrix()
            assert grad is not None
            res = precondition_layer(layer, grad, self.ctx.flags.damping)
            valid = self._valid(layer)
            if res.preconditioned is False or valid is None:
                return res
            return Preconditioned(
                torch.where(valid, res.matrix, grad),
                torch.where(valid, res.vg, 0.0),
                valid.clone(),
            )

    def _send(self, bucket: int) -> None:
        """Precondition the layers whose last bucket is ``bucket`` and broadcast them, per owner."""
        st = self.state
        assert st is not None
        rank, size = self.comm.rank, self.comm.size
        with_kl = self.ctx.with_kl
        for owner in range(size):
            sent = [
                x
                for x in self.layers
                if self.last_bucket[x.name] == bucket
                and self._plan().sends_update(owner, x.name)
                and x.module.weight.grad is not None
            ]
            if not sent:
                continue
            buffers: list[torch.Tensor] = []
            for layer in sent:
                res = None
                if owner == rank:
                    self._prepare(layer)
                    res = self._precondition(layer)
                    st.results[layer.name] = res
                buffers += update_buffers(layer, res, with_kl=with_kl)
            if not self.comm.active:
                continue
            handle = self.bcast_comm.broadcast(
                buffers,
                owner,
                "precond_broadcast",
                cap_bytes=self.ctx.bucket_cap_bytes,
                async_op=True,
            )
            st.sends.append((sent, buffers, handle))

    # ------------------------------------------------------------- step()
    def finish(self) -> dict[str, Preconditioned] | None:
        """Wait for what is left and return every layer's update (None: not overlapped)."""
        st, self.state = self.state, None
        inactive, self.inactive = self.inactive, False
        if st is None:
            if inactive or not self.ctx.flags.overlapped:
                return None
            self._begin()  # no backward this step (or no hook fired): do it all here
            st, self.state = self.state, None
            if st is None:
                return None
        self.state = st
        try:
            for layer in self.layers:
                if self._plan().captures(self.comm.rank, layer.name):
                    self._prepare(layer)  # layers without gradients still fold their factors
            self._launch(ready_only=False)
            self._poll(block=True)
            final = self._collect(st)
            self._check_factors(st)
        finally:
            self.state = None
        return final

    def _collect(self, st: _StepState) -> dict[str, Preconditioned]:
        """Wait for the broadcasts; the updates in the form ``share_preconditioned`` gives."""
        if not self.comm.active:
            return st.results
        with_kl = self.ctx.with_kl
        out: dict[str, Preconditioned] = {}
        for sent, buffers, handle in st.sends:
            self.bcast_comm.wait(handle)
            out.update(received_updates(sent, buffers, with_kl=with_kl))
        return out

    def _check_factors(self, st: _StepState) -> None:
        """Read the step's finiteness flags at once; warn, and undo first averages of NaN/Inf."""
        if not st.folds:
            return
        device = st.folds[0][1].finite.device
        finite = self.ctx.host.flags(torch.stack([r.finite.to(device) for _, r in st.folds]))
        for (layer, record), ok in zip(st.folds, finite, strict=True):
            if not ok:
                warn_non_finite(layer.name, record.which, stacklevel=5)
                layer.undo_fold(record)
