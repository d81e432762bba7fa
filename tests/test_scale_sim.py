"""Scale by simulation (experiments.bench.scale_sim): ranks of large jobs, one per process run.

Each rank of a P-rank job (P = 64, 256, 1024) runs its real construction and
steps on torch's fake process group with the harness model on fake CUDA
tensors; the bytes it hands to collectives, its K-FAC memory and the one-time
traffic must equal the cost model's prediction for that rank exactly, for
every kind of strategy. Then the benchmark mode (``table=scale_sim``) on a toy
config: its dispatch, its files and its checks.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

from experiments.bench.run import compose_config, run_table_task
from experiments.bench.scale_sim import (
    FakeModel,
    StrategyConfig,
    kfac_strategies,
    resolve_ranks,
    run_arguments,
    simulate,
)
from experiments.config import ExperimentError

#: One of each strategy kind, with every start-up measurement given (nothing is measured).
VARIANTS: dict[str, dict[str, Any]] = {
    "dp_kfac": {"strategy": "dp_kfac", "grad_reduction": "allreduce"},
    "dp_kfac_owner": {"strategy": "dp_kfac", "grad_reduction": "owner"},
    "dp_kfac_owner_overlap": {"strategy": "dp_kfac", "grad_reduction": "owner", "overlap": True},
    "d_kfac": {"strategy": "d_kfac"},
    "spd_kfac": {
        "strategy": "spd_kfac",
        "hardware": "v100_ib100",
        "comm_alpha": 2e-5,
        "comm_beta": 1e-10,
    },
    "kaisa_quarter": {"strategy": "kaisa", "grad_worker_fraction": 0.25},
    "grouped_k4_half": {"strategy": "grouped", "factor_group_size": 4, "grad_worker_fraction": 0.5},
}


class Small(nn.Module):
    """Three K-FAC layers: a 3x3 convolution, a strided 1x1 one without bias, a Linear head.

    The cost model prices every rank of P (O(P^2) per layer at P=1024), so the model
    is smaller than the harness's ResNetLike to keep the test at P=1024 fast.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 6, 1, stride=2, bias=False)
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.conv(x)))).mean((2, 3)))


@pytest.fixture(scope="module")
def model() -> FakeModel:
    return FakeModel("small", lambda: (Small(), (torch.randn(3, 3, 8, 8),)))


@pytest.mark.parametrize("world_size", [64, 256, 1024])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_simulated_ranks_hand_over_the_predicted_bytes(
    model: FakeModel, variant: str, world_size: int
) -> None:
    ranks = resolve_ranks([0, 5, -1], world_size)
    results = simulate(model, StrategyConfig(variant, VARIANTS[variant]), world_size, ranks)
    assert [r.rank for r in results] == ranks
    for r in results:
        where = f"{variant} rank {r.rank} of {world_size}"
        assert r.note == "", where  # every option given: nothing filled in
        assert r.comm == r.predicted_comm, where
        assert r.memory == r.predicted_memory, where
        assert r.setup == r.predicted_setup, where
        assert r.match is True and r.calls_match is True and r.measured_step >= 1, where
        assert r.comm["grad_allreduce"]["bytes"] + r.comm["precond_broadcast"]["bytes"] > 0
        for seconds in (r.pg_s, r.construct_s, r.first_step_s, r.step_s, r.predict_s):
            assert math.isfinite(seconds) and seconds >= 0, where
    # The busiest of the simulated ranks holds K-FAC state.
    assert max(sum(r.memory.values()) for r in results) > 0


def test_a_combination_that_cannot_run_is_a_row_with_the_reason(model: FakeModel) -> None:
    config = StrategyConfig("kaisa_bad", {"strategy": "kaisa", "grad_worker_fraction": 0.3})
    (result,) = simulate(model, config, 64, [3])
    assert result.match is None and result.calls_match is None and not result.comm
    assert result.note.startswith("cannot run at P=64: grad_worker_fraction=0.3")
    row = result.row()
    assert row["match"] == "" and row["world_size"] == 64 and row["rank"] == 3


