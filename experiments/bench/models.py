"""Benchmark models with fixed-shape synthetic batches.

A timing benchmark needs the same tensor shapes on every step and every rank,
so each builder returns the model together with a batch factory and a loss,
not a data loader. The CIFAR ResNets, BERT for question answering and the
translation Transformer come from the training side's builders
(:mod:`experiments.models`), so the benchmark times the very models the
presets train; ResNet-50 is torchvision's. Sizes come from
``conf/bench/model/*.yaml``; the options that make a model affordable on a
CPU (a width divisor, a shorter sequence, fewer layers) are explicit keys
there, so the paper's sizes are one override away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]


@dataclass
class BenchModel:
    """A model ready to be timed.

    Attributes:
        model: the network, in training mode.
        make_batch: ``seed -> batch``; each rank passes its own seed so the
            ranks see different data of the same shape, as in data parallelism.
        loss: ``(model, batch) -> scalar loss`` (a mean over the batch).
        skip_layers: regexes of modules K-FAC leaves alone (vocabulary layers).
        weight_sharing: "expand" for convolutions, "reduce" for sequence
            models as in the DP-KFAC reference code.
        example_input: positional inputs of one forward pass, for the cost
            model's shape extraction.
    """

    model: nn.Module
    make_batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    skip_layers: list[str] = field(default_factory=list)
    weight_sharing: str = "expand"
    example_input: tuple[Any, ...] = ()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _image_model(model: nn.Module, batch_size: int, image_size: int, classes: int) -> BenchModel:
    def make_batch(seed: int) -> Batch:
        g = _generator(seed)
        return {
            "x": torch.randn(batch_size, 3, image_size, image_size, generator=g),
            "y": torch.randint(0, classes, (batch_size,), generator=g),
        }

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return F.cross_entropy(m(b["x"]), b["y"])

    example = (torch.zeros(batch_size, 3, image_size, image_size),)
    return BenchModel(model, make_batch, loss, example_input=example)


def cifar_resnet(
    depth: int = 32, batch_size: int = 32, image_size: int = 32, num_classes: int = 10
) -> BenchModel:
    """He et al.'s CIFAR ResNet-(6n+2), the paper's ResNet-32/110."""
    from experiments.models.cifar_resnet import CIFARResNet

    model = CIFARResNet(num_classes=num_classes, depth=depth)
    return _image_model(model, batch_size, image_size, num_classes)


def resnet50(
    width_divisor: int = 1, batch_size: int = 32, image_size: int = 224, num_classes: int = 1000
) -> BenchModel:
    """torchvision's ResNet-50, optionally with every stage's width divided.

    The bottleneck layout (3, 4, 6, 3 blocks, expansion 4) is kept; dividing
    the widths shrinks the largest factor from 4609 (eigh of about 30 s on
    one CPU core) to 1153 at ``width_divisor=4``, which is what makes the
    "decompose every step" setting affordable here.
    """
    import torchvision
    from torchvision.models.resnet import Bottleneck, ResNet

    if width_divisor == 1:
        model = torchvision.models.resnet50(weights=None, num_classes=num_classes)
        return _image_model(model, batch_size, image_size, num_classes)
    if width_divisor < 1 or 64 % width_divisor:
        raise ValueError(f"width_divisor must divide 64, got {width_divisor}")

    class NarrowResNet(ResNet):
        def _make_layer(self, block: type, planes: int, *args: Any, **kwargs: Any) -> nn.Module:
            return super()._make_layer(block, planes // width_divisor, *args, **kwargs)

    model = NarrowResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes)
    # conv1/bn1 keep torchvision's 64 stem channels; only the classifier input changes.
    model.fc = nn.Linear(512 * Bottleneck.expansion // width_divisor, num_classes)
    return _image_model(model, batch_size, image_size, num_classes)


def bert_qa(
    hidden_size: int = 768,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    intermediate_size: int = 3072,
    seq_len: int = 384,
    batch_size: int = 4,
    vocab_size: int = 30522,
) -> BenchModel:
    """The training side's ``BertForQuestionAnswering`` (random weights, nothing downloaded)."""
    from experiments.models.bert import bert_for_question_answering

    model = bert_for_question_answering(
        vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max(512, seq_len),
    )

    def make_batch(seed: int) -> Batch:
        g = _generator(seed)
        return {
            "input_ids": torch.randint(1, vocab_size, (batch_size, seq_len), generator=g),
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "start_positions": torch.randint(0, seq_len, (batch_size,), generator=g),
            "end_positions": torch.randint(0, seq_len, (batch_size,), generator=g),
        }

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return m(**b).loss

    example = (torch.ones(batch_size, seq_len, dtype=torch.long),)
    return BenchModel(model, make_batch, loss, weight_sharing="reduce", example_input=example)


