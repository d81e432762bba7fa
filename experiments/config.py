"""Checks on the composed configuration, and the error type for user mistakes.

Hydra already rejects unknown group options (``strategy=nope``) and unknown keys
with a short message. Values it cannot judge (``trainer.max_steps=-3``, a damping
of zero, an unknown ``compute_method`` or ``assignment``) are checked here before
anything is built, so a bad override costs a second, not a crashed run an hour
later, and the message names the key and the value.

The ``strategy`` node is checked by the library itself: its values build
:class:`dpkfac.options.KFACOptions` and the strategy's own options dataclass
(:func:`dpkfac.strategies.strategy_options`), the same objects the
preconditioner builds, so what passes here is what the preconditioner accepts,
in the library's words. Both entry points use these checks.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from experiments.errors import ExperimentError
from experiments.preconditioning import UPDATE_INTERVALS, node_options, uses_preconditioner
from experiments.schedules import build_step_schedules


def plain(node: Any) -> Any:
    """A config node as plain Python containers (resolved); anything else as it is."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def first_line(err: BaseException, default: str | None = None) -> str:
    """An exception's first line, for a one-line message (``default``, or the exception's
    type name, when it has no text)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else (type(err).__name__ if default is None else default)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _positive(value: Any) -> bool:
    return _is_number(value) and value > 0


def _non_negative(value: Any) -> bool:
    return _is_number(value) and value >= 0


def _rank_spec(value: Any) -> bool:
    return _is_int(value) or value == "middle"


def _factor_methods() -> tuple[str, ...]:
    from dpkfac.curvature.factors import FACTOR_METHODS

    return tuple(FACTOR_METHODS)


#: key -> (check, what a valid value is)
Checks = dict[str, tuple[Callable[[Any], bool], str]]

_TRAINING: Checks = {
    "seed": (_is_int, "an integer"),
    "trainer.max_epochs": (_positive_int, "a positive integer"),
    "trainer.max_steps": (_optional(_positive_int), "a positive integer or null"),
    "trainer.eval_every_epochs": (_positive_int, "a positive integer"),
    "trainer.eval_every_steps": (_optional(_positive_int), "a positive integer or null"),
    "trainer.log_every_steps": (_positive_int, "a positive integer"),
    "trainer.checkpoint_every_steps": (_optional(_positive_int), "a positive integer or null"),
    "trainer.keep_checkpoints": (_positive_int, "a positive integer"),
    "trainer.dist_timeout_s": (_positive, "a positive number of seconds"),
    "trainer.accumulate_grad_batches": (_positive_int, "a positive integer"),
    "trainer.max_grad_norm": (_optional(_positive), "a positive number or null"),
    "trainer.precision": (lambda v: v in PRECISIONS, "32, bf16 or fp16"),
    "trainer.threads": (lambda v: v == "auto" or _positive_int(v), "auto or a positive integer"),
    "trainer.loop": (lambda v: v in ("project", "hf"), "project or hf"),
    "data.batch_size": (_positive_int, "a positive integer"),
    "data.eval_batch_size": (_positive_int, "a positive integer"),
    "data.num_workers": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "optimizer.lr": (_positive, "a positive number"),
    "optimizer.weight_decay": (_optional(_non_negative), "a non-negative number"),
}


@dataclass(frozen=True)
class Table:
    """One results table, ``results/<name>.*``, and the function that writes it.

    ``kind``: ``measured`` (a sweep's rows, ``writer(rows, out)``: conf/table/<name>.yaml's
    callback, or ``python -m experiments.bench.tables <name>`` from results/raw/<name>.csv),
    ``predicted`` (``writer(out)``: nothing measured) or ``task`` (one benchmark job,
    ``task=<name>``, runs and writes it: ``writer(cfg)``). ``writer``: ``module:function``,
    imported when the table is written. ``shown`` (how results/README.md calls the
    numbers: measured, predicted, simulated) and ``what`` (one sentence): its line there, if any.
    """

    name: str
    kind: str
    writer: str
    shown: str = ""
    what: str = ""
    command: str = ""  # where its runs are not one sweep's (the convergence study's driver)

    def write(self, *args: Any) -> dict[str, Path]:
        module, function = self.writer.split(":")
        result: dict[str, Path] = getattr(importlib.import_module(module), function)(*args)
        return result

    @property
    def recipe(self) -> str:
        """The command that writes it."""
        if self.command:
            return self.command
        if self.kind == "predicted":
            return f"python -m experiments.bench.tables {self.name}"
        sweep = "-m " if self.kind == "measured" else ""
        return f"python -m experiments.bench {sweep}table={self.name}"


_TABLES = "experiments.bench.tables:write_"
#: Every table, in results/README.md's order (docs/reproduction.md, "How to add a table").
TABLES = {
    t.name: t
    for t in (
        Table(
            "second_order_update",
            "measured",
            _TABLES + "second_order_update",
            "measured",
            "Cost of one second-order update per strategy (compute, bytes, K-FAC memory), "
            "DP-KFAC against the baselines, six models.",
        ),
        Table(
            "ablation",
            "measured",
            _TABLES + "ablation",
            "measured + predicted",
            "From D-KFAC to DP-KFAC one switch at a time, every strategy config interleaved at "
            "P=2, beside the cost model's prediction at P=64 on V100/InfiniBand.",
        ),
        Table(
            "time_breakdown",
            "measured",
            _TABLES + "time_breakdown",
            "measured",
            "One iteration split into its phases per strategy (the stacked bars).",
        ),
        Table(
            "scaling",
            "measured",
            _TABLES + "scaling",
            "measured + predicted",
            "Iteration time at P=1, 2, 4 and predicted to 256; the cost model's per-phase error "
            "with the predicted world size held out (scaling_errors.csv).",
        ),
        Table(
            "network",
            "measured",
            "experiments.bench.network_table:write_network",
            "measured + predicted",
            "SGD and every K-FAC config on an emulated cluster network (a namespace per rank, "
            "links shaped to 1 Gbit/s and one more rate), exposed and hidden communication, "
            "against each config's floor and the cost model's prediction from the job's own "
            "probes.",
        ),
        Table(
            "convergence",
            "measured",
            _TABLES + "convergence",
            "measured",
            "Test accuracy per epoch on scikit-learn digits (the default preset) per strategy "
            "and P, and the smoke status of every training preset.",
        ),
        Table(
            "convergence_scale",
            "measured",
            "experiments.bench.convergence_scale:write_convergence_scale",
            "measured",
            "Steps to a target test accuracy as P grows (MNIST-1D and digits, ranks as threads "
            "of one process), every configuration tuned by one protocol (learning rate, "
            "damping, seeds); paired dp_kfac/d_kfac verdicts and time to target against SGD.",
            command="python -m experiments.bench.tune",
        ),
        Table(
            "fidelity",
            "task",
            "experiments.bench.run:fidelity_task",
            "measured",
            "Cosine between the update from an owner's local factors and the one from all "
            "ranks' factors, per layer over training steps.",
        ),
        Table("factor_kernels", "task", "experiments.bench.run:factor_kernels_task"),
        Table(
            "paper",
            "predicted",
            "experiments.bench.paper:write_paper",
            "predicted",
            "The DP-KFAC paper's headline ratios predicted at P=64 on V100/InfiniBand for the "
            "paper-size models.",
        ),
        Table(
            "scale_sim",
            "task",
            "experiments.bench.run:scale_sim_task",
            "simulated",
            "One rank of a P=64-1024 job on torch's fake process group: its bytes, calls and "
            "memory against the cost model's, exactly.",
        ),
    )
}
#: What a benchmark job does: the first three write benchmark rows (a table preset's callback
#: turns a sweep's rows into its table); the others are the jobs of the ``task`` tables.
ROW_TASKS = ("timing", "convergence", "convergence_scale")
TABLE_TASKS = tuple(name for name, t in TABLES.items() if t.kind == "task")
TASKS = (*ROW_TASKS, *TABLE_TASKS)
#: Values of ``trainer.precision`` (Hydra reads a bare 32 as an int).
PRECISIONS = (32, "32", "bf16", "fp16")

_BENCHMARK: Checks = {
    "seed": (_is_int, "an integer"),
    "task": (lambda v: v in TASKS, ", ".join(TASKS[:-1]) + " or " + TASKS[-1]),
    "world_size": (_positive_int, "a positive integer"),
    "warmup": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "steps": (_positive_int, "a positive integer"),
    "threads": (_positive_int, "a positive integer"),
    "timeout_s": (_positive, "a positive number of seconds"),
    "lr": (_positive, "a positive number"),
    "trace": (lambda v: isinstance(v, bool), "true or false"),
    "probes": (lambda v: isinstance(v, bool), "true or false"),
    "isolate_comm": (lambda v: isinstance(v, bool), "true or false"),
    "setting.factor_update_steps": (_positive_int, "a positive integer"),
    "setting.inv_update_steps": (_positive_int, "a positive integer"),
    "fidelity.every": (_positive_int, "a positive integer"),
    "fidelity.timeout_s": (_positive, "a positive number of seconds"),
    "factor_kernels.batch": (_positive_int, "a positive integer"),
    "factor_kernels.reps": (_positive_int, "a positive integer"),
    "factor_kernels.threads": (
        lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(_positive_int(t) for t in v),
        "a non-empty list of positive integers",
    ),
    "scale_sim.world_sizes": (
        lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(_positive_int(p) for p in v),
        "a non-empty list of positive integers",
    ),
    "scale_sim.ranks": (
        lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(_rank_spec(r) for r in v),
        'a non-empty list of ranks: integers (negative: from the end) or "middle"',
    ),
    "scale_sim.paper": (lambda v: isinstance(v, bool), "true or false"),
    "scale_sim.factor_method": (
        lambda v: v is None or v in _factor_methods(),
        "null or a factor_method of dpkfac (dpkfac.curvature.factors.FACTOR_METHODS)",
    ),
}


def _check_values(cfg: DictConfig, checks: Checks) -> None:
    for key, (check, allowed) in checks.items():
        node: Any = cfg
        present = True
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in node:
                present = False
                break
            node = node[part]
        if present and not check(node):
            raise ExperimentError(f"invalid value {key}={node!r}: expected {allowed}")


def _culprit(message: str, values: Mapping[str, Any]) -> str | None:
    """The first option a library message mentions (for checks across options)."""
    mentioned = [
        (match.start(), key)
        for key in values
        if (match := re.search(rf"\b{re.escape(key)}\b", message)) is not None
    ]
    return min(mentioned)[1] if mentioned else None


def _build_each(
    build: Callable[[dict[str, Any]], Any], values: dict[str, Any], prefix: str
) -> None:
    """Build the options one value at a time, then all together; name what fails.

    One value at a time pins a bad value to its key whatever the library's
    message says; the final build catches rules that join several options.
    """
    for key, value in values.items():
        try:
            build({key: value})
        except (TypeError, ValueError) as err:
            raise ExperimentError(f"invalid value {prefix}.{key}={value!r}: {err}") from None
    try:
        build(values)
    except (TypeError, ValueError) as err:
        key = _culprit(str(err), values) or next(iter(values))
        raise ExperimentError(f"invalid value {prefix}.{key}={values[key]!r}: {err}") from None


def validate_strategy(node: DictConfig, prefix: str = "strategy") -> None:
    """Check a ``strategy`` node with the library's option dataclasses.

    Values that are ``_target_`` nodes (schedules of the step) are built, with a
    placeholder of one step per epoch, and checked by their value at step 0; the
    first-order baseline (no ``_target_``) has nothing to check.

    Args:
        node: The strategy config node.
        prefix: Its key, for messages.

    Raises:
        ExperimentError: Naming the offending key, its value and the library's reason.
    """
    from dpkfac.options import KFACOptions
    from dpkfac.plan import SCHEMES
    from dpkfac.strategies import canonical_name, strategy_options

    name = node.get("name")
    if not isinstance(name, str) or not name:
        raise ExperimentError(f"invalid value {prefix}.name={name!r}: expected a config name")
    if not uses_preconditioner(node):
        return
    algorithm = node.get("algorithm")
    try:
        algorithm = canonical_name(algorithm)
    except ValueError as err:  # the library's words: the closest name, the spelling rule
        raise ExperimentError(f"invalid value {prefix}.algorithm={algorithm!r}: {err}") from None
    except TypeError:
        raise ExperimentError(
            f"invalid value {prefix}.algorithm={algorithm!r}: expected one of {sorted(SCHEMES)}"
        ) from None
    options = node_options(node)
    try:
        schedules = build_step_schedules(options, steps_per_epoch=1)
    except ValueError as err:
        key, _, reason = str(err).partition(": ")
        raise ExperimentError(f"invalid value {prefix}.{key}={options[key]!r}: {reason}") from None
    for key, schedule in schedules.items():
        try:
            options[key] = schedule(0)
        except Exception as err:  # a user's target may fail in any way
            raise ExperimentError(
                f"invalid value {prefix}.{key}: its schedule fails at step 0 ({err})"
            ) from None
    common_keys = {f.name for f in fields(KFACOptions)}
    common = {k: v for k, v in options.items() if k in common_keys}
    own = {k: v for k, v in options.items() if k not in common_keys}
    _build_each(lambda values: KFACOptions(**values), common, prefix)
    # An unknown key lands among the strategy's own options; the message names the common
    # ones too, since a misspelt common option (dampening) is the likelier mistake.
    _build_each(lambda values: strategy_options(algorithm, values, common=common_keys), own, prefix)


#: The Hydra tree of both entry points.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a primary config of ``conf/``, inside a running Hydra app or not.

    Inside ``python -m experiments.bench`` Hydra is already initialised on
    ``conf/``; elsewhere (tests, notebooks) the tree is opened for the call.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides=list(overrides))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


#: Config groups whose keys are fixed by their files in conf/ (``+key`` additions refused).
STRICT_GROUPS = ("trainer", "data", "logger", "paths", "launcher", "network")


def known_keys(group: str) -> set[str]:
    """Every key the files of ``conf/<group>/`` define (the group's schema).

    A group's options may define different keys (the datasets do): a key is
    known if any option of the group defines it.
    """
    keys: set[str] = set()
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        if isinstance(node, DictConfig):
            keys |= {str(k) for k in node if k != "defaults"}
    return keys


def check_keys(cfg: DictConfig, groups: Sequence[str] = STRICT_GROUPS) -> None:
    """Refuse keys no file of their group defines (``+trainer.max_epoch=2``, a typo).

    Hydra refuses an unknown key without ``+``, but accepts it with one, and the
    run would then ignore it silently.

    Raises:
        ExperimentError: Naming the key, with the closest known ones.
    """
    import difflib

    for group in groups:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        known = known_keys(group)
        for key in node:
            if str(key) in known:
                continue
            close = difflib.get_close_matches(str(key), sorted(known), n=3)
            hint = f"; did you mean {', '.join(f'{group}.{c}' for c in close)}?" if close else ""
            raise ExperimentError(
                f"unknown key {group}.{key} (no config of conf/{group}/ defines it){hint}"
            )


def validate(cfg: DictConfig) -> None:
    """Reject training values that would fail, or silently misbehave, later.

    Args:
        cfg: The composed configuration of ``experiments.train``.

    Raises:
        ExperimentError: Naming the first offending key, its value and what is allowed.
    """
    check_keys(cfg)
    _check_values(cfg, _TRAINING)
    validate_strategy(cfg.strategy)
    resume = cfg.trainer.get("resume")
    if resume is not None and not isinstance(resume, str):
        raise ExperimentError(
            f"invalid value trainer.resume={resume!r}: expected auto, a path or null"
        )
    validate_launcher(cfg)


#: Values of ``launcher.name`` (conf/launcher/).
LAUNCHERS = ("torchrun", "threads")


def launcher_name(cfg: DictConfig) -> str:
    """``launcher.name``: how the run's ranks start (``torchrun`` when the group is absent)."""
    launcher = cfg.get("launcher") or {}
    return str(launcher.get("name", "torchrun"))


def validate_launcher(cfg: DictConfig) -> None:
    """Check the ``launcher`` group: how the ranks of a training run are started.

    ``threads`` (experiments/threads.py) runs every rank in this process: it
    needs a positive ``launcher.world_size``, the CPU (its process group moves
    CPU tensors) and loaders without worker processes (forking a process whose
    other threads are mid-run is not safe, and P ranks would fork P pools).

    Raises:
        ExperimentError: Naming the key, its value and what is allowed.
    """
    launcher = cfg.get("launcher") or {}
    name = launcher_name(cfg)
    if name not in LAUNCHERS:
        raise ExperimentError(f"invalid value launcher.name={name!r}: expected torchrun or threads")
    world_size = launcher.get("world_size")
    if name == "torchrun":
        if world_size is not None:
            raise ExperimentError(
                f"launcher.world_size={world_size} is the rank count of launcher=threads; "
                "with torchrun the ranks are --nproc_per_node (and --nnodes)"
            )
        return
    if not _positive_int(world_size):
        raise ExperimentError(
            f"invalid value launcher.world_size={world_size!r}: expected a positive integer"
        )
    device = str(cfg.trainer.get("device", "auto"))
    if device not in ("auto", "cpu"):
        raise ExperimentError(
            f"trainer.device={device} with launcher=threads: its ranks share this process "
            "and its process group moves CPU tensors; use trainer.device=cpu (or auto)"
        )
    workers = cfg.data.get("num_workers", 0)
    if workers:
        raise ExperimentError(
            f"data.num_workers={workers} with launcher=threads: each rank would fork its own "
            "loader processes from a process whose other threads are running; use "
            "data.num_workers=0"
        )


def validate_benchmark(cfg: DictConfig) -> None:
    """Reject benchmark values that would fail, or silently misbehave, later.

    Args:
        cfg: The composed configuration of ``python -m experiments.bench``.

    Raises:
        ExperimentError: Naming the first offending key, its value and what is allowed;
            also a strategy's update interval that contradicts the setting's
            (:func:`check_update_intervals`).
    """
    _check_values(cfg, _BENCHMARK)
    strategies = cfg.get("strategies")
    if strategies is not None:
        if isinstance(strategies, str) or not all(isinstance(s, str) for s in strategies):
            raise ExperimentError(
                f"invalid value strategies={strategies!r}: expected a list of strategy configs"
            )
        if cfg.task != "timing":
            raise ExperimentError(
                f"invalid value strategies={list(strategies)!r}: interleaved strategies are "
                "for task=timing only"
            )
    if cfg.task == "fidelity":
        _check_fidelity_runs(cfg.fidelity)
    if cfg.task == "scale_sim":
        _check_scale_sim(cfg.scale_sim)
    if cfg.task == "convergence_scale":
        _check_convergence_scale(cfg.convergence_scale)
    validate_strategy(cfg.strategy)
    if cfg.task == "timing":
        check_update_intervals(cfg.strategy, cfg.setting)


def check_update_intervals(
    strategy: DictConfig, setting: DictConfig, prefix: str = "strategy"
) -> None:
    """Refuse update intervals of a strategy config that the benchmark's setting contradicts.

    The benchmark's update intervals are its ``setting``'s
    (``setting.factor_update_steps``, ``setting.inv_update_steps``). A strategy
    node leaves them null (``conf/kfac/common.yaml``): not set, the setting
    decides. A value set by a strategy config, by the common K-FAC config or on
    the command line is explicit: equal to the setting's it is accepted,
    different it is refused rather than silently replaced.

    Args:
        strategy: The strategy config node.
        setting: The setting node.
        prefix: The strategy node's key, for messages.

    Raises:
        ExperimentError: Naming both values and the ways out.
    """
    for key in UPDATE_INTERVALS:
        value = strategy.get(key)
        if value is None:
            continue
        wanted = setting.get(key)
        if _is_int(value) and value == wanted:
            continue
        shown = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
        through = "setting=<name> of conf/setting/" + (
            f" or setting.{key}={value}" if _positive_int(value) else ""
        )
        raise ExperimentError(
            f"invalid value {prefix}.{key}={shown!r}: the benchmark takes its update intervals "
            f"from setting={setting.get('name')}, where setting.{key}={wanted!r}; drop the "
            f"strategy's value (leave it null) or ask for that interval through the setting "
            f"({through})"
        )


def _check_scale_sim(node: DictConfig) -> None:
    """``scale_sim``: known workloads, strategy configs and hardware preset; valid limits."""
    from dpkfac.plan.presets import PRESETS

    def names(group: str) -> list[str]:
        return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))

    def listed(key: str, allowed: list[str], value: Any, empty: bool = False) -> list[str]:
        if (
            not isinstance(value, ListConfig)
            or (not value and not empty)
            or not all(v in allowed for v in value)
        ):
            shown = list(value) if isinstance(value, ListConfig) else value
            raise ExperimentError(
                f"invalid value scale_sim.{key}={shown!r}: expected a "
                f"{'' if empty else 'non-empty '}list of {allowed}"
            )
        return [str(v) for v in value]

    listed("models", names("workload"), node.get("models"))
    strategies = names("strategy")
    if node.get("strategies") is not None:
        listed("strategies", strategies, node.get("strategies"))
    if node.get("hardware") not in PRESETS:
        raise ExperimentError(
            f"invalid value scale_sim.hardware={node.get('hardware')!r}: expected one of "
            f"{sorted(PRESETS)}"
        )
    limits = node.get("limits")
    if not isinstance(limits, ListConfig):
        raise ExperimentError(f"invalid value scale_sim.limits={limits!r}: expected a list")
    for i, limit in enumerate(limits):
        key = f"limits[{i}]"
        keys = {"world_size", "strategies", "exclude", "ranks"}
        if not isinstance(limit, DictConfig) or not set(limit) <= keys or "world_size" not in limit:
            raise ExperimentError(
                f"invalid value scale_sim.{key}={limit!r}: expected "
                "{world_size: P, strategies: [...] or null, exclude: [...], ranks: [...] or null}"
            )
        if not _positive_int(limit.world_size):
            raise ExperimentError(
                f"invalid value scale_sim.{key}.world_size={limit.world_size!r}: "
                "expected a positive integer"
            )
        if limit.get("strategies") is not None:
            listed(f"{key}.strategies", strategies, limit.strategies, empty=True)
        if limit.get("exclude") is not None:
            listed(f"{key}.exclude", strategies, limit.exclude, empty=True)
        ranks = limit.get("ranks")
        if ranks is not None and not (
            isinstance(ranks, ListConfig) and all(_rank_spec(r) for r in ranks)
        ):
            raise ExperimentError(
                f"invalid value scale_sim.{key}.ranks={ranks!r}: expected a list of ranks "
                '(integers, negative from the end, or "middle") or null'
            )


