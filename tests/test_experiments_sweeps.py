"""Hydra sweeps under torchrun: every job finishes, every time.

The jobs of a sweep run one after another in the same processes, each with its
own process group. They used to share the keys of torchrun's store, so a job
could read the previous job's gloo addresses and wait on sockets that were
gone: about half of the sweeps hung after the first job. Five sweeps of three
strategies must now all finish, and ranks that run different jobs fail fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_experiments_distributed import REPO, _free_port

STRATEGIES = "dp_kfac,d_kfac,kaisa_comm_opt"


def _sweep(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "experiments.train",
        "-m",
        "data.fake=true",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.dist_timeout_s=60",
        "trainer.max_steps=2",
        "data.batch_size=16",
        f"hydra.sweep.dir={tmp_path}",
        *overrides,
    ]
    return subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("attempt", range(5))
def test_a_torchrun_sweep_finishes_every_job(attempt: int, tmp_path: Path) -> None:
    proc = _sweep(tmp_path, f"strategy={STRATEGIES}", f"seed={attempt}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for job, strategy in enumerate(STRATEGIES.split(",")):
        (folder,) = tmp_path.glob(f"{job}_*")  # the job's folder: <num>_<strategy>
        final = json.loads((folder / "metrics.json").read_text())["final"]
        assert final["world_size"] == 2 and final["steps"] == 2, (job, strategy)
