"""Benchmark workloads: a network from the ``model`` group and a fixed-shape synthetic batch.

A timing benchmark needs the same tensor shapes on every step and every rank,
so it times a network on synthetic batches rather than on a data loader. The
network is the training side's own config (``conf/model/<name>.yaml``, a
``_target_``), so the benchmark times the very models the presets train. What
the training side gets from its data module (the number of classes or the
vocabulary, the loss) comes here from a *batch* (``workload.batch`` of
``conf/workload/<name>.yaml``, also a ``_target_``): one of the classes below,
which makes the batches, computes the loss and names the sizes the network
needs. The options that make a model affordable on a CPU (a width divisor, a
shorter sequence, fewer layers) are explicit keys of the workload, so the
paper's sizes are one override away (``workload.paper``).

:func:`build` puts the two together; :func:`row_model` rebuilds the model a
benchmark row was measured on (or its paper-sized version) from the row.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


@dataclass(frozen=True)
class ImageBatches:
    """Image classification: square images ``x`` and class labels ``y``.

    Attributes:
        batch_size: Images per rank.
        image_size: Height and width.
        num_classes: Classes (handed to the network as ``num_classes``).
        channels: Input channels.
    """

    batch_size: int
    image_size: int = 32
    num_classes: int = 10
    channels: int = 3

    def model_kwargs(self) -> dict[str, Any]:
        """The sizes the network takes from its data."""
        return {"num_classes": self.num_classes}

    def make_batch(self, seed: int) -> Batch:
        """A batch drawn from ``seed`` (ranks pass their own, as in data parallelism)."""
        g = _generator(seed)
        size = (self.batch_size, self.channels, self.image_size, self.image_size)
        return {
            "x": torch.randn(*size, generator=g),
            "y": torch.randint(0, self.num_classes, (self.batch_size,), generator=g),
        }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy."""
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def example_input(self) -> tuple[Any, ...]:
        """Positional inputs of one forward pass (for the cost model's shapes)."""
        return (torch.zeros(self.batch_size, self.channels, self.image_size, self.image_size),)


@dataclass(frozen=True)
class VectorBatches:
    """Classification of feature vectors (the tiny MLP of the tests).

    Attributes:
        batch_size: Vectors per rank.
        features: Features per vector.
        num_classes: Classes.
    """

    batch_size: int
    features: int = 16
    num_classes: int = 10

    def model_kwargs(self) -> dict[str, Any]:
        """The sizes the network takes from its data."""
        return {"num_classes": self.num_classes}

    def make_batch(self, seed: int) -> Batch:
        """A batch drawn from ``seed``."""
        g = _generator(seed)
        return {
            "x": torch.randn(self.batch_size, self.features, generator=g),
            "y": torch.randint(0, self.num_classes, (self.batch_size,), generator=g),
        }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy."""
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def example_input(self) -> tuple[Any, ...]:
        """Positional inputs of one forward pass."""
        return (torch.zeros(self.batch_size, self.features),)


@dataclass(frozen=True)
class QuestionAnsweringBatches:
    """Extractive question answering (BERT): token ids and answer start/end positions.

    Attributes:
        batch_size: Sequences per rank.
        seq_len: Tokens per sequence.
        vocab_size: Vocabulary (handed to the network as ``vocab_size``).
    """

    batch_size: int
    seq_len: int = 384
    vocab_size: int = 30522

    def model_kwargs(self) -> dict[str, Any]:
        """The sizes the network takes from its data."""
        return {"vocab_size": self.vocab_size, "max_position_embeddings": max(512, self.seq_len)}

    def make_batch(self, seed: int) -> Batch:
        """A batch drawn from ``seed``."""
        g = _generator(seed)
        shape = (self.batch_size, self.seq_len)
        return {
            "input_ids": torch.randint(1, self.vocab_size, shape, generator=g),
            "attention_mask": torch.ones(*shape, dtype=torch.long),
            "start_positions": torch.randint(0, self.seq_len, (self.batch_size,), generator=g),
            "end_positions": torch.randint(0, self.seq_len, (self.batch_size,), generator=g),
        }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The model's own span loss."""
        return model(**batch).loss

    def example_input(self) -> tuple[Any, ...]:
        """Positional inputs of one forward pass."""
        return (torch.ones(self.batch_size, self.seq_len, dtype=torch.long),)