def _check_convergence_scale(node: DictConfig) -> None:
    """``convergence_scale``: a known preset with a target, positive sizes and rates, a
    known hardware preset, and limits keyed as the sweep needs them.

    Checked before a job trains: a typo in a sweep of hundreds of runs should cost a
    second, not the first run's minutes.
    """
    from dpkfac.plan.configs import kfac_configs
    from dpkfac.plan.presets import PRESETS

    def bad(key: str, expected: str) -> ExperimentError:
        value = node.get(key)
        shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        return ExperimentError(
            f"invalid value convergence_scale.{key}={shown!r}: expected {expected}"
        )

    presets = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    if node.get("experiment") not in presets:
        raise bad("experiment", f"one of {presets}")
    checks: Checks = {
        "batch_size": (_positive_int, "a positive integer"),
        "base_batch": (lambda v: v is None or _positive_int(v), "null or a positive integer"),
        "base_lr": (lambda v: v is None or _positive(v), "null or a positive number"),
        "lr_multiplier": (_positive, "a positive number"),
        "fidelity_every": (lambda v: _is_int(v) and v >= 0, "a non-negative integer (0: off)"),
    }
    for key, (check, expected) in checks.items():
        if not check(node.get(key)):
            raise bad(key, expected)
    if node.get("hardware") not in PRESETS:
        raise bad("hardware", f"one of {sorted(PRESETS)}")
    targets = node.get("targets")
    target = targets.get(node.experiment) if isinstance(targets, DictConfig) else None
    pair = list(target) if isinstance(target, ListConfig) else [target, target]
    if not (len(pair) == 2 and all(_is_number(t) for t in pair) and 0 < pair[0] <= pair[1] <= 1):
        raise bad("targets", f"a test accuracy in (0, 1], or [low, high], for {node.experiment}")
    for key in ("damping", "evals_per_epoch"):
        if not (node.get(key) is None or _positive(node.get(key))):
            raise bad(key, "null or a positive number")
    limits = node.get("max_world_size")
    if (limits is not None and not isinstance(limits, DictConfig)) or not all(
        str(k) in presets and _positive_int(v) for k, v in (limits or {}).items()
    ):
        raise bad("max_world_size", "null or a mapping of experiment presets to positive P")
    kfac = sorted(kfac_configs())
    if node.get("one_rank_kfac") not in (None, *kfac):
        raise bad("one_rank_kfac", f"null or a K-FAC strategy config, one of {kfac}")
    same = node.get("same_step")
    if (same is not None and not isinstance(same, DictConfig)) or not all(
        k in kfac and v in kfac and k != v for k, v in (same or {}).items()
    ):
        raise bad("same_step", f"null or a mapping between two different configs of {kfac}")
    if not isinstance(node.get("overrides"), ListConfig):
        raise bad("overrides", "a list of training overrides")


def _check_fidelity_runs(node: DictConfig) -> None:
    """``fidelity.runs``: known runs, each with a positive number of ``fidelity.steps``."""
    from experiments.bench.fidelity import RUNS

    runs = node.get("runs")
    if not isinstance(runs, ListConfig) or not runs or not all(r in RUNS for r in runs):
        shown = list(runs) if isinstance(runs, ListConfig) else runs
        raise ExperimentError(
            f"invalid value fidelity.runs={shown!r}: expected a non-empty list of {sorted(RUNS)}"
        )
    steps = node.get("steps")
    for run in runs:
        value = steps.get(run) if isinstance(steps, DictConfig) else None
        if not _positive_int(value):
            raise ExperimentError(
                f"invalid value fidelity.steps.{run}={value!r}: expected a positive integer"
            )
