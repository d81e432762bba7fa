"""Elastic runs under torchrun: restarts resume, nothing hangs, accumulation under DDP.

* A rank killed mid-run (SIGKILL, after its step 6 of 10; checkpoints every 4 steps)
  under ``torchrun --standalone --max-restarts=1``: torchrun restarts both ranks, the
  run folder (named after the rendezvous id) is the same, ``trainer.resume=auto``
  continues from step 4, and the run ends at step 10 with the parameters and K-FAC
  factors of an uninterrupted run, bitwise.
* Joining the process group is bounded by ``trainer.dist_timeout_s``: a watchdog
  ends the process with one line naming the phase and the rank.
* ``trainer.accumulate_grad_batches=2`` under DDP (``no_sync`` on the first
  micro-batch) equals the whole batch at world size 2.
* fp16 at world size 2 wraps the model in DDP by itself (the library requires it).
* torchrun with restarts but no stable run folder is refused before training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_experiments_distributed import REPO, _free_port, torchrun

#: What the torchrun helper of test_experiments_distributed adds (fake data, no
#: logger, no progress bar, a 120 s timeout, hydra.run.dir), for direct launches.
LAUNCH = ["data.fake=true", "logger=none", "trainer.progress_bar=false"]
# 160 fake training images over 2 ranks, 16 per batch: 5 steps per epoch.
DIGITS = ["experiment=digits_cnn", "data.batch_size=16"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for name in ("DPKFAC_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"):
        if name not in extra:
            env.pop(name, None)
    return env


def _last(run_dir: Path) -> dict:
    path = run_dir / "checkpoints" / "last.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_rank_is_restarted_and_resumes_from_the_last_checkpoint(tmp_path):
    run = [
        *DIGITS,
        "strategy=dp_kfac",
        "trainer.max_steps=10",
        "trainer.checkpoint_every_steps=4",
        "trainer.keep_checkpoints=5",
    ]
    logs = tmp_path / "logs"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        "-m",
        "experiments.train",
        *LAUNCH,
        "trainer.dist_timeout_s=120",
        *run,
        f"paths.log_dir={logs}",
    ]
    # Rank 1 kills itself after step 6, on torchrun's first attempt only: by then rank 0
    # has written the step-4 checkpoint (step 5 needed rank 0 after it had saved).
    env = _env(DPKFAC_TEST_KILL_AT_STEP="6", DPKFAC_TEST_KILL_RANK="1")
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = list((logs / "digits_cnn").iterdir())
    assert len(runs) == 1, runs  # one folder for both attempts: named after the rendezvous id
    final = json.loads((runs[0] / "metrics.json").read_text())["final"]
    # The second attempt resumed at the step-4 checkpoint and ran steps 5..10.
    assert (final["steps"], final["steps_this_run"], final["world_size"]) == (10, 6, 2)
    steps = sorted(p.name for p in (runs[0] / "checkpoints").glob("step_*.pt"))
    assert steps == ["step_000000004.pt", "step_000000008.pt", "step_000000010.pt"]

    straight = torchrun(tmp_path / "straight", *run)
    assert straight.returncode == 0, straight.stderr[-4000:]
    a, b = _last(tmp_path / "straight"), _last(runs[0])
    assert a["step"] == b["step"] == 10
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for name, entry in a["preconditioner"]["layers"].items():
        for which in ("A", "G"):
            assert torch.equal(entry[which], b["preconditioner"]["layers"][name][which]), name
    print(f"kill-and-restart run: {elapsed:.1f} s")


def test_a_hung_phase_ends_the_process_with_one_line(tmp_path):
    script = (
        "import time\n"
        "from experiments.distributed import deadline\n"
        "with deadline('init_process_group', 1, 1):\n"
        "    time.sleep(60)\n"
    )
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert time.perf_counter() - started < 30
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: init_process_group did not finish within 1 s on rank 1"


def test_joining_a_group_whose_peer_never_comes_is_bounded(tmp_path):
    """Rank 1 of 2 alone: init_process_group gives up (or is ended) after the timeout."""
    script = (
        "from experiments.distributed import distributed_context\n"
        "with distributed_context('cpu', 3):\n"
        "    pass\n"
    )
    env = _env(
        WORLD_SIZE="2",
        RANK="1",
        LOCAL_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert time.perf_counter() - started < 60
    assert proc.returncode != 0
    # Either torch's own timeout fired first, or the watchdog ended the process.
    if proc.returncode == 1 and "did not finish" in proc.stderr:
        assert "init_process_group did not finish within 3 s on rank 1" in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_accumulation_under_ddp_equals_the_whole_batch(tmp_path):
    common = ["experiment=digits_cnn", "strategy=dp_kfac", "trainer.ddp=true"]
    whole = torchrun(tmp_path / "whole", *common, "trainer.max_steps=3", "data.batch_size=16")
    assert whole.returncode == 0, whole.stderr[-4000:]
    parts = torchrun(
        tmp_path / "parts",
        *common,
        "trainer.max_steps=3",
        "data.batch_size=8",
        "trainer.accumulate_grad_batches=2",
    )
    assert parts.returncode == 0, parts.stderr[-4000:]
    a, b = _last(tmp_path / "whole"), _last(tmp_path / "parts")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_restarts_without_a_stable_run_folder_are_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", *LAUNCH, *DIGITS, f"paths.log_dir={tmp_path}"],
        cwd=REPO,
        env=_env(TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_RUN_ID="none"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error: torchrun --max-restarts=3 restarts every rank" in proc.stderr
    assert "--rdzv-id" in proc.stderr and "hydra.run.dir" in proc.stderr


def test_the_run_folder_is_named_after_the_rendezvous_id(tmp_path):
    script = (
        "import experiments\n"
        "from hydra import compose, initialize_config_dir\n"
        "from hydra.core.hydra_config import HydraConfig\n"
        "from omegaconf import OmegaConf\n"
        f"with initialize_config_dir(config_dir='{REPO / 'conf'}', version_base='1.3'):\n"
        f"    cfg = compose('config', overrides=['paths.log_dir={tmp_path}'],"
        " return_hydra_config=True)\n"
        "print(OmegaConf.select(cfg, 'hydra.run.dir'))\n"
    )

    def run_dir(**env: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env=_env(**env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip().splitlines()[-1]

    assert run_dir(TORCHELASTIC_RUN_ID="job42") == f"{tmp_path}/digits_cnn/job42"
    stamped = run_dir(TORCHELASTIC_RUN_ID="none")  # the static rendezvous names no run
    assert stamped.startswith(f"{tmp_path}/digits_cnn/") and "none" not in stamped


@pytest.mark.slow
@pytest.mark.distributed
def test_fp16_with_two_ranks_wraps_the_model_in_ddp(tmp_path):
    """The loss scaler needs averaged gradients: fp16 gets DDP even without trainer.ddp."""
    proc = torchrun(
        tmp_path, *DIGITS, "strategy=dp_kfac", "trainer.precision=fp16", "trainer.max_steps=3"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = json.loads((tmp_path / "metrics.json").read_text())["final"]
    assert (final["steps"], final["world_size"]) == (3, 2)
    assert _last(tmp_path)["scaler"]["scale"] > 0
