"""The benchmark's Hydra entry point: ``python -m experiments.bench [overrides]``.

Measures, for one model, strategy config (or several, interleaved step by step:
``strategies=[none,dp_kfac,d_kfac]``), world size and update setting, the
seconds of every phase of an iteration (forward/backward, gradient
communication, factor computation and communication, decomposition and its
communication, preconditioning and its communication, the optimizer step),
the bytes of every collective category and the K-FAC memory of the busiest
rank, and writes one row per strategy config (``rows.json`` in the job's output folder).

The configuration is the training side's tree (``conf/benchmark.yaml`` composes
the same ``model`` and ``strategy`` groups as ``conf/config.yaml``), so
``model=resnet32 strategy=dp_kfac`` is the network and the preconditioner
arguments that ``experiments.train`` would use; the workload chosen with the
model (``conf/workload``) adds the synthetic batch and the CPU sizes.

The job starts its own ``world_size`` local ranks through torch's elastic
launcher (:mod:`experiments.bench.launch`), so a Hydra multirun sweeps world
sizes without a shell loop::

    python -m experiments.bench strategy=dp_kfac model=resnet32 world_size=2
    python -m experiments.bench -m model=resnet32,bert_base strategy=dp_kfac,d_kfac
    python -m experiments.bench -m table=second_order_update

Under ``torchrun --nproc_per_node=N -m experiments.bench world_size=N``
every rank measures itself and rank 0 writes the row. ``task=convergence``
trains with the training entry point instead (:mod:`experiments.bench.convergence`),
and ``task=convergence_scale`` trains one run with every rank a thread of the job's
process (:mod:`experiments.bench.convergence_scale`).

Three table presets are single jobs that write their table themselves rather than
rows for a callback, each with its node of ``conf/benchmark.yaml`` (``task=<name>``,
:func:`run_table_task`: :func:`fidelity_task`, :func:`factor_kernels_task` and
:func:`scale_sim_task`, ranks of jobs of up to thousands of ranks simulated in this process)::

    python -m experiments.bench table=fidelity
    python -m experiments.bench table=factor_kernels
    python -m experiments.bench table=scale_sim
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from dpkfac.timeline import merge
from dpkfac.timeline import write as write_trace
from experiments import network as network_lib
from experiments.bench.aggregate import aggregate, kind_weights
from experiments.bench.machine import machine
from experiments.bench.measure import step_kinds
from experiments.config import (
    CONF_DIR,
    TABLE_TASKS,
    TABLES,
    ExperimentError,
    check_update_intervals,
    compose_config,
    first_line,
    plain,
    validate,
    validate_benchmark,
    validate_strategy,
)
from experiments.preconditioning import (
    node_options,
    preconditioner_kwargs,
    strategy_name,
    uses_preconditioner,
)

log = logging.getLogger(__name__)

#: Preconditioner arguments the benchmark passes itself: its setting's update intervals
#: (as schedules of the measured step kinds) and its own learning rate. A strategy config
#: leaves the intervals null; one that sets them to other values than the setting's is
#: refused (:func:`experiments.config.check_update_intervals`), never overridden silently.
BENCHMARK_DECIDES = ("factor_update_steps", "inv_update_steps", "lr")
#: K-FAC's view of the model, recorded for every row (first order too) for the cost model.
VIEW_KEYS = ("compute_method", "skip_layers", "weight_sharing", "bucket_cap_mb")


def _without(overrides: Sequence[str], keys: Sequence[str]) -> list[str]:
    """The overrides minus those choosing one of ``keys`` (``strategy=x``, not ``strategy.x=1``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [o.input_line for o in parsed if o.key_or_group not in keys]


def member_configs(cfg: DictConfig, overrides: Sequence[str] = ()) -> list[DictConfig]:
    """The job's config once per strategy config it measures.

    Without ``strategies`` that is ``cfg`` itself. With it, every entry is
    composed as this job would be with ``strategy=<entry>`` (the same
    overrides, the same workload), so an interleaved job and a job per
    strategy config measure the same preconditioner arguments.

    Args:
        cfg: The job's composed config.
        overrides: The job's command-line overrides.

    Raises:
        ExperimentError: an entry that is no strategy config, that the
            job's overrides do not fit, or whose update intervals contradict
            the setting's.
    """
    from hydra.errors import HydraException

    names = cfg.get("strategies")
    if not names:
        return [cfg]
    base = _without(overrides, ("strategy", "strategies"))
    members = []
    for name in names:
        try:
            member = compose_config("benchmark", [*base, f"strategy={name}", "strategies=null"])
        except HydraException as err:
            raise ExperimentError(
                f"invalid value strategies={list(names)!r}: cannot compose strategy={name} "
                f"with this job's overrides ({first_line(err)})"
            ) from None
        validate_strategy(member.strategy)
        check_update_intervals(member.strategy, member.setting)
        members.append(member)
    return members


def _member(cfg: DictConfig) -> dict[str, Any]:
    """What a rank needs of one strategy config: name, preconditioner arguments, K-FAC's view."""
    from dpkfac.options import KFACOptions

    node = cfg.strategy
    kwargs = preconditioner_kwargs(node)
    if kwargs is not None:
        kwargs = {k: plain(v) for k, v in kwargs.items() if k not in BENCHMARK_DECIDES}
    defaults = KFACOptions()
    given = node_options(node)
    view = {key: plain(given.get(key, getattr(defaults, key))) for key in VIEW_KEYS}
    view["skip_layers"] = list(view["skip_layers"])
    return {"name": strategy_name(node), "kfac": kwargs, "view": view}


def job_spec(
    cfg: DictConfig, overrides: Sequence[str] = (), output_dir: str | Path | None = None
) -> dict[str, Any]:
    """The plain, picklable description every rank receives.

    Args:
        cfg: The job's composed config.
        overrides: The job's command-line overrides (to compose ``strategies``).
        output_dir: The job's folder (convergence runs write theirs below it).

    Raises:
        ExperimentError: a value the checks reject (naming key and value).
    """
    validate_benchmark(cfg)
    if cfg.task in TABLE_TASKS:
        raise ExperimentError(
            f"task={cfg.task} writes its table itself and has no job spec (run_table_task)"
        )
    members = member_configs(cfg, overrides)
    keys = (
        "task",
        "world_size",
        "seed",
        "isolate_comm",
        "lr",
        "threads",
        "device",
        "timeout_s",
        "trace",
        "probes",
    )
    spec: dict[str, Any] = {key: plain(cfg[key]) for key in keys}
    spec["model"] = {
        "name": str(cfg.workload.name),
        "label": str(cfg.workload.label),
        "config": plain(cfg.model),
        "batch": plain(cfg.workload.batch),
        "paper": plain(cfg.workload.get("paper")) or {},
    }
    spec["setting"] = plain(cfg.setting)
    network = network_lib.from_config(plain(cfg.get("network")))
    if network is not None:
        network.nodes(int(cfg.world_size))  # refuses a world size that fills no two nodes
    spec["network"] = None if network is None else dataclasses.asdict(network)
    spec["strategies"] = [_member(m) for m in members]
    spec["interleaved"] = len(members) > 1
    intervals = int(cfg.setting.factor_update_steps), int(cfg.setting.inv_update_steps)
    kinds = step_kinds(*intervals)
    cycle = len(kinds) if any(uses_preconditioner(m.strategy) for m in members) else 1
    # Whole cycles, so every step kind is measured equally often.
    spec["warmup"] = -(-int(cfg.warmup) // cycle) * cycle
    spec["steps"] = max(-(-int(cfg.steps) // cycle), 1) * cycle
    spec["factor_update_steps"], spec["inv_update_steps"] = intervals
    if spec["task"] == "convergence":
        from experiments.bench.convergence import training_config

        out = Path(output_dir) if output_dir is not None else Path(cfg.paths.log_dir) / "adhoc"
        train_cfg = training_config(cfg, out / "train", f"trainer.device={cfg.device}")
        validate(train_cfg)
        spec["train_config"] = OmegaConf.to_container(train_cfg, resolve=True)
    return spec


def _identity(spec: dict[str, Any], member: dict[str, Any]) -> dict[str, Any]:
    """Columns that say what was measured, where and when."""

    return {
        "task": spec["task"],
        "model": spec["model"]["name"],
        "label": spec["model"]["label"],
        "strategy": member["name"],
        "world_size": int(spec["world_size"]),
        "setting": spec["setting"]["name"],
        "factor_update_steps": spec["setting"]["factor_update_steps"],
        "inv_update_steps": spec["setting"]["inv_update_steps"],
        "batch_size": spec["model"]["batch"].get("batch_size"),
        "warmup": spec["warmup"],
        "steps": spec["steps"],
        "seed": spec["seed"],
        "threads": spec["threads"],
        "isolate_comm": bool(spec.get("isolate_comm", False)),
        "compute_method": member["view"]["compute_method"],
        **machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def timing_rows(spec: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One benchmark row per strategy config from every rank's timing results."""
    return [_timing_row(spec, member, results) for member in spec["strategies"]]


def _timing_row(
    spec: dict[str, Any], member: dict[str, Any], results: list[dict[str, Any]]
) -> dict[str, Any]:
    row = _identity(spec, member)
    row["interleaved"] = bool(spec["interleaved"])
    first = results[0]["strategies"][member["name"]]
    row.update(
        device=results[0]["device"],
        backend=results[0]["backend"],
        kfac_layers=first["kfac_layers"],
        params=first["params"],
    )
    mine = [
        {"rank": r["rank"], "records": r["strategies"][member["name"]]["records"]} for r in results
    ]
    intervals = spec["factor_update_steps"], spec["inv_update_steps"]
    row.update(aggregate(mine, *intervals))
    row.update(_what_ran(spec, member))
    row.update(
        rank_timings=json.dumps(row["rank_timings"]),
        least_wait=json.dumps(row["least_wait"]),
        fusion_plan=json.dumps(first.get("fusion_plan")),
        measured_hardware=first.get("hardware") or "",
        link_probes=json.dumps(results[0].get("link_probes") or []),
        compute_probes=json.dumps(results[0].get("compute_probes") or []),
        **_network_columns(results[0].get("network")),
        configuration=first.get("configuration") or "",
    )
    for key, value in list(row.items()):
        if isinstance(value, float) and key.startswith(("bytes_", "calls_", "wire_", "mem_")):
            row[key] = int(value) if value.is_integer() else value
    row["kind_weights"] = json.dumps(kind_weights(*intervals))
    row["error"] = ""
    return row


def _network_columns(record: dict[str, Any] | None) -> dict[str, Any]:
    """The network a job ran on (:func:`experiments.bench.link_probe.network_record`), as
    row columns: ``network``, ``network_rate_bps``, ``network_faithful_bps`` and the faithful
    probe's ladder as JSON (``network_probe``)."""
    record = record or {"network": "loopback"}
    return {
        "network": record["network"],
        "network_rate_bps": record.get("network_rate_bps"),
        "network_faithful_bps": record.get("network_faithful_bps"),
        "network_probe": json.dumps(record.get("network_probe")),
    }


def _what_ran(spec: dict[str, Any], member: dict[str, Any]) -> dict[str, Any]:
    """The columns that say which model and preconditioner a row's job runs (as JSON).

    ``kfac_options`` is everything passed to ``KFACPreconditioner`` but the model and the
    update intervals (callables of the setting's step kinds; the row has
    ``factor_update_steps``/``inv_update_steps``), null for first order.
    """
    kfac = None if member["kfac"] is None else {**member["kfac"], "lr": spec["lr"]}
    return {
        "model_config": json.dumps(spec["model"]["config"]),
        "model_batch": json.dumps(spec["model"]["batch"]),
        "model_paper": json.dumps(spec["model"]["paper"]),
        "skip_layers": json.dumps(member["view"]["skip_layers"]),
        "weight_sharing": member["view"]["weight_sharing"],
        "kfac_options": json.dumps(kfac, default=str),
    }


def described_rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per strategy config of a job, saying what it would run, measured by nobody.

    The identity and model columns of :func:`timing_rows` (no timings, bytes
    or memory): what the cost model needs to predict the job
    (:func:`experiments.bench.predict.measurement`), e.g. at the papers' sizes
    and world size without running anything (``results/paper.*``).
    """
    return [{**_identity(spec, m), **_what_ran(spec, m)} for m in spec["strategies"]]


def convergence_rows(spec: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: the accuracy curve as JSON plus the final and best accuracy."""
    from experiments.bench.convergence import curve

    train_cfg = spec["train_config"]
    row = _identity(spec, spec["strategies"][0])
    main = results[0]
    history = curve(main["history"] or [])
    result = main["result"]
    row.update(
        model=train_cfg["name"],
        label=f"{train_cfg['model']['_target_'].rsplit('.', 1)[-1]} ({train_cfg['name']} preset)",
        batch_size=train_cfg["data"]["batch_size"],
        epochs=len(history),
        steps_per_epoch=round(result["steps"] / result["epochs"]) if result["epochs"] else 0,
        final_acc=result.get("accuracy", float("nan")),
        best_acc=max((h["test_acc"] for h in history), default=float("nan")),
        seconds=result["wall_time_s"],
        curve=json.dumps(history),
        # The trainer compares the ranks' parameters bitwise at the end and fails otherwise.
        replicas_identical=bool(train_cfg["trainer"]["check_replicas"]),
        kfac_options=json.dumps(preconditioner_kwargs(train_cfg["strategy"]), default=str),
        error="",
    )
    return [row]


def run(
    cfg: DictConfig, overrides: Sequence[str] = (), output_dir: str | Path | None = None
) -> list[dict[str, Any]]:
    """Run one job and return its rows (one per strategy config measured).

    Args:
        cfg: The job's composed config.
        overrides: The job's command-line overrides (to compose ``strategies``).
        output_dir: The job's folder.
    """
    from experiments.bench.convergence import run_convergence
    from experiments.bench.launch import launch
    from experiments.bench.measure import run_rank

    if cfg.task == "convergence_scale":  # its ranks are threads of this process
        from experiments.bench import convergence_scale

        validate_benchmark(cfg)
        out = Path(output_dir) if output_dir is not None else Path(cfg.paths.log_dir) / "adhoc"
        return convergence_scale.run_job(cfg, out)
    spec = job_spec(cfg, overrides, output_dir)
    names, size = "+".join(m["name"] for m in spec["strategies"]), spec["world_size"]
    network = network_lib.Network(**spec["network"]) if spec["network"] else None
    where = network.label if network is not None else "loopback"
    if spec["task"] == "timing":
        fn, make_rows = run_rank, timing_rows
        model, setting = spec["model"]["name"], spec["setting"]["name"]
        log.info("timing %s on %s, P=%s, %s setting, %s", names, model, size, setting, where)
    else:
        fn, make_rows = run_convergence, convergence_rows
        experiment = spec["train_config"]["name"]
        log.info("convergence: experiment=%s strategy=%s, P=%s, %s", experiment, names, size, where)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks started by torchrun
        if network is not None:
            raise ExperimentError(
                "network=emulated starts every rank itself, one node per network namespace: "
                "run python -m experiments.bench without torchrun"
            )
        spec["world_size"] = int(os.environ["WORLD_SIZE"])
        spec["gather"] = True
        results = fn(spec)
        results = results if isinstance(results, list) else [results]
    else:
        results = launch(fn, spec, int(size), threads=int(spec["threads"]), network=network)
    if spec.get("trace") and output_dir is not None and int(os.environ.get("RANK", "0")) == 0:
        path = write_trace(merge([r["trace"] for r in results]), Path(output_dir) / "trace.json")
        log.info("timeline of the measured steps: %s (open it at https://ui.perfetto.dev)", path)
    return make_rows(spec, results)


def run_table_task(cfg: DictConfig) -> dict[str, Path]:
    """Run the job of a ``task`` table (:data:`experiments.config.TABLES`): its writer
    below writes to ``results_dir`` and returns its files.

    Raises:
        ExperimentError: a value the checks reject, or ranks started by torchrun
            (these jobs start their own processes, if any).
    """
    validate_benchmark(cfg)
    if cfg.task not in TABLE_TASKS:
        raise ExperimentError(f"invalid value task={cfg.task!r}: expected one of {TABLE_TASKS}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ExperimentError(
            f"task={cfg.task} is one process that starts its own ranks: run it without torchrun"
        )
    return TABLES[cfg.task].write(cfg)


def fidelity_task(cfg: DictConfig) -> dict[str, Path]:
    """``task=fidelity``: the ``fidelity`` node's runs with this job's strategy config."""
    from experiments.bench.fidelity import run_fidelity

    node = cfg.fidelity
    log.info("fidelity: runs %s on %s rank(s)", list(node.runs), cfg.world_size)
    return run_fidelity(
        list(node.runs),
        {str(k): int(v) for k, v in node.steps.items()},
        nproc=int(cfg.world_size),
        every=int(node.every),
        strategy=strategy_name(cfg.strategy),
        out=Path(str(cfg.results_dir)),
        timeout=float(node.timeout_s),
    )


def scale_sim_task(cfg: DictConfig) -> dict[str, Path]:
    """``task=scale_sim``: the ``scale_sim`` node's jobs, simulated in this process."""
    from experiments.bench.scale_sim import Limit, run_scale_sim

    node = plain(cfg.scale_sim)
    log.info(
        "scale_sim: %s at P=%s, ranks %s",
        ", ".join(node["models"]),
        node["world_sizes"],
        node["ranks"],
    )
    return run_scale_sim(
        node["models"],
        [int(p) for p in node["world_sizes"]],
        node["ranks"],
        node["strategies"],
        limits=[Limit.parse(limit) for limit in node["limits"]],
        hardware=str(node["hardware"]),
        paper=bool(node["paper"]),
        factor_method=node["factor_method"],
        out=Path(str(cfg.results_dir)),
    )


def factor_kernels_task(cfg: DictConfig) -> dict[str, Path]:
    """``task=factor_kernels``: the ``factor_kernels`` node's batch, repetitions and threads."""
    from experiments.bench.factor_kernels import run_factor_kernels

    node, out = cfg.factor_kernels, Path(str(cfg.results_dir))
    return run_factor_kernels(node.threads, node.batch, node.reps, out=out)


def write_rows(rows: list[dict[str, Any]], out_dir: Path, extra_csv: str | None = None) -> None:
    """``rows.json`` in the job folder, and optionally more lines of a CSV."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    if extra_csv:
        import pandas as pd

        path = Path(extra_csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(path, mode="a", header=not path.exists(), index=False)


def _summary(row: dict[str, Any]) -> str:
    if row.get("task") == "convergence_scale":
        return (
            f"{row['model']} {row['strategy']} P={row['world_size']} lr {row['lr']:.4g} seed "
            f"{row['seed']}: final test accuracy {row['final_acc']:.4f} (val "
            f"{row['final_val_acc']:.4f}), steps to {row['target']}: {row['steps_to_target']}, "
            f"{row['seconds']:.1f} s"
        )
    if row.get("task") == "convergence":
        return (
            f"{row['strategy']} P={row['world_size']}: final test accuracy "
            f"{row['final_acc']:.4f} after {row['epochs']} epochs ({row['seconds']:.1f} s)"
        )
    chosen = f" ({row['configuration']})" if row.get("configuration") else ""
    return (
        f"{row['model']} {row['strategy']}{chosen} P={row['world_size']} {row['setting']}: "
        f"iteration {row['iteration_s'] * 1e3:.1f} ms, K-FAC compute {row['compute_s'] * 1e3:.1f}"
        f" ms, comm {row['comm_s'] * 1e3:.1f} ms, second-order traffic "
        f"{row['bytes_second_order'] / 2**20:.2f} MiB, K-FAC memory "
        f"{row['mem_kfac'] / 2**20:.2f} MiB"
    )


@hydra.main(config_path=str(CONF_DIR), config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Measure one configuration and write its rows; failures are recorded, not fatal.

    A bad value stops the job with a one-line message (exit status 2), as in
    training. A job that fails while measuring (a rank crashing, a timeout)
    writes a row whose ``error`` column says why, so the rest of the sweep and
    the table still come out; the table writers list failed rows instead of
    dropping them. A ``task=fidelity``, ``factor_kernels`` or ``scale_sim`` job
    writes its table instead (:func:`run_table_task`) and fails as a whole.
    """
    from hydra.core.hydra_config import HydraConfig
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if cfg.task in TABLE_TASKS:  # a job that writes its table itself; failures are fatal
        try:
            paths = run_table_task(cfg)
        except ExperimentError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        log.info("table %s: %s", cfg.table_name, ", ".join(str(p) for p in paths.values()))
        return
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        rows = run(cfg, list(hydra_cfg.overrides.task), out_dir)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except SignalException:  # the user stopped the sweep: do not go on to the next job
        raise
    except Exception as err:  # recorded in the row; the table shows it
        log.exception("benchmark job failed")
        names = cfg.get("strategies") or [strategy_name(cfg.strategy)]
        message = first_line(err, "")[:300]
        model = cfg.workload.name
        if cfg.task in ("convergence", "convergence_scale"):  # a training preset
            model = cfg[cfg.task].experiment
        rows = [
            {
                "task": cfg.task,
                "model": model,
                "label": cfg.workload.label,
                "strategy": name,
                "world_size": int(cfg.world_size),
                "setting": cfg.setting.name,
                "error": f"{type(err).__name__}: {message}".rstrip(": "),
            }
            for name in names
        ]
    if int(os.environ.get("RANK", "0")) == 0:
        write_rows(rows, out_dir, cfg.out)
        for row in rows:
            log.info(row["error"] or _summary(row))


if __name__ == "__main__":
    main()
