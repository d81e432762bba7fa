"""The tuning protocol of the convergence study: one rule, applied alike to every configuration.

A comparison of optimisers is only as honest as its tuning. This module is the
protocol as code: given the runs made so far, it says which runs come next and
records why each choice was made, so no grid is ever extended by hand and SGD
gets exactly what K-FAC gets. It is pure (runs in, plans out): the driver
(:mod:`experiments.bench.tune`) trains what it asks for and calls it again, and
the tests drive it with made-up scores.

Per cell (model, configuration, P), screening on seed 0:

1. **Learning rate.** Multipliers ``lr_start``; while the best is at an edge of
   what was tried, the next multiplier beyond it (x2 or /2) is tried. The search
   stops early only where that next point diverged (non-finite loss, or
   validation accuracy at chance), and the cell says so; ``max_points`` bounds it.
2. **Damping** (K-FAC configurations, at the world sizes ``damping_at``): the
   values ``damping`` at the chosen learning rate, extended along the 1-3 series
   (..., 0.001, 0.003, 0.01, 0.03, 0.1, ...) by the same rule; then the
   learning rate is searched again at the chosen damping. Other world sizes use
   the damping chosen at the nearest tuned P (in log P; a tie takes the smaller).
3. **Final choice.** The ``finalists`` best screened points at the final damping
   each run ``final_seeds`` seeds; the chosen point has the highest mean
   validation accuracy over them. Where it lies at an edge, the search goes on
   past it.
4. **Paired seeds.** In ``paired`` cells (model -> world sizes) the
   ``paired_strategies`` run ``paired_seeds`` seeds at their chosen points.

A configuration that computes another's step (``same_step``) runs one check at
its twin's chosen point; where that run equals the twin's bitwise, the twin's
runs and choices stand for it, and otherwise it is tuned like any other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

#: The first-order baseline: no damping to tune.
SGD = "none"


@dataclass(frozen=True)
class Protocol:
    """The protocol's settings (``convergence_scale.tuning`` in conf/table/convergence_scale.yaml).

    Raises ValueError on construction for a setting the rules cannot work with.
    """

    lr_start: tuple[float, ...] = (0.5, 1.0, 2.0)
    lr_factor: float = 2.0
    damping: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03)
    damping_start: float = 0.01
    damping_at: tuple[int, ...] = (4, 64)
    finalists: int = 2
    final_seeds: int = 3
    max_points: int = 10
    chance: float = 0.1
    chance_margin: float = 0.02
    paired: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    paired_strategies: tuple[str, ...] = ("dp_kfac", "d_kfac")
    paired_seeds: int = 8

    def __post_init__(self) -> None:
        if len(self.lr_start) < 2 or min(self.lr_start) <= 0:
            raise ValueError(f"tuning.lr_start needs at least 2 positive values: {self.lr_start}")
        if self.lr_factor <= 1:
            raise ValueError(f"tuning.lr_factor must be > 1: {self.lr_factor}")
        if len(self.damping) < 2 or min(self.damping) <= 0:
            raise ValueError(f"tuning.damping needs at least 2 positive values: {self.damping}")
        for d in (*self.damping, self.damping_start):
            if not _on_one_three(d):
                raise ValueError(f"tuning damping {d} is not on the 1-3 series (1 or 3 x 10^k)")
        if self.finalists < 1 or self.final_seeds < 1 or self.max_points < len(self.lr_start):
            raise ValueError(
                f"tuning.finalists ({self.finalists}) and final_seeds ({self.final_seeds}) must "
                f"be >= 1 and max_points ({self.max_points}) >= len(lr_start)"
            )
        if not self.damping_at:
            raise ValueError("tuning.damping_at names no world size to tune damping at")

    @classmethod
    def from_config(cls, node: Mapping[str, Any]) -> Protocol:
        """From a plain mapping (a resolved config node); unknown keys are refused by name."""
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(node) - known):
            raise ValueError(f"unknown tuning setting(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = dict(node)
        for key in ("lr_start", "damping", "damping_at", "paired_strategies"):
            if key in values:
                values[key] = tuple(values[key])
        if "paired" in values:
            values["paired"] = {
                str(m): tuple(int(p) for p in ps) for m, ps in values["paired"].items()
            }
        return cls(**values)

    def damping_source(self, world_size: int) -> int:
        """The tuned world size whose damping a K-FAC cell at ``world_size`` uses."""
        return min(self.damping_at, key=lambda p: (abs(math.log2(p) - math.log2(world_size)), p))


def _on_one_three(value: float) -> bool:
    mantissa = Decimal(repr(float(value))).normalize().as_tuple()
    return mantissa.digits in ((1,), (3,))


def one_three(value: float, up: bool) -> float:
    """The next value of the 1-3 series above (or below) ``value``: 0.01 -> 0.03 -> 0.1."""
    exponent = math.floor(math.log10(value) + 1e-9)
    three = round(value / 10**exponent) == 3
    if up:
        return float(f"1e{exponent + 1}") if three else float(f"3e{exponent}")
    return float(f"1e{exponent}") if three else float(f"3e{exponent - 1}")


@dataclass(frozen=True)
class Point:
    """One training run the protocol asks for (``damping`` NaN: SGD, none to set)."""

    model: str
    strategy: str
    world_size: int
    lr_multiplier: float
    damping: float
    seed: int
    stage: str

    def key(self) -> tuple[str, str, int, float, float, int]:
        """What identifies the run (the stage is why it was asked for, not what it is)."""
        return point_key(
            self.model, self.strategy, self.world_size, self.lr_multiplier, self.damping, self.seed
        )


def point_key(
    model: str, strategy: str, p: int, lr_multiplier: float, damping: float, seed: int
) -> tuple[str, str, int, float, float, int]:
    """A run's identity, with floats rounded so that a value read back from a CSV matches."""
    d = -1.0 if damping != damping else round(float(damping), 12)
    return (str(model), str(strategy), int(p), round(float(lr_multiplier), 12), d, int(seed))


