"""The training loop's order of calls, checked on every step without reading the device.

K-FAC works only when ``pre.step()`` sits between ``loss.backward()`` and
``optimizer.step()``. A loop that calls it too early
(``opt.zero_grad(); pre.step(); loss.backward(); opt.step()``) looks right
from the preconditioner's side after its first step: every ``step()`` follows a
backward pass (the previous iteration's), but the optimizer has already used
those gradients and ``zero_grad`` has cleared them, so K-FAC preconditions
``None`` or zeros and the model trains with plain SGD, to the last bit. The
events the preconditioner sees (forward, backward, step) repeat in the same
cycle in both orders, so the order itself cannot tell them apart; what the
misordered loop leaves behind can, and three checks look for it:

* **consumed** (free, certain): an optimizer holding K-FAC weights stepped
  after their gradients arrived and before ``step()``. One process-wide
  optimizer step pre-hook (:class:`OptimizerWatch`) tells each
  :class:`GradientLedger` whose weights the stepping optimizer holds.
* **cleared** (free, certain): every K-FAC weight whose gradient arrived since
  the last ``step()`` has ``.grad is None`` again (``zero_grad()``'s default).
* **zeroed** (one flag, not certain): ``zero_grad(set_to_none=False)`` or a
  hand-written ``p.grad.zero_()`` leaves zeros, which only a device read can
  see. Version counters (host metadata) filter first: where any gradient is
  still the tensor, at the version, its backward pass left, nothing zeroed
  it. Otherwise :meth:`GradientLedger.zero_flag` is a device flag that the
  step reads together with its finiteness checks, in the host read a factor
  step makes anyway; a true zero gradient (a zero loss) is possible, so this
  one warns.

The first two raise a ``RuntimeError``; see :data:`CALL_ORDER`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["CALL_ORDER", "WATCH", "GradientLedger", "OptimizerWatch"]

#: The order of calls of one training iteration, as every message names it.
CALL_ORDER = "zero_grad → backward → pre.step → opt.step"


class GradientLedger:
    """What the backward passes since the last ``step()`` left in the K-FAC weights' ``.grad``.

    Fed by the weights' post-accumulate-grad hooks (:meth:`arrived`) and by
    :class:`OptimizerWatch` (:meth:`optimizer_stepped`); both only touch host
    metadata (the gradient's identity and version counter), never a value.
    """

    def __init__(self) -> None:
        # id(weight) -> (weight, id(grad), grad._version) as its last backward left them.
        self._arrivals: dict[int, tuple[nn.Parameter, int, int]] = {}
        # id(weight) -> backward passes that wrote its gradient since the last reset.
        self._passes: dict[int, int] = {}
        self._consumed = False
        #: Set by a fresh preconditioner: the next optimizer step holding its weights is the
        #: first of the run (before the first update, or, for an optimizer that runs the
        #: backward pass in its closure as Lightning does, around it), and an optimizer already
        #: holding state then has stepped before (a resume that restored the optimizer but not
        #: the preconditioner).
        self.first_update = False
        self._warned_stale_optimizer = False

    @property
    def fresh(self) -> bool:
        """Whether a backward pass wrote a K-FAC gradient since the last :meth:`reset`."""
        return bool(self._arrivals)

    @property
    def passes(self) -> int:
        """Backward passes since the last :meth:`reset`: the most any K-FAC weight received
        (a layer some micro-batch does not use receives fewer)."""
        return max(self._passes.values(), default=0)

    def arrived(self, weight: nn.Parameter) -> None:
        """A backward pass accumulated ``weight.grad`` (its post-accumulate-grad hook)."""
        grad = weight.grad
        if grad is not None:
            self._arrivals[id(weight)] = (weight, id(grad), grad._version)
        self._passes[id(weight)] = self._passes.get(id(weight), 0) + 1
        self._consumed = False  # this gradient is newer than any optimizer step so far

    def optimizer_stepped(self, optimizer: Optimizer) -> None:
        """An optimizer holding K-FAC weights is about to step."""
        if self._arrivals:
            self._consumed = True
        if self.first_update:
            self.first_update = False
            if optimizer.state and not self._warned_stale_optimizer:
                self._warned_stale_optimizer = True
                warnings.warn(
                    "dpkfac: the optimizer already holds state (it has stepped, or its "
                    "state_dict was loaded) while the preconditioner takes its first step: a "
                    "resumed run that restored the optimizer but not the preconditioner starts "
                    "K-FAC's factors from nothing and takes another trajectory. Save "
                    "pre.state_dict() with the checkpoint and call pre.load_state_dict(state) "
                    "on resume (dpkfac.integrations do it for Trainer, accelerate and Lightning)",
                    RuntimeWarning,
                    stacklevel=4,
                )

    def reset(self) -> None:
        """``step()`` took (or refused) the gradients: the next ones are the next backward's."""
        self._arrivals = {}
        self._passes = {}
        self._consumed = False

    def misuse(self) -> str | None:
        """What certainly went wrong since the backward pass, in words (None: nothing seen).

        Free: a flag set by the optimizer's hook and ``.grad is None`` per weight.
        """
        reasons = []
        if self._consumed:
            reasons.append("used by optimizer.step()")
        if self._arrivals and all(w.grad is None for w, _, _ in self._arrivals.values()):
            reasons.append("cleared by zero_grad() (every K-FAC gradient is None)")
        return " and ".join(reasons) or None

    def zero_flag(self) -> torch.Tensor | None:
        """Device flag, True where some K-FAC gradient is nonzero; None where no read is needed.

        Only where every gradient was changed after its backward pass wrote it
        (as ``zero_grad(set_to_none=False)`` does, but also DDP, a loss
        scaler's ``unscale_`` or gradient clipping) could a zero_grad have
        zeroed them; a gradient left as its backward pass wrote it rules that
        out without any device work.
        """
        grads = []
        for weight, grad_id, version in self._arrivals.values():
            grad = weight.grad
            if grad is None:
                continue
            if id(grad) == grad_id and grad._version == version:
                return None
            grads.append(grad)
        if not grads:
            return None
        return torch.nn.utils.get_total_norm(grads, norm_type=float("inf")) != 0


class OptimizerWatch:
    """One process-wide optimizer step pre-hook that tells ledgers their weights are stepped.

    One hook for the process, however many preconditioners live in it (the
    threads launcher runs P ranks in one): each optimizer is matched once to
    the ledgers whose weights it holds, again only when its parameters or the
    registered preconditioners change. Weights and ledgers are held weakly.
    """

    def __init__(self) -> None:
        # id(weight) -> (weight, its ledger), both weak.
        self._owners: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[GradientLedger]]] = {}
        self._matched: weakref.WeakKeyDictionary[
            Optimizer, tuple[int, int, list[weakref.ref[GradientLedger]]]
        ] = weakref.WeakKeyDictionary()
        self._generation = 0
        self._handle: RemovableHandle | None = None

    def watch(self, ledger: GradientLedger, weights: Sequence[torch.Tensor]) -> None:
        """Tell ``ledger`` whenever an optimizer holding one of ``weights`` steps."""
        ref = weakref.ref(ledger)
        ids = [id(w) for w in weights]
        for weight in weights:
            self._owners[id(weight)] = (weakref.ref(weight), ref)
        self._generation += 1
        weakref.finalize(ledger, self._forget, ids, ref)
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._stepping)

    def _forget(self, ids: list[int], ref: weakref.ref[GradientLedger]) -> None:
        """Drop a collected ledger's weights (an id may already name another ledger's)."""
        for key in ids:
            entry = self._owners.get(key)
            if entry is not None and entry[1] is ref:
                del self._owners[key]
        self._generation += 1

    def _ledgers(self, optimizer: Optimizer) -> list[weakref.ref[GradientLedger]]:
        """The ledgers whose weights ``optimizer`` holds (cached per optimizer)."""
        groups = optimizer.param_groups
        count = sum(len(group["params"]) for group in groups)
        cached = self._matched.get(optimizer)
        if cached is not None and cached[0] == self._generation and cached[1] == count:
            return cached[2]
        found: dict[int, weakref.ref[GradientLedger]] = {}
        for group in groups:
            for param in group["params"]:
                entry = self._owners.get(id(param))
                if entry is not None and entry[0]() is param:
                    found[id(entry[1])] = entry[1]
        ledgers = list(found.values())
        self._matched[optimizer] = (self._generation, count, ledgers)
        return ledgers

    def _stepping(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for ref in self._ledgers(optimizer):
            ledger = ref()
            if ledger is not None:
                ledger.optimizer_stepped(optimizer)


#: The process's one watch.
WATCH = OptimizerWatch()
