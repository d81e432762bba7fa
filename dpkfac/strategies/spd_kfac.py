"""SPD-KFAC: D-KFAC's maths with pipelined, fused, triangle-packed factor traffic.

Differences from :mod:`dpkfac.strategies.d_kfac`, after Shi et al.'s smart
parallel D-KFAC:

1. **Pipelining.** Each batch factor's all-reduce is launched asynchronously
   from the capture hook that built it (A in the forward hook, G in the
   backward hook); ``step()`` only waits.
2. **Dynamic tensor fusion.** During the first ``profile_steps`` factor
   updates every factor travels alone while its ready time (seconds since
   the step's first factor) is recorded. The ranks then agree on the
   element-wise maximum of those times and of a measured alpha-beta model of
   the collective, and :func:`dpkfac.fusion.plan_buckets` merges consecutive
   factors while the next one will be ready before the current bucket's
   communication would finish (or waiting for it costs less than alpha). A
   bucket is launched as soon as its last factor is built.
3. **Triangle packing.** Only the upper triangle of each symmetric factor is sent.
4. **Placement from the cost model.** A factor is decomposed locally on every
   rank (no broadcast) when its predicted decomposition time is below the
   predicted time to receive its decomposition; the others go to ranks by LPT
   on predicted decomposition time and are broadcast. The predictions come
   from a :class:`~dpkfac.costmodel.Hardware` model: a preset, a JSON file,
   or (the default) one measured at start-up on this group
   (:func:`dpkfac.costmodel.calibration.measure_in_group`). The reference
   code's fixed rule, local below a dimension of about 1024, is one option
   away (``local_threshold``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dpkfac.assignment import EIGH_COEFF, LayerShape, Placement, assign_factors
from dpkfac.comm import Handle, triangle_numel
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.fusion import CommModel, fit_comm_model, plan_buckets
from dpkfac.options import StrategyOptions, check_choice
from dpkfac.strategies.base import Traits
from dpkfac.strategies.d_kfac import DKFAC

if TYPE_CHECKING:
    from dpkfac.costmodel.hardware import Hardware

Key = tuple[str, str]

FUSIONS = ("dynamic", "none")
#: Sizes (float32 elements) of the all-reduces timed to fit the alpha-beta model.
PROBE_NUMELS = (256, 16384, 262144)
PROBE_REPEATS = 3


@dataclass(frozen=True)
class SPDKFACOptions(StrategyOptions):
    """Options of spd_kfac.

    Attributes:
        local_threshold: None (default): decide per factor from the hardware
            model, as SPD-KFAC's load-balanced placement does. An int: the
            reference code's fixed rule, factors with a smaller dimension are
            decomposed locally on every rank (it uses about 1024).
        hardware: the hardware model of that decision: a preset name of
            :data:`dpkfac.costmodel.PRESETS`, a JSON file written by
            ``python -m dpkfac.costmodel calibrate``, a ``Hardware``, or None
            (default) to measure it at start-up on this group.
        fusion: "dynamic" (the rule above) or "none" (one collective per factor).
        profile_steps: factor updates measured before the fusion plan is fixed.
        comm_alpha / comm_beta: fix the alpha-beta model instead of measuring it.
    """

    local_threshold: int | None = None
    hardware: str | Hardware | None = None
    fusion: str = "dynamic"
    profile_steps: int = 2
    comm_alpha: float | None = None
    comm_beta: float | None = None

    def __post_init__(self) -> None:
        check_choice("fusion", self.fusion, FUSIONS)
        for name in ("local_threshold", "profile_steps"):
            value = getattr(self, name)
            if value is None and name == "local_threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {self.profile_steps}")
        from dpkfac.costmodel.presets import check_hardware_option

        check_hardware_option(self.hardware)

    @property
    def fixed_comm_model(self) -> bool:
        """Whether the alpha-beta model is given rather than measured."""
        return self.comm_alpha is not None and self.comm_beta is not None

    @property
    def measures_hardware(self) -> bool:
        """Whether the run measures its hardware model at start-up."""
        return self.local_threshold is None and self.hardware is None

    def hardware_model(self) -> Hardware | None:
        """The hardware model, read from its preset or file (None: not known yet)."""
        from dpkfac.costmodel.presets import hardware_option

        return hardware_option(self.hardware)


def decomposition_seconds(hardware: Hardware, dim: int) -> float:
    """Predicted seconds of one factor's eigendecomposition (``9·d³`` flops)."""
    return hardware.engine("eigh").time(1, 2 * EIGH_COEFF * float(dim) ** 3)


def receive_seconds(hardware: Hardware, dim: int, world_size: int) -> float:
    """Predicted seconds to receive one factor's eigendecomposition by broadcast."""
    from dpkfac.costmodel.hardware import wire_bytes

    nbytes = (dim * dim + dim) * 4
    wire = wire_bytes("broadcast", nbytes, world_size)
    return hardware.link("broadcast").time(1, wire, world_size)


