"""Capture: the hooks that build batch factors, and the parameters the step reduces.

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
  unfrozen later (averaged, never preconditioned).

Both see the run through what they are handed (the layers, the options, the
strategy's questions, the timer, the probe), never the preconditioner: it
sits above them and arms them before each step.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from dpkfac.amp import inverse_loss_scale
from dpkfac.attention import not_capturable
from dpkfac.call_order import GradientLedger
from dpkfac.compile import CaptureSite, GradHook, uncaptured_hint
from dpkfac.curvature import KFACLayer, helper_for
from dpkfac.fidelity import FidelityProbe
from dpkfac.options import KFACOptions
from dpkfac.stats import PhaseTimer
from dpkfac.strategies import Strategy

__all__ = ["Capture", "Parameters", "find_layers"]


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
