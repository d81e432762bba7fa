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


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_under_torchrun_is_bitwise(tiny, tmp_path):
    """dp_kfac keeps factors on owner ranks only: a 2-rank checkpoint must still hold them all.
    The straight run's step-2 checkpoint, continued to step 4, ends where it ended."""
    common = ["experiment=digits_cnn", "strategy=dp_kfac", *tiny["digits_cnn"]]
    straight = torchrun(
        tmp_path / "straight", *common, "trainer.max_steps=4", "trainer.checkpoint_every_steps=2"
    )
    assert straight.returncode == 0, straight.stderr[-4000:]
    halfway = tmp_path / "straight" / "checkpoints" / f"step_{2:09d}.pt"
    resumed = torchrun(
        tmp_path / "resumed", *common, "trainer.max_steps=4", f"trainer.resume={halfway}"
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    def load(run: str) -> dict:
        path = tmp_path / run / "checkpoints" / "last.pt"
        return torch.load(path, map_location="cpu", weights_only=True)

    a, b = load("straight"), load("resumed")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    layers_a, layers_b = a["preconditioner"]["layers"], b["preconditioner"]["layers"]
    assert all(entry["A"] is not None for entry in layers_a.values())  # every owner's factors
    for name, entry in layers_a.items():
        assert torch.equal(entry["A"], layers_b[name]["A"]), name
        assert torch.equal(entry["G"], layers_b[name]["G"]), name


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("extra", "path"),
    [
        (["trainer.precision=fp16"], "DDP's buckets, from its communication hook"),
        (["trainer.ddp=false"], "own hooks"),
    ],
)
def test_owner_overlap_under_torchrun(extra, path, tmp_path):
    """The training entry point's DDP and fp16 runs take the overlapped owner reduction."""
    proc = torchrun(
        tmp_path,
        "experiment=digits_cnn",
        "strategy=dp_kfac_owner_overlap",
        "trainer.max_steps=4",
        *extra,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = json.loads((tmp_path / "metrics.json").read_text())["final"]
    assert final["steps"] == 4 and final["gradient_path"].startswith(
        "reduced onto their owners, updates all-gathered inside the backward pass"
    )
    assert path in final["gradient_path"]
    assert "replicas diverged" not in proc.stderr
