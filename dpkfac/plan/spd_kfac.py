"""spd_kfac's plan: D-KFAC's roles with pipelined, fused, triangle-packed factor traffic.

After Shi et al.'s smart parallel D-KFAC: every rank captures and
preconditions every layer; each batch factor's all-reduce is launched from
the capture hook that built it, fused into buckets by
:func:`dpkfac.plan.fusion.plan_buckets`, only upper triangles travel. A
factor is decomposed locally on every rank (no broadcast) when its predicted
decomposition time is below the predicted time to receive its decomposition;
the others go to ranks by LPT on predicted decomposition time and are
broadcast. The predictions come from a hardware model: a preset, a JSON
file, or (the default) one measured at start-up. The reference code's fixed
rule, local below a dimension of about 1024, is one option away
(``local_threshold``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpkfac.plan.assignment import LayerShape, Placement, assign_factors, decomposition_seconds
from dpkfac.plan.hardware import Hardware, wire_bytes
from dpkfac.plan.options import StrategyOptions, check_choice
from dpkfac.plan.presets import check_hardware_option, hardware_option
from dpkfac.plan.probes import MEASURE_COLLECTIVES, allreduce_probe_collectives
from dpkfac.plan.scheme import Scheme
from dpkfac.plan.traits import Traits

__all__ = [
    "FUSIONS",
    "SPDKFACOptions",
    "SPDKFACScheme",
    "receive_seconds",
]

FUSIONS = ("dynamic", "none")


@dataclass(frozen=True)
class SPDKFACOptions(StrategyOptions):
    """Options of spd_kfac.

    Attributes:
        local_threshold: None (default): decide per factor from the hardware
            model, as SPD-KFAC's load-balanced placement does. An int: the
            reference code's fixed rule, factors with a smaller dimension are
            decomposed locally on every rank (it uses about 1024).
        hardware: the hardware model of that decision: a preset name of
            :data:`dpkfac.plan.presets.PRESETS`, a JSON file written by
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
        return hardware_option(self.hardware)


def receive_seconds(hardware: Hardware, dim: int, world_size: int) -> float:
    """Predicted seconds to receive one factor's eigendecomposition by broadcast."""
    nbytes = (dim * dim + dim) * 4
    wire = wire_bytes("broadcast", nbytes, world_size)
    return hardware.link("broadcast").time(1, wire, world_size)


class SPDKFACScheme(Scheme):
    """Pipelined, fused, triangle-packed factor all-reduces and thresholded placement."""

    name = "spd_kfac"
    Options = SPDKFACOptions

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
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        """Local where decomposing beats receiving, LPT on predicted time elsewhere.

        The decision compares the eigen method's costs (the decomposition the
        papers use); with ``local_threshold`` set, the fixed dimension rule.
        """
        assert isinstance(options, SPDKFACOptions)
        dims = [d for s in shapes for d in (s.a_dim, s.g_dim)]
        if options.local_threshold is not None:
            return Placement.per_factor(
                assign_factors(dims, world_size, local_threshold=options.local_threshold)
            )
        hardware = options.hardware_model()
        if hardware is None:
            raise ValueError(
                "spd_kfac's placement needs a hardware model; it is measured when the "
                "strategy starts (or give hardware= or local_threshold=)"
            )
        costs = [decomposition_seconds(hardware, d) for d in dims]
        local = [
            world_size > 1 and cost < receive_seconds(hardware, d, world_size)
            for d, cost in zip(dims, costs, strict=True)
        ]
        return Placement.per_factor(assign_factors(dims, world_size, local=local, costs=costs))

    @classmethod
    def setup_collectives(cls, options: StrategyOptions, num_factors: int) -> list[tuple[str, int]]:
        """The hardware measurement (when placement needs it), the alpha-beta probes
        (unless fixed), then the agreement on ready times and model."""
        assert isinstance(options, SPDKFACOptions)
        hardware = list(MEASURE_COLLECTIVES) if options.measures_hardware else []
        probes = [] if options.fixed_comm_model else allreduce_probe_collectives()
        return [*hardware, *probes, ("allreduce", 8 * (num_factors + 2))]
