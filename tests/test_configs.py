"""The strategy configurations have one home, dpkfac/plan/configs.py, and every spelling reads it.

Python (``KFACPreconditioner(strategy=NAME)``), the cost model's command line, Hydra
(conf/strategy/NAME.yaml, which must set the same options) and the tables' ``strategy``
column. No other module lists them: a literal naming three or more configurations at
module level, or eight or more anywhere, fails :func:`test_no_configuration_list_outside_home`
unless it is a deliberate sample in :data:`SAMPLES` (a test's own choice of cases or a
table's own rows, which need no update when a configuration is added).
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import dpkfac
from dpkfac.costmodel.__main__ import main as costmodel_main
from dpkfac.costmodel.table import VARIANTS
from dpkfac.plan import configs, scheme_options
from experiments.bench import gpu_report, plots

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "dpkfac" / "plan" / "configs.py"
#: (file, top-level name) of literals that list configurations on purpose: samples, not lists.
SAMPLES = {
    ("experiments/bench/convergence_scale.py", "SGD"),  # its three roles: SGD, reference, baseline
    ("experiments/bench/gpu_report.py", "SIDE_BY_SIDE"),  # five measured on ResNet-32
    ("tests/strategy_cases.py", "STRATEGY_VARIANTS"),  # with test-sized options, + spd_kfac_local
    ("tests/strategy_cases.py", "REPLICATED_VARIANTS"),  # a property of those cases
    ("tests/test_scale_sim.py", "VARIANTS"),  # one of each kind, start-up measurements given
    ("tests/test_strategies_accounting.py", "VARIANTS"),
    ("tests/test_differential.py", "KINDS"),  # the fuzzer's kinds (scheme names among them)
    ("tests/test_plot_colors.py", "DRAWN"),
    ("tests/test_benchmark_tables.py", "ABLATION_KFAC"),  # the ablation table's rows
    ("tests/test_benchmark_tables.py", "ABLATION_ORDER"),
    ("tests/test_benchmark_run.py", "test_ablation_preset_states_every_switch"),
}


def yaml_mismatches(
    table: Mapping[str, tuple[str | None, Mapping[str, Any]]], conf: Path
) -> list[str]:
    """How conf/strategy/*.yaml (composed by Hydra) differs from ``table``."""
    files = {p.stem for p in (conf / "strategy").glob("*.yaml")}
    problems = [f"{n}: no conf/strategy/{n}.yaml" for n in table if n not in files]
    problems += [f"conf/strategy/{n}.yaml: not in {HOME.name}" for n in sorted(files - set(table))]
    common = {*OmegaConf.load(conf / "kfac" / "common.yaml"), "name", "algorithm"}
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for name in sorted(files & set(table)):
            node = OmegaConf.to_container(compose("config", [f"strategy={name}"]).strategy)
            assert isinstance(node, dict)
            scheme, preset = table[name]
            own = {k: v for k, v in node.items() if k not in common}
            if node.get("name") != name:
                problems.append(f"{name}.yaml: name {node.get('name')!r}")
            elif scheme is None or node.get("algorithm") != scheme:
                if scheme is not None or "_target_" in node:
                    problems.append(f"{name}.yaml: algorithm {node.get('algorithm')!r} != {scheme}")
            elif scheme_options(scheme, own) != scheme_options(scheme, preset):
                problems.append(f"{name}.yaml: {own} != {preset} (as {scheme}'s options)")
    return problems


def listings(names: set[str], root: Path, skip: Path) -> list[str]:
    """Literals under root's dpkfac/, experiments/ and tests/ that list configurations."""
    found = []
    for path in sorted(
        p for d in ("dpkfac", "experiments", "tests") for p in (root / d).rglob("*.py")
    ):
        if path == skip:
            continue
        tree = ast.parse(path.read_text())
        exempt = {
            id(node.args[1])
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "parametrize"
            and len(node.args) > 1
        }
        for stmt in tree.body:
            targets = getattr(stmt, "targets", None) or [getattr(stmt, "target", None)]
            names_in = (
                [n.id for n in ast.walk(targets[0]) if isinstance(n, ast.Name)]
                if targets[0]
                else []
            )
            top = getattr(stmt, "name", None) or next(iter(names_in), None)
            if (path.relative_to(root).as_posix(), top) in SAMPLES:
                continue
            least = 3 if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else 8
            for node in ast.walk(stmt):
                if id(node) in exempt or not isinstance(
                    node, (ast.Tuple, ast.List, ast.Set, ast.Dict)
                ):
                    continue
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                listed = {
                    i.value for i in items if isinstance(i, ast.Constant) and i.value in names
                }
                if len(listed) >= least:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {sorted(listed)}")
    return found


def test_hydra_configs_equal_the_python_ones() -> None:
    assert yaml_mismatches(configs.CONFIGS, ROOT / "conf") == []


def test_no_configuration_list_outside_home() -> None:
    assert listings(set(configs.CONFIGS), ROOT, HOME) == []


def test_a_configuration_added_to_a_copy_of_the_home_passes_the_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adding one touches the home and its yaml; the checks name what is missing or listed."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    table = {**configs.CONFIGS, "dp_kfac_rr": ("dp_kfac", {"assignment": "round_robin"})}
    monkeypatch.setattr(configs, "CONFIGS", table)
    assert yaml_mismatches(configs.CONFIGS, conf) == [
        "dp_kfac_rr: no conf/strategy/dp_kfac_rr.yaml"
    ]
    text = "defaults:\n  - dp_kfac\n  - _self_\n\nname: dp_kfac_rr\nassignment: lpt\n"
    (conf / "strategy" / "dp_kfac_rr.yaml").write_text(text)
    assert len(yaml_mismatches(configs.CONFIGS, conf)) == 1  # the assignment differs
    (conf / "strategy" / "dp_kfac_rr.yaml").write_text(text.replace("lpt", "round_robin"))
    assert yaml_mismatches(configs.CONFIGS, conf) == []
    assert configs.resolve("dp_kfac_rr", {}) == ("dp_kfac", {"assignment": "round_robin"})
    # a list of configurations elsewhere is found; the home itself is not
    for d in ("dpkfac", "experiments", "tests"):
        (tmp_path / d).mkdir()
    shutil.copy(HOME, tmp_path / "dpkfac" / "configs.py")
    (tmp_path / "tests" / "test_x.py").write_text('CASES = ("dp_kfac", "d_kfac", "dp_kfac_rr")\n')
    assert listings(set(table), tmp_path, tmp_path / "dpkfac" / "configs.py") == [
        "tests/test_x.py:1: ['d_kfac', 'dp_kfac', 'dp_kfac_rr']"
    ]


def test_readers_take_the_list_from_the_home() -> None:
    kfac = configs.kfac_configs()
    assert list(configs.CONFIGS) == plots.STRATEGY_ORDER
    assert set(configs.BASELINES) | {configs.REFERENCE} <= set(kfac)
    assert list(VARIANTS) == list(kfac) == list(gpu_report.CHECKED)


@pytest.mark.parametrize("name", ["dp_kfac_owner", "DP-KFAC-owner", "kaisa_mem_opt"])
def test_costmodel_command_line_reads_configuration_names(name: str, capsys) -> None:
    costmodel_main(["table", "--format", "csv", "--models", "resnet32", "--strategies", name])
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and rows[1].split(",")[1] == name.lower().replace("-", "_")


def test_table_rows_are_spelled_as_the_configurations() -> None:
    from dpkfac.costmodel import predicted_table
    from dpkfac.costmodel.zoo import ZOO

    rows = predicted_table({"resnet32": ZOO["resnet32"]}, world_size=8)
    assert [r["strategy"] for r in rows] == list(configs.kfac_configs())


def test_resolve_gives_the_scheme_and_options_explicit_ones_winning() -> None:
    assert configs.resolve("dp_kfac_owner", {"overlap": True}) == (
        "dp_kfac",
        {"grad_reduction": "owner", "overlap": True},
    )
    assert configs.resolve("kaisa", {}) == ("kaisa", {})  # a scheme name passes through
    with pytest.raises(ValueError, match="no preconditioner"):
        configs.resolve("none", {})


def test_python_reads_configuration_names() -> None:
    from torch import nn

    pre = dpkfac.KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), strategy="dp_kfac_owner")
    assert pre.strategy.options.grad_reduction == "owner"
    # Explicit options win over the configuration's; any spelling reads.
    pre = dpkfac.KFACPreconditioner(
        nn.Sequential(nn.Linear(3, 2)), strategy="DP-KFAC-owner", grad_reduction="allreduce"
    )
    assert pre.strategy.options.grad_reduction == "allreduce"
    with pytest.raises(ValueError, match="'none'"):
        dpkfac.KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), strategy="none")
