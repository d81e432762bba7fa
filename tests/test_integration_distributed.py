"""The integrations on two processes under torchrun (gloo, CPU): Hugging Face Trainer
(``trainer.loop=hf``), accelerate and Lightning ``strategy="ddp"`` each give the project's own
trainer's parameters on the case of tests/integration_cases.py (the project trainer averaging
the gradients in K-FAC's ``step()``, the frameworks through DDP), the preconditioner following
DDP with no second all-reduce (problem 2), and every resume bitwise.
tests/integration_ranks.py is the rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dist_utils import free_port
from integration_cases import STEPS, TOLERANCE

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

RANK_SCRIPT = Path(__file__).resolve().parent / "integration_ranks.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ranks")
    scratch = tmp_path_factory.mktemp("scratch")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(RANK_SCRIPT),
        str(out),
        str(scratch),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.distributed
def test_trainer_on_two_processes(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["project_gradient_path"] == "all-reduced in step(), after the backward pass"
        hf = result["hf"]
        assert hf["difference"] <= TOLERANCE
        # Built on model_wrapped: DDP reduces the gradients, K-FAC does not again (problem 2).
        assert hf["gradient_path"].startswith("all-reduced by DDP")
        assert hf["resumed_bitwise"]


@pytest.mark.distributed
def test_accelerate_on_two_processes(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        acc = result["accelerate"]
        assert acc["difference"] <= TOLERANCE
        assert acc["ddp"] and acc["pre_steps"] == STEPS  # one step() per optimizer step
        assert acc["resumed_bitwise"]


@pytest.mark.distributed
def test_lightning_ddp_on_two_processes(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        lt = result["lightning"]
        assert lt["difference"] <= TOLERANCE
        assert lt["ddp"] and lt["grad_bytes"] == 0 and lt["pre_steps"] == STEPS
        assert lt["resumed_bitwise"]
        # Nothing the core warns about (accumulation, no_sync, stale optimizer) happened.
        assert result["runtime_warnings"] == []
