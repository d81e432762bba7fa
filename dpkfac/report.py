"""What gets preconditioned, what does not and why, and which factors will be slow.

A researcher's first question about a new model is what K-FAC does with it.
:func:`skipped_modules` names every parameter-bearing module that is not
preconditioned, with the reason; :func:`layer_rows` describes every K-FAC
layer; :func:`format_summary` renders both for ``KFACPreconditioner.summary()``;
:func:`slow_factors` finds the factors whose decomposition alone takes long
enough to dominate a step on the run's device; :func:`report_construction`
logs the first two and warns of the last when a preconditioner is built.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dpkfac.attention import not_capturable
from dpkfac.curvature import KFACLayer, helper_for
from dpkfac.curvature.layer import FACTORS
from dpkfac.plan.assignment import decomposition_seconds
from dpkfac.plan.presets import device_preset

log = logging.getLogger("dpkfac")

#: Predicted seconds of one factor's decomposition above which the run is warned.
SLOW_DECOMPOSITION_S = 1.0


@dataclass(frozen=True)
class Skipped:
    """A module with parameters of its own that K-FAC leaves alone, and why."""

    name: str
    kind: str
    reason: str


def skipped_modules(
    model: nn.Module, layers: Mapping[str, KFACLayer], skip: Sequence[re.Pattern[str]]
) -> list[Skipped]:
    """Every parameter-bearing module (direct parameters) that is not a K-FAC layer.

    What ``nn.MultiheadAttention`` applies functionally (its packed in-projection, its
    ``out_proj``) is named with :func:`dpkfac.attention.not_capturable`'s reason, which says
    how to make it K-FAC layers.
    """
    out = []
    functional = not_capturable(model)
    for name, module in model.named_modules():
        if name in layers or not any(True for _ in module.parameters(recurse=False)):
            continue
        kind = type(module).__name__
        matched = [p.pattern for p in skip if p.search(name)]
        if name in functional:
            reason = functional[name]
        elif helper_for(module) is None:
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                reason = f"grouped convolution (groups={module.groups}): not one Kronecker block"
            else:
                reason = f"unsupported type {kind} (K-FAC covers nn.Linear and nn.Conv2d)"
        elif matched:
            reason = f"skipped by skip_layers {matched[0]!r}"
        else:
            frozen = [n for n, p in module.named_parameters(recurse=False) if not p.requires_grad]
            reason = f"frozen at construction ({', '.join(frozen)} requires_grad=False)"
        out.append(Skipped(name or "<root>", kind, reason))
    return out


def layer_rows(
    layers: Iterable[KFACLayer], *, placed: bool, uncaptured: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """One row per K-FAC layer: sizes, placement and what this rank holds (MiB)."""
    never = set(uncaptured)
    rows = []
    for layer in layers:
        owners = {w: layer.factors[w].decomposer for w in FACTORS}
        rows.append(
            {
                "layer": layer.name,
                "type": type(layer.module).__name__,
                "A": layer.helper.a_dim,
                "G": layer.helper.g_dim,
                "owner": layer.owner if placed else None,
                "decomposers": f"{owners['A']}/{owners['G']}" if placed else None,
                "factors_mib": layer.factor_nbytes() / 2**20,
                "decompositions_mib": layer.decomposition_nbytes() / 2**20,
                "note": "never captured: called functionally" if layer.name in never else "",
            }
        )
    return rows


def slow_factors(
    layers: Iterable[KFACLayer], device_type: str, limit_s: float = SLOW_DECOMPOSITION_S
) -> list[tuple[str, str, int, float]]:
    """(layer, factor, width, predicted seconds) of factors whose eigh exceeds ``limit_s``.

    Predicted by the cost model's one estimate on the device's preset
    (:func:`~dpkfac.plan.presets.device_preset`). Its rates are fitted on factors up to a
    few thousand wide; wider ones run slower still (a 4608-wide float32 eigh took 123 s on
    the CPU preset's machine, against 27 s predicted), so the warning errs on the quiet side.
    """
    hardware = device_preset(device_type)
    out = []
    for layer in layers:
        for which in FACTORS:
            dim = layer.dim(which)
            seconds = decomposition_seconds(hardware, dim)
            if seconds > limit_s:
                out.append((layer.name, which, dim, seconds))
    return sorted(out, key=lambda item: -item[3])


def format_summary(
    rows: Sequence[Mapping[str, Any]],
    skipped: Sequence[Skipped],
    timings_ms: Mapping[str, float] | None = None,
) -> str:
    """The preconditioned layers, the modules left alone with reasons, and the phase times."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    lines = []
    if rows:
        columns = list(rows[0])
        table = [[c for c in columns]] + [[cell(r[c]) for c in columns] for r in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        for i, line in enumerate(table):
            lines.append("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
    total = {
        key: sum(r[key] for r in rows) for key in ("factors_mib", "decompositions_mib") if rows
    }
    lines.append(
        f"{len(rows)} K-FAC layer(s); held here: "
        + ", ".join(f"{k} {v:.3f}" for k, v in total.items())
    )
    if skipped:
        lines.append("not preconditioned:")
        lines += [f"  {s.name} ({s.kind}): {s.reason}" for s in skipped]
    if timings_ms:
        lines.append(
            "time per phase since reset_stats(), ms: "
            + ", ".join(f"{k} {v:.1f}" for k, v in timings_ms.items() if v)
        )
    return "\n".join(lines)


def report_construction(
    layers: Sequence[KFACLayer],
    skipped: Sequence[Skipped],
    *,
    rank: int,
    device_type: str,
    inv_update_steps: object,
) -> None:
    """Log what is preconditioned and what is not (rank 0); warn of slow factors.

    Called by the preconditioner's constructor itself: the warning points at
    the user's ``KFACPreconditioner(...)``.
    """
    if rank == 0:
        for x in layers:
            log.info(
                "K-FAC layer %s (%s): A %d x %d, G %d x %d",
                x.name,
                type(x.module).__name__,
                x.helper.a_dim,
                x.helper.a_dim,
                x.helper.g_dim,
                x.helper.g_dim,
            )
        for entry in skipped:
            log.info("not preconditioned: %s (%s): %s", *vars(entry).values())
    slow = slow_factors(layers, device_type)
    if slow:
        listed = ", ".join(f"{n} {w} {d}-wide (~{t:.0f} s)" for n, w, d, t in slow[:3])
        # An interval given as a schedule (a callable of the step) has no value to show.
        now = repr(inv_update_steps) if isinstance(inv_update_steps, int) else "a schedule"
        warnings.warn(
            f"dpkfac: decomposing the widest factors will dominate a step on "
            f"{device_type}: {listed}{' and more' if len(slow) > 3 else ''} per "
            f"decomposition step; raise inv_update_steps (now {now}) so they are "
            "decomposed rarely, leave those layers out (skip_layers), or use "
            "compute_method='inverse'",
            RuntimeWarning,
            stacklevel=3,
        )