class SPDKFAC(DKFAC):
    """Pipelined, fused, triangle-packed factor all-reduces and thresholded placement."""

    name = "spd_kfac"
    Options = SPDKFACOptions
    options: SPDKFACOptions

    @classmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        return Traits(
            captures_all=True,
            factor_comm="pipelined",
            triangle=True,
            decomposition_broadcast=True,
            preconditions_all=True,
        )

    @classmethod
    def local_threshold(cls, options: SPDKFACOptions) -> int | None:  # type: ignore[override]
        return options.local_threshold

    @classmethod
    def resolve_options(  # type: ignore[override]
        cls, options: SPDKFACOptions, hardware: Hardware, **_: Any
    ) -> SPDKFACOptions:
        """A run that measures its hardware at start-up finds ``hardware``."""
        return replace(options, hardware=hardware) if options.measures_hardware else options

    @classmethod
    def placement(  # type: ignore[override]
        cls, shapes: Sequence[LayerShape], world_size: int, options: SPDKFACOptions
    ) -> Placement:
        """Local where decomposing beats receiving, LPT on predicted time elsewhere.

        The decision compares the eigen method's costs (the decomposition the
        papers use); with ``local_threshold`` set, the fixed dimension rule.
        """
        if options.local_threshold is not None:
            return super().placement(shapes, world_size, options)
        hardware = options.hardware_model()
        if hardware is None:
            raise ValueError(
                "spd_kfac's placement needs a hardware model; it is measured when the "
                "strategy starts (or give hardware= or local_threshold=)"
            )
        dims = [d for s in shapes for d in (s.a_dim, s.g_dim)]
        costs = [decomposition_seconds(hardware, d) for d in dims]
        local = [
            world_size > 1 and cost < receive_seconds(hardware, d, world_size)
            for d, cost in zip(dims, costs, strict=True)
        ]
        return Placement.per_factor(assign_factors(dims, world_size, local=local, costs=costs))

    @classmethod
    def placement_rule(cls, options: StrategyOptions) -> str:
        return "lpt"

    def sync_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Batch factors are already averaged by the pipeline: nothing to sync."""

    @classmethod
    def setup_collectives(  # type: ignore[override]
        cls, options: SPDKFACOptions, num_factors: int
    ) -> list[tuple[str, int]]:
        """The hardware measurement (when placement needs it), the alpha-beta probes
        (unless fixed), then the agreement on ready times and model."""
        from dpkfac.costmodel.calibration import MEASURE_COLLECTIVES

        hardware = list(MEASURE_COLLECTIVES) if options.measures_hardware else []
        probes = (
            []
            if options.fixed_comm_model
            else [("allreduce", 4 * n) for n in PROBE_NUMELS for _ in range(PROBE_REPEATS)]
        )
        return [*hardware, *probes, ("allreduce", 8 * (num_factors + 2))]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.options.measures_hardware:
            self.options = replace(self.options, hardware=self._measure_hardware())
        self.plan: list[list[Key]] | None = None
        self.comm_model: CommModel | None = None
        self._bucket_of: dict[Key, int] = {}
        self._profiles: list[dict[Key, float]] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._t0: float | None = None
        self._times: dict[Key, float] = {}
        self._ready: dict[int, list[Key]] = {}
        self._launched: set[Key] = set()
        self._stale: set[Key] = set()
        self._inflight: list[tuple[list[tuple[KFACLayer, str]], list[torch.Tensor], Handle]] = []
        self._layers: dict[str, KFACLayer] = {}

    # -------------------------------------------------------------- pipelining
    def factor_ready(self, layer: KFACLayer, which: str) -> None:
        if not self.comm.active:
            return
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        key = (layer.name, which)
        self._layers[layer.name] = layer
        if key in self._times:
            # The module ran again in this step (a shared layer, activation
            # checkpointing, a micro-batch beyond the declared ones): whatever
            # was or will be launched for it is partial, so step() all-reduces
            # the complete sum instead. It must not count twice towards its
            # bucket, or the bucket would launch before its other members exist.
            self._stale.add(key)
            return
        self._times[key] = now - self._t0
        if key in self._launched:
            self._stale.add(key)
            return
        bucket = self._bucket_of.get(key)
        if bucket is None:
            self._launch([(layer, which)])
            return
        ready = self._ready.setdefault(bucket, [])
        ready.append(key)
        if len(ready) == len(self.plan[bucket]):
            self._launch_keys(self.plan[bucket])

    def _launch_keys(self, keys: Sequence[Key]) -> None:
        self._launch([(self._layers[name], which) for name, which in keys])

    def _launch(self, items: list[tuple[KFACLayer, str]]) -> None:
        tensors = [layer.pending(which).clone() for layer, which in items]
        handle = self.comm.allreduce_mean(
            tensors, "factor_allreduce", triangle=True, async_op=True, overlapped=True
        )
        self._launched.update((layer.name, which) for layer, which in items)
        self._inflight.append((items, tensors, handle))

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        if not self.comm.active:
            self._reset_step()
            return
        # Buckets with members that did not run this step (on any rank, since
        # usage must match across ranks) still go, in plan order.
        for bucket in sorted(self._ready):
            keys = self._ready[bucket]
            if len(keys) < len(self.plan[bucket]):
                order = [k for k in self.plan[bucket] if k in keys]
                self._launch_keys(order)
        for items, tensors, handle in self._inflight:
            self.comm.wait(handle)
            for (layer, which), tensor in zip(items, tensors, strict=True):
                if (layer.name, which) not in self._stale:
                    layer.set_pending(which, tensor)
        redo = [
            (layer, w)
            for layer in layers
            for w in FACTORS
            if layer.has_pending(w)
            and ((layer.name, w) in self._stale or (layer.name, w) not in self._launched)
        ]
        if redo:
            tensors = [layer.pending(w) for layer, w in redo]
            self.comm.allreduce_mean(tensors, "factor_allreduce", triangle=True)
            for (layer, which), tensor in zip(redo, tensors, strict=True):
                layer.set_pending(which, tensor)
        if self.plan is None and self._times:
            self._profiles.append(dict(self._times))
            if len(self._profiles) >= self.options.profile_steps:
                self._build_plan(layers)
        self._reset_step()

    def _measure_hardware(self) -> Hardware:
        """The group's decomposition and broadcast model, agreed by every rank.

        On one rank nothing is ever received, and the rule keeps every factor local.
        """
        from dpkfac.costmodel.calibration import start_up_hardware

        return start_up_hardware(self.comm)

    # ------------------------------------------------------------------ fusion
    def _measure_comm_model(self) -> CommModel:
        """Time blocking all-reduces of a few sizes and fit alpha and beta."""
        if self.options.fixed_comm_model:
            return CommModel(float(self.options.comm_alpha), float(self.options.comm_beta))
        samples = []
        for numel in PROBE_NUMELS:
            buf = torch.zeros(numel, dtype=torch.float32, device=self.comm.device)
            for _ in range(PROBE_REPEATS):
                start = time.perf_counter()
                self.comm.allreduce_sum(buf, "setup")
                samples.append((buf.numel() * buf.element_size(), time.perf_counter() - start))
        return fit_comm_model(samples)

    def _build_plan(self, layers: Sequence[KFACLayer]) -> None:
        """Fix the fusion plan from the profiled ready times, identically on every rank."""
        keys = [(layer.name, w) for layer in layers for w in FACTORS]
        seen = [k for k in keys if any(k in p for p in self._profiles)]
        times = [sum(p.get(k, 0.0) for p in self._profiles) / len(self._profiles) for k in seen]
        model = self._measure_comm_model()
        agreed = self.comm.agree_max([*times, model.alpha, model.beta])
        times_l = agreed[:-2]
        self.comm_model = CommModel(agreed[-2], agreed[-1])
        order = sorted(range(len(seen)), key=lambda i: (times_l[i], i))
        by_name = {layer.name: layer for layer in layers}
        sizes = []
        for i in order:
            name, which = seen[i]
            dim = by_name[name].dim(which)
            dtype = by_name[name].module.weight.dtype
            sizes.append(triangle_numel(dim) * dtype.itemsize)
        ready = [times_l[i] for i in order]
        if self.options.fusion == "dynamic":
            buckets = plan_buckets(ready, sizes, self.comm_model)
        else:
            buckets = [[i] for i in range(len(order))]
        self.plan = [[seen[order[i]] for i in bucket] for bucket in buckets]
        self._bucket_of = {k: b for b, bucket in enumerate(self.plan) for k in bucket}

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "plan": [list(map(list, bucket)) for bucket in self.plan] if self.plan else None,
            "comm_model": (self.comm_model.alpha, self.comm_model.beta)
            if self.comm_model
            else None,
            "profiles": [[[k[0], k[1], t] for k, t in p.items()] for p in self._profiles],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        plan = state.get("plan")
        self.plan = [[(k[0], k[1]) for k in bucket] for bucket in plan] if plan else None
        self._bucket_of = (
            {k: b for b, bucket in enumerate(self.plan) for k in bucket} if self.plan else {}
        )
        cm = state.get("comm_model")
        self.comm_model = CommModel(*cm) if cm else None
        self._profiles = [{(n, w): t for n, w, t in p} for p in state.get("profiles", [])]
