"""One preset per family under ``torchrun --nproc_per_node=2`` (gloo on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[1]
# Each family with a different strategy; `none` exercises the DDP path.
CASES = [
    ("cifar10_resnet32", "dp_kfac", ["model.depth=14"]),
    ("imagenet_resnet50", "d_kfac", []),
    ("squad_bert", "spd_kfac", []),
    ("multi30k_transformer", "none", []),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """Launch ``experiments.train`` with torchrun on localhost; fails after 4 minutes."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "experiments.train",
        "data.fake=true",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.dist_timeout_s=120",
        f"hydra.run.dir={tmp_path}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("preset", "strategy", "extra"), CASES)
def test_preset_under_torchrun(preset, strategy, extra, tiny, tmp_path):
    proc = torchrun(
        tmp_path,
        f"experiment={preset}",
        f"strategy={strategy}",
        "trainer.max_steps=2",
        *tiny[preset],
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = json.loads((tmp_path / "metrics.json").read_text())["final"]
    assert final["world_size"] == 2 and final["steps"] == 2
    # Rank 0 alone writes checkpoints; replicas were checked bitwise equal at the end.
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    assert "replicas diverged" not in proc.stderr
