"""The step readable: the files of dpkfac/ one steady-state dp_kfac step passes through,
counted by the profiler tool docs/design.md names (experiments/bench/step_files.py)."""

from __future__ import annotations

from experiments.bench.step_files import step_files

#: Files today (docs/design.md, "One dp_kfac step"); a change that adds one must say why.
MOST = 18


def test_a_dp_kfac_step_passes_through_few_files_and_never_the_plan_of_its_roles() -> None:
    files = step_files("dp_kfac", 2)
    assert len(files) <= MOST, sorted(files)
    # The roles are read once, at placement (RankRoles): a step asks no plan or scheme.
    assert not {"plan/roles.py", "plan/assignment.py", "plan/dp_kfac.py"} & set(files)
    assert "strategies/dp_kfac.py" not in files  # DPKFAC overrides nothing of a step
    # The exchanges are the one description the cost model prices too.
    assert {"plan/exchange.py", "strategies/base.py", "comm.py", "preconditioner.py"} <= set(files)