@dataclass(frozen=True)
class TranslationBatches:
    """Translation (encoder-decoder): source and target token ids, teacher forcing.

    Attributes:
        batch_size: Sentence pairs per rank.
        seq_len: Source tokens (and target tokens fed to the decoder).
        vocab_size: Joint vocabulary (handed to the network as ``vocab_size``).
    """

    batch_size: int
    seq_len: int = 32
    vocab_size: int = 10000

    def model_kwargs(self) -> dict[str, Any]:
        """The sizes the network takes from its data."""
        return {"vocab_size": self.vocab_size}

    def make_batch(self, seed: int) -> Batch:
        """A batch drawn from ``seed``; token 0 is padding, so only real tokens are drawn."""
        g = _generator(seed)
        return {
            "src": torch.randint(1, self.vocab_size, (self.batch_size, self.seq_len), generator=g),
            "tgt": torch.randint(
                1, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g
            ),
        }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-token cross-entropy."""
        logits = model(batch["src"], batch["tgt"][:, :-1])
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["tgt"][:, 1:].reshape(-1)
        )

    def example_input(self) -> tuple[Any, ...]:
        """Positional inputs of one forward pass."""
        shape = (self.batch_size, self.seq_len)
        return (torch.ones(*shape, dtype=torch.long), torch.ones(*shape, dtype=torch.long))


@dataclass
class BenchModel:
    """A model ready to be timed.

    Attributes:
        model: the network, in training mode.
        make_batch: ``seed -> batch``; each rank passes its own seed so the
            ranks see different data of the same shape, as in data parallelism.
        loss: ``(model, batch) -> scalar loss`` (a mean over the batch).
        batch_size: examples per rank.
        example_input: positional inputs of one forward pass, for the cost
            model's shape extraction.
        skip_layers: regexes of modules K-FAC leaves alone (the strategy
            node's, filled by :func:`row_model` from the row).
        weight_sharing: how K-FAC treats positions ("expand"/"reduce"; idem).
    """

    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    batch_size: int
    example_input: tuple[Any, ...] = ()
    skip_layers: list[str] = field(default_factory=list)
    weight_sharing: str = "expand"


def build(model: Mapping[str, Any], batch: Mapping[str, Any], seed: int = 0) -> BenchModel:
    """Build a benchmark model with identical initial weights on every rank.

    Args:
        model: the network's config (``_target_`` and arguments), as in ``conf/model``.
        batch: the synthetic batch's config (``_target_`` naming one of the
            batch classes above, and its sizes), as in ``conf/workload``.
        seed: torch seed for the weights (the same on all ranks).
    """
    from hydra.utils import instantiate

    batches = instantiate(dict(batch))
    torch.manual_seed(seed)
    network = instantiate(dict(model), **batches.model_kwargs())
    network.train()
    return BenchModel(
        model=network,
        make_batch=batches.make_batch,
        loss=batches.loss,
        batch_size=int(batches.batch_size),
        example_input=batches.example_input(),
    )


def json_value(value: Any) -> Any:
    """A row's cell decoded: JSON text parsed, a value read back already decoded kept."""
    return json.loads(value) if isinstance(value, str) else value


#: The synthetic batches a workload's ``batch`` (and a row's ``model_batch``) may name.
BATCHES = (ImageBatches, VectorBatches, QuestionAnsweringBatches, TranslationBatches)


def batch_target(target: str) -> str:
    """A batch ``_target_`` as this module names its class.

    Rows record their batch's ``_target_``; rows written before this module got
    its present name call the same class by its earlier, no longer importable
    path. A target whose class is one of :data:`BATCHES` is named after this
    module; any other is returned unchanged.
    """
    name = str(target).rsplit(".", 1)[-1]
    return f"{__name__}.{name}" if name in {c.__name__ for c in BATCHES} else str(target)


def upgrade_batch(value: Any) -> Any:
    """A row's ``model_batch`` (JSON text or a mapping) with :func:`batch_target`'s name."""
    batch = json_value(value)
    if not isinstance(batch, Mapping) or "_target_" not in batch:
        return value
    target = batch_target(batch["_target_"])
    if target == batch["_target_"]:
        return value
    batch = {**batch, "_target_": target}
    return json.dumps(batch) if isinstance(value, str) else batch


def row_model(row: Mapping[str, Any], *, paper: bool = False, seed: int = 0) -> BenchModel:
    """The model a benchmark row was measured on, or its paper-sized version.

    Args:
        row: a timing row (``model_config``, ``model_batch``, ``model_paper``,
            ``skip_layers`` and ``weight_sharing`` are read; JSON strings or
            already decoded values).
        paper: apply the row's ``model_paper`` overrides (the papers' sizes).
        seed: torch seed for the weights.
    """
    model = dict(json_value(row["model_config"]))
    batch = dict(json_value(upgrade_batch(row["model_batch"])))
    if paper:
        overrides = json_value(row.get("model_paper") or "{}") or {}
        model.update(overrides.get("model") or {})
        batch.update(overrides.get("batch") or {})
    bench = build(model, batch, seed=seed)
    bench.skip_layers = list(json_value(row.get("skip_layers") or "[]") or [])
    bench.weight_sharing = str(row.get("weight_sharing") or "expand")
    return bench
