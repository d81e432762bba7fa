"""The step readable: the files of dpkfac/ one steady-state dp_kfac step passes through,
counted by the profiler tool docs/design.md names (experiments/bench/step_files.py)."""

from __future__ import annotations

from experiments.bench.step_files import step_files

#: Files today (docs/design.md, "One dp_kfac step"); a change that adds one must say why.
MOST = 10


def test_a_dp_kfac_step_passes_through_few_files_and_never_the_plan_of_its_roles() -> None:
    files = step_files("dp_kfac", 2)
    assert len(files) <= MOST, sorted(files)
    # The plan is read once: the roles at placement (RankRoles), the exchanges (the one
    # description the cost model prices too) once per layout; a step asks nothing of plan/.
    assert not [f for f in files if f.startswith("plan/")], sorted(files)
    assert "strategies/dp_kfac.py" not in files  # DPKFAC overrides nothing of a step
    assert {"strategies/base.py", "comm.py", "preconditioner.py"} <= set(files)
