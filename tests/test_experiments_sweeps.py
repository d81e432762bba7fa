"""Hydra sweeps under torchrun: every job finishes, every time.

The jobs of a sweep run one after another in the same processes, each with its
own process group. They used to share the keys of torchrun's store, so a job
could read the previous job's gloo addresses and wait on sockets that were
gone: about half of the sweeps hung after the first job. One sweep of three
strategies by three seeds (nine jobs in the same two processes, eight hand-overs
from one job's process group to the next) must now finish every job, and ranks that run
different jobs fail fast.
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


#: The seeds of the sweep: each is one more round of hand-overs between jobs.
SEEDS = 3


@pytest.mark.slow
@pytest.mark.distributed
def test_a_torchrun_sweep_finishes_every_job(tmp_path: Path) -> None:
    seeds = ",".join(map(str, range(SEEDS)))
    proc = _sweep(tmp_path, f"strategy={STRATEGIES}", f"seed={seeds}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = len(STRATEGIES.split(",")) * SEEDS
    for job in range(jobs):
        (folder,) = tmp_path.glob(f"{job}_*")  # the job's folder: <num>_<strategy>
        final = json.loads((folder / "metrics.json").read_text())["final"]
        assert final["world_size"] == 2 and final["steps"] == 2, folder.name


def test_a_sweep_folder_gets_its_summary_and_each_run_its_last_line(tmp_path: Path) -> None:
    """One process, two jobs: summary.csv/md with a row per job; the last log line of a run."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "-m",
            "strategy=dp_kfac,none",
            "data.fake=true",
            "logger=none",
            "trainer.progress_bar=false",
            "trainer.max_steps=2",
            "data.batch_size=16",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    csv_text = (tmp_path / "summary.csv").read_text().splitlines()
    assert csv_text[0].startswith("job,overrides,strategy,world_size,primary_metric,metric")
    assert len(csv_text) == 3
    assert "kfac_bytes_per_step" in csv_text[0]
    md = (tmp_path / "summary.md").read_text()
    assert "2 job(s). Best accuracy" in md and "strategy=dp_kfac" in md
    for job in ("0_dp_kfac", "1_none"):
        last = (tmp_path / job / "train.log").read_text().strip().splitlines()[-1]
        assert "done: strategy" in last and "world size 1" in last and "accuracy" in last
        assert f"output {tmp_path / job}" in last


def _different_jobs(rank: int, world_size: int) -> str:
    from experiments.config import ExperimentError
    from experiments.distributed import DistEnv, _check_same_job

    env = DistEnv(rank, world_size)
    try:
        _check_same_job(env, f"job 0: strategy={'dp_kfac' if rank == 0 else 'd_kfac'}")
    except ExperimentError as err:
        return str(err)
    return ""


@pytest.mark.distributed
def test_ranks_running_different_jobs_fail_fast_on_every_rank() -> None:
    from dist_utils import run_ranks

    for message in run_ranks(_different_jobs, 2):
        assert "the ranks run different jobs" in message
        assert "rank 0: 'job 0: strategy=dp_kfac'; rank 1: 'job 0: strategy=d_kfac'" in message


def test_the_runs_of_a_sweep_share_a_wandb_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from experiments import train

    fake = SimpleNamespace(
        mode=RunMode.MULTIRUN, sweep=SimpleNamespace(dir="multirun/digits_cnn/2026-12-01_06-00")
    )
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: fake))
    assert train._sweep_group() == "digits_cnn/2026-12-01_06-00"
    fake.mode = RunMode.RUN
    assert train._sweep_group() is None
