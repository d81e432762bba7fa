"""Capture: the hooks that build batch factors, the parameters the step reduces, and the
ledger of gradients that checks the training loop's order of calls.

The preconditioner's step reads what a training step's forward and backward
passes left behind; this module is everything that runs *inside* those
passes, so that the step loop reads as the step and nothing else:

* :func:`find_layers` picks the K-FAC layers of a model (module order);
* :class:`Capture` hooks them: the forward hook builds A, a hook on the
  layer's *output tensor* builds G (a tensor hook registered before an
  in-place op such as ``nn.ReLU(inplace=True)`` still receives the gradient
  of the value the layer produced, whereas the module backward hook errors
  out), and a hook on each weight tells the call-order ledger a gradient
  arrived. Under ``torch.compile`` the forward hook is not traced: it puts
  the capture operators of :mod:`dpkfac.compile` into the graph, which run the
  same capture when the graph runs. With gradient accumulation a batch factor
  is announced to the strategy only once its last micro-batch is in;
* :class:`Parameters` lists the model's parameters once and follows those
  unfrozen later (averaged, never preconditioned);
* :class:`GradientLedger` keeps what the backward passes left in the K-FAC
  weights' ``.grad`` (the weight hooks feed it), which the step reads to check
  the training loop's order of calls (below).

They see the run through what they are handed (the layers, the options, the
strategy's questions, the timer, the probe), never the preconditioner: it
sits above them and arms them before each step.

**The training loop's order of calls, checked on every step without reading the device.**

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

import re
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from dpkfac.amp import inverse_loss_scale
from dpkfac.attention import not_capturable
from dpkfac.compile import CaptureSite, GradHook, uncaptured_hint
from dpkfac.curvature import KFACLayer, helper_for
from dpkfac.fidelity import FidelityProbe
from dpkfac.options import KFACOptions
from dpkfac.stats import PhaseTimer
from dpkfac.strategies import Strategy

__all__ = [
    "CALL_ORDER",
    "WATCH",
    "Capture",
    "GradientLedger",
    "OptimizerWatch",
    "Parameters",
    "find_layers",
]


def find_layers(
    module: nn.Module, options: KFACOptions, skip: Sequence[re.Pattern[str]]
) -> dict[str, KFACLayer]:
    """Every supported, trainable, non-skipped module as a K-FAC layer (module order).

    Not hooked yet: :class:`Capture` does that once the run around the
    layers (strategy, fidelity probe) exists.
    """
    layers: dict[str, KFACLayer] = {}
    # A Linear that nn.MultiheadAttention calls functionally can never be captured: it is
    # not a layer (the report lists it with what to do), whatever its type says.
    functional = not_capturable(module)
    for name, sub in module.named_modules():
        helper = helper_for(sub)
        if helper is None or name in functional or any(p.search(name) for p in skip):
            continue
        if not all(p.requires_grad for p in helper.parameters()):
            continue
        layers[name] = KFACLayer(name, sub, helper, options.accumulation_steps)
    return layers


class Capture:
    """The capture hooks of the K-FAC layers, armed step by step.

    Args:
        layers: the K-FAC layers, in module order; each is hooked now.
        options: the common options (weight sharing, factor dtype and method,
            accumulation steps).
        strategy: asked which layers this rank captures and told when a batch
            factor is complete (a pipelined strategy sends it at once).
        timer: times the factor computation (phase ``factor_compute``).
        ledger: told when a backward pass writes a K-FAC weight's gradient.
        grad_scaler: the run's loss scaler, whose ``1/s`` G is built with.
        probe: the curvature-fidelity probe, which captures its layers on
            every rank (None: off).

    Attributes:
        active: whether this step's hooks capture (a factor step).
        hooks_active: whether they do anything (capture or a probe): a
            compiled model guards on it, one graph with the capture operators
            and one without.
    """

    def __init__(
        self,
        layers: Sequence[KFACLayer],
        *,
        options: KFACOptions,
        strategy: Strategy,
        timer: PhaseTimer,
        ledger: GradientLedger,
        grad_scaler: torch.amp.GradScaler | None,
        probe: FidelityProbe | None,
    ) -> None:
        self._layers = list(layers)
        self._options = options
        self._strategy = strategy
        self._timer = timer
        self._grad_scaler = grad_scaler
        self._probe = probe
        self.active = False
        self.hooks_active = False
        #: Whether the forward hooks look for a DistributedDataParallel running the model (set
        #: by a multi-rank preconditioner built on the bare module, until its first step).
        self.watch_wrapper = False
        #: The DDP module whose forward ran a K-FAC layer while :attr:`watch_wrapper` was set.
        self.wrapper: nn.parallel.DistributedDataParallel | None = None
        # 1/s of the loss scaler per device, for the G hooks of the current step.
        self._inverse_scales: dict[torch.device, torch.Tensor] = {}
        for layer in self._layers:
            layer.module.register_forward_hook(partial(self._forward_hook, layer), with_kwargs=True)
            layer.helper.module.weight.register_post_accumulate_grad_hook(ledger.arrived)
        # What a compiled graph calls in place of the forward hook (dpkfac/compile.py).
        self._sites = {
            x.name: CaptureSite(partial(self._capture_compiled, x)) for x in self._layers
        }
        # Whether Dynamo has traced a forward hook: until then no site holds a call.
        self._traced = False

    def arm(self, *, capture: bool, probing: bool) -> None:
        """Set what the hooks of the next step do; drop what a forward pass without a
        backward pass left."""
        self.active = capture
        self.hooks_active = capture or probing
        if self._traced:  # an eager model's sites never hold a call
            for site in self._sites.values():
                site.reset()

    def forget_loss_scale(self) -> None:
        """The next backward pass may run under another loss scale: recompute ``1/s``."""
        self._inverse_scales = {}

    def inverse_scale(self, device: torch.device) -> torch.Tensor | None:
        """The loss scale's ``1/s`` on ``device``: computed once per step, not once per layer
        (the scale changes only at ``scaler.update()``, after ``step()``)."""
        if self._grad_scaler is None:
            return None
        if device not in self._inverse_scales:
            inverse = inverse_loss_scale(self._grad_scaler, device)
            if inverse is None:
                return None
            self._inverse_scales[device] = inverse
        return self._inverse_scales[device]

    def _dtype_for(self, layer: KFACLayer) -> torch.dtype:
        return self._options.factor_dtype or layer.helper.module.weight.dtype

    def _forward_hook(
        self,
        layer: KFACLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        """Capture A now and hook the output's gradient for G (eager).

        While Dynamo traces the model (``torch.compile``), the capture is not
        traced: the hook puts the capture operators of :mod:`dpkfac.compile`
        into the graph, which run :meth:`_capture_input` and the G hooks when
        the graph runs; no graph break, and the same factors.
        """
        if torch.compiler.is_compiling():
            # Grad mode first: a graph traced without gradients (evaluation) then guards on
            # nothing of the schedule, and serves every step.
            active = torch.is_grad_enabled() and self.hooks_active
            self._traced = True
            return self._sites[layer.name].in_graph(active, args, kwargs, output)
        if self.watch_wrapper and self.wrapper is None:
            # DDP's forward announces itself in a class attribute (torch.compile's DDP
            # optimizer reads the same); read softly: a torch without it detects nothing.
            ddp = nn.parallel.DistributedDataParallel
            self.wrapper = getattr(ddp, "_active_ddp_module", None)
        hooks = self._capture_input(layer, args, kwargs, grad_enabled=torch.is_grad_enabled())
        if hooks and isinstance(output, torch.Tensor) and output.requires_grad:
            for hook in hooks:
                output.register_hook(hook)
        return None

    def _capture_compiled(self, layer: KFACLayer, x: torch.Tensor | None) -> list[GradHook]:
        """:meth:`_capture_input` as a compiled graph's capture operator calls it (its graph
        calls it only where gradients are enabled; the operator runs without)."""
        return self._capture_input(layer, (x,) if x is not None else (), {}, grad_enabled=True)

    def _capture_input(
        self,
        layer: KFACLayer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        grad_enabled: bool,
    ) -> list[GradHook]:
        """One call of a layer at this step: build its batch A (and the fidelity probe's
        shadow A) from the input; returns the hooks that build G from the gradient of the
        call's output (empty where nothing was captured)."""
        module = layer.module
        hooks: list[GradHook] = []
        probe = self._probe
        if probe is not None and layer.name in probe.active:
            # Probed layers are captured on every rank; where the strategy does not
            # capture now, the probe builds its own copy (never the layer's state).
            captured = self.active and self._strategy.captures(layer)
            shadow = probe.capture_input(
                layer, module, args, kwargs, captured=captured, grad_enabled=grad_enabled
            )
            if shadow is not None:
                hooks.append(shadow)
        if not (self.active and module.training and grad_enabled):
            if self.active and grad_enabled:
                layer.seen_in_eval_mode = True  # explains a missing capture in the warning
            return hooks
        # On every rank, captured here or not: the ranks run the same forward, so each
        # knows which layers their owners have captured (grouped's receivers need it).
        layer.ever_seen = True
        if not self._strategy.captures(layer):
            return hooks
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return hooks
        options = self._options
        with self._timer.phase("factor_compute"):
            layer.accumulate_a(
                x, options.weight_sharing, self._dtype_for(layer), options.factor_method
            )
        self._factor_ready(layer, "A")
        hooks.append(partial(self._grad_hook, layer))
        return hooks

    def _grad_hook(self, layer: KFACLayer, grad: torch.Tensor) -> None:
        with self._timer.phase("factor_compute"):
            options = self._options
            layer.accumulate_g(
                grad,
                options.weight_sharing,
                self._dtype_for(layer),
                options.factor_method,
                inverse_scale=self.inverse_scale(grad.device),
            )
        self._factor_ready(layer, "G")

    def _factor_ready(self, layer: KFACLayer, which: str) -> None:
        """Tell the strategy a batch factor is complete, from the last micro-batch on.

        Earlier micro-batches are not announced: a pipelined strategy would
        send a partial sum and have to send the factor again at step time.
        """
        if layer.factors[which].count >= self._options.accumulation_steps:
            self._strategy.factor_ready(layer, which)

    def warn_uncaptured(self) -> None:
        """Warn once per layer whose hooks never fired although it has a gradient.

        Called by ``step()`` itself: the warning points at the user's ``pre.step()``.
        """
        for layer in self._layers:
            if (
                layer.ever_captured
                or layer.warned_no_capture
                or not self._strategy.captures(layer)
                or layer.module.weight.grad is None
            ):
                continue
            layer.warned_no_capture = True
            reason = (
                "its forward ran in eval mode during training steps (call model.train(); "
                "from_pretrained() returns eval-mode models)"
                if layer.seen_in_eval_mode
                else "its forward hook never fired (it is probably called functionally: its "
                "weight used by F.linear or the like instead of calling the module"
                f"{uncaptured_hint()})"
            )
            # The user's pre.step() call: this method, step(), then torch.no_grad's wrapper.
            warnings.warn(
                f"dpkfac: layer {layer.name!r} ({type(layer.module).__name__}) received a gradient "
                f"but was never captured: {reason}; it keeps its averaged gradient",
                RuntimeWarning,
                stacklevel=4,
            )


