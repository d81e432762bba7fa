"""Data, models and the reference loop shared by the framework integration tests.

The reference is the project's own loop (README, ``experiments.trainer``): per optimizer step,
``k`` micro-batches each with loss/k (DDP's ``no_sync`` on all but the last), ``pre.step()``,
then the gradient clip, ``optimizer.step()`` and ``scheduler.step()``, with the KL clip's lr
read from the optimizer. Every framework run must give the same parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dpkfac
from dpkfac.integrations._common import follow_lr

#: K-FAC options of every integration test (factors and decompositions every step, an
#: active KL clip so the followed learning rate matters).
KFAC = {"strategy": "dp_kfac", "damping": 0.01, "kl_clip": 1e-4, "factor_decay": 0.9}
LR = 0.05
BATCH = 4


def squad_features(root: Path, max_seq_length: int = 48) -> tuple[Any, int, int]:
    """Training windows of a SQuAD-format JSON file written here (the project's fake SQuAD,
    its own tokenizer): (dataset of tensors, vocabulary size, padding id)."""
    from experiments.data.squad import SquadData
    from experiments.distributed import DistEnv

    data = SquadData(
        root=str(root),
        fake=True,
        batch_size=BATCH,
        eval_batch_size=BATCH,
        num_workers=0,
        max_seq_length=max_seq_length,
        doc_stride=12,
    )
    data.write_fake(root)
    train, _ = data.load(root, DistEnv())
    return train, len(data.tokenizer), int(data.tokenizer.pad_token_id)


def qa_model(vocab_size: int, pad_token_id: int, seed: int = 0) -> nn.Module:
    """A tiny BertForQuestionAnswering from a config, float64, no dropout (exact runs)."""
    from experiments.models.bert import bert_for_question_answering

    torch.manual_seed(seed)
    model = bert_for_question_answering(
        vocab_size,
        pad_token_id,
        tiny=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    )
    return model.double()


def cls_model(seed: int = 0) -> nn.Module:
    """A tiny BertForSequenceClassification (its batches carry ``labels``)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return BertForSequenceClassification(config).double()


class ClassificationRows(torch.utils.data.Dataset):
    """Synthetic token sequences with a class each, as dict rows."""

    def __init__(self, rows: int = 64, length: int = 8) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(1, 50, (rows, length), generator=g)
        self.labels = torch.randint(0, 3, (rows,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def optimizer_and_schedule(
    model: nn.Module, total: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """SGD with momentum and a linear decay to 10% (the KL clip must follow it)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / total)
    return opt, sched


def batches(dataset: Any, rank: int = 0, world_size: int = 1) -> Iterator[dict[str, Any]]:
    """Sequential batches as Trainer's sequential sampler and accelerate's sharding give
    them, epoch after epoch: batch j of the whole sequence goes to rank j % world_size."""
    from transformers import default_data_collator

    n = len(dataset) // BATCH
    while True:
        for j in range(rank, n - n % world_size, world_size):
            yield default_data_collator([dataset[i] for i in range(j * BATCH, (j + 1) * BATCH)])


def reference_run(
    model: nn.Module,
    dataset: Any,
    *,
    steps: int,
    accumulation: int,
    max_grad_norm: float,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The project's loop on ``model`` (DDP-wrapped by the caller if several ranks)."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    opt, sched = optimizer_and_schedule(inner, steps)
    pre = dpkfac.KFACPreconditioner(
        model, accumulation_steps=accumulation, lr=follow_lr(opt), **KFAC
    )
    data = batches(dataset, rank, world_size)
    norms = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for i in range(accumulation):
            last = i == accumulation - 1
            ddp = isinstance(model, DistributedDataParallel)
            sync = model.no_sync() if ddp and not last else contextlib.nullcontext()
            with sync:
                (model(**next(data)).loss / accumulation).backward()
        pre.step()
        norms.append(float(torch.nn.utils.clip_grad_norm_(inner.parameters(), max_grad_norm)))
        opt.step()
        sched.step()
    return {"params": params_of(inner), "grad_norms": norms, "pre_steps": pre.steps}


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)
