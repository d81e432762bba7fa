"""KFACPreconditioner: the public API and the generic step loop.

The loop is the same for every distribution scheme; at each point it asks
the strategy object (:mod:`dpkfac.strategies`) what this rank should do:

1. capture (hooks, :mod:`dpkfac.capture`): build batch factors for the layers
   this rank captures, A in the forward hook and G in a hook on the layer's
   output tensor;
2. average gradients across ranks (unless DDP already has);
3. reduce batch factors (strategy-specific) and fold them into running averages;
4. on decomposition steps, decompose the factors this rank is assigned and
   share the results;
5. precondition the layers this rank is responsible for and share the results;
6. scale by the KL clip and write the gradients back for ``optimizer.step()``.

This module is the one orchestrator: what runs around the loop lives beside
it, below it, and is handed what it needs, never the preconditioner: the
capture hooks and the parameters they follow (:mod:`dpkfac.capture`), the
strategy built at start-up and the first step's placement, where "auto"
options are resolved (:mod:`dpkfac.placement`), checkpoints and world-size
changes (:mod:`dpkfac.state`), the layer report (:mod:`dpkfac.report`), the
overlapped mode (:mod:`dpkfac.overlap`) and the fidelity probe
(:mod:`dpkfac.fidelity`). docs/design.md walks through one dp_kfac step.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import fields
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpkfac.amp import check_grad_scaler
from dpkfac.capture import CALL_ORDER, WATCH, Capture, GradientLedger, Parameters, find_layers
from dpkfac.comm import Communicator
from dpkfac.compile import unwrap_compiled
from dpkfac.costmodel.auto import Candidate
from dpkfac.curvature import DECOMPOSITIONS, KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.device import HostReader
from dpkfac.fidelity import FidelityProbe, select_layers
from dpkfac.options import KFACOptions, Scalar, Schedule
from dpkfac.overlap import OverlapContext, OverlapEngine
from dpkfac.placement import build_strategy, finalise_placement
from dpkfac.plan import SCHEMES, Scheme, StrategyOptions, scheme_of, scheme_options
from dpkfac.plan.configs import resolve as resolve_config
from dpkfac.plan.hardware import drains_early
from dpkfac.plan.options import STEP_RULES
from dpkfac.report import format_summary, layer_rows, report_construction, skipped_modules
from dpkfac.state import load_state, save_state
from dpkfac.stats import CommStats, PhaseTimer
from dpkfac.strategies import Preconditioned, Strategy
from dpkfac.strategies.base import layer_shape, precondition_layer
from dpkfac.timeline import Timeline


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
    # A configuration's name (dp_kfac_owner) is its scheme with options; explicit ones win.
    name, values = resolve_config(strategy, values)
    scheme = scheme_of(name)
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
            kernels chosen per layer, see :mod:`dpkfac.curvature.factors`),
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
        timing: how ``timings()`` measures phases: "auto" (CUDA events on a GPU,
            never a device sync; the wall clock on CPU), "events", "host" or "off".
        host_reader: the library's one way to read device tensors on the host
            (:class:`~dpkfac.device.HostReader`, which counts the reads); default: a
            fresh one. Pass one to count a run's host reads.
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
        # The common keywords are KFACOptions' fields, by name (tests/test_option_validation.py
        # keeps the signature and that dataclass equal): KFACOptions validates and converts
        # them (skip_layers and fidelity_layers: a str or a list of them to a tuple).
        given = locals()
        settings = KFACOptions(**{f.name: given[f.name] for f in fields(KFACOptions)})
        self.options = _common_options(options, settings)
        # The options a schedule sets (a callable of the step): the only ones read through
        # KFACOptions.at, which calls and checks them, at every step; constants were checked
        # at construction and are read as they are (:meth:`_at`).
        self._scheduled = frozenset(n for n in STEP_RULES if callable(getattr(self.options, n)))
        self._skip = [re.compile(p) for p in self.options.skip_layers]
        self.model = model
        self.ddp = isinstance(model, DistributedDataParallel)
        check_grad_scaler(grad_scaler)
        self.grad_scaler = grad_scaler
        self.module: nn.Module = unwrap_compiled(
            model.module if isinstance(model, DistributedDataParallel) else model
        )
        self.method = DECOMPOSITIONS[self.options.compute_method]
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
        # The options the run was given decide its one-time setup.
        self._given_options = own_options
        self.strategy: Strategy = build_strategy(
            scheme, own_options, comm=self.comm, method=self.method, kfac=self.options
        )
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
        self.layers: dict[str, KFACLayer] = find_layers(self.module, self.options, self._skip)
        self._layer_list = list(self.layers.values())
        self._params = Parameters(self.module, self._layer_list)
        self._skipped = skipped_modules(self.module, self.layers, self._skip)
        report_construction(
            self._layer_list,
            self._skipped,
            rank=self.comm.rank,
            device_type=self.device.type,
            inv_update_steps=self.options.inv_update_steps,
        )
        # Checked even while the probe is off: a typo should not wait for fidelity_every > 0.
        select_layers(list(self.layers), self.options.fidelity_layers)
        self.strategy.place(
            self._layer_list,
            [layer_shape(x, 1, 1) for x in self._layer_list],
            given=self._given_options,
        )
        self._buffer_peak = 0
        # What the backward passes since the last step() left in the K-FAC gradients, and
        # whether an optimizer stepped with them first (the order of calls, checked per step).
        self._ledger = GradientLedger()
        # The first optimizer step of a fresh preconditioner: one holding state then has
        # stepped before (load_state_dict disarms it).
        self._ledger.first_update = True
        WATCH.watch(self._ledger, [x.helper.module.weight for x in self._layer_list])
        # The device flag "some K-FAC gradient is nonzero" of this step, read with the
        # factor step's finiteness checks (None: no zero_grad can have zeroed them).
        self._nonzero: torch.Tensor | None = None
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
        # The hooks that build the batch factors (dpkfac/capture.py), armed by _arm.
        self._capture = Capture(
            self._layer_list,
            options=self.options,
            strategy=self.strategy,
            timer=self._timer,
            ledger=self._ledger,
            grad_scaler=grad_scaler,
            probe=self._fidelity,
        )
        #: The overlapped execution mode, where the options ask for it or "auto" may.
        self._overlap: OverlapEngine | None = self._install_overlap() if overlaps else None
        # Built on the bare module with several ranks: the first step() looks whether a DDP
        # wrapper ran it since (Trainer, accelerate and Lightning wrap the model they are given).
        self._capture.watch_wrapper = self.comm.active and not self.ddp
        #: Set by an integration whose loop calls ``step()`` on every micro-batch (accelerate's
        #: ``accelerator.sync_gradients``): while it returns False, ``step()`` returns at once
        #: and the gradients keep accumulating. None: every call is an optimizer step's.
        self.synced: Callable[[], bool] | None = None
        self._arm(0)

    def _install_overlap(self) -> OverlapEngine:
        """The overlapped mode's gradient hooks (DDP's communication hook on a DDP model), with
        the narrow view of the run it needs."""
        reduced = self._params.kfac | {id(p) for p in self._params.others}
        seen: set[int] = set()
        params = []
        for p in self._params.all:
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
            early = drains_early(self.comm.backend)
            ready = early and traits is not None and traits.drain == "ready"
            when = ", each bucket preconditioned from the first hook that finds it reduced"
            return f"{how} inside the backward pass ({source}){when if ready else ''}{scaled}"
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
        capture = self._is_factor_step(step)
        if self._fidelity is not None:
            self._fidelity.arm(step)
        probing = self._fidelity is not None and bool(self._fidelity.active)
        self._capture.arm(capture=capture, probing=probing)
        if self._overlap is None:
            return
        flags = self._overlap.ctx.flags
        flags.step = step
        flags.roles = self.strategy.roles
        flags.capture = capture
        flags.decompose = self._is_inv_step(step)
        flags.overlapped = (
            self.strategy.traits.overlapped_precondition
            and self.strategy.placed
            and not self._decompose_next
            and not probing
        )
        if flags.overlapped:
            flags.damping = float(self._at("damping", step))
            flags.decay = float(self._at("factor_decay", step))

    def _note_buffers(self, nbytes: int) -> None:
        """Record the bytes of batch factors awaiting their fold (the peak is reported)."""
        self._buffer_peak = max(self._buffer_peak, nbytes)

    # ------------------------------------------------------------ registration
    def summary(self) -> str:
        """A table of the K-FAC layers (sizes, placement, MiB held here) and of the modules
        left alone with the reason, then the time per phase (ms). Reads timings: on a GPU
        this waits for the timed work."""
        uncaptured = [x.name for x in self._layer_list if x.warned_no_capture]
        rows = layer_rows(self._layer_list, placed=self.strategy.placed, uncaptured=uncaptured)
        timings = {k: v * 1e3 for k, v in self.timings().items()}
        return format_summary(rows, self._skipped, timings)

    def _at(self, name: str, step: int) -> Any:
        """Option ``name`` (one of ``STEP_RULES``) at ``step``: a schedule's checked value
        (:meth:`KFACOptions.at`), a constant as it is."""
        if name in self._scheduled:
            return self.options.at(name, step)
        return getattr(self.options, name)

    def _is_factor_step(self, step: int) -> bool:
        return step % self._at("factor_update_steps", step) == 0

    def _is_inv_step(self, step: int) -> bool:
        return step % self._at("inv_update_steps", step) == 0

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self) -> None:
        """Average gradients, update curvature as scheduled and precondition in place.

        Raises:
            RuntimeError: the loop calls it out of order (:data:`CALL_ORDER`): an
                optimizer stepped with the last backward pass's gradients, or
                ``zero_grad()`` cleared them, before this call. Nothing is done.
                Or, at the first step: the model was wrapped in DDP after the
                preconditioner was built on it, where following the wrapper is not
                exact (the overlapped mode reduces from hooks of its own).

        Warns (RuntimeWarning, at every such call) when the number of backward
        passes since the last ``step()`` is not ``accumulation_steps``, or when
        called inside DDP's ``no_sync()``: the gradients are then partial, or G
        is scaled for another number of micro-batches.
        """
        if self.synced is not None and not self.synced():
            return
        if self._capture.watch_wrapper:
            self._follow_wrapper()
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
        self._check_accumulation()
        self._check_order()
        self._capture.forget_loss_scale()  # the next backward may run under another scale
        step = self.steps
        strat = self.strategy
        layers = self._layer_list
        probe = self._fidelity
        if probe is not None:
            # The local batch factors, before placement drops or reduction averages them.
            probe.collect()
        self._params.follow_unfrozen(
            hooks_fixed=lambda: (
                self._overlap is not None
                and (strat.traits.overlapped_precondition or not strat.configured)
            ),
            ddp=self.ddp,
        )
        if not strat.placed:
            # At the first step: "auto" resolved for the agreed shapes, layers placed.
            choice = finalise_placement(
                layers,
                strat,
                comm=self.comm,
                kfac=self.options,
                given=self._given_options,
                overlap_installed=self._overlap is not None,
                parameters=self._params.layout(layers),
                ddp=self.ddp,
            )
            if choice is not None:
                self.choice = choice
        self._buffer_peak = max(self._buffer_peak, sum(x.pending_nbytes() for x in layers))

        # A strategy that did this step's work in the backward pass (dp_kfac's
        # overlap) hands over the updates: only the KL clip and write-back remain, done
        # while the other gradients are still on the wire.
        engine = self._overlap
        if engine is not None and (overlapped := engine.finish(defer_rest=True)) is not None:
            self._apply(overlapped, step)
            engine.settle_rest()
            self._capture.warn_uncaptured()
            self.steps += 1
            self._arm(self.steps)
            return

        if not self.ddp:
            strat.reduce_gradients(layers, self._params.others)

        if any(x.has_pending(w) for x in layers for w in FACTORS) or self._capture.active:
            strat.reduce_factors(layers)
            self._fold_factors(float(self._at("factor_decay", step)))

        damping = float(self._at("damping", step))
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
        self._capture.warn_uncaptured()

        self.steps += 1
        self._arm(self.steps)

    def _follow_wrapper(self) -> None:
        """At the first step of a preconditioner built on the bare module with several ranks:
        follow the DDP wrapper that ran the model since, or refuse where that is not exact.

        Without this, ``step()`` would all-reduce the gradients DDP already averaged: the same
        bits, twice the traffic, nothing to notice.
        """
        self._capture.watch_wrapper = False
        ddp, self._capture.wrapper = self._capture.wrapper, None
        # DDP wraps this module or a module holding it (Lightning wraps the LightningModule).
        if ddp is None or not any(m is self.module for m in ddp.module.modules()):
            return
        ranks = dist.get_world_size(ddp.process_group)
        if self._overlap is not None or ranks != self.comm.size:
            why = (
                "the overlapped mode reduces the gradients from hooks installed at construction"
                if self._overlap is not None
                else f"DDP spans {ranks} ranks and the preconditioner {self.comm.size}"
            )
            raise RuntimeError(
                "dpkfac: the model was wrapped in DistributedDataParallel after the "
                f"preconditioner was built on the bare module, and {why}: both would reduce "
                "the gradients. Build the preconditioner on the DDP model "
                "(KFACPreconditioner(ddp_model, ...), e.g. trainer.model_wrapped, or "
                "accelerator.prepare(model)'s result), or use dpkfac.integrations"
            )
        # Exact: DDP averages in the backward pass, and step() leaves the gradients to it.
        self.model = ddp
        self.ddp = True

    def _check_accumulation(self) -> None:
        """Warn where this step's gradients are not those of ``accumulation_steps`` whole,
        synchronised backward passes (host counters only, no device read)."""
        k = self.options.accumulation_steps
        passes = self._ledger.passes
        unsynced = self.ddp and not getattr(self.model, "require_backward_grad_sync", True)
        fix = (
            "call pre.step() once per optimizer step, after the last micro-batch's backward "
            "pass (with accelerate: under `if accelerator.sync_gradients:`, or build it with "
            "dpkfac.integrations.accelerate.prepare, which skips the other calls)"
        )
        if unsynced:
            warnings.warn(
                f"dpkfac: step() at step {self.steps} was called inside DDP's no_sync(): the "
                "gradients are this rank's own, not yet averaged, and K-FAC preconditions them "
                f"as if they were; {fix}",
                RuntimeWarning,
                stacklevel=4,
            )
        elif passes < k:
            warnings.warn(
                f"dpkfac: step() at step {self.steps} came after {passes} backward pass(es), "
                f"but accumulation_steps={k}: mid-accumulation, the gradients are partial; {fix}",
                RuntimeWarning,
                stacklevel=4,
            )
        elif passes > k:
            warnings.warn(
                f"dpkfac: step() at step {self.steps} came after {passes} backward passes, but "
                f"accumulation_steps={k}: G is scaled for {k} micro-batches of loss/{k} each. "
                f"Pass accumulation_steps={passes} (the trainer's accumulation setting; "
                "dpkfac.integrations read it) or call pre.step() after every "
                f"{k} backward pass(es)",
                RuntimeWarning,
                stacklevel=4,
            )

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
        reads = self._capture.active and not overlapped
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
        with self._timer.phase("decomposition", layer=layer.name):
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
        grads = [g for p in self._params.all if p.requires_grad and (g := p.grad) is not None]
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
        lr = float(self._at("lr", step))
        kl_clip = float(self._at("kl_clip", step))
        device = terms[0].device
        vg_sum = torch.stack([t.to(device) for t in terms]).sum() * lr**2
        if self.takes_scaled_gradients:
            # ⟨V, ∇W⟩ of gradients scaled by s is s² too large.
            inverse = self._capture.inverse_scale(device)
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

    # -------------------------------------------------------------- inspection
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per collective category on this rank since :meth:`reset_stats`."""
        return self._stats.as_dict()

    def timings(self) -> dict[str, float]:
        """Seconds per phase on this rank since :meth:`reset_stats`."""
        return self._timer.as_dict()

    @property
    def timeline(self) -> Timeline | None:
        """Where this rank records its timeline (None, the default: nowhere).

        Set a :class:`dpkfac.timeline.Timeline` to record, from then on, every
        timed phase (with the layer) and every collective (launched, completed,
        per process group), and in the overlapped mode when each bucket became
        ready and was seen reduced; ``pre.timeline.save("trace.json")`` writes
        what Perfetto opens. It is kept across :meth:`reset_stats`.
        """
        return self._timer.timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._timer.timeline = timeline

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
        return save_state(
            self._layer_list,
            self.strategy,
            self.comm,
            steps=self.steps,
            strategy_name=self.strategy_name,
            compute_method=self.options.compute_method,
        )

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
        loaded = load_state(
            state,
            self.layers,
            self.strategy,
            world_size=self.comm.size,
            method=self.method,
            strategy_name=self.strategy_name,
            compute_method=self.options.compute_method,
            given=self._given_options,
            allow_world_size_change=allow_world_size_change,
        )
        self.steps = loaded.steps
        self._ledger.first_update = False
        if loaded.resized:
            self._decompose_next = loaded.decompose_next
        self._arm(self.steps)

    def __repr__(self) -> str:
        return (
            f"KFACPreconditioner(strategy={self.strategy_name!r}, "
            f"method={self.options.compute_method!r}, "
            f"layers={len(self.layers)}, not_preconditioned={len(self._skipped)}, "
            f"world_size={self.comm.size}, rank={self.comm.rank})"
        )
