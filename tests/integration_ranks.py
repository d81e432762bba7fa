"""One rank of the two-process integration checks, run by torchrun (see
tests/test_integration_distributed.py): ``python -m torch.distributed.run --nproc_per_node 2
tests/integration_ranks.py OUT SCRATCH``.

On every rank: the project's own trainer on the case of tests/integration_cases.py (K-FAC
averaging the gradients itself), then the same case through Hugging Face Trainer
(``trainer.loop=hf``), accelerate and Lightning (``strategy="ddp"``), each compared with the
project's parameters; each also saves at step 2 and resumes. Each rank writes what it
measured to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from integration_cases import hf_params, max_difference, project_params, same, train_case

from experiments.distributed import DistEnv


def _kfac_grad_bytes(pre: Any) -> int:
    """Bytes the preconditioner all-reduced as gradients (0 where DDP alone reduced them)."""
    return int(pre.comm_stats().get("grad_allreduce", {}).get("bytes", 0))


def huggingface(scratch: Path, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    result = train_case(scratch / "hf", "trainer.loop=hf")
    checkpoint = scratch / "hf" / "hf" / "checkpoint-2"
    train_case(scratch / "hf_resumed", "trainer.loop=hf", f"trainer.resume={checkpoint}")
    dist.barrier()  # rank 0 wrote the checkpoints
    straight = hf_params(scratch / "hf")
    return {
        "difference": max_difference(straight, reference),
        "gradient_path": result["gradient_path"],
        "resumed_bitwise": same(hf_params(scratch / "hf_resumed"), straight),
    }


def accelerate(env: DistEnv, scratch: Path, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    import test_integration_accelerate as acc

    folder = scratch / "accelerate"  # the same on every rank; save_state writes from rank 0
    full = acc.accelerate_run(env, save_at=2, folder=folder)
    resumed = acc.accelerate_run(env, folder=folder, resume=True)
    return {
        "difference": max_difference(full["params"], reference),
        "ddp": full["ddp"],
        "pre_steps": full["pre_steps"],
        "resumed_bitwise": same(resumed["params"], full["params"]),
    }


def lightning(env: DistEnv, scratch: Path, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    import test_integration_lightning as lt

    folder = scratch / "lightning"  # the same on every rank; rank 0 writes the checkpoints
    full = lt.lightning_run(env, folder=folder, devices=env.world_size, strategy="ddp")
    dist.barrier()
    (checkpoint,) = folder.glob("*step=2.ckpt")  # 1 step per epoch on 2 ranks
    resumed = lt.lightning_run(env, resume=checkpoint, devices=env.world_size, strategy="ddp")
    pre = full["pre"]
    return {
        "difference": max_difference(full["params"], reference),
        "ddp": pre.ddp,
        "grad_bytes": _kfac_grad_bytes(pre),
        "pre_steps": pre.steps,
        "resumed_bitwise": same(resumed["params"], full["params"]),
    }


def main() -> None:
    out, scratch = Path(sys.argv[1]), Path(sys.argv[2])  # scratch: one folder for all ranks
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank, world, rank, torch.device("cpu"))
    results: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        project = train_case(scratch / "project")  # K-FAC all-reduces (no DDP)
        results["project_gradient_path"] = project["gradient_path"]
        dist.barrier()
        reference = project_params(scratch / "project")
        results["hf"] = huggingface(scratch, reference)
        results["accelerate"] = accelerate(env, scratch, reference)
        dist.barrier()
        results["lightning"] = lightning(env, scratch, reference)
        dist.barrier()
    results["runtime_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
    ]
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