def test_start_up_measurements_are_replaced_by_the_preset() -> None:
    kwargs, notes = run_arguments(StrategyConfig("spd", {"strategy": "spd_kfac"}), 256)
    options = kwargs["strategy"]
    assert options.hardware is not None and options.fixed_comm_model
    assert notes == [
        "hardware: v100_ib100 (not measured)",
        "comm model: v100_ib100 all-reduce at P=256 (not measured)",
    ]
    kwargs, notes = run_arguments(StrategyConfig("dp", {"strategy": "dp_kfac", "damping": 0.01}), 8)
    assert notes == [] and kwargs["damping"] == 0.01


def test_ranks_are_read_from_the_end_and_the_middle() -> None:
    assert resolve_ranks([0, 5, "middle", -1], 8) == [0, 4, 5, 7]
    assert resolve_ranks([0, 5, "middle", -1], 2) == [0, 1]
    assert resolve_ranks([9, -9], 8) == []


def test_every_k_fac_config_and_no_other_is_simulated_by_default() -> None:
    names = kfac_strategies()
    assert "dp_kfac" in names and "grouped_auto" in names and "none" not in names
    assert len(names) == len(list((Path(__file__).parents[1] / "conf/strategy").glob("*.yaml"))) - 1


def test_the_table_task_writes_both_tables(tmp_path: Path) -> None:
    """``table=scale_sim`` on a toy config: the tiny MLP at its CPU size, P = 4 and 8."""
    cfg = compose_config(
        "benchmark",
        [
            "table=scale_sim",
            "scale_sim.models=[mlp]",
            "scale_sim.paper=false",
            "scale_sim.world_sizes=[4,8]",
            "scale_sim.ranks=[0,middle,-1]",
            "scale_sim.strategies=[dp_kfac,kaisa_mem_opt,grouped_local_decomp]",
            "scale_sim.limits=[{world_size:8,exclude:[grouped_local_decomp]}]",
            f"results_dir={tmp_path}",
        ],
    )
    assert cfg.task == "scale_sim"
    paths = run_table_task(cfg)
    assert paths == {"csv": tmp_path / "scale_sim.csv", "md": tmp_path / "scale_sim.md"}
    rows = pd.read_csv(paths["csv"])
    assert len(rows) == 3 * 3 + 2 * 3
    for column in ("match", "calls_match", "setup_match"):
        assert rows[column].astype(bool).all(), column
    assert (rows["bytes_sim"] == rows["bytes_pred"]).all()
    assert set(rows["strategy"]) == {"dp_kfac", "kaisa_mem_opt", "grouped_local_decomp"}
    assert sorted(set(rows[rows["world_size"] == 8]["rank"])) == [0, 4, 7]
    md = paths["md"].read_text()
    assert md.splitlines()[2].startswith("**Takeaway.** Simulated one rank at a time")
    assert "15 of 15 (model, strategy, P, rank) runs" in md
    assert "), 15 also with exactly its calls." in md
    assert "`scale_sim.limits`: P=8: grouped_local_decomp." in md
    assert "## Start-up seconds against P (median over the simulated ranks)" in md


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("scale_sim.models=[nope]", "scale_sim.models=['nope']"),
        ("scale_sim.ranks=[first]", "scale_sim.ranks="),
        ("scale_sim.world_sizes=[0]", "scale_sim.world_sizes="),
        ("scale_sim.strategies=[nope]", "scale_sim.strategies=['nope']"),
        ("scale_sim.strategies=[dp_kfac,none]", "scale_sim.strategies=['dp_kfac', 'none']"),
        ("scale_sim.hardware=nope", "scale_sim.hardware='nope'"),
        ("scale_sim.factor_method=nope", "scale_sim.factor_method='nope'"),
        ("scale_sim.limits=[{world_size:0}]", "scale_sim.limits[0].world_size=0"),
        ("scale_sim.limits=[{world_size:8,only:[dp_kfac]}]", "scale_sim.limits[0]="),
    ],
)
def test_bad_values_are_named(override: str, named: str) -> None:
    with pytest.raises(ExperimentError, match=f"invalid value {re.escape(named)}"):
        run_table_task(compose_config("benchmark", ["table=scale_sim", override]))


def test_the_committed_table_opens_with_its_takeaway() -> None:
    lines = (Path(__file__).parents[1] / "results" / "scale_sim.md").read_text().split("\n")
    assert lines[0].startswith("# ") and lines[2].startswith("**Takeaway")
