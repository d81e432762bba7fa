"""``torch.compile`` support: K-FAC's capture as two opaque operators in the model's graph.

The capture hooks (:class:`~dpkfac.preconditioner.KFACPreconditioner`) are
Python that Dynamo must not trace: they time their work with the host's clock
(:class:`~dpkfac.stats.PhaseTimer`), read ``functools.lru_cache`` tables
(:mod:`dpkfac.curvature.factors`), mutate the layers' state and may hand a
factor to a strategy that starts a collective at once. Traced, each of these
is a graph break or a warning, and the compilation that follows a break would
run inside the hook's timed phase (booked as ``factor_compute``). Left to run
eagerly (``torch.compiler.disable``), they would break the model's graph at
every K-FAC layer instead, on every step: the G hook needs the layer's output
as a real tensor, and Dynamo breaks the graph on a tensor hook registered on an
intermediate anyway.

So under Dynamo the forward hook emits, instead of running the capture:

* ``dpkfac::capture_input(x, site, grad)``, an opaque operator that, when the
  compiled graph runs, calls the eager capture code with the layer's input x
  (A, and the curvature-fidelity probe's shadow A);
* an identity autograd function around the layer's output, whose backward
  emits ``dpkfac::capture_grad(grad, site)`` with the output's gradient: the
  G hooks that the eager forward hook would have registered on the output run
  there.

The graph is the model's with two operator calls per K-FAC layer and no
graph break; the factors are those of an eager run on the same tensors (the
same code builds them, outside the graph, in eager mode); the compilation is
over before the graph, hence any timed phase, starts. Whether the operators
are in the graph depends on one flag of the preconditioner (whether this
step's hooks capture anything) that Dynamo guards on: a model compiles to one
graph with the capture and one without, whatever the schedule.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: A hook on the gradient of a layer's output (what the eager path registers on the output).
GradHook = Callable[[torch.Tensor], Any]

#: Live capture sites by key: the operators name their site by this key (an int in the graph).
_SITES: weakref.WeakValueDictionary[int, CaptureSite] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op(
    "dpkfac::capture_input", mutates_args=(), schema="(Tensor? x, int site, bool grad) -> ()"
)
def _capture_input(x: torch.Tensor | None, site: int, grad: bool) -> None:
    _SITES[site].run_input(x, grad)


@_capture_input.register_fake
def _capture_input_fake(x: torch.Tensor | None, site: int, grad: bool) -> None:
    return None


@torch.library.custom_op(
    "dpkfac::capture_grad", mutates_args=(), schema="(Tensor g, int site) -> ()"
)
def _capture_grad(g: torch.Tensor, site: int) -> None:
    _SITES[site].run_grad(g)


@_capture_grad.register_fake
def _capture_grad_fake(g: torch.Tensor, site: int) -> None:
    return None


# Operators that return nothing are dead code to the graph passes unless marked: these
# two exist for their effect on the preconditioner's state.
for _op in (torch.ops.dpkfac.capture_input.default, torch.ops.dpkfac.capture_grad.default):
    torch.fx.node.has_side_effect(_op)


class _GradTap(torch.autograd.Function):
    """The identity on a layer's output; its backward hands the output's gradient to the
    layer's capture site (in a compiled graph, where no hook can be put on the output).

    The forward returns a copy, not a view: the model may modify the output in place
    (``nn.ReLU(inplace=True)``), which autograd forbids on a view made by a custom
    function. The copy is in the capture graph only; inductor may fuse it away.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, site: int) -> torch.Tensor:
        ctx.site = site
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        torch.ops.dpkfac.capture_grad(grad, ctx.site)
        return grad, None


class CaptureSite:
    """One K-FAC layer's capture, as a compiled graph calls it.

    Args:
        capture: the eager capture of one call of the layer, given its input
            (None when the input is not a tensor): builds what it builds and
            returns the hooks to run on the gradient of that call's output.

    Each compiled call of the layer whose output needs a gradient queues the
    hooks its capture returned; the backward pass of that output runs them
    (last call first, as autograd reaches them). :meth:`reset` drops what a
    forward pass without a backward pass left.
    """

    def __init__(self, capture: Callable[[torch.Tensor | None], list[GradHook]]) -> None:
        self._capture = capture
        self._pending: list[list[GradHook]] = []
        self.key = next(_KEYS)
        _SITES[self.key] = self

    def in_graph(
        self, active: bool, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """The forward hook while Dynamo traces: the capture operators, or nothing.

        Args:
            active: whether this step's hooks capture anything (a flag Dynamo
                guards on: one graph with the operators, one without).
            args, kwargs, output: the forward hook's.

        Returns:
            The output wrapped in the identity whose backward captures G (the
            hook's replacement output), or None where the output needs no gradient.
        """
        if not active:
            return None
        x = args[0] if args else kwargs.get("input")
        wants_grad = isinstance(output, torch.Tensor) and output.requires_grad
        torch.ops.dpkfac.capture_input(
            x if isinstance(x, torch.Tensor) else None, self.key, wants_grad
        )
        return _GradTap.apply(output, self.key) if wants_grad else None

    def run_input(self, x: torch.Tensor | None, grad: bool) -> None:
        """``capture_input`` at run time: the eager capture, its G hooks queued if ``grad``."""
        hooks = self._capture(x)
        if grad:
            self._pending.append(hooks)

    def run_grad(self, g: torch.Tensor) -> None:
        """``capture_grad`` at run time: the G hooks of the latest call not yet backpropagated."""
        if self._pending:
            for hook in self._pending.pop():
                hook(g)

    def reset(self) -> None:
        """Forget the calls not backpropagated (a new step starts)."""
        self._pending.clear()


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, else the module.

    The preconditioner hooks, names and checks (DistributedDataParallel) the
    model itself: a compiled wrapper would prefix every layer name with
    ``_orig_mod.`` and hide a DDP model inside it. Without ``torch._dynamo``
    imported there is no such wrapper (its import is not paid here).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    while wrapper is not None and isinstance(module, wrapper):
        module = module._orig_mod
    return module


def uncaptured_hint() -> str:
    """Why a layer's hook may never have fired, where Dynamo compiled code in this process.

    Dynamo does not guard on module hooks: a graph compiled before the
    preconditioner registered them keeps running without them. Empty where
    nothing was compiled.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    frames = getattr(utils, "counters", {}).get("frames", {})
    if not frames.get("ok", 0):
        return ""
    return (
        ", or a torch.compile'd model ran before the preconditioner hooked it (its graphs "
        "run without the hooks: build the preconditioner before the first forward pass, or "
        "call torch._dynamo.reset() after building it)"
    )