class Parameters:
    """The model's parameters as the step reduces them, listed once and followed.

    The layers are planned from the parameters trainable at construction; a
    parameter unfrozen later (fine-tuning a backbone) is averaged from the next
    step on like any parameter of no K-FAC layer, never preconditioned.

    Attributes:
        all: every parameter of the model, in module order.
        kfac: ids of the K-FAC layers' parameters.
        others: trainable parameters of no K-FAC layer, in module order (averaged only).
    """

    def __init__(self, module: nn.Module, layers: Sequence[KFACLayer]) -> None:
        self._module = module
        self.all = list(module.parameters())
        self.kfac = {id(p) for layer in layers for p in layer.helper.parameters()}
        self.others = self._trainable_others()
        # Trainable parameters the strategy was set up with (those unfrozen later are new).
        self._planned = {id(p) for p in self.others} | self.kfac

    def _trainable_others(self) -> list[nn.Parameter]:
        return [p for p in self.all if p.requires_grad and id(p) not in self.kfac]

    def layout(self, layers: Sequence[KFACLayer]) -> list[tuple[int, int]]:
        """Every trainable parameter in module order, as (index of its layer in ``layers``,
        or -1 for none, elements): what the cost model prices the step's gradients from."""
        owner = {id(p): i for i, layer in enumerate(layers) for p in layer.helper.parameters()}
        return [(owner.get(id(p), -1), p.numel()) for p in self.all if p.requires_grad]

    def follow_unfrozen(self, *, hooks_fixed: Callable[[], bool], ddp: bool) -> None:
        """Follow parameters unfrozen since construction (the same on every rank).

        Their gradients are averaged from now on, and a warning says they are
        not preconditioned (the layers were planned without them). Where
        ``hooks_fixed()`` (the overlapped mode, which reduces gradients from
        hooks registered at construction and cannot add one), ValueError.
        Called by ``step()`` itself: the warning points at the user's ``pre.step()``.
        """
        others = self._trainable_others()
        if len(others) == len(self.others) and all(
            a is b for a, b in zip(others, self.others, strict=True)
        ):
            return
        names = {id(p): n for n, p in self._module.named_parameters()}
        new = [names.get(id(p), "?") for p in others if id(p) not in self._planned]
        self.others = others
        if not new:
            return
        self._planned |= {id(p) for p in others}
        if hooks_fixed():
            raise ValueError(
                f"dpkfac: parameters {new} were frozen when the preconditioner was built and are "
                "trainable now; overlap=True reduces gradients from hooks registered at "
                "construction and cannot add them: build the preconditioner after unfreezing"
            )
        averaged = (
            "DDP averages their gradients only if they were trainable when it wrapped the model"
            if ddp
            else "their gradients are averaged across ranks"
        )
        warnings.warn(
            f"dpkfac: parameters {new} were frozen when the preconditioner was built and are "
            f"trainable now: {averaged}, but they are not preconditioned (build a new "
            "preconditioner after unfreezing to precondition their layers)",
            RuntimeWarning,
            stacklevel=4,  # the user's pre.step(): this method, step(), torch.no_grad's wrapper
        )


# ------------------------------------------------------------ the call order
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