@dataclass(frozen=True)
class Outcome:
    """What the protocol reads of one finished run."""

    val_acc: float  # final validation accuracy (NaN: none, a failed run)
    diverged: bool
    note: str = ""  # why it counts as diverged or failed
    fingerprint: str = ""  # curve and final accuracies: equal strings, bitwise-equal runs


@dataclass(frozen=True)
class Search:
    """A one-dimensional search's state: the best value so far and what must run next."""

    best: float | None
    pending: tuple[float, ...]
    notes: tuple[str, ...]

    @property
    def done(self) -> bool:
        return not self.pending


def search(
    scores: Mapping[float, float | None],
    start: Sequence[float],
    step: Callable[[float, bool], float],
    max_points: int,
    safe_up: bool,
    name: str,
) -> Search:
    """Extend a grid towards its best value until the best is interior.

    ``scores`` maps each value tried to its score (None: diverged or failed). ``step(v,
    up)`` is the next value beyond ``v``. Every start value runs first. Then, while the
    best sits at an edge of what was tried, the value beyond it is tried, unless that
    value was tried and diverged (the search stops there and says so) or ``max_points``
    values were tried. Where every value diverged, the search moves towards safety
    (``safe_up``: larger values are safer, as for damping; else smaller, as for a
    learning rate). The best is the highest score, the smallest value on a tie.
    """
    missing = tuple(v for v in start if v not in scores)
    if missing:
        return Search(None, missing, ())
    grid = sorted(scores)
    finite = [v for v in grid if scores[v] is not None]
    if not finite:
        edge = grid[-1] if safe_up else grid[0]
        nxt = step(edge, safe_up)
        if len(grid) >= max_points:
            return Search(
                None, (), (f"every {name} tried diverged; stopped at {len(grid)} points",)
            )
        return Search(None, (nxt,), ())
    best = max(finite, key=lambda v: (scores[v], -v))
    i = grid.index(best)
    pending: list[float] = []
    notes: list[str] = []
    for j, up, side in ((i - 1, False, "lower"), (i + 1, True, "higher")):
        if 0 <= j < len(grid):
            if scores[grid[j]] is None:
                notes.append(f"the next {side} {name} ({grid[j]:g}) diverged")
        elif len(grid) >= max_points:
            notes.append(
                f"best {name} {best:g} at the grid's {side} edge: stopped at {len(grid)} points"
            )
        else:
            pending.append(step(best, up))
    return Search(best, tuple(pending), tuple(notes))


def _lr_step(factor: float) -> Callable[[float, bool], float]:
    return lambda v, up: v * factor if up else v / factor


@dataclass
class CellPlan:
    """One cell's state: the runs it still needs, its decisions, and its choice once made."""

    model: str
    strategy: str
    world_size: int
    pending: list[Point] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    chosen: tuple[float, float] | None = None  # (lr multiplier, damping)
    damping: float | None = None  # the damping once decided (NaN: SGD)
    notes: list[str] = field(default_factory=list)
    stand_in_for: str = ""
    waiting_for: str = ""
    failed: str = ""  # why no point can be chosen (every point tried diverged)

    @property
    def done(self) -> bool:
        """Nothing left to run: a point is chosen (with its seeds), or none can be."""
        finished = self.chosen is not None or bool(self.failed)
        return finished and not self.pending and not self.waiting_for

    def fail(self, stage: str, reason: str) -> None:
        self.failed = reason
        self.decide(stage, "none", reason)

    def decide(self, stage: str, decision: str, reason: str) -> None:
        self.decisions.append(
            {
                "model": self.model,
                "strategy": self.strategy,
                "world_size": self.world_size,
                "stage": stage,
                "decision": decision,
                "reason": reason,
            }
        )


