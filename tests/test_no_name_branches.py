"""No strategy name is compared as a string outside ``dpkfac/strategies``.

Code that needs to know what a strategy does asks the strategy class
(traits, placement, groups); tables and logs may *order* rows by a list of
names, which is not a comparison. This scans the source: comparisons (``==``,
``!=``, ``in``, ...) and ``startswith``/``endswith`` calls against a literal
strategy name, in any spelling, a strategy config's name, or the old "sgd".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dpkfac.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]


def _literals(node: ast.expr) -> list[object]:
    """Constants of an operand: a literal, or the elements of a literal collection."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def name_comparisons(paths: list[Path], names: set[str]) -> list[str]:
    """``file:line`` of every comparison of an operand with one of ``names``."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            operands: list[ast.expr] = []
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "endswith")
            ):
                operands = list(node.args)
            if any(c in names for op in operands for c in _literals(op)):
                where = path.relative_to(ROOT) if ROOT in path.parents else path
                found.append(f"{where}:{node.lineno}")
    return found


def _names(configs: bool) -> set[str]:
    """Strategy names in every spelling; with ``configs`` the Hydra strategy configs' too.

    The library knows no config names ("none" is a traits value there, the
    first-order config in the experiments).
    """
    keys = set(STRATEGIES)
    if configs:
        keys |= {p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")}
    return {n for key in keys for n in (key, key.replace("_", "-"))} | {"sgd"}


@pytest.mark.parametrize("package", ["dpkfac", "experiments"])
def test_no_strategy_name_is_compared_outside_the_strategies(package: str) -> None:
    strategies = ROOT / "dpkfac" / "strategies"
    paths = [p for p in sorted((ROOT / package).rglob("*.py")) if strategies not in p.parents]
    assert paths
    assert name_comparisons(paths, _names(configs=package == "experiments")) == []


def test_the_scan_finds_a_comparison(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text('def f(name):\n    return name == "d_kfac" or name.startswith("spd-kfac")\n')
    assert len(name_comparisons([bad], _names(configs=False))) == 2
