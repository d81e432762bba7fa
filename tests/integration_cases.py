"""The case every framework integration test trains, and the project's own trainer as reference.

The reference is ``experiments.train`` itself, the project's :class:`experiments.trainer.Trainer`
on a composed Hydra config (``experiment=squad_bert``): a tiny ``BertForQuestionAnswering``
built from a config, the SQuAD-format JSON the data module writes (``data.fake=true``),
SGD with momentum under a linear decay, K-FAC with an active KL clip (so the followed learning
rate matters), 2 micro-batches per step, gradients clipped to 0.5 after ``pre.step()``
(``trainer.max_grad_norm``), 4 steps over more than one epoch (3 steps per epoch on one
process, 1 on two, the last batch of each epoch left out), no dropout (the frameworks' random
streams are not the project's). Float32: every framework runs the same operations in the same
order, so the parameters agree to the last bit (the tests allow 1e-6).

Each framework builds what it trains with :func:`experiments.train.build_components` (the
function the project loop builds with), its K-FAC options with
:func:`experiments.hf_loop.kfac_options`, and reads the project loop's batches from the data
module (:meth:`~experiments.data.loading.DataModule.train_loader` for a loop that takes a rank's
own batches, :meth:`~experiments.data.loading.DataModule.round_robin_train_loader` for one that
deals a loader's batches to the ranks, as accelerate's ``prepare`` does).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader

from experiments.data.loading import epoch_sampler

CONF = Path(__file__).resolve().parents[1] / "conf"
STEPS, K, CLIP, BATCH = 4, 2, 0.5, 14
TOLERANCE = 1e-6  # the bound; float32 runs agree bitwise (measured: 0.0)

#: The case's overrides of ``experiment=squad_bert``.
CASE = [
    "experiment=squad_bert",
    "data.fake=true",
    "data.max_seq_length=64",
    "data.doc_stride=16",
    f"data.batch_size={BATCH}",
    "model.hidden_dropout_prob=0.0",
    "model.attention_probs_dropout_prob=0.0",
    "optimizer.lr=0.05",
    "strategy.kl_clip=1e-4",
    f"trainer.max_steps={STEPS}",
    f"trainer.accumulate_grad_batches={K}",
    f"trainer.max_grad_norm={CLIP}",
    "trainer.checkpoint_every_steps=2",
    "trainer.log_every_steps=1",
    "trainer.eval_every_epochs=100",  # scored once, at the end
    "trainer.progress_bar=false",
    "trainer.threads=1",
    "logger=none",
]


def compose_case(*overrides: str) -> DictConfig:
    """The case's config, composed as ``python -m experiments.train`` composes it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*CASE, *overrides])


def train_case(out: Path, *overrides: str) -> dict[str, Any]:
    """``experiments.train`` on the case (the project loop unless ``trainer.loop=hf``)."""
    from experiments.train import run

    return run(compose_case(f"output_dir={out}", *overrides))


def project_params(out: Path) -> dict[str, torch.Tensor]:
    """The parameters a project-loop run of the case ended with (its last checkpoint)."""
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    return dict(state["model"])


def hf_params(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The parameters of a ``trainer.loop=hf`` run's Trainer checkpoint at ``step``."""
    from safetensors.torch import load_file

    return load_file(str(out / "hf" / f"checkpoint-{step}" / "model.safetensors"))


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


class ProjectBatches:
    """A rank's batches of the project loop, resumable mid-epoch the project loop's way.

    The data module's :meth:`train_loader` with each epoch cut to ``batches`` (the trainer's
    steps per epoch times k), started at a position by ``EpochSampler.set_epoch(epoch,
    start)``; ``state_dict``/``load_state_dict`` are the stateful-loader protocol Lightning
    saves and restores mid-epoch (a plain loader would restart its epoch on resume).
    """

    def __init__(self, loader: DataLoader, batch_size: int, batches: int) -> None:
        self.loader, self.batch_size, self.batches = loader, batch_size, batches
        self.epoch = self.position = 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Any]:
        start = self.position
        epoch_sampler(self.loader).set_epoch(self.epoch, start * self.batch_size)
        batches = iter(self.loader)
        for position in range(start, self.batches):
            self.position = position + 1
            yield next(batches)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def cls_model(seed: int = 0) -> nn.Module:
    """A tiny BertForSequenceClassification (its batches carry ``labels``), float64."""
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

    def __init__(self, rows: int = 32, length: int = 8) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(1, 50, (rows, length), generator=g)
        self.labels = torch.randint(0, 3, (rows,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}