Results = Mapping[tuple[str, str, int, float, float, int], Outcome]


def _score(outcome: Outcome | None) -> float | None:
    if outcome is None or outcome.diverged or outcome.val_acc != outcome.val_acc:
        return None
    return outcome.val_acc


class Planner:
    """The protocol over a study: which runs come next, per cell, given the results so far."""

    def __init__(
        self,
        protocol: Protocol,
        results: Results,
        same_step: Mapping[str, str] | None = None,
        one_rank_kfac: str | None = None,
    ) -> None:
        self.protocol = protocol
        self.results = results
        self.same_step = dict(same_step or {})
        self.one_rank_kfac = one_rank_kfac
        self._cells: dict[tuple[str, str, int], CellPlan] = {}

    # ---------------------------------------------------------------- helpers
    def _outcome(self, point: Point) -> Outcome | None:
        return self.results.get(point.key())

    def _scores(self, cell: CellPlan, damping: float, seed: int = 0) -> dict[float, float | None]:
        """Scores by learning-rate multiplier at ``damping`` and ``seed`` among the results."""
        d = point_key("", "", 0, 0.0, damping, 0)[4]
        return {
            x: _score(outcome)
            for (m, s, p, x, dd, sd), outcome in self.results.items()
            if (m, s, p, dd, sd) == (cell.model, cell.strategy, cell.world_size, d, seed)
        }

    def _ask(self, cell: CellPlan, stage: str, lr: float, damping: float, seed: int = 0) -> None:
        point = Point(cell.model, cell.strategy, cell.world_size, lr, damping, seed, stage)
        if self._outcome(point) is None:
            cell.pending.append(point)

    def twin(self, strategy: str, world_size: int) -> str | None:
        """The configuration whose step this one computes at this P, if any."""
        if strategy == SGD:
            return None
        twin = self.one_rank_kfac if world_size == 1 else self.same_step.get(strategy)
        return twin if twin and twin != strategy else None

    # ---------------------------------------------------------------- the cell
    def cell(self, model: str, strategy: str, world_size: int) -> CellPlan:
        """The plan of one cell (memoised: a K-FAC cell reads its damping source's)."""
        key = (model, strategy, world_size)
        if key not in self._cells:
            plan = CellPlan(model, strategy, world_size)
            self._cells[key] = plan  # before planning: a cycle would read it as waiting
            plan.waiting_for = "being planned"
            self._plan(plan)
            if plan.waiting_for == "being planned":
                plan.waiting_for = ""
        return self._cells[key]

    def _plan(self, cell: CellPlan) -> None:
        twin = self.twin(cell.strategy, cell.world_size)
        if twin is not None and self._stand_in(cell, twin):
            return
        p = self.protocol
        kfac = cell.strategy != SGD
        if not kfac:
            damping = math.nan
        elif cell.world_size in p.damping_at:
            damping = p.damping_start
        else:
            source = self.cell(cell.model, cell.strategy, p.damping_source(cell.world_size))
            if source.damping is None:
                cell.waiting_for = f"the damping chosen at P={source.world_size}"
                return
            damping = source.damping
            cell.decide("damping", f"{damping:g}", f"chosen at P={source.world_size}")
        # 1. learning rate at the starting damping
        found = self._search_lr(cell, "lr", damping, p.lr_start)
        if found is None:
            return
        if kfac and cell.world_size in p.damping_at:
            # 2. damping at that learning rate, then 3. the learning rate again
            scores = self._damping_scores(cell, found)
            s = search(scores, p.damping, one_three, p.max_points, safe_up=True, name="damping")
            for d in s.pending:
                self._ask(cell, "damping", found, d)
            if not s.done:
                return
            if s.best is None:
                cell.fail("damping", "; ".join(s.notes))
                return
            cell.notes.extend(s.notes)
            cell.decide(
                "damping",
                f"{s.best:g}",
                f"best validation accuracy at lr x{found:g} over {sorted(scores)}"
                + (f" ({'; '.join(s.notes)})" if s.notes else ""),
            )
            damping = s.best
            if damping != p.damping_start:
                again = (found / p.lr_factor, found, found * p.lr_factor)
                found = self._search_lr(cell, "lr again", damping, again)
                if found is None:
                    return
        cell.damping = damping
        self._final(cell, damping)

    def _damping_scores(self, cell: CellPlan, lr: float) -> dict[float, float | None]:
        out: dict[float, float | None] = {}
        for (m, s, p, x, d, sd), outcome in self.results.items():
            if (m, s, p, sd) == (cell.model, cell.strategy, cell.world_size, 0) and x == lr:
                out[d] = _score(outcome)
        return out

    def _search_lr(
        self, cell: CellPlan, stage: str, damping: float, start: Sequence[float]
    ) -> float | None:
        p = self.protocol
        scores = self._scores(cell, damping)
        s = search(scores, start, _lr_step(p.lr_factor), p.max_points, safe_up=False, name="lr")
        for x in s.pending:
            self._ask(cell, stage, x, damping)
        if not s.done:
            return None
        cell.notes.extend(s.notes)
        at = "" if damping != damping else f" at damping {damping:g}"
        if s.best is None:
            cell.fail(stage, "; ".join(s.notes))
            return None
        cell.decide(
            stage,
            f"x{s.best:g}",
            f"best seed-0 validation accuracy{at} over "
            + ", ".join(f"x{v:g}" for v in sorted(scores))
            + (f" ({'; '.join(s.notes)})" if s.notes else ""),
        )
        return s.best

    def _final(self, cell: CellPlan, damping: float) -> None:
        """Finalists on ``final_seeds`` seeds; the chosen point must be interior, and paired
        cells add seeds at it."""
        p = self.protocol
        while True:
            scores = self._scores(cell, damping)
            ranked = sorted(
                (x for x, v in scores.items() if v is not None), key=lambda x: (-scores[x], x)
            )
            finalists = ranked[: p.finalists]
            short = False
            for x in finalists:
                for seed in range(p.final_seeds):
                    if self._outcome(self._point(cell, x, damping, seed)) is None:
                        self._ask(cell, "final", x, damping, seed)
                        short = True
            if short:
                return
            means = {x: self._mean(cell, x, damping, range(p.final_seeds)) for x in finalists}
            chosen = max(finalists, key=lambda x: (means[x], -x))
            grid = sorted(scores)
            i = grid.index(chosen)
            extend = [
                beyond
                for j, beyond in ((i - 1, chosen / p.lr_factor), (i + 1, chosen * p.lr_factor))
                if not 0 <= j < len(grid)
            ]
            if extend and len(grid) < p.max_points:
                for x in extend:
                    self._ask(cell, "final edge", x, damping)
                return
            break
        cell.chosen = (chosen, damping)
        table = ", ".join(f"x{x:g} {means[x]:.4f}" for x in finalists)
        cell.decide(
            "final",
            f"x{chosen:g}" + ("" if damping != damping else f", damping {damping:g}"),
            f"highest mean validation accuracy over seeds 0-{p.final_seeds - 1} among the "
            f"{len(finalists)} best screened points ({table})",
        )
        if cell.strategy in p.paired_strategies and cell.world_size in p.paired.get(cell.model, ()):
            for seed in range(p.paired_seeds):
                if self._outcome(self._point(cell, chosen, damping, seed)) is None:
                    self._ask(cell, "paired seeds", chosen, damping, seed)

    def _point(self, cell: CellPlan, lr: float, damping: float, seed: int) -> Point:
        return Point(cell.model, cell.strategy, cell.world_size, lr, damping, seed, "")

    def _mean(self, cell: CellPlan, lr: float, damping: float, seeds: Iterable[int]) -> float:
        values = [self._outcome(self._point(cell, lr, damping, s)) for s in seeds]
        scores = [_score(v) for v in values]
        # A seed that diverged counts as chance: a point that sometimes diverges loses.
        return sum(self.protocol.chance if v is None else v for v in scores) / len(scores)

    def _stand_in(self, cell: CellPlan, twin: str) -> bool:
        """Whether ``twin``'s runs stand for this cell (True: nothing else to plan)."""
        theirs = self.cell(cell.model, twin, cell.world_size)
        if theirs.chosen is None:
            cell.waiting_for = f"{twin}'s choice (its step is computed here)"
            return True
        lr, damping = theirs.chosen
        mine = self._outcome(self._point(cell, lr, damping, 0))
        if mine is None:
            self._ask(cell, "same-step check", lr, damping)
            return True
        other = self._outcome(self._point(theirs, lr, damping, 0))
        if other is not None and mine.fingerprint and mine.fingerprint == other.fingerprint:
            cell.stand_in_for = twin
            cell.chosen, cell.damping = theirs.chosen, theirs.damping
            cell.decide(
                "same step",
                f"{twin}'s runs",
                f"its run at {twin}'s chosen point (x{lr:g}, seed 0) equals {twin}'s bitwise",
            )
            return True
        cell.decide("same step", "own tuning", f"its run at {twin}'s chosen point differs")
        return False

    # ---------------------------------------------------------------- the study
    def plan(self, cells: Iterable[tuple[str, str, int]]) -> list[CellPlan]:
        """Every cell's plan, in the order given (which is also the order runs are taken)."""
        return [self.cell(m, s, p) for m, s, p in cells]


