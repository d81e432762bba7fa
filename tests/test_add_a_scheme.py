"""Adding a scheme is one module, one entry in CONFIGS and one yaml file (docs/design.md §9).

In a temporary copy of the package a new scheme is added: D-KFAC with each factor's
decomposition placed round-robin (A_i and G_i on consecutive ranks) and the published eager
factor averaging. Its module, one entry in ``CONFIGS`` and ``conf/strategy/<name>.yaml`` are
written; no other file is touched. Then, in a fresh interpreter on that copy:

* the configuration's name builds a preconditioner, which the base strategy runs (the scheme
  has no runtime class);
* two gloo ranks on different batches match one process on the concatenated batch (the
  D-KFAC equivalence of tests/test_strategies_equivalence.py), with the factors placed
  round-robin;
* the scale simulation finds every rank of an 8-rank job handing over exactly the bytes,
  calls and memory the cost model predicts for it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = "d_kfac_rr"

MODULE = '''
"""D-KFAC with round-robin decompositions and eager factor averaging: a scheme in one module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpkfac.plan.assignment import LayerShape, Placement
from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.plan.options import StrategyOptions


@dataclass(frozen=True)
class RoundRobinOptions(DKFACOptions):
    """d_kfac's options, eager by default (the published scheme)."""

    lazy_factor_sync: bool = False


class RoundRobinScheme(DKFACScheme):
    """Factor i of [A_0, G_0, A_1, ...] decomposed on rank i mod P."""

    name = "d_kfac_rr"
    Options = RoundRobinOptions

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        return Placement.per_factor([i % world_size for i in range(2 * len(shapes))])
'''

YAML = """\
# D-KFAC with each factor's decomposition placed round-robin, eager (dpkfac/plan/d_kfac_rr.py).
defaults:
  - d_kfac
  - _self_

name: d_kfac_rr
algorithm: d_kfac_rr
lazy_factor_sync: false
"""

SCRIPT = """
import os, sys
from pathlib import Path
import torch
import dpkfac
assert os.path.dirname(dpkfac.__file__) == os.path.join(sys.argv[1], "dpkfac"), dpkfac.__file__
from dpkfac.plan import SCHEMES
from dpkfac.plan.configs import CONFIGS
from dpkfac.strategies import strategy_class
from dpkfac.strategies.base import Strategy
from dist_utils import run_ranks
from strategy_cases import batch, concat_batch, make_model, max_rel_err, run

assert CONFIGS["d_kfac_rr"] == ("d_kfac_rr", {})

def make(model):
    return dpkfac.KFACPreconditioner(
        model, strategy="d_kfac_rr", damping=0.01, factor_decay=0.9, kl_clip=None, lr=0.1,
        collective_timeout=60.0,
    )

def rank_run(rank, world_size):
    model = make_model()
    pre = make(model)
    out = run(model, pre, [batch(s, rank) for s in range(3)])
    out["owners"] = [
        (layer.a_decomposer, layer.g_decomposer) for layer in pre.layers.values()
    ]
    out["runtime"] = type(pre.strategy).__mro__[1].__name__
    return out

from test_configs import yaml_mismatches
assert yaml_mismatches(CONFIGS, Path(sys.argv[1]) / "conf") == []  # the yaml says the same

results = run_ranks(rank_run, 2)
runtime = strategy_class("d_kfac_rr")  # asking for the name loads its module
assert "d_kfac_rr" in SCHEMES and runtime.__mro__[1] is Strategy
assert results[0]["runtime"] == "Strategy"
assert results[0]["owners"] == [(0, 1), (0, 1), (0, 1)], results[0]["owners"]
reference = make_model()
ref = run(reference, dpkfac.KFACPreconditioner(
    reference, strategy="d_kfac", damping=0.01, factor_decay=0.9, kl_clip=None, lr=0.1),
    [concat_batch(s, 2) for s in range(3)])
for step in range(3):
    err = max_rel_err(results[0]["params"][step], ref["params"][step])
    assert err < 1e-6, (step, err)
    for name, t in results[1]["params"][step].items():
        assert torch.equal(t, results[0]["params"][step][name]), (step, name)

from torch import nn
from experiments.bench.scale_sim import FakeModel, StrategyConfig, simulate

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))

model = FakeModel("small", lambda: (Small(), (torch.randn(3, 3, 8, 8),)))
ranks = simulate(model, StrategyConfig("d_kfac_rr", {"strategy": "d_kfac_rr"}), 8, range(8))
for r in ranks:
    assert r.match is True and r.calls_match is True, (r.rank, r.comm, r.predicted_comm)
    assert r.comm["factor_allreduce"]["bytes"] > 0 and r.comm["decomposition_broadcast"]["calls"]
print("accepted")
"""


def _copy(tmp: Path) -> Path:
    """The package and its Hydra configs, as a clean checkout has them, under ``tmp``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "dpkfac", tmp / "dpkfac", ignore=ignore)
    shutil.copytree(ROOT / "conf", tmp / "conf", ignore=ignore)
    return tmp


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.distributed
def test_a_new_scheme_is_one_module_one_config_and_one_yaml(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    before = _snapshot(root)
    (root / "dpkfac/plan" / f"{NAME}.py").write_text(textwrap.dedent(MODULE).lstrip())
    configs = root / "dpkfac/plan/configs.py"
    text = configs.read_text()
    anchor = '    "grouped_auto": ("grouped", {}),\n'
    assert anchor in text
    configs.write_text(text.replace(anchor, anchor + f'    "{NAME}": ("{NAME}", {{}}),\n'))
    (root / "conf/strategy" / f"{NAME}.yaml").write_text(YAML)
    after = _snapshot(root)
    added = sorted(set(after) - set(before))
    changed = sorted(k for k in before if before[k] != after.get(k))
    assert added == [f"conf/strategy/{NAME}.yaml", f"dpkfac/plan/{NAME}.py"]
    assert changed == ["dpkfac/plan/configs.py"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(ROOT), str(ROOT / "tests")]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("accepted")
