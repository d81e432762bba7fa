"""One rank of the two-process integration checks, run by torchrun (see
tests/test_integration_distributed.py): ``python -m torch.distributed.run --nproc_per_node 2
tests/integration_ranks.py OUT``.

On every rank: the project's reference loop on a DDP model, then the same training through
the Hugging Face Trainer (tiny BertForQuestionAnswering on the project's SQuAD JSON),
accelerate and Lightning (``strategy="ddp"``, tiny BERT classifier), each compared with its
reference; each also saves at step 2 and resumes. Each rank writes what it
measured to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from integration_cases import (
    ClassificationRows,
    cls_model,
    max_difference,
    params_of,
    qa_model,
    reference_run,
    squad_features,
)

STEPS, K, CLIP = 4, 2, 0.5


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _kfac_grad_bytes(pre: Any) -> int:
    """Bytes the preconditioner all-reduced as gradients (0 where DDP alone reduced them)."""
    return int(pre.comm_stats().get("grad_allreduce", {}).get("bytes", 0))


def huggingface(rank: int, world: int, scratch: Path) -> dict[str, Any]:
    import test_integration_huggingface as hf

    dataset, vocab, pad = squad_features(scratch / f"squad{rank}")
    reference = reference_run(
        DistributedDataParallel(qa_model(vocab, pad)),
        dataset,
        steps=STEPS,
        accumulation=K,
        max_grad_norm=CLIP,
        rank=rank,
        world_size=world,
    )
    out = scratch / "hf"  # the same folder on every rank, as Trainer expects
    callback = hf.KFACCallback(**hf.KFAC)
    model = qa_model(vocab, pad)
    trainer = hf._trainer(model, dataset, out / "run", callback)
    trainer.train()
    resumed_cb = hf.KFACCallback(**hf.KFAC)
    resumed_model = qa_model(vocab, pad, seed=1)
    resumed = hf._trainer(resumed_model, dataset, out / "resumed", resumed_cb)
    resumed.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    assert callback.pre is not None
    return {
        "difference": max_difference(params_of(model), reference["params"]),
        "grad_norms": hf._grad_norms(trainer),
        "reference_norms": reference["grad_norms"],
        "ddp": callback.pre.ddp,
        "grad_bytes": _kfac_grad_bytes(callback.pre),
        "resumed_bitwise": _same(params_of(resumed_model), params_of(model)),
    }


def accelerate(rank: int, world: int, scratch: Path) -> dict[str, Any]:
    import test_integration_accelerate as acc

    dataset = ClassificationRows()
    reference = reference_run(
        DistributedDataParallel(cls_model()),
        dataset,
        steps=STEPS,
        accumulation=K,
        max_grad_norm=CLIP,
        rank=rank,
        world_size=world,
    )
    folder = scratch / "accelerate"
    full = acc.accelerate_run(dataset, save_at=2, folder=folder, rank=rank, world_size=world)
    resumed = acc.accelerate_run(dataset, resume=folder, rank=rank, world_size=world)
    return {
        "difference": max_difference(full["params"], reference["params"]),
        "ddp": full["ddp"],
        "pre_steps": full["pre_steps"],
        "resumed_bitwise": _same(resumed["params"], full["params"]),
    }


def lightning(rank: int, world: int, scratch: Path) -> dict[str, Any]:
    import test_integration_lightning as lt

    reference = reference_run(
        DistributedDataParallel(cls_model()),
        ClassificationRows(lt.ROWS),
        steps=STEPS,
        accumulation=K,
        max_grad_norm=CLIP,
        rank=rank,
        world_size=world,
    )
    folder = scratch / "lightning"  # the same on every rank; rank 0 writes the checkpoints
    module, callback = lt.Classifier(), lt.KFACCallback(**lt.KFAC)
    trainer = lt.lightning_trainer(STEPS, callback, folder, devices=world, strategy="ddp")
    trainer.fit(module, lt.ResumableBatches(rank, world))
    resumed, resumed_cb = lt.Classifier(), lt.KFACCallback(**lt.KFAC)
    again = lt.lightning_trainer(STEPS, resumed_cb, devices=world, strategy="ddp")
    again.fit(resumed, lt.ResumableBatches(rank, world), ckpt_path=folder / "epoch=0-step=2.ckpt")
    assert callback.pre is not None
    return {
        "difference": max_difference(params_of(module.model), reference["params"]),
        "ddp": callback.pre.ddp,
        "grad_bytes": _kfac_grad_bytes(callback.pre),
        "pre_steps": callback.pre.steps,
        "resumed_bitwise": _same(params_of(resumed.model), params_of(module.model)),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    # One scratch folder for all ranks (Trainer and accelerate write checkpoints from rank 0).
    scratch = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())
    results: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        checks = (("hf", huggingface), ("accelerate", accelerate), ("lightning", lightning))
        for name, check in checks:
            results[name] = check(rank, world, scratch)
            dist.barrier()
    results["runtime_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
    ]
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
