"""An encoder-decoder Transformer for translation with explicit attention projections.

K-FAC preconditions exactly the ``nn.Linear``/``nn.Conv2d`` modules whose hooks fire.
``torch.nn.MultiheadAttention`` hides most of attention from it: queries, keys and
values share one bare ``in_proj_weight`` (a parameter, not a module, so never
preconditioned) and ``out_proj`` is called functionally (its hooks never fire). The
DP-KFAC authors' Transformer (jadore801120/attention-is-all-you-need-pytorch, as used
by lzhangbv/kfac_pytorch) instead computes queries, keys, values and the attention
output with separate bias-free ``nn.Linear`` layers, and the papers precondition them.
This model does the same, so K-FAC sees every attention projection and every
feed-forward layer. Its module names are the authors' (``layer_stack``, ``slf_attn``,
``enc_attn``, ``pos_ffn``, ``w_qs``/``w_ks``/``w_vs``/``fc``, ``w_1``/``w_2``), which
are also those of :func:`dpkfac.costmodel.zoo.transformer`, so the layer list the
benchmark measures and the one the cost model predicts are the same list.

Everything else follows the previous ``torch.nn.Transformer`` model of the presets:
post-LN blocks with a final LayerNorm after each stack, dropout on the embedded input,
the attention weights, after each sublayer and inside the feed-forward block, ReLU,
Xavier-uniform projections, sinusoidal positions, and a joint vocabulary whose
embedding is tied to the output projection (``generator``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "MultiHeadAttention",
    "PositionwiseFeedForward",
    "TranslationTransformer",
    "sinusoidal_positions",
]


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """The fixed sine/cosine position encodings of Vaswani et al. (2017)."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model)
    )
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: d_model // 2])
    return table


class MultiHeadAttention(nn.Module):
    """Post-LN attention sublayer: ``LayerNorm(x + Dropout(fc(Attention(x, memory))))``.

    Queries come from ``x``, keys and values from ``memory`` (``x`` itself for
    self-attention), each through its own bias-free ``nn.Linear`` called as a
    module, so K-FAC's hooks capture all four projections. The attention itself
    is :func:`torch.nn.functional.scaled_dot_product_attention` (scaled by
    ``1/sqrt(d_model/nhead)``, dropout on the attention weights in training).

    Args:
        d_model: Model width (split evenly over the heads).
        nhead: Attention heads.
        dropout: Dropout on the attention weights and on the sublayer output.
    """

    def __init__(self, d_model: int, nhead: int, dropout: float = 0.1) -> None:
        super().__init__()
        if d_model % nhead:
            raise ValueError(f"d_model={d_model} is not divisible by nhead={nhead}")
        self.nhead = nhead
        self.attention_dropout = dropout
        # Registration order is the K-FAC layer order (and the cost model's).
        self.w_qs = nn.Linear(d_model, d_model, bias=False)
        self.w_ks = nn.Linear(d_model, d_model, bias=False)
        self.w_vs = nn.Linear(d_model, d_model, bias=False)
        self.fc = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        """(N, L, d_model) -> (N, heads, L, d_model / heads)."""
        n, length, d = x.shape
        return x.view(n, length, self.nhead, d // self.nhead).transpose(1, 2)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attend from ``x`` (N, Lq, d) to ``memory`` (N, Lk, d).

        Args:
            x: Queries, and the residual.
            memory: Keys and values.
            mask: Boolean, broadcastable to (N, heads, Lq, Lk); True where a
                query may attend to a key.
        """
        q = self._split(self.w_qs(x))
        k = self._split(self.w_ks(memory))
        v = self._split(self.w_vs(memory))
        p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        out = out.transpose(1, 2).reshape(x.shape)
        return self.layer_norm(x + self.dropout(self.fc(out)))


class PositionwiseFeedForward(nn.Module):
    """Post-LN feed-forward sublayer: ``LayerNorm(x + Dropout(w_2(Dropout(relu(w_1 x)))))``.

    Args:
        d_model: Model width.
        dim_feedforward: Inner width.
        dropout: Dropout inside the block and on its output.
    """

    def __init__(self, d_model: int, dim_feedforward: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, dim_feedforward)
        self.w_2 = nn.Linear(dim_feedforward, d_model)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The sublayer applied at every position."""
        inner = self.dropout(F.relu(self.w_1(x)))
        return self.layer_norm(x + self.dropout(self.w_2(inner)))


class EncoderLayer(nn.Module):
    """Self-attention, then the feed-forward block."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__()
        self.slf_attn = MultiHeadAttention(d_model, nhead, dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, dim_feedforward, dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One encoder block (``mask``: which source keys each position may attend to)."""
        return self.pos_ffn(self.slf_attn(x, x, mask))


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder states, then the feed-forward block."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__()
        self.slf_attn = MultiHeadAttention(d_model, nhead, dropout)
        self.enc_attn = MultiHeadAttention(d_model, nhead, dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, dim_feedforward, dropout)

    def forward(
        self,
        y: torch.Tensor,
        memory: torch.Tensor,
        self_mask: torch.Tensor,
        memory_mask: torch.Tensor,
    ) -> torch.Tensor:
        """One decoder block.

        ``self_mask`` is causal and hides target padding; ``memory_mask`` hides source padding.
        """
        y = self.slf_attn(y, y, self_mask)
        return self.pos_ffn(self.enc_attn(y, memory, memory_mask))


class Encoder(nn.Module):
    """A stack of encoder blocks and a final LayerNorm."""

    def __init__(
        self, num_layers: int, d_model: int, nhead: int, dim_feedforward: int, dropout: float
    ) -> None:
        super().__init__()
        self.layer_stack = nn.ModuleList(
            EncoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_layers)
        )
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Encoder states of the embedded source ``x``."""
        for layer in self.layer_stack:
            x = layer(x, mask)
        return self.layer_norm(x)


class Decoder(nn.Module):
    """A stack of decoder blocks and a final LayerNorm."""

    def __init__(
        self, num_layers: int, d_model: int, nhead: int, dim_feedforward: int, dropout: float
    ) -> None:
        super().__init__()
        self.layer_stack = nn.ModuleList(
            DecoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_layers)
        )
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(
        self,
        y: torch.Tensor,
        memory: torch.Tensor,
        self_mask: torch.Tensor,
        memory_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder states of the embedded target prefix ``y``."""
        for layer in self.layer_stack:
            y = layer(y, memory, self_mask, memory_mask)
        return self.layer_norm(y)