def pending(plans: Iterable[CellPlan]) -> list[Point]:
    """The runs to do next, in the cells' order, each once."""
    seen: set[tuple[str, str, int, float, float, int]] = set()
    out = []
    for plan in plans:
        for point in plan.pending:
            if point.key() not in seen:
                seen.add(point.key())
                out.append(point)
    return out


# ------------------------------------------------------------ from rows
#: Columns that decide whether two runs are the same run, bitwise (the same-step check).
FINGERPRINT = ("curve", "final_acc", "final_val_acc")


def study_cells(node: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """The study's cells (model, configuration, P) in the order their runs are taken:
    experiments, then world sizes in the order listed (the damping-tuning sizes first, so
    the others can start), then configurations; ``max_world_size`` caps an experiment."""
    study = node["study"]
    limits = node.get("max_world_size") or {}
    return [
        (str(m), str(s), int(p))
        for m in study["experiments"]
        for p in study["world_sizes"]
        if int(p) <= int(limits.get(m, p))
        for s in study["strategies"]
    ]


def outcome(row: Mapping[str, Any], protocol: Protocol) -> Outcome:
    """What the protocol reads of a row: a failed or diverged run scores nothing.

    Diverged: the run's last training loss is not finite, or its final validation
    accuracy is within ``chance_margin`` of chance.
    """
    error = str(row.get("error") or "")
    if error and error != "nan":
        return Outcome(math.nan, True, f"failed: {error[:120]}")
    val = float(row.get("final_val_acc", math.nan))
    curve = json.loads(row["curve"]) if isinstance(row.get("curve"), str) else []
    loss = float(curve[-1].get("train_loss", math.nan)) if curve else math.nan
    fingerprint = json.dumps([str(row.get(k)) for k in FINGERPRINT])
    if not math.isfinite(loss) and curve:
        return Outcome(val, True, "non-finite training loss", fingerprint)
    if not math.isfinite(val) or val <= protocol.chance + protocol.chance_margin:
        return Outcome(val, True, f"validation accuracy {val:.3f} at chance", fingerprint)
    return Outcome(val, False, "", fingerprint)


#: Failed attempts (an error row: a crash or a timeout, not a divergence) after which a run
#: counts as failed; before that it is asked for again.
ATTEMPTS = 2


def read_results(rows: Iterable[Mapping[str, Any]], protocol: Protocol) -> dict[tuple, Outcome]:
    """Outcomes by run; the latest finished row of a run wins (rows are appended in time order).

    A run that ended in an error (the job crashed or timed out: nothing about the
    hyper-parameters) is no outcome until it failed :data:`ATTEMPTS` times, so the
    protocol asks for it again rather than reading the crash as a divergence.
    """
    out: dict[tuple, Outcome] = {}
    failures: dict[tuple, list[Outcome]] = {}
    for row in rows:
        if row.get("task") != "convergence_scale" or "damping" not in row:
            continue
        damping = float(row["damping"]) if row["damping"] == row["damping"] else math.nan
        key = point_key(
            row["model"],
            row["strategy"],
            int(row["world_size"]),
            float(row["lr_multiplier"]),
            math.nan if str(row["strategy"]) == SGD else damping,
            int(row["seed"]),
        )
        result = outcome(row, protocol)
        if result.note.startswith("failed:"):
            failures.setdefault(key, []).append(result)
        else:
            out[key] = result
    for key, failed in failures.items():
        if key not in out and len(failed) >= ATTEMPTS:
            last = failed[-1]
            out[key] = Outcome(last.val_acc, True, f"{last.note} ({len(failed)} attempts)")
    return out


def plan_study(
    node: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]
) -> tuple[Protocol, list[CellPlan]]:
    """The protocol and every cell's plan, given the rows so far."""
    protocol = Protocol.from_config(node["tuning"])
    planner = Planner(
        protocol,
        read_results(rows, protocol),
        same_step=node.get("same_step") or {},
        one_rank_kfac=node.get("one_rank_kfac"),
    )
    return protocol, planner.plan(study_cells(node))