def transformer(
    d_model: int = 512,
    nhead: int = 8,
    num_layers: int = 6,
    dim_feedforward: int = 2048,
    seq_len: int = 32,
    batch_size: int = 128,
    vocab_size: int = 10000,
) -> BenchModel:
    """The training side's Multi30K ``TranslationTransformer`` (encoder-decoder, tied vocabulary).

    K-FAC leaves the embedding, the tied vocabulary projection and the
    attention output projections (called functionally, so never hooked) to
    SGD, as the ``multi30k_transformer`` preset does.
    """
    from experiments.models.translation import TranslationTransformer

    model = TranslationTransformer(
        vocab_size,
        d_model=d_model,
        nhead=nhead,
        num_encoder_layers=num_layers,
        num_decoder_layers=num_layers,
        dim_feedforward=dim_feedforward,
    )

    def make_batch(seed: int) -> Batch:
        g = _generator(seed)
        # Token 0 is padding; real tokens only, so every position counts.
        return {
            "src": torch.randint(1, vocab_size, (batch_size, seq_len), generator=g),
            "tgt": torch.randint(1, vocab_size, (batch_size, seq_len + 1), generator=g),
        }

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        logits = m(b["src"], b["tgt"][:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["tgt"][:, 1:].reshape(-1))

    example = (
        torch.ones(batch_size, seq_len, dtype=torch.long),
        torch.ones(batch_size, seq_len, dtype=torch.long),
    )
    return BenchModel(
        model,
        make_batch,
        loss,
        skip_layers=["embed", "generator", "out_proj"],
        weight_sharing="reduce",
        example_input=example,
    )


def mlp(d_in: int = 16, hidden: int = 32, classes: int = 10, batch_size: int = 8) -> BenchModel:
    """A two-layer perceptron: the tests' tiny model (exact bytes in well under a second)."""
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def make_batch(seed: int) -> Batch:
        g = _generator(seed)
        return {
            "x": torch.randn(batch_size, d_in, generator=g),
            "y": torch.randint(0, classes, (batch_size,), generator=g),
        }

    def loss(m: nn.Module, b: Batch) -> torch.Tensor:
        return F.cross_entropy(m(b["x"]), b["y"])

    return BenchModel(model, make_batch, loss, example_input=(torch.zeros(batch_size, d_in),))


BUILDERS: dict[str, Callable[..., BenchModel]] = {
    "cifar_resnet": cifar_resnet,
    "resnet50": resnet50,
    "bert_qa": bert_qa,
    "transformer": transformer,
    "mlp": mlp,
}


def build(kind: str, seed: int = 0, **kwargs: Any) -> BenchModel:
    """Build a benchmark model with identical initial weights on every rank.

    Args:
        kind: a key of :data:`BUILDERS`.
        seed: torch seed for the weights (the same on all ranks).
        **kwargs: the builder's size options, from ``conf/bench/model``.
    """
    if kind not in BUILDERS:
        raise ValueError(
            f"unknown benchmark model kind {kind!r}; expected one of {sorted(BUILDERS)}"
        )
    torch.manual_seed(seed)
    bench = BUILDERS[kind](**kwargs)
    bench.model.train()
    return bench
