"""Analytic K-FAC shapes of the papers' models, without building them.

The 64-GPU table needs ResNet-50, BERT-large and the Transformer; building
BERT-large just to read its shapes costs gigabytes, so these functions write
the :class:`~dpkfac.costmodel.shapes.ModelShapes` down from the
architectures. ``tests/test_costmodel.py`` checks them against
:func:`~dpkfac.costmodel.shapes.shapes_from_model` on the real torchvision
and Hugging Face modules.
"""

from __future__ import annotations

from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.options import KFACOptions
from dpkfac.plan.assignment import LayerShape

__all__ = ["PAPER_MODELS", "ZOO", "bert_qa", "cifar_resnet", "resnet50", "transformer"]


class _Builder:
    """A model's layers, biases and other parameters, at a local batch of ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.layers: list[LayerShape] = []
        self.bias: list[bool] = []
        self.others: list[int] = []

    def linear(
        self, name: str, d_in: int, d_out: int, t: int, bias: bool = True, norm: bool = False
    ) -> None:
        """A Linear layer over ``t`` positions, then with ``norm`` a LayerNorm of ``d_out``."""
        self.layers.append(
            LayerShape.linear(name, d_in, d_out, bias=bias, batch_size=self.n, positions=t)
        )
        self.bias.append(bias)
        self.others += [d_out, d_out] if norm else []

    def conv_bn(self, name: str, c_in: int, c_out: int, k: int, hw: int) -> None:
        """A bias-free Conv2d followed by a BatchNorm of ``c_out``."""
        self.layers.append(
            LayerShape.conv2d(name, c_in, c_out, (k, k), (hw, hw), batch_size=self.n)
        )
        self.bias.append(False)
        self.others += [c_out, c_out]

    def build(self) -> ModelShapes:
        n = len(self.layers)
        return ModelShapes(tuple(self.layers), tuple(self.bias), (True,) * n, tuple(self.others))


def _out(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def resnet50(batch_size: int = 32, image_size: int = 224, num_classes: int = 1000) -> ModelShapes:
    """torchvision ``resnet50()`` (v1.5: stride in the 3x3 conv), BatchNorm left to SGD."""
    b = _Builder(batch_size)
    hw = _out(image_size, 7, 2, 3)
    b.conv_bn("conv1", 3, 64, 7, hw)
    hw = _out(hw, 3, 2, 1)
    inplanes = 64
    for stage, (planes, blocks, stride) in enumerate(
        [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1
    ):
        for i in range(blocks):
            s = stride if i == 0 else 1
            out_hw = _out(hw, 3, s, 1)
            p = f"layer{stage}.{i}."
            b.conv_bn(p + "conv1", inplanes, planes, 1, hw)
            b.conv_bn(p + "conv2", planes, planes, 3, out_hw)
            b.conv_bn(p + "conv3", planes, 4 * planes, 1, out_hw)
            if i == 0 and (s != 1 or inplanes != 4 * planes):
                b.conv_bn(p + "downsample.0", inplanes, 4 * planes, 1, out_hw)
            inplanes, hw = 4 * planes, out_hw
    b.linear("fc", 2048, num_classes, 1)
    return b.build()


def bert_qa(
    batch_size: int = 4,
    seq_len: int = 384,
    hidden: int = 1024,
    layers: int = 24,
    intermediate: int = 4096,
    vocab: int = 30522,
    max_positions: int = 512,
    type_vocab: int = 2,
) -> ModelShapes:
    """Hugging Face ``BertForQuestionAnswering`` (defaults: BERT-large, SQuAD's 384 tokens).

    Every Linear is a K-FAC layer with ``T = seq_len``: Q, K, V and the
    attention output (hidden²), the FFN (hidden x intermediate and back) and
    the QA head (hidden x 2). Embeddings and LayerNorms stay with SGD.
    """
    b = _Builder(batch_size)
    b.others += [vocab * hidden, max_positions * hidden, type_vocab * hidden, hidden, hidden]
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        for m in ("query", "key", "value"):
            b.linear(p + f"attention.self.{m}", hidden, hidden, seq_len)
        b.linear(p + "attention.output.dense", hidden, hidden, seq_len, norm=True)
        b.linear(p + "intermediate.dense", hidden, intermediate, seq_len)
        b.linear(p + "output.dense", intermediate, hidden, seq_len, norm=True)
    b.linear("qa_outputs", hidden, 2, seq_len)
    return b.build()


def transformer(
    batch_size: int = 128,
    src_len: int = 32,
    tgt_len: int = 32,
    d_model: int = 512,
    heads: int = 8,
    d_inner: int = 2048,
    encoder_layers: int = 6,
    decoder_layers: int = 6,
    vocab: int = 10000,
) -> ModelShapes:
    """The DP-KFAC paper's Transformer (jadore801120/attention-is-all-you-need-pytorch).

    Its attention has separate bias-free Linear layers ``w_qs``, ``w_ks``,
    ``w_vs`` and ``fc`` (``d_k = d_v = d_model / heads``); the FFN has
    ``w_1``/``w_2`` with biases; every attention and FFN sublayer ends in a
    LayerNorm, and each stack in a final one. Source and target embeddings
    and the output projection share one ``vocab x d_model`` weight (the
    projection is the skipped pre-softmax layer). Multi30K's padded sentence
    lengths are about 30 tokens (an estimate; ``src_len``/``tgt_len`` set
    ``T``).

    The layout, names included, is that of the model the presets train and
    the benchmark measures (``experiments.models.translation``), with
    ``skip_layers`` ``embed`` and ``generator``; ``tests/test_translation_model.py``
    checks that :func:`~dpkfac.costmodel.shapes.shapes_from_model` of the
    benchmark's paper-size model equals this function's result.
    """
    b = _Builder(batch_size)
    b.others.append(vocab * d_model)

    def attention(p: str, t_q: int, t_kv: int) -> None:
        b.linear(p + "w_qs", d_model, d_model, t_q, bias=False)
        b.linear(p + "w_ks", d_model, d_model, t_kv, bias=False)
        b.linear(p + "w_vs", d_model, d_model, t_kv, bias=False)
        b.linear(p + "fc", d_model, d_model, t_q, bias=False, norm=True)

    def ffn(p: str, t: int) -> None:
        b.linear(p + "w_1", d_model, d_inner, t)
        b.linear(p + "w_2", d_inner, d_model, t, norm=True)

    for i in range(encoder_layers):
        attention(f"encoder.layer_stack.{i}.slf_attn.", src_len, src_len)
        ffn(f"encoder.layer_stack.{i}.pos_ffn.", src_len)
    b.others += [d_model, d_model]
    for i in range(decoder_layers):
        attention(f"decoder.layer_stack.{i}.slf_attn.", tgt_len, tgt_len)
        attention(f"decoder.layer_stack.{i}.enc_attn.", tgt_len, src_len)
        ffn(f"decoder.layer_stack.{i}.pos_ffn.", tgt_len)
    b.others += [d_model, d_model]
    return b.build()


def cifar_resnet(
    depth: int = 32, batch_size: int = 128, image_size: int = 32, num_classes: int = 10
) -> ModelShapes:
    """He et al.'s CIFAR ResNet-(6n+2) with identity shortcuts (option A), as the presets train it.

    A 3x3 stem to 16 channels, three stages of n basic blocks (16, 32 and 64
    channels; the first block of stages 2 and 3 has stride 2) and a linear
    classifier; every convolution is a K-FAC layer, BatchNorm stays with SGD.
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth must be 6n + 2 >= 8, got {depth}")
    blocks = (depth - 2) // 6
    b = _Builder(batch_size)
    b.conv_bn("conv1", 3, 16, 3, image_size)
    in_planes, hw, index = 16, image_size, 0
    for stage, planes in enumerate((16, 32, 64)):
        for i in range(blocks):
            hw = _out(hw, 3, 2 if stage > 0 and i == 0 else 1, 1)
            p = f"layers.{index}."
            b.conv_bn(p + "conv1", in_planes, planes, 3, hw)
            b.conv_bn(p + "conv2", planes, planes, 3, hw)
            in_planes, index = planes, index + 1
    b.linear("fc", 64, num_classes, 1)
    return b.build()


_EXPAND = KFACOptions(compute_method="eigen", kl_clip=0.001, weight_sharing="expand")
_BERT = KFACOptions(compute_method="eigen", kl_clip=None, weight_sharing="reduce")
_TRANSFORMER = KFACOptions(compute_method="inverse", kl_clip=0.001, weight_sharing="reduce")

#: The papers' models at their per-rank batches, with the preconditioner options
#: of their ``conf/experiment`` presets (what :func:`~dpkfac.costmodel.predict`
#: takes as ``kfac``), by the names the experiments use for them.
ZOO: dict[str, tuple[ModelShapes, KFACOptions]] = {
    "resnet32": (cifar_resnet(32, batch_size=128), _EXPAND),
    "resnet50": (resnet50(batch_size=32), _EXPAND),
    "bert_base": (bert_qa(batch_size=4, hidden=768, layers=12, intermediate=3072), _BERT),
    "bert_large": (bert_qa(batch_size=4), _BERT),
    "transformer": (transformer(batch_size=128), _TRANSFORMER),
}

#: The 64-GPU table's models (the DP-KFAC paper's), labelled as the paper does.
PAPER_MODELS: dict[str, tuple[ModelShapes, KFACOptions]] = {
    "ResNet-50": ZOO["resnet50"],
    "BERT-large": ZOO["bert_large"],
    "Transformer": ZOO["transformer"],
}
