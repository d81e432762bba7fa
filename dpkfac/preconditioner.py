"""KFACPreconditioner: capture hooks, the generic step loop and checkpoint state.

The loop is the same for every distribution scheme; at each point it asks
the strategy object (:mod:`dpkfac.strategies`) what this rank should do:

1. capture (hooks): build batch factors for the layers this rank captures,
   A in the forward hook and G in a hook on the layer's output tensor;
2. average gradients across ranks (unless DDP already has);
3. reduce batch factors (strategy-specific) and fold them into running averages;
4. on decomposition steps, decompose the factors this rank is assigned and
   share the results;
5. precondition the layers this rank is responsible for and share the results;
6. scale by the KL clip and write the gradients back for ``optimizer.step()``.

The G hook is registered on the layer's *output tensor* rather than with
``register_full_backward_hook``: a tensor hook registered before an in-place
op (``nn.ReLU(inplace=True)``) still receives the gradient of the value the
layer produced, whereas the module backward hook errors out.

Under ``torch.compile`` the hooks are not traced: they put two operators into
the model's graph that run the same capture when the graph runs (no graph
break, one graph with the capture and one without; :mod:`dpkfac.compile`).
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from collections.abc import Iterable
from dataclasses import fields
from functools import cache, partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpkfac.amp import check_grad_scaler, inverse_loss_scale
from dpkfac.attention import not_capturable
from dpkfac.call_order import CALL_ORDER, WATCH, GradientLedger
from dpkfac.comm import Communicator
from dpkfac.compile import CaptureSite, GradHook, uncaptured_hint, unwrap_compiled
from dpkfac.costmodel.auto import Candidate, log_choice
from dpkfac.costmodel.predict import resolve
from dpkfac.curvature import COMPUTE_METHODS, KFACLayer, helper_for
from dpkfac.curvature.layer import FACTORS
from dpkfac.curvature.state import layer_state, load_layer_state, merge_layer_states
from dpkfac.device import HostReader
from dpkfac.fidelity import FidelityProbe, select_layers
from dpkfac.options import KFACOptions, Scalar, Schedule
from dpkfac.overlap import OverlapContext, OverlapEngine
from dpkfac.plan import SCHEMES, Scheme, StrategyOptions, name_key, scheme_of, scheme_options
from dpkfac.probes import start_up_hardware
from dpkfac.report import format_table, layer_rows, skipped_modules, slow_factors
from dpkfac.stats import CommStats, PhaseTimer
from dpkfac.strategies import Preconditioned, Strategy, strategy_class
from dpkfac.strategies.base import layer_shape, precondition_layer

log = logging.getLogger("dpkfac")


def _scheme_and_options(
    strategy: str | StrategyOptions, values: dict[str, Any]
) -> tuple[type[Scheme], StrategyOptions]:
    """The scheme and its validated options, from a name and keyword options, or from an
    options instance (which names its scheme by its class)."""
    if isinstance(strategy, StrategyOptions):
        if values:
            raise ValueError(
                f"strategy options {sorted(values)} given as keywords beside the "
                f"{type(strategy).__name__} instance; set them in the instance"
            )
        matches = [s for s in SCHEMES.values() if type(strategy) is s.Options]
        if not matches:
            raise ValueError(
                f"strategy={strategy!r}: not the options of a registered strategy "
                f"({', '.join(s.Options.__name__ for s in SCHEMES.values())})"
            )
        return matches[0], strategy
    scheme = scheme_of(strategy)
    return scheme, scheme_options(scheme.name, values, common=_common_keywords())


@cache
def _common_keywords() -> tuple[str, ...]:
    """The preconditioner's own keyword arguments, read from its signature.

    An unknown keyword lands among a strategy's options, but it is more often
    a common option misspelt (``dampening``): its message lists these too, and
    the signature is the one list that cannot drift from what is accepted.
    """
    parameters = inspect.signature(KFACPreconditioner.__init__).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _common_options(given: KFACOptions | None, keywords: KFACOptions) -> KFACOptions:
    """``options=`` when given (then no common option may also be given as a keyword),
    else the options built from the keywords."""
    if given is None:
        return keywords
    if not isinstance(given, KFACOptions):
        raise TypeError(f"options must be a KFACOptions, got {type(given).__name__}")
    defaults = KFACOptions()
    clash = [
        f.name
        for f in fields(KFACOptions)
        if getattr(keywords, f.name) != getattr(defaults, f.name)
    ]
    if clash:
        raise ValueError(
            f"common options {clash} given as keywords beside options=KFACOptions(...); "
            "set them in options"
        )
    return given


class KFACPreconditioner:
    """Distributed K-FAC gradient preconditioner (see ``docs/design.md``).

    Args:
        model: the model, possibly wrapped in ``DistributedDataParallel``.
        strategy: "dp_kfac" (default), "d_kfac", "spd_kfac", "kaisa" or "grouped"
            (in any case, with ``-`` or ``_``: "DP-KFAC"), or a scheme's options
            instance (e.g. :class:`~dpkfac.plan.DPKFACOptions`), which names
            the scheme and holds its options.
        options: the common options as one :class:`~dpkfac.options.KFACOptions`
            (then none of the keywords below may be given as well).
        compute_method: "eigen" (exact damped Kronecker inverse) or "inverse"
            (damping split as √γ on each factor).
        damping: γ, a float or a callable of the step.
        factor_decay: running-average decay of the factors.
        kl_clip: KL-clip bound (float or callable of the step), or None to disable it.
        lr: learning rate used by the KL clip (float or callable of the step).
        factor_update_steps: factor update interval (int or callable of the step).
        inv_update_steps: decomposition interval (int or callable of the step).
        skip_layers: regexes searched in module names; matches are not preconditioned.
        weight_sharing: "expand" or "reduce" for Conv2d positions and sequence dims.
        process_group: group to distribute over (default: the world group).
        factor_dtype: dtype factors are built and accumulated in (default:
            the layer weight's dtype).
        factor_method: how batch factors are built: "auto" (default: exact
            kernels chosen per layer, see :mod:`dpkfac.curvature.kernels`),
            "unfold" (the original im2col path) or "auto_bf16"
            (bf16 products with float32 sums; opt-in, not exact).
        decomposition_dtype: dtype of decompositions (at least float32; a
            float64 factor is decomposed in float64).
        pi_damping: with the inverse method, split the damping between the
            factors by their mean eigenvalues (π-damping) instead of √γ each.
        bucket_cap_mb: size cap of fused gradient/factor buckets.
        collective_timeout: seconds before a collective is declared hung.
        accumulation_steps: micro-batches per ``step()``, each captured, each
            with its loss divided by this number (gradient accumulation).
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision run.
            G is then built from unscaled output gradients, and the factor
            update is skipped on every rank on steps whose averaged gradients
            overflowed (the steps the scaler skips). Call
            ``scaler.unscale_(optimizer)`` before ``pre.step()``; with several
            ranks the model must then be DDP-wrapped, so every rank's scaler
            sees the same averaged gradients. With the overlapped mode
            (``overlap``), where a rank holds unreduced gradients of the layers
            it does not own until the updates arrive, the order is the other
            way (``takes_scaled_gradients``): ``pre.step()`` takes the scaled
            gradients and leaves every rank the same ones, then
            ``scaler.step(optimizer)`` unscales them and decides, alike on
            every rank; the KL clip divides out ``s²``. DDP is then optional.
        fidelity_every: every this many steps (``step % fidelity_every == 0``)
            run the curvature-fidelity probe (:mod:`dpkfac.fidelity`): the
            probed layers' batch factors are captured on every rank and
            averaged by one extra all-reduce (category ``fidelity_allreduce``),
            and the layer's owner compares the averaged gradient preconditioned
            with its local factors against the averaged factors; read the
            values with :meth:`fidelity`. 0 (default) turns it off. Training is
            bitwise unaffected.
        fidelity_layers: layer names or regexes (full match; each must match a
            K-FAC layer, else ValueError) probed at every probe step; None:
            one layer per probe step, in rotation in module order.
        **strategy_options: the strategy's own options as keywords, when
            ``strategy`` is a name (the fields of its scheme's ``Options``,
            e.g. :class:`~dpkfac.plan.DPKFACOptions`). Unknown options raise
            ValueError naming the closest accepted keyword, common or the strategy's.

    Every argument after ``model`` is keyword-only.

    Attributes:
        options: the common options, a :class:`~dpkfac.options.KFACOptions`.
        strategy: the strategy object; ``strategy.options`` holds its own options.
        strategy_name: the strategy's registered name.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        strategy: str | StrategyOptions = "dp_kfac",
        options: KFACOptions | None = None,
        compute_method: str = "eigen",
        damping: Scalar = 0.003,
        factor_decay: Scalar = 0.95,
        kl_clip: Scalar | None = 0.001,
        lr: Scalar = 0.1,
        factor_update_steps: Schedule = 1,
        inv_update_steps: Schedule = 1,
        skip_layers: str | Iterable[str] = (),
        weight_sharing: str = "expand",
        process_group: dist.ProcessGroup | None = None,
        factor_dtype: torch.dtype | None = None,
        factor_method: str = "auto",
        decomposition_dtype: torch.dtype = torch.float32,
        pi_damping: bool = False,
        bucket_cap_mb: float = 25.0,
        collective_timeout: float = 300.0,
        accumulation_steps: int = 1,
        grad_scaler: torch.amp.GradScaler | None = None,
        fidelity_every: int = 0,
        fidelity_layers: str | Iterable[str] | None = None,
        timing: str = "auto",
        host_reader: HostReader | None = None,
        **strategy_options_kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        # torch.compile's wrapper holds the model: hook and name the model itself.
        model = unwrap_compiled(model)
        scheme, own_options = _scheme_and_options(strategy, strategy_options_kwargs)
        self.strategy_name = scheme.name
        # skip_layers and fidelity_layers: KFACOptions converts a str or a list of them to
        # the tuple its fields declare (a dataclass field cannot type its converter).
        settings = KFACOptions(
            compute_method=compute_method,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            skip_layers=skip_layers,  # type: ignore[arg-type]  # converted by KFACOptions
            weight_sharing=weight_sharing,
            factor_dtype=factor_dtype,
            factor_method=factor_method,
            decomposition_dtype=decomposition_dtype,
            pi_damping=pi_damping,
            bucket_cap_mb=bucket_cap_mb,
            collective_timeout=collective_timeout,
            accumulation_steps=accumulation_steps,
            fidelity_every=fidelity_every,
            fidelity_layers=fidelity_layers,  # type: ignore[arg-type]  # converted by KFACOptions
            timing=timing,
        )
        self.options = _common_options(options, settings)
        self._skip = [re.compile(p) for p in self.options.skip_layers]
        self.model = model
        self.ddp = isinstance(model, DistributedDataParallel)
        check_grad_scaler(grad_scaler)
        self.grad_scaler = grad_scaler
        self.module: nn.Module = unwrap_compiled(
            model.module if isinstance(model, DistributedDataParallel) else model
        )
        self.method = COMPUTE_METHODS[self.options.compute_method]
        self.steps = 0

        self._stats = CommStats()
        #: The run's device: the model's. Every tensor the library makes for a layer
        #: is made there, and every collective must be handed tensors on it.
        self.device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        self._timer = PhaseTimer(self.device, self.options.timing)
        self.host = host_reader if host_reader is not None else HostReader()
        self.comm = Communicator(
            process_group,
            timeout=self.options.collective_timeout,
            stats=self._stats,
            timer=self._timer,
            device=self.device,
            host=self.host,
        )
        self.strategy: Strategy = self._build_strategy(scheme, own_options)
        #: Every candidate "auto" priced at the first step (empty when nothing was "auto").
        self.choice: list[Candidate] = []
        overlaps = self.strategy.scheme.may_overlap(self.strategy.options)
        #: Whether ``step()`` takes the gradients still scaled by ``grad_scaler``: with the
        #: overlapped mode, call ``pre.step()`` before ``scaler.step(optimizer)`` and do not
        #: call ``scaler.unscale_`` first (see ``grad_scaler``).
        self.takes_scaled_gradients = grad_scaler is not None and overlaps
        if grad_scaler is not None and self.comm.active and not self.ddp and not overlaps:
            raise ValueError(
                "grad_scaler with more than one rank needs a DistributedDataParallel model "
                "(or the overlapped mode, overlap=True): the scaler decides whether to skip a "
                "step from the gradients it unscales, which must already be averaged across "
                "ranks or the ranks would disagree"
            )
        self.layers: dict[str, KFACLayer] = self._register()
        self._track_parameters()
        self._layer_list = list(self.layers.values())
        # What a compiled graph calls in place of the forward hook (dpkfac/compile.py).
        self._sites = {
            x.name: CaptureSite(partial(self._capture_compiled, x)) for x in self._layer_list
        }
        self._skipped = skipped_modules(self.module, self.layers, self._skip)
        self._report_construction()
        # Checked even while the probe is off: a typo should not wait for fidelity_every > 0.
        select_layers(list(self.layers), self.options.fidelity_layers)
        self.strategy.place(
            self._layer_list,
            [layer_shape(x, 1, 1) for x in self._layer_list],
            given=self._given_options,
        )
        self._buffer_peak = 0
        self._capture = self._is_factor_step(0)
        # What the backward passes since the last step() left in the K-FAC gradients, and
        # whether an optimizer stepped with them first (the order of calls, checked per step).
        self._ledger = GradientLedger()
        WATCH.watch(self._ledger, [x.helper.module.weight for x in self._layer_list])
        # The device flag "some K-FAC gradient is nonzero" of this step, read with the
        # factor step's finiteness checks (None: no zero_grad can have zeroed them).
        self._nonzero: torch.Tensor | None = None
        # 1/s of the loss scaler per device, for the G hooks of the current step.
        self._inverse_scales: dict[torch.device, torch.Tensor] = {}
        # Set by a checkpoint of another world size that lacks some decompositions.
        self._decompose_next = False
        self._fidelity: FidelityProbe | None = None
        if self.options.fidelity_every > 0:
            self._fidelity = FidelityProbe(
                self._layer_list,
                self.options,
                comm=self.comm,
                timer=self._timer,
                grad_scaler=grad_scaler,
            )
        #: The overlapped execution mode, where the options ask for it or "auto" may.
        self._overlap: OverlapEngine | None = self._install_overlap() if overlaps else None
        self._arm(0)

    def _install_overlap(self) -> OverlapEngine:
        """The overlapped mode's gradient hooks (DDP's communication hook on a DDP model), with
        the narrow view of the run it needs."""
        reduced = self._kfac_params | {id(p) for p in self._other_params}
        seen: set[int] = set()
        params = []
        for p in self._params:
            if id(p) in reduced and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        return OverlapEngine(
            OverlapContext(
                layers=self._layer_list,
                params=params,
                comm=self.comm,
                bucket_cap_bytes=self.options.bucket_cap_bytes,
                accumulation_steps=self.options.accumulation_steps,
                with_kl=self.options.kl_clip is not None,
                timer=self._timer,
                host=self.host,
                decompose=self._decompose_layer,
                note_buffers=self._note_buffers,
                ddp=self.model if isinstance(self.model, DistributedDataParallel) else None,
                scaled=self.takes_scaled_gradients,
            )
        )

    @property
    def gradient_path(self) -> str:
        """How this run's gradients travel, in words, for logs and run records.

        Who reduces them (DDP, DDP's communication hook, the preconditioner's
        hooks or its ``step()``), how (all-reduce, or onto the owners with the
        updates all-gathered) and whether inside the backward pass. Under
        "auto" the choice is made at the first step; before it, the candidates.
        """
        traits = self.strategy.traits if self.strategy.configured else None
        owner = traits is not None and traits.owner_grad_reduction
        how = "reduced onto their owners, updates all-gathered" if owner else "all-reduced"
        if traits is None:
            how = "reduction chosen at the first step"
        scaled = ", before the loss scaler unscales them" if self.takes_scaled_gradients else ""
        if self._overlap is not None and (traits is None or traits.overlapped_precondition):
            source = "DDP's buckets, from its communication hook" if self.ddp else "own hooks"
            return f"{how} inside the backward pass ({source}){scaled}"
        if self.ddp:
            after = ", updates exchanged in step()" if self.comm.active else ""
            return f"all-reduced by DDP inside the backward pass{after}{scaled}"
        if not self.comm.active:
            return "one rank: nothing to reduce"
        return f"{how} in step(), after the backward pass{scaled}"

    @property
    def overlap(self) -> OverlapEngine | None:
        """The overlapped execution mode, where the options ask for it or "auto" may choose it
        (else None)."""
        return self._overlap

    def _arm(self, step: int) -> None:
        """Set what the hooks of ``step`` do: capture, and (overlapped mode) the step's flags."""
        self._capture = self._is_factor_step(step)
        if self._fidelity is not None:
            self._fidelity.arm(step)
        #: Whether the hooks of ``step`` capture anything (capture or a fidelity probe): a
        #: compiled model guards on it, one graph with the capture operators, one without.
        self._hooks_active = self._capture or (
            self._fidelity is not None and bool(self._fidelity.active)
        )
        for site in self._sites.values():
            site.reset()
        if self._overlap is None:
            return
        flags = self._overlap.ctx.flags
        flags.step = step
        flags.plan = self.strategy.plan
        flags.capture = self._capture
        flags.decompose = self._is_inv_step(step)
        flags.owner = self.strategy.traits.owner_grad_reduction
        flags.overlapped = (
            self.strategy.traits.overlapped_precondition
            and self.strategy.placed
            and not self._decompose_next
            and not (self._fidelity is not None and bool(self._fidelity.active))
        )
        if flags.overlapped:
            flags.damping = float(self.options.at("damping", step))
            flags.decay = float(self.options.at("factor_decay", step))

    def _note_buffers(self, nbytes: int) -> None:
        """Record the bytes of batch factors awaiting their fold (the peak is reported)."""
        self._buffer_peak = max(self._buffer_peak, nbytes)

    def _build_strategy(self, scheme: type[Scheme], options: StrategyOptions) -> Strategy:
        """The runtime strategy, once the start-up measurement its options ask for is done.

        The options the run was given decide its one-time setup (kept in
        ``_given_options``); a hardware model the scheme places work by is
        measured now, on this group (a collective).
        """
        self._given_options = options
        if scheme.measures_hardware(options):
            options = scheme.with_hardware(options, start_up_hardware(self.comm))
        return strategy_class(scheme.name)(
            self.comm,
            self.method,
            options,
            decomposition_dtype=self.options.decomposition_dtype,
            bucket_cap_mb=self.options.bucket_cap_mb,
            kfac=self.options,
        )

    def _track_parameters(self) -> None:
        """The model's parameters, listed once: the step loop checks their trainability."""
        self._params = list(self.module.parameters())
        self._kfac_params = {
            id(p) for layer in self.layers.values() for p in layer.helper.parameters()
        }
        self._other_params = self._trainable_others()
        # Trainable parameters the strategy was set up with (those unfrozen later are new).
        self._planned_params = {id(p) for p in self._other_params} | self._kfac_params

    # ------------------------------------------------------------ registration
    def _register(self) -> dict[str, KFACLayer]:
        """Wrap every supported, trainable, non-skipped module and hook it (module order)."""
        layers: dict[str, KFACLayer] = {}
        # A Linear that nn.MultiheadAttention calls functionally can never be captured: it is
        # not a layer (the report lists it with what to do), whatever its type says.
        functional = not_capturable(self.module)
        for name, module in self.module.named_modules():
            helper = helper_for(module)
            if helper is None or name in functional or any(p.search(name) for p in self._skip):
                continue
            if not all(p.requires_grad for p in helper.parameters()):
                continue
            layer = KFACLayer(name, module, helper, self.options.accumulation_steps)
            module.register_forward_hook(partial(self._forward_hook, layer), with_kwargs=True)
            module.weight.register_post_accumulate_grad_hook(self._gradient_arrived)
            layers[name] = layer
        return layers

    def _report_construction(self) -> None:
        """Log what is preconditioned and what is not (rank 0); warn of slow factors."""
        if self.comm.rank == 0:
            for x in self._layer_list:
                log.info(
                    "K-FAC layer %s (%s): A %d x %d, G %d x %d",
                    x.name,
                    type(x.module).__name__,
                    x.helper.a_dim,
                    x.helper.a_dim,
                    x.helper.g_dim,
                    x.helper.g_dim,
                )
            for skipped in self._skipped:
                log.info("not preconditioned: %s (%s): %s", *vars(skipped).values())
        slow = slow_factors(self._layer_list, self.device.type)
        if slow:
            listed = ", ".join(f"{n} {w} {d}-wide (~{t:.0f} s)" for n, w, d, t in slow[:3])
            interval = self.options.inv_update_steps
            warnings.warn(
                f"dpkfac: decomposing the widest factors will dominate a step on "
                f"{self.device.type}: {listed}{' and more' if len(slow) > 3 else ''} per "
                f"decomposition step; raise inv_update_steps (now {interval!r}) so they are "
                "decomposed rarely, leave those layers out (skip_layers), or use "
                "compute_method='inverse'",
                RuntimeWarning,
                stacklevel=3,
            )

    def summary(self) -> str:
        """A table of the K-FAC layers (sizes, placement, MiB held here) and of the modules
        left alone with the reason, then the time per phase (ms). Reads timings: on a GPU
        this waits for the timed work."""
        uncaptured = [x.name for x in self._layer_list if x.warned_no_capture]
        rows = layer_rows(self._layer_list, placed=self.strategy.placed, uncaptured=uncaptured)
        timings = {k: v * 1e3 for k, v in self.timings().items()}
        return format_table(rows, self._skipped, timings)

    def _trainable_others(self) -> list[nn.Parameter]:
        """Trainable parameters of no K-FAC layer, in module order (averaged only)."""
        return [p for p in self._params if p.requires_grad and id(p) not in self._kfac_params]

    def _check_unfrozen(self) -> None:
        """Follow parameters unfrozen since construction (the same on every rank).

        Their gradients are averaged from now on, like any parameter of no
        K-FAC layer, and a warning says they are not preconditioned (the
        layers were planned without them). The overlap cannot add gradient
        hooks mid-run, so it refuses.
        """
        others = self._trainable_others()
        if len(others) == len(self._other_params) and all(
            a is b for a, b in zip(others, self._other_params, strict=True)
        ):
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        new = [names.get(id(p), "?") for p in others if id(p) not in self._planned_params]
        self._other_params = others
        if not new:
            return
        self._planned_params |= {id(p) for p in others}
        if self._overlap is not None and (
            self.strategy.traits.overlapped_precondition or not self.strategy.configured
        ):
            raise ValueError(
                f"dpkfac: parameters {new} were frozen when the preconditioner was built and are "
                "trainable now; overlap=True reduces gradients from hooks registered at "
                "construction and cannot add them: build the preconditioner after unfreezing"
            )
        averaged = (
            "DDP averages their gradients only if they were trainable when it wrapped the model"
            if self.ddp
            else "their gradients are averaged across ranks"
        )
        warnings.warn(
            f"dpkfac: parameters {new} were frozen when the preconditioner was built and are "
            f"trainable now: {averaged}, but they are not preconditioned (build a new "
            "preconditioner after unfreezing to precondition their layers)",
            RuntimeWarning,
            stacklevel=4,  # the user's pre.step(): this method, step(), torch.no_grad's wrapper
        )

    def _gradient_arrived(self, param: nn.Parameter) -> None:
        """A backward pass wrote a K-FAC layer's gradient: the next ``step()`` has work."""
        self._ledger.arrived(param)

    def _is_factor_step(self, step: int) -> bool:
        return step % self.options.at("factor_update_steps", step) == 0

    def _is_inv_step(self, step: int) -> bool:
        return step % self.options.at("inv_update_steps", step) == 0

    def _dtype_for(self, layer: KFACLayer) -> torch.dtype:
        return self.options.factor_dtype or layer.helper.module.weight.dtype

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
            active = torch.is_grad_enabled() and self._hooks_active
            return self._sites[layer.name].in_graph(active, args, kwargs, output)
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
        probe = self._fidelity
        if probe is not None and layer.name in probe.active:
            # Probed layers are captured on every rank; where the strategy does not
            # capture now, the probe builds its own copy (never the layer's state).
            captured = self._capture and self.strategy.captures(layer)
            shadow = probe.capture_input(
                layer, module, args, kwargs, captured=captured, grad_enabled=grad_enabled
            )
            if shadow is not None:
                hooks.append(shadow)
        if not (self._capture and module.training and grad_enabled):
            if self._capture and grad_enabled:
                layer.seen_in_eval_mode = True  # explains a missing capture in the warning
            return hooks
        # On every rank, captured here or not: the ranks run the same forward, so each
        # knows which layers their owners have captured (grouped's receivers need it).
        layer.ever_seen = True
        if not self.strategy.captures(layer):
            return hooks
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return hooks
        with self._timer.phase("factor_compute"):
            layer.accumulate_a(
                x, self.options.weight_sharing, self._dtype_for(layer), self.options.factor_method
            )
        self._factor_ready(layer, "A")
        hooks.append(partial(self._grad_hook, layer))
        return hooks

    def _grad_hook(self, layer: KFACLayer, grad: torch.Tensor) -> None:
        with self._timer.phase("factor_compute"):
            options = self.options
            layer.accumulate_g(
                grad,
                options.weight_sharing,
                self._dtype_for(layer),
                options.factor_method,
                inverse_scale=self._inverse_scale(grad.device),
            )
        self._factor_ready(layer, "G")

    def _inverse_scale(self, device: torch.device) -> torch.Tensor | None:
        """The loss scale's ``1/s`` on ``device``: computed once per step, not once per layer
        (the scale changes only at ``scaler.update()``, after ``step()``)."""
        if self.grad_scaler is None:
            return None
        if device not in self._inverse_scales:
            inverse = inverse_loss_scale(self.grad_scaler, device)
            if inverse is None:
                return None
            self._inverse_scales[device] = inverse
        return self._inverse_scales[device]

    def _factor_ready(self, layer: KFACLayer, which: str) -> None:
        """Tell the strategy a batch factor is complete, from the last micro-batch on.

        Earlier micro-batches are not announced: a pipelined strategy would
        send a partial sum and have to send the factor again at step time.
        """
        if layer.factors[which].count >= self.options.accumulation_steps:
            self.strategy.factor_ready(layer, which)

    # --------------------------------------------------------------- placement
    def _finalise_placement(self) -> None:
        """Place layers from the first batch's shapes, agreed on by all ranks.

        Where options are left to choose ("auto"), the cost model resolves them
        first for these shapes, and the strategy is configured with the choice.
        """
        strategy = self.strategy
        stats = [float(v) for x in self._layer_list for v in (x.batch_size, x.positions)]
        if strategy.scheme.placement_uses_batch(self._given_options):
            stats = self.comm.agree_max(stats)
        # A step's batch is its k micro-batches: placing by one micro-batch would
        # place (and so precondition) an accumulated run unlike the same batch in one.
        k = self.options.accumulation_steps
        shapes = [
            layer_shape(x, k * int(stats[2 * i]), int(stats[2 * i + 1]))
            for i, x in enumerate(self._layer_list)
        ]
        if not strategy.configured:
            scheme = strategy.scheme
            chosen, self.choice = resolve(
                scheme,
                strategy.options,
                shapes=shapes,
                world_size=self.comm.size,
                kfac=self.options,
                allow=lambda c: (
                    self._overlap is not None or not scheme.traits(c).overlapped_precondition
                ),
            )
            strategy.configure(chosen)
            log_choice(strategy.scheme, self.comm.size, chosen, self.choice)
        strategy.place(self._layer_list, shapes, final=True, given=self._given_options)
        if self.comm.rank == 0 and self.comm.size > 1:
            for x in self._layer_list:
                log.info(
                    "placed %s: owner rank %d, A decomposed by %s, G by %s",
                    x.name,
                    x.owner,
                    x.a_owner,
                    x.g_owner,
                )
        for layer in self._layer_list:
            if not self.strategy.captures(layer):
                # Another rank holds this layer: drop what was built here, and what a
                # checkpoint of another world size gave every rank (dp_kfac's factors).
                layer.clear_pending()
                keep_decompositions = self.strategy.preconditions(layer)
                for state in layer.factors.values():
                    state.running = None
                    if not keep_decompositions:  # a gradient worker keeps them
                        state.decomposition = None

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> None:
        """Average gradients, update curvature as scheduled and precondition in place.

        Raises:
            RuntimeError: the loop calls it out of order (:data:`CALL_ORDER`): an
                optimizer stepped with the last backward pass's gradients, or
                ``zero_grad()`` cleared them, before this call. Nothing is done.
        """
        if self._layer_list and not self._ledger.fresh:
            warnings.warn(
                "dpkfac: step() was called without a backward pass since the last step() "
                f"(step {self.steps}): nothing was done, and the gradients were left as they are "
                "(the same gradients are never preconditioned twice); the order of calls is "
                f"{CALL_ORDER}",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self._check_order()
        self._inverse_scales = {}  # the next backward may run under another loss scale
        step = self.steps
        strat = self.strategy
        layers = self._layer_list
        probe = self._fidelity
        if probe is not None:
            # The local batch factors, before placement drops or reduction averages them.
            probe.collect()
        self._check_unfrozen()
        if not strat.placed:
            self._finalise_placement()
        self._buffer_peak = max(self._buffer_peak, sum(x.pending_nbytes() for x in layers))

        # A strategy that did this step's work in the backward pass (dp_kfac's
        # overlap) hands over the updates: only the KL clip and write-back remain.
        overlapped = None if self._overlap is None else self._overlap.finish()
        if overlapped is not None:
            self._apply(overlapped, step)
            self._warn_uncaptured()
            self.steps += 1
            self._arm(self.steps)
            return

        if not self.ddp:
            strat.reduce_gradients(layers, self._other_params)

        if any(x.has_pending(w) for x in layers for w in FACTORS) or self._capture:
            strat.reduce_factors(layers)
            self._fold_factors(float(self.options.at("factor_decay", step)))

        damping = float(self.options.at("damping", step))
        if probe is not None:
            probe.run(step, damping)  # gradients averaged, not yet overwritten
        if self._is_inv_step(step) or self._decompose_next:
            self._decompose_next = False
            strat.sync_factors(layers)
            due = {(x.name, w) for x in layers for w in FACTORS if x.factor(w) is not None}
            for layer in sorted(layers, key=lambda x: x.name):
                self._decompose_layer(layer, damping)
            strat.share_decompositions(layers, due)

        results = self._precondition(damping)
        with_kl = self.options.kl_clip is not None
        final = strat.share_preconditioned(layers, results, with_kl=with_kl)
        self._apply(final, step)
        self._warn_uncaptured()

        self.steps += 1
        self._arm(self.steps)

    def _check_order(self) -> None:
        """Refuse gradients the optimizer already used or ``zero_grad()`` cleared; arm the
        zero check.

        Both facts are host metadata, so the check costs no device read. Under
        the overlapped mode the backward pass launched the step's collectives:
        they are waited for (every rank of a misordered loop refuses at the same
        call) and their updates dropped, so that a caller who catches the error
        finds the next step consistent.
        """
        ledger = self._ledger
        misuse = ledger.misuse()
        # The zero check rides on the ordinary step's read of a factor step: elsewhere
        # there is no read to join (the overlapped mode reads in its own finish()).
        overlapped = self._overlap is not None and self._overlap.ctx.flags.overlapped
        reads = self._capture and not overlapped
        self._nonzero = ledger.zero_flag() if misuse is None and reads else None
        ledger.reset()
        if misuse is None:
            return
        if self._overlap is not None:
            self._overlap.finish()
        raise RuntimeError(
            f"dpkfac: step() at step {self.steps} found the gradients of the last backward pass "
            f"already {misuse}: the model takes plain SGD steps, not K-FAC's. Nothing was done. "
            f"The order of calls is {CALL_ORDER} (pre.step() after loss.backward(), before "
            "optimizer.step())"
        )

    def _warn_zero_gradients(self, step: int) -> None:
        """Every K-FAC gradient is zero after something zeroed them: say what that means."""
        warnings.warn(
            f"dpkfac: step() at step {step} found the gradient of every K-FAC layer zero, set "
            "after the backward pass wrote it (as zero_grad(set_to_none=False) does): if "
            "pre.step() runs before loss.backward(), K-FAC preconditions zeros and the model "
            f"takes plain SGD steps. The order of calls is {CALL_ORDER}",
            RuntimeWarning,
            stacklevel=5,
        )

    def _decompose_layer(self, layer: KFACLayer, damping: float) -> None:
        """The layer's decompositions this rank computes: the one routine of ``step()`` and of
        the overlapped mode's hooks."""
        due = [w for w in FACTORS if layer.factor(w) is not None]
        mine = [w for w in due if self.strategy.decomposes(layer, w)]
        if not mine:
            return
        with self._timer.phase("decomposition"):
            for which in mine:
                self._decompose(layer, which, damping)

    def _decompose(self, layer: KFACLayer, which: str, damping: float) -> None:
        """Decompose one factor with the step's damping (split by π under ``pi_damping``)."""
        factor_damping = (
            layer.pi_damping(which, damping, self.host) if self.options.pi_damping else damping
        )
        layer.decompose(
            which,
            self.method,
            damping=factor_damping,
            dtype=self.options.decomposition_dtype,
            host=self.host,
        )

    def _fold_factors(self, decay: float) -> None:
        """Fold every pending batch factor into its running average.

        The non-finite checks of all factors are read together: one host
        sync per factor step instead of one per factor. With a loss scaler the
        same read says whether the averaged gradients overflowed: the scaler
        then skips the step, and so do the factors, on every rank (the
        decision comes from values every rank holds alike, never from one
        rank's local batch).
        """
        checks = [
            (layer, w, ok) for layer in self._layer_list for w, ok in layer.finite_checks().items()
        ]
        scaler = self.grad_scaler is not None
        identical = self.ddp or not self.strategy.traits.owner_grad_reduction
        # Where ranks hold different gradients, agreeing is a collective: every rank takes
        # part, those without factors to fold too.
        overflow = scaler and not identical and self._agree_overflow()
        nonzero, self._nonzero = self._nonzero, None
        if not checks:
            return
        device = checks[0][2].device
        flags = [ok.to(device) for _, _, ok in checks]
        if scaler and identical:
            flags.append(self._gradients_finite().to(device))
        if nonzero is not None:
            flags.append(nonzero.to(device))
        read = self.host.flags(torch.stack(flags))
        if nonzero is not None and not read.pop():
            self._warn_zero_gradients(self.steps)
        if scaler:
            overflow = overflow or (identical and not read[-1])
            if overflow:
                # The scaler skips this step: so do the factors, all of them and without
                # a warning (this is routine).
                for layer in self._layer_list:
                    layer.clear_pending()
                return
        finite: dict[str, dict[str, bool]] = {}
        for (layer, which, _), ok in zip(checks, read, strict=False):
            finite.setdefault(layer.name, {})[which] = bool(ok)
        for layer in self._layer_list:
            layer.update_factors(decay, finite.get(layer.name, {}))

    def _gradients_finite(self) -> torch.Tensor:
        """Device flag: every gradient this rank holds (K-FAC layers' and the others') is
        finite."""
        grads = [g for p in self._params if p.requires_grad and (g := p.grad) is not None]
        if not grads:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return torch.stack([torch.isfinite(g).all().to(self.device) for g in grads]).all()

    def _agree_overflow(self) -> bool:
        """Whether any rank's reduced gradients overflowed, where ranks hold different ones
        (the owner reduction's ordinary step without DDP): one 8-byte all-reduce."""
        ok = self.host.flags(self._gradients_finite().reshape(1))[0]
        return self.comm.agree_max([0.0 if ok else 1.0], "grad_allreduce")[0] > 0.0

    def _precondition(self, damping: float) -> dict[str, Preconditioned]:
        results: dict[str, Preconditioned] = {}
        with self._timer.phase("precondition"):
            for layer in self._layer_list:
                if not self.strategy.preconditions(layer):
                    continue
                grad = layer.helper.grad_matrix()
                if grad is None:
                    continue
                results[layer.name] = precondition_layer(layer, grad, damping)
        return results

    def _kl_scale(self, final: dict[str, Preconditioned], step: int) -> torch.Tensor | None:
        """``ν = min(1, sqrt(kl_clip / |Σ lr² ⟨V, ∇W⟩|))`` as a device scalar (None: no clip).

        Computed on the device from every rank's identical inputs in layer
        order, so all ranks get the same bits without a host round trip; a
        zero or non-finite sum leaves the updates unscaled.
        """
        if self.options.kl_clip is None:
            return None
        terms = []
        for layer in self._layer_list:
            res = final.get(layer.name)
            if res is None or res.preconditioned is False:
                continue
            flag = res.preconditioned
            terms.append(res.vg if flag is True else torch.where(flag, res.vg, 0.0))
        if not terms:
            return None
        lr = float(self.options.at("lr", step))
        kl_clip = float(self.options.at("kl_clip", step))
        device = terms[0].device
        vg_sum = torch.stack([t.to(device) for t in terms]).sum() * lr**2
        if self.takes_scaled_gradients:
            # ⟨V, ∇W⟩ of gradients scaled by s is s² too large.
            inverse = self._inverse_scale(device)
            if inverse is not None:
                vg_sum = vg_sum * inverse.to(vg_sum.dtype) ** 2
        usable = torch.isfinite(vg_sum) & (vg_sum != 0)
        ratio = kl_clip / vg_sum.abs().clamp(min=torch.finfo(vg_sum.dtype).tiny)
        return torch.where(usable, ratio.sqrt().clamp(max=1.0), torch.ones_like(vg_sum))

    def _apply(self, final: dict[str, Preconditioned], step: int) -> None:
        """Scale by the KL clip and write the updates into ``.grad``."""
        scale = self._kl_scale(final, step)
        for layer in self._layer_list:
            res = final.get(layer.name)
            if res is None:
                continue
            # Unpreconditioned updates are written too: under dp-kfac they may
            # have arrived by broadcast in place of a gradient never averaged here.
            matrix, flag = res.matrix, res.preconditioned
            if scale is not None and flag is not False:
                factor = scale if flag is True else torch.where(flag, scale, 1.0)
                matrix = matrix * factor.to(matrix.device)
            layer.helper.set_grad_matrix(matrix)

    def _warn_uncaptured(self) -> None:
        """Warn once per layer whose hooks never fired although it has a gradient."""
        for layer in self._layer_list:
            if (
                layer.ever_captured
                or layer.warned_no_capture
                or not self.strategy.captures(layer)
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

    # -------------------------------------------------------------- inspection
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per collective category on this rank since :meth:`reset_stats`."""
        return self._stats.as_dict()

    def timings(self) -> dict[str, float]:
        """Seconds per phase on this rank since :meth:`reset_stats`."""
        return self._timer.as_dict()

    def fidelity(self) -> dict[str, dict[str, float | int]]:
        """The curvature-fidelity probe's latest values per probed layer (same on every rank).

        ``{layer: {"cosine": c, "rel_error": e, "step": s}}``: at step ``s`` the
        layer's owner preconditioned the averaged gradient with the damped
        factors of its own batch (``a``) and of all ranks' batches (``b``);
        ``c`` is their cosine similarity and ``e = ‖a − b‖ / ‖b‖``. Empty when
        ``fidelity_every`` is 0 or no probe ran yet. Reads the host.
        """
        return {} if self._fidelity is None else self._fidelity.results()

    def reset_stats(self) -> None:
        """Zero the communication, timing and buffer-peak accounting."""
        self._stats.reset()
        self._timer.reset()
        self._buffer_peak = 0

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank.

        ``factors_bytes`` and ``decompositions_bytes`` are what is held now;
        ``buffers_bytes`` is the peak of batch factors awaiting their fold since
        the last reset.
        """
        return {
            "factors_bytes": sum(x.factor_nbytes() for x in self._layer_list),
            "decompositions_bytes": sum(x.decomposition_nbytes() for x in self._layer_list),
            "buffers_bytes": self._buffer_peak,
        }

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Factors, decompositions, placement and step counters (tensors cloned).

        Under dp_kfac each rank holds only its own layers' factors (and under
        kaisa with f < 1 and grouped, decompositions live on gradient workers
        only), so this is a collective there: every rank must call it, and
        rank 0 receives the complete state, each piece from a rank that holds
        it (the usual "save on rank 0" pattern then loses nothing).
        Other ranks return their own part. Under lazy factor synchronisation
        (d_kfac's and kaisa's default) the ranks' running factors differ until
        the next decomposition, so this is a collective there too: it averages
        them first. Otherwise every rank's state is already complete and no
        communication happens.
        """
        # Lazily synchronised factors differ between ranks until averaged: a
        # checkpoint holds their average (a collective then, on every rank).
        self.strategy.sync_factors(self._layer_list)
        layers = {x.name: layer_state(x, **self._held(x)) for x in self._layer_list}
        if self.comm.active and not self.strategy.replicated_state:
            parts = self.comm.gather_objects(layers, dst=0)
            for part in parts or []:
                for name, entry in part.items():
                    layers[name] = merge_layer_states(layers[name], entry)
        return {
            "steps": self.steps,
            "strategy": self.strategy_name,
            "compute_method": self.options.compute_method,
            "world_size": self.comm.size,
            "placed": self.strategy.placed,
            "layers": layers,
            "strategy_state": self.strategy.state_dict(),
        }

    def _held(self, layer: KFACLayer) -> dict[str, bool]:
        """What this rank holds of a layer: its factors where it captures the layer, its
        decompositions there and where it preconditions the layer (a gradient worker)."""
        captures = self.strategy.captures(layer)
        return {"held": captures, "decompositions": captures or self.strategy.preconditions(layer)}

    def load_state_dict(
        self, state: dict[str, Any], *, allow_world_size_change: bool = False
    ) -> None:
        """Restore :meth:`state_dict` output; the run then continues bitwise-identically.

        Every rank may load the same (rank 0) state: each keeps what its
        strategy says it holds.

        Args:
            state: What :meth:`state_dict` returned (rank 0's, for dp_kfac).
            allow_world_size_change: Accept a state saved with another number
                of ranks (an elastic restart with fewer or more workers) instead
                of raising. The saved placement names ranks of the old group, so
                the layers are placed again at the next ``step()`` (every rank
                captures until then); the factors and decompositions are kept,
                since rank 0's state holds all of them (dp_kfac gathers the
                owners' layers into it; the other strategies replicate them).
                Where the state lacks a decomposition of a held factor (KAISA's
                column-local decompositions), the next step decomposes. The
                strategy's own state (spd_kfac's fusion plan and link model)
                describes the old group and is measured again. A RuntimeWarning
                says so: the run continues, but not bitwise. Every rank must
                load the same state.

        Raises:
            ValueError: Another strategy or compute method, another world size
                without ``allow_world_size_change``, or layers this model lacks.
        """
        saved = dict(state)
        if isinstance(saved.get("strategy"), str):  # checkpoints of another spelling
            saved["strategy"] = name_key(saved["strategy"])
        for key, mine in (
            ("strategy", self.strategy_name),
            ("compute_method", self.options.compute_method),
        ):
            if saved.get(key) != mine:
                raise ValueError(
                    f"checkpoint was saved with {key}={saved.get(key)!r} but this preconditioner "
                    f"has {key}={mine!r}"
                )
        resized = saved.get("world_size") != self.comm.size
        if resized and not allow_world_size_change:
            raise ValueError(
                f"checkpoint was saved with world_size={saved.get('world_size')!r} but this "
                f"preconditioner has world_size={self.comm.size!r} (pass "
                "allow_world_size_change=True to continue without a bitwise guarantee)"
            )
        missing = sorted(set(state["layers"]) - set(self.layers))
        if missing:
            raise ValueError(f"checkpoint has K-FAC layers this model lacks: {missing}")
        self.steps = int(state["steps"])
        entries = {n: e for n, e in state["layers"].items() if n in self.layers}
        if resized:
            self._load_resized(entries, saved.get("world_size"))
        else:
            self.strategy.placed = bool(state["placed"])
            self.strategy.load_state_dict(state.get("strategy_state", {}))
            for name, entry in entries.items():  # placement first: it decides what is held
                load_layer_state(self.layers[name], entry, self.method, held=None)
            self.strategy.restore(self._layer_list, given=self._given_options)
            for name, entry in entries.items():
                layer = self.layers[name]
                load_layer_state(layer, entry, self.method, **self._held(layer))
        self._arm(self.steps)

    def _load_resized(self, entries: dict[str, dict[str, Any]], saved_size: Any) -> None:
        """Load layer entries saved by another number of ranks (see :meth:`load_state_dict`)."""
        # The saved owners may not exist here: place with nominal shapes now (every
        # rank captures every layer until the first step places with measured ones).
        self.strategy.placed = False
        self.strategy.place(
            self._layer_list,
            [layer_shape(x, 1, 1) for x in self._layer_list],
            given=self._given_options,
        )
        for name, entry in entries.items():
            layer = self.layers[name]
            here = {
                **entry,
                "owner": layer.owner,
                "a_owner": layer.factors["A"].owner,
                "g_owner": layer.factors["G"].owner,
            }
            load_layer_state(layer, here, self.method, held=True)
        # Identical on every rank (they load the same state), so all agree on the step.
        self._decompose_next = any(
            entry[w] is not None and entry[f"{w}_decomp"] is None
            for entry in entries.values()
            for w in FACTORS
        )
        warnings.warn(
            f"dpkfac: checkpoint was saved with world_size={saved_size!r}, this preconditioner has "
            f"world_size={self.comm.size}: continuing with the saved factors"
            + (
                " (the missing decompositions are computed at the next step)"
                if self._decompose_next
                else " and decompositions"
            )
            + "; layers are placed again at the next step, and the run is not a bitwise "
            "continuation",
            RuntimeWarning,
            stacklevel=3,
        )

    def __repr__(self) -> str:
        return (
            f"KFACPreconditioner(strategy={self.strategy_name!r}, "
            f"method={self.options.compute_method!r}, "
            f"layers={len(self.layers)}, not_preconditioned={len(self._skipped)}, "
            f"world_size={self.comm.size}, rank={self.comm.rank})"
        )