class TranslationTransformer(nn.Module):
    """Post-LN encoder-decoder Transformer with a joint vocabulary (the DP-KFAC paper's model).

    K-FAC layers, in order: per encoder block ``slf_attn.{w_qs,w_ks,w_vs,fc}`` and
    ``pos_ffn.{w_1,w_2}``; per decoder block the same plus ``enc_attn.{w_qs,...,fc}``.
    The embedding and the tied vocabulary projection (``embed``, ``generator``) are
    left to the base optimizer by the presets (``skip_layers``).

    Args:
        vocab_size: Joint source/target vocabulary size.
        pad_id: Padding token id (masked in attention and the loss).
        d_model: Model width.
        nhead: Attention heads.
        num_encoder_layers: Encoder blocks.
        num_decoder_layers: Decoder blocks.
        dim_feedforward: Feed-forward width.
        dropout: Dropout rate.
        share_embeddings: Tie the output projection to the embedding matrix.
        max_len: Longest sequence the position table covers.
    """

    def __init__(
        self,
        vocab_size: int,
        pad_id: int = 0,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 2,
        num_decoder_layers: int = 2,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        share_embeddings: bool = True,
        max_len: int = 512,
    ) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, mean=0.0, std=d_model**-0.5)
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        sizes = (d_model, nhead, dim_feedforward, dropout)
        self.encoder = Encoder(num_encoder_layers, *sizes)
        self.decoder = Decoder(num_decoder_layers, *sizes)
        for module in (*self.encoder.modules(), *self.decoder.modules()):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
        self.generator = nn.Linear(d_model, vocab_size, bias=False)
        if share_embeddings:
            self.generator.weight = self.embed.weight

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d_model) + self.positions[: tokens.size(1)]
        return self.dropout(x)

    def _keys(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, 1, 1, L): True at the real (non-padding) tokens, the keys one may attend to."""
        return (tokens != self.pad_id)[:, None, None, :]

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states and the source padding mask (True at padding)."""
        return self.encoder(self._embed(source), self._keys(source)), source == self.pad_id

    def decode(
        self, target: torch.Tensor, memory: torch.Tensor, source_mask: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits for every target prefix (``source_mask``: True at padding)."""
        length = target.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=target.device).tril()
        self_mask = self._keys(target) & causal
        out = self.decoder(self._embed(target), memory, self_mask, ~source_mask[:, None, None, :])
        return self.generator(out)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits, shape (batch, target length, vocabulary)."""
        memory, mask = self.encode(source)
        return self.decode(target, memory, mask)

    @torch.no_grad()
    def greedy_decode(self, source: torch.Tensor, bos: int, eos: int, max_len: int) -> torch.Tensor:
        """Greedy translations, padded with ``pad_id`` after each sentence's end token."""
        memory, mask = self.encode(source)
        out = torch.full((source.size(0), 1), bos, dtype=torch.long, device=source.device)
        finished = torch.zeros(source.size(0), dtype=torch.bool, device=source.device)
        for _ in range(max_len):
            step = self.decode(out, memory, mask)[:, -1].argmax(dim=-1)
            step = step.masked_fill(finished, self.pad_id)
            out = torch.cat([out, step.unsqueeze(1)], dim=1)
            finished |= step == eos
            if bool(finished.all()):
                break
        return out
