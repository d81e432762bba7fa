"""Scale by simulation: one rank of a P-rank job, run for real in this process, on fake tensors.

On torch's fake process group any single rank of a job of any size runs its
real preconditioner construction and steps in one process: collectives
complete at once and move nothing, but the library hands them the tensors it
would hand NCCL, and counts them. With the model built under
``FakeTensorMode`` on device "cuda" (:mod:`experiments.bench.fake_cuda`),
nothing is allocated or computed, so the paper-size ResNet-50 and BERT-large
fit too. For each simulated rank, :func:`simulate` records

* the bytes, calls and wire bytes per collective category of a steady
  factor-and-decomposition step (``pre.comm_stats()``) and the K-FAC memory
  (``pre.memory_usage()``), beside :func:`dpkfac.costmodel.predict` for the
  same rank, shapes (:func:`~dpkfac.costmodel.shapes_from_model` of the same
  model) and resolved options (``Prediction.steps[(True, True)].comm_of(rank)``
  and ``Prediction.memory[rank]``), and whether they are exactly equal (bytes
  and memory: ``match``; calls and wire bytes too: ``calls_match``);
* the one-time traffic (the "setup" category, from construction to the
  measured step) beside ``Prediction.setup_comm``;
* start-up seconds (process group, construction, the first ``pre.step()``:
  final placement, "auto" resolution, setup collectives), a steady step and
  the prediction's seconds. These are host seconds of this one process, with
  fake kernels and collectives: they show how start-up *code* scales with P,
  not how long a GPU job starts.

Every step updates factors and decompositions (a strategy config's intervals
are not passed). Step 0 places; the steps after it run until one has no
one-time ("setup") collective (spd_kfac profiles its fusion plan over its first
``profile_steps`` factor updates, then agrees on it), and that step is the
measured one. What a run would measure at start-up cannot be measured on fake
tensors, so :func:`run_arguments` gives it (the row's ``note`` says so). A
pipelined strategy's fusion plan, profiled on this rank, is replayed by the
prediction (as :func:`experiments.bench.predict.predict_row` does for measured
rows). Batch factors use ``factor_method="unfold"`` by default: bytes and
memory do not depend on the kernel, and on fake tensors one product per factor
simulates about three times faster than "auto"'s one per block.

``python -m experiments.bench table=scale_sim`` (:func:`run_scale_sim`, the
``scale_sim`` node of ``conf/benchmark.yaml``) writes ``results/scale_sim.csv``
(one row per model, strategy config, P and rank) and ``results/scale_sim.md``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pandas as pd
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.bench.fake_cuda import (
    copy_fake,
    dry_run_preconditioner,
    fake_forward_backward,
    fake_mode,
    fake_process_group,
    fake_step,
    on_fake_cuda,
)
from experiments.bench.machine import machine

log = logging.getLogger(__name__)

MiB = 2**20
#: The hardware preset that stands in for start-up measurements, by default.
HARDWARE = "v100_ib100"
#: Steps after the first one that may still have one-time collectives (then the next is
#: measured whatever it holds, and mismatches).
MAX_WARMUP = 8
#: Keys of a strategy config a simulated run does not take: it times nothing, reads no host
#: values, and updates factors and decompositions every step (the library's default).
NOT_ARGUMENTS = ("timing", "host_reader", "factor_update_steps", "inv_update_steps")


# ------------------------------------------------------------------- the model
class FakeModel:
    """A model built once on fake CUDA, its forward inputs and its K-FAC shapes.

    Every simulated rank gets a fresh copy (:meth:`copy`): a preconditioner
    hooks the modules it is given, and the template is never handed to one.
    ``build`` is called under the fake mode on device "cuda" and returns the
    module and the positional inputs of one forward pass; ``batch_size`` is the
    local batch ``N`` the shapes record (default: the inputs' first dimension);
    ``label`` describes the model in the table.
    """

    def __init__(
        self,
        name: str,
        build: Callable[[], tuple[nn.Module, Sequence[Any]]],
        *,
        batch_size: int | None = None,
        label: str = "",
    ) -> None:
        self.name = name
        self.label = label or name
        self.mode: FakeTensorMode = fake_mode()
        module, inputs = on_fake_cuda(self.mode, build)
        self.module: nn.Module = module.train()
        self.inputs = tuple(inputs)
        self.batch_size = batch_size
        self._shapes: dict[tuple[str, ...], Any] = {}

    def copy(self) -> nn.Module:
        """A fresh copy of the model (same shapes, no hooks)."""
        return copy_fake(self.mode, self.module)

    def shapes(self, skip_layers: Sequence[str] = ()) -> Any:
        """:func:`dpkfac.costmodel.shapes_from_model` of the model (cached per ``skip_layers``)."""
        from dpkfac.costmodel import shapes_from_model

        key = tuple(skip_layers)
        if key not in self._shapes:
            with self.mode:
                self._shapes[key] = shapes_from_model(
                    self.module, self.inputs, self.batch_size, skip_layers=list(key)
                )
        return self._shapes[key]


# ---------------------------------------------------------------- the strategy
@dataclass(frozen=True)
class StrategyConfig:
    """A strategy config as the benchmark gives it: its name (how rows call it) and its
    ``KFACPreconditioner`` keyword arguments (``strategy``: the config's ``algorithm``)."""

    name: str
    kwargs: Mapping[str, Any]

    @property
    def algorithm(self) -> str:
        return str(self.kwargs.get("strategy", "dp_kfac"))


def run_arguments(
    config: StrategyConfig, world_size: int, hardware: str = HARDWARE
) -> tuple[dict[str, Any], list[str]]:
    """The preconditioner's arguments for a simulated run, and notes on what was filled in.

    The strategy's own options become its ``Options`` instance (validated as
    the library validates them). Start-up measurements are replaced: the
    hardware model by the ``hardware`` preset where the options leave it to
    one, and a measured all-reduce alpha-beta model (``comm_alpha`` /
    ``comm_beta`` both unset) by the preset's all-reduce link at
    ``world_size``, as the cost model plans fusion without a given model.

    Raises:
        ValueError / TypeError: options the library refuses.
    """
    from dpkfac.plan import scheme_of, scheme_options
    from dpkfac.plan.presets import PRESETS

    scheme = scheme_of(config.algorithm)
    own_names = {f.name for f in fields(scheme.Options)}
    kwargs = {k: v for k, v in config.kwargs.items() if k not in (*NOT_ARGUMENTS, "strategy")}
    own = {k: kwargs.pop(k) for k in list(kwargs) if k in own_names}
    options = scheme_options(scheme.name, own)
    notes = []
    if scheme.measures_hardware(options):
        options = scheme.with_hardware(options, PRESETS[hardware])
        notes.append(f"hardware: {hardware} (not measured)")
    alpha_beta = ("comm_alpha", "comm_beta")
    if set(alpha_beta) <= own_names and all(getattr(options, k) is None for k in alpha_beta):
        link, p = PRESETS[hardware].link("allreduce"), int(world_size)
        alpha, beta = link.latency(p), link.beta * 2 * (p - 1) / p
        options = replace(options, comm_alpha=alpha, comm_beta=beta)
        notes.append(f"comm model: {hardware} all-reduce at P={p} (not measured)")
    return {"strategy": options, **kwargs}, notes


# ---------------------------------------------------------------- one rank
@dataclass
class RankResult:
    """What one simulated rank handed to collectives and held, beside the prediction.

    ``comm``/``predicted_comm``: category -> ``{"bytes", "calls",
    "wire_bytes"}`` of the measured step; ``memory``/``predicted_memory``:
    ``memory_usage()``; ``setup``/``predicted_setup``: the "setup" category
    from construction to the measured step, and its prediction;
    ``measured_step``: the measured step's index (0 is the placing one).
    ``match``: the step's bytes in every category and every kind of memory
    exactly equal (None: not simulated, see ``note``); ``calls_match``: the
    calls and wire bytes of every category too. Seconds are host
    ``perf_counter`` times of this process.
    """

    model: str
    strategy: str
    algorithm: str
    world_size: int
    rank: int
    note: str = ""
    configuration: str = ""
    measured_step: int = 0
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    predicted_comm: dict[str, dict[str, int]] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    predicted_memory: dict[str, int] = field(default_factory=dict)
    setup: dict[str, int] = field(default_factory=dict)
    predicted_setup: dict[str, int] = field(default_factory=dict)
    match: bool | None = None
    calls_match: bool | None = None
    pg_s: float = float("nan")
    construct_s: float = float("nan")
    first_step_s: float = float("nan")
    step_s: float = float("nan")
    predict_s: float = float("nan")

    def row(self) -> dict[str, Any]:
        """One flat CSV row: totals, then bytes per category and memory per kind."""
        head = ("model", "strategy", "algorithm", "world_size", "rank", "configuration")
        out: dict[str, Any] = {k: getattr(self, k) for k in head}
        out["match"] = "" if self.match is None else bool(self.match)
        out["calls_match"] = "" if self.calls_match is None else bool(self.calls_match)
        out["setup_match"] = "" if self.match is None else self.setup == self.predicted_setup
        for key in ("bytes", "calls", "wire_bytes"):
            out[f"{key}_sim"] = _total(self.comm, key)
            out[f"{key}_pred"] = _total(self.predicted_comm, key)
        out["memory_sim"] = sum(self.memory.values()) if self.memory else None
        out["memory_pred"] = sum(self.predicted_memory.values()) if self.predicted_memory else None
        for cat in sorted(set(self.comm) | set(self.predicted_comm)):
            out[f"bytes_{cat}_sim"] = self.comm.get(cat, {}).get("bytes")
            out[f"bytes_{cat}_pred"] = self.predicted_comm.get(cat, {}).get("bytes")
        for kind in sorted(set(self.memory) | set(self.predicted_memory)):
            out[f"{kind}_sim"] = self.memory.get(kind)
            out[f"{kind}_pred"] = self.predicted_memory.get(kind)
        out["setup_bytes_sim"] = self.setup.get("bytes")
        out["setup_bytes_pred"] = self.predicted_setup.get("bytes")
        tail = ("measured_step", "pg_s", "construct_s", "first_step_s", "step_s", "predict_s")
        # The start-up seconds are host times: the page names the machine they ran on.
        where = {**machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        return out | {k: getattr(self, k) for k in (*tail, "note")} | where


def _total(comm: Mapping[str, Mapping[str, int]], key: str) -> int | None:
    return sum(int(c.get(key, 0)) for c in comm.values()) if comm else None


def _of(comm: Mapping[str, Mapping[str, int]], key: str) -> dict[str, int]:
    """``key`` of every category (categories the other side lacks count as 0)."""
    return {cat: int(c.get(key, 0)) for cat, c in comm.items() if c.get(key, 0)}


def _setup_of(comm: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    return dict(comm.get("setup", {"bytes": 0, "calls": 0, "wire_bytes": 0}))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The library's per-layer INFO lines (placement of every layer, rank 0) left out, and
    its warning that the widest decompositions will dominate a step (not on fake tensors)."""
    logger = logging.getLogger("dpkfac")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="dpkfac: decomposing the widest factors", category=RuntimeWarning
            )
            yield
    finally:
        logger.setLevel(level)


def _run_rank(model: FakeModel, kwargs: Mapping[str, Any], result: RankResult) -> Any:
    """Construction, first step and steps up to the measured one, as ``result``'s rank.

    Sets what was measured on ``result``; returns the preconditioner (its group destroyed).
    """
    module = model.copy()
    t0 = time.perf_counter()
    with fake_process_group(result.rank, result.world_size), model.mode:
        t1 = time.perf_counter()
        pre = dry_run_preconditioner(module, **kwargs)
        t2 = time.perf_counter()
        fake_forward_backward(module, model.inputs)
        t3 = time.perf_counter()
        pre.step()
        t4 = time.perf_counter()
        # Steps until one without one-time collectives: the measured step.
        setup = _setup_of(pre.comm_stats())
        for index in range(1, MAX_WARMUP + 2):
            pre.reset_stats()
            fake_forward_backward(module, model.inputs)
            t5 = time.perf_counter()
            pre.step()
            t6 = time.perf_counter()
            comm = pre.comm_stats()
            more = _setup_of(comm)
            if not more["calls"] or index > MAX_WARMUP:
                break
            setup = {k: setup[k] + more[k] for k in setup}
        memory = pre.memory_usage()
    result.comm, result.memory, result.setup, result.measured_step = comm, memory, setup, index
    result.pg_s, result.construct_s = t1 - t0, t2 - t1
    result.first_step_s, result.step_s = t4 - t3, t6 - t5
    return pre


def simulate(
    model: FakeModel,
    config: StrategyConfig,
    world_size: int,
    ranks: Sequence[int],
    *,
    hardware: str = HARDWARE,
    predictions: dict[Any, tuple[Any, float]] | None = None,
) -> list[RankResult]:
    """Each of ``ranks`` as a rank of a ``world_size``-rank job, against the cost model.

    Args:
        model: the fake model (copied for each rank).
        config: the strategy config.
        world_size: P.
        ranks: the ranks to play (each in ``range(world_size)``).
        hardware: the preset standing in for start-up measurements, and the
            hardware of the prediction (bytes and memory do not depend on it).
        predictions: a cache of predictions (ranks with the same resolved
            options and fusion plan share one; at large P one costs seconds).

    Returns:
        One :class:`RankResult` per rank. A combination the library refuses
        (an option that does not fit P: a kaisa fraction, a grouped k) is a
        result with ``match`` None and the reason in ``note``.
    """
    from dpkfac.costmodel import predict
    from dpkfac.plan.presets import PRESETS

    cache = {} if predictions is None else predictions
    results = []
    for rank in ranks:
        result = RankResult(model.name, config.name, config.algorithm, int(world_size), int(rank))
        results.append(result)
        if not 0 <= rank < world_size:
            result.note = f"rank {rank} is not in range(P={world_size})"
            continue
        try:
            kwargs, notes = run_arguments(config, world_size, hardware)
            with _quiet():
                pre = _run_rank(model, kwargs, result)
        except (ValueError, TypeError) as err:
            result.note = f"cannot run at P={world_size}: {err}"
            continue
        except Exception as err:  # recorded in the row: the other combinations go on
            log.exception(
                "scale_sim: %s %s P=%d rank %d failed", model.name, config.name, world_size, rank
            )
            result.note = f"failed: {type(err).__name__}: {str(err).strip()[:300]}"
            continue
        strategy = pre.strategy
        plan = getattr(strategy, "fusion_plan", None)
        result.configuration = strategy.scheme.describe(strategy.options)
        result.note = "; ".join(notes)
        key = (repr(pre.options), repr(strategy.options), repr(plan), model.name, int(world_size))
        if key not in cache:
            t = time.perf_counter()
            prediction = predict(
                model.shapes(pre.options.skip_layers),
                strategy=pre.strategy_name,
                world_size=world_size,
                hardware=PRESETS[hardware],
                kfac=pre.options,
                options=strategy.options,
                param_itemsize=next(model.module.parameters()).element_size(),
                fusion_plan=plan,
            )
            cache[key] = (prediction, time.perf_counter() - t)
        prediction, result.predict_s = cache[key]
        result.predicted_comm = prediction.steps[(True, True)].comm_of(rank)
        result.predicted_memory = dict(prediction.memory[rank])
        result.predicted_setup = _setup_of(prediction.setup_comm)
        result.match = (
            _of(result.comm, "bytes") == _of(result.predicted_comm, "bytes")
            and result.memory == result.predicted_memory
        )
        result.calls_match = result.comm == result.predicted_comm
    return results


# ------------------------------------------------------- configs of the benchmark
def resolve_ranks(spec: Sequence[int | str], world_size: int) -> list[int]:
    """Ranks of ``world_size`` from a spec: ints (negative: from the end) and "middle" (P // 2).

    Ranks out of range are dropped; the rest are sorted, each once.
    """
    ranks = [
        world_size // 2 if isinstance(item, str) and item.strip() == "middle" else int(item)
        for item in spec
    ]
    ranks = [rank + world_size if rank < 0 else rank for rank in ranks]
    return sorted({rank for rank in ranks if 0 <= rank < world_size})


def kfac_strategies() -> list[str]:
    """Every strategy config that configures a preconditioner, sorted (their one home,
    :func:`dpkfac.plan.configs.kfac_configs`, is what ``conf/strategy`` must match)."""
    from dpkfac.plan.configs import kfac_configs

    return sorted(kfac_configs())


def workload_configs(model: str, strategies: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """The benchmark's composed config of ``model=<model>``, and of each strategy config with it.

    Each strategy config is composed as ``python -m experiments.bench
    model=<model> strategy=<name>`` would compose it, so a workload's K-FAC
    settings (BERT's ``weight_sharing: reduce``) apply, and checked as the
    benchmark checks it.
    """
    from experiments.config import compose_config, validate_strategy

    base = compose_config("benchmark", [f"model={model}"])
    members = {}
    for name in strategies:
        cfg = compose_config("benchmark", [f"model={model}", f"strategy={name}"])
        validate_strategy(cfg.strategy)
        members[name] = cfg
    return base, members


def strategy_config(cfg: Any, *, factor_method: str | None = None) -> StrategyConfig:
    """The strategy config of a composed benchmark config (schedules instantiated).

    ``factor_method``: the batch-factor kernel instead of the config's (None:
    the config's; why "unfold" by default: see the module docstring).
    """
    from experiments.preconditioning import preconditioner_kwargs, strategy_name, with_schedules

    kwargs = preconditioner_kwargs(cfg.strategy)
    if kwargs is None:
        raise ValueError(f"strategy={strategy_name(cfg.strategy)} configures no preconditioner")
    kwargs = with_schedules(kwargs)
    if factor_method is not None:
        kwargs["factor_method"] = factor_method
    return StrategyConfig(strategy_name(cfg.strategy), kwargs)


def workload_model(cfg: Any, *, paper: bool = True) -> FakeModel:
    """The fake model of a composed benchmark config's workload (its paper size with ``paper``)."""
    from experiments.bench.workloads import build
    from experiments.config import plain

    model, batch = plain(cfg.model), plain(cfg.workload.batch)
    label = str(cfg.workload.label)
    if paper:
        sizes = plain(cfg.workload.get("paper")) or {}
        model.update(sizes.get("model") or {})
        batch.update(sizes.get("batch") or {})
        if sizes:
            given = ", ".join(f"{k}={v}" for k, v in (sizes.get("batch") or {}).items())
            label = f"{cfg.workload.name} at paper size ({given})"
    size: dict[str, int] = {}

    def make() -> tuple[nn.Module, tuple[Any, ...]]:
        bench = build(model, batch, seed=int(cfg.seed))
        size["batch"] = bench.batch_size
        return bench.model, bench.example_input

    fake = FakeModel(str(cfg.workload.name), make, label=label)
    fake.batch_size = size["batch"]
    return fake


@dataclass(frozen=True)
class Limit:
    """What a world size simulates, when not everything (``scale_sim.limits``): only the
    ``strategies`` configs (None: all of the job's), not the ``exclude`` ones, and these
    ``ranks`` instead of the job's (None: the job's)."""

    world_size: int
    strategies: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    ranks: tuple[int | str, ...] | None = None

    @classmethod
    def parse(cls, node: Mapping[str, Any]) -> Limit:
        if set(node) - {f.name for f in fields(cls)} or "world_size" not in node:
            raise ValueError(
                f"a limit is {{world_size, strategies, exclude, ranks}}, got {dict(node)!r}"
            )
        strategies, ranks = node.get("strategies"), node.get("ranks")
        return cls(
            int(node["world_size"]),
            None if strategies is None else tuple(str(s) for s in strategies),
            tuple(str(s) for s in node.get("exclude") or ()),
            None if ranks is None else tuple(ranks),
        )


def plan_jobs(
    strategies: Sequence[str],
    world_sizes: Sequence[int],
    ranks: Sequence[int | str],
    limits: Sequence[Limit] = (),
) -> tuple[list[tuple[str, int, list[int]]], list[str]]:
    """(strategy, P, ranks) to simulate, and what the limits leave out, per world size."""
    by_p = {limit.world_size: limit for limit in limits}
    jobs, left_out = [], []
    for p in map(int, world_sizes):
        limit = by_p.get(p, Limit(p))
        chosen = [
            s
            for s in strategies
            if (limit.strategies is None or s in limit.strategies) and s not in limit.exclude
        ]
        if dropped := [s for s in strategies if s not in chosen]:
            left_out.append(f"P={p}: {', '.join(dropped)}")
        spec = ranks if limit.ranks is None else limit.ranks
        jobs += [(name, p, resolve_ranks(spec, p)) for name in chosen]
    return jobs, left_out


def run_scale_sim(
    models: Sequence[str],
    world_sizes: Sequence[int],
    ranks: Sequence[int | str],
    strategies: Sequence[str] | None = None,
    *,
    limits: Sequence[Limit] = (),
    hardware: str = HARDWARE,
    paper: bool = True,
    factor_method: str | None = "unfold",
    out: Path | None = None,
) -> dict[str, Path]:
    """Simulate every (model, strategy config, P, rank) and write ``<out>/scale_sim.{csv,md}``.

    Args:
        models: workload names (``conf/workload``), each built once on fake CUDA.
        world_sizes: the P to play.
        ranks: per P, ints (negative: from the end) and "middle".
        strategies: strategy configs (None: every K-FAC config of ``conf/strategy``).
        limits: per world size, fewer strategy configs or other ranks.
        hardware: the preset standing in for start-up measurements.
        paper: build each workload at its paper size (``workload.paper``).
        factor_method: the batch-factor kernel of every run (None: each
            config's); see :func:`strategy_config`.
        out: the results folder (None: write nothing, return nothing).

    Returns:
        The files written (``{"csv": ..., "md": ...}``).
    """
    names = list(strategies) if strategies is not None else kfac_strategies()
    jobs, left_out = plan_jobs(names, world_sizes, ranks, limits)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for model_name in models:
        base, members = workload_configs(model_name, names)
        try:
            configs = {
                n: strategy_config(c, factor_method=factor_method) for n, c in members.items()
            }
        except ValueError as err:
            from experiments.config import ExperimentError

            raise ExperimentError(f"invalid value scale_sim.strategies={names!r}: {err}") from None
        t = time.perf_counter()
        model = workload_model(base, paper=paper)
        log.info("scale_sim: %s built on fake CUDA in %.1f s", model.label, time.perf_counter() - t)
        _warm_up(model)
        cache: dict[Any, tuple[Any, float]] = {}
        for name, p, chosen in jobs:
            t = time.perf_counter()
            results = simulate(
                model, configs[name], p, chosen, hardware=hardware, predictions=cache
            )
            rows += [{"label": model.label, **r.row()} for r in results]
            ok, took = sum(bool(r.match) for r in results), time.perf_counter() - t
            log.info(
                f"scale_sim: {model_name} {name} P={p} ranks {chosen}: "
                f"{ok}/{len(results)} match ({took:.1f} s)"
            )
    seconds = time.perf_counter() - started
    log.info("scale_sim: %d rows in %.0f s", len(rows), seconds)
    if out is None:
        return {}
    return write_scale_sim(
        pd.DataFrame(rows),
        Path(out),
        hardware=hardware,
        factor_method=factor_method,
        left_out=left_out,
        seconds=seconds,
    )


def _warm_up(model: FakeModel) -> None:
    """One untimed single-process step, so fake-kernel caches do not count as start-up."""
    module = model.copy()
    with _quiet(), model.mode:
        fake_step(module, dry_run_preconditioner(module), inputs=model.inputs)


# ----------------------------------------------------------------- the table
def startup_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Start-up seconds per (model, strategy, P): medians over the simulated ranks."""
    ok = df[df["match"].astype(str) != ""] if not df.empty else df
    cols = ["pg_s", "construct_s", "first_step_s", "step_s", "predict_s"]
    if ok.empty:
        return pd.DataFrame(columns=["model", "strategy", "world_size", "ranks", *cols])
    grouped = ok.groupby(["model", "strategy", "world_size"], sort=False)
    frame = grouped[cols].median().reset_index()
    frame.insert(3, "ranks", grouped.size().to_numpy())
    return frame


def _rows_table(df: pd.DataFrame) -> pd.DataFrame:
    """The page's row table (8 columns: what was simulated and whether it matched the
    prediction); predictions and differences stay in the CSV, a match meaning they are 0."""

    def sign(value: Any) -> str:
        return "" if value == "" else ("=" if value else "≠")

    checks = [
        "" if c == "" else f"{sign(c)}, {sign(s)}"
        for c, s in zip(df["calls_match"], df["setup_match"], strict=True)
    ]
    return pd.DataFrame(
        {
            "strategy": df["strategy"],
            "P": df["world_size"],
            "rank": df["rank"],
            "MiB": df["bytes_sim"] / MiB,
            "memory MiB": df["memory_sim"] / MiB,
            "match": df["match"].map(lambda m: "" if m == "" else ("yes" if m else "**no**")),
            "calls, setup": checks,
            "chosen, note": [
                ", ".join(x for x in (str(c or ""), str(n or "")) if x and x != "nan")
                for c, n in zip(df["configuration"], df["note"], strict=True)
            ],
        }
    )


def write_scale_sim(
    df: pd.DataFrame,
    out: Path,
    *,
    hardware: str = HARDWARE,
    factor_method: str | None = None,
    left_out: Sequence[str] = (),
    seconds: float | None = None,
) -> dict[str, Path]:
    """``<out>/scale_sim.csv`` (every row) and ``scale_sim.md`` (takeaway, both tables)."""
    from experiments.bench import takeaways
    from experiments.bench.pages import machine_line, page, to_markdown, write_page

    out.mkdir(parents=True, exist_ok=True)
    csv = out / "scale_sim.csv"
    df.to_csv(csv, index=False)
    startup = startup_frame(df)
    method = [
        "Each row is one rank of a P-rank job, run for real in one process on torch's fake",
        "process group (collectives complete at once and move nothing) with the model built",
        'under FakeTensorMode on device "cuda" (no memory, no compute): the preconditioner\'s',
        "construction, the first step (placement) and steps until one has no one-time",
        "collectives, every step updating factors and decompositions. **MiB** and **memory",
        "MiB**: the bytes handed to collectives in that step (`pre.comm_stats()`, every",
        "category) and the K-FAC memory (`pre.memory_usage()`), simulated; the cost model's",
        "prediction (`dpkfac.costmodel.predict` for the same rank, shapes from",
        "`shapes_from_model` of the same model, and options) and the differences are in",
        "`scale_sim.csv`. **match**: the bytes of every category and every kind of memory",
        "exactly equal; **calls, setup**: the calls and wire bytes of every category too, and",
        "the one-time (`setup`) traffic from construction on (`=`: equal). Start-up",
        f"measurements cannot run on fake tensors: the `{hardware}` preset stands in (see",
        "note).",
    ]
    if factor_method is not None:
        method.append(
            f"Every run builds its batch factors with `factor_method={factor_method}` (bytes and "
            "memory do not depend on the kernel; it simulates faster on fake tensors)."
        )
    if left_out:
        method += ["", f"Left out by the preset's `scale_sim.limits`: {'; '.join(left_out)}."]
    if seconds is not None:
        method += ["", f"The whole run took {seconds / 60:.1f} min on this machine."]
    method += [
        "",
        "Start-up: host `time.perf_counter()` seconds of this one process, fake kernels and",
        "collectives that move nothing: how start-up *code* scales with P, not a GPU job's",
        "start-up. process group: `init_process_group` (fake backend); construction: the",
        "preconditioner (placement with nominal shapes); first step: `pre.step()` of step 0",
        "(final placement, `auto` resolution, setup collectives, and the step's own fake",
        "work); predict: the cost model's `predict` of that rank; a later `pre.step()`,",
        "for comparison: `step_s` in `scale_sim.csv`.",
    ]
    body: list[str] = []
    for model, group in df.groupby("model", sort=False):
        label = group["label"].iloc[0] if "label" in group else model
        body += [f"## {label}: bytes of one update step and K-FAC memory", ""]
        body += [to_markdown(_rows_table(group), {"MiB": 2, "memory MiB": 2}), ""]
    body += ["## Start-up seconds against P (median over the simulated ranks)", ""]
    # A later step's seconds (``step_s``, for comparison) stay in the CSV, per rank.
    show = startup.drop(columns="step_s").rename(
        columns={
            "world_size": "P",
            "pg_s": "process group s",
            "construct_s": "construction s",
            "first_step_s": "first step s",
            "predict_s": "predict s",
        }
    )
    body.append(to_markdown(show, {"P": 0, "ranks": 0, "process group s": 4}))
    answer = [*takeaways.scale_sim(df, startup), machine_line(df)]
    md = page(
        "Scale by simulation: one rank of a P-rank job, predicted against simulated",
        answer,
        body,
        method,
    )
    return {"csv": csv, "md": write_page(out / "scale_sim.md", md)}
