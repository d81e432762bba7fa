"""What "auto" chooses among: the priced candidates, the schedule's average, the log line.

A scheme lists the resolved options it could run with
(:meth:`~dpkfac.plan.Scheme.candidates`);
:func:`dpkfac.costmodel.predict.choose_options` prices each (it lives beside
:func:`~dpkfac.costmodel.predict.predict`, which it calls and which calls it,
so the two are one module, not a cycle of two) and returns them as
:class:`Candidate` records. No strategy imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpkfac.plan import Scheme, StrategyOptions
from dpkfac.plan.options import checked_at

__all__ = ["SCHEDULE_HORIZON", "Candidate", "average_interval", "log_choice"]

log = logging.getLogger("dpkfac")

#: Steps over which a callable update schedule is averaged to price "auto".
SCHEDULE_HORIZON = 1000


def average_interval(schedule: int | Callable[[int], int], name: str = "inv_update_steps") -> int:
    """An update interval as an int: a callable schedule's mean over the first steps.

    The preconditioner updates at step ``s`` when ``s % schedule(s) == 0``;
    the mean interval is :data:`SCHEDULE_HORIZON` over the number of such
    steps (rounded, at least 1).
    """
    if not callable(schedule):
        return int(schedule)
    fires = sum(1 for s in range(SCHEDULE_HORIZON) if s % checked_at(name, schedule, s) == 0)
    return max(1, round(SCHEDULE_HORIZON / max(fires, 1)))


@dataclass(frozen=True)
class Candidate:
    """One configuration "auto" priced.

    Attributes:
        options: the resolved options.
        label: what they chose, in a few words (``k=2, f=1/2``).
        iteration: predicted seconds per step, averaged over the schedule.
        comm_bytes: predicted bytes handed to collectives per step and rank.
        wire_bytes: predicted bytes on the wire per step and rank.
    """

    options: StrategyOptions
    label: str
    iteration: float
    comm_bytes: float
    wire_bytes: float = 0.0


def log_choice(
    scheme: type[Scheme], world_size: int, chosen: StrategyOptions, candidates: Sequence[Candidate]
) -> None:
    """Log the choice and every candidate's prediction (logger "dpkfac")."""
    if not candidates:
        return
    log.info(
        "%s: chose %s at P=%d (predicted %.2f ms/step; candidates: %s)",
        scheme.name,
        scheme.describe(chosen) or "as published",
        world_size,
        1e3 * min(c.iteration for c in candidates),
        ", ".join(f"{c.label}: {1e3 * c.iteration:.2f} ms" for c in candidates),
    )
