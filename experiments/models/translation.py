"""An encoder-decoder Transformer for translation, built on ``torch.nn.Transformer``."""

from __future__ import annotations

import math

import torch
from torch import nn


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


class TranslationTransformer(nn.Module):
    """Post-LN Transformer with a joint vocabulary (the DP-KFAC paper's Multi30K model).

    K-FAC sees the feed-forward ``linear1``/``linear2`` layers of every block;
    attention projections are parameters or functional calls inside
    ``nn.MultiheadAttention``, and the embedding and the vocabulary projection
    (``embed``, ``generator``) are left to the base optimizer by the preset.

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
        block = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout, batch_first=True
        )
        # Nested tensors (a prototype inference fast path) would change the encoder's
        # numerics between training and evaluation; keep the plain path.
        encoder = nn.TransformerEncoder(
            block, num_encoder_layers, nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=nhead,
            num_decoder_layers=num_decoder_layers,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            custom_encoder=encoder,
            batch_first=True,
        )
        self.generator = nn.Linear(d_model, vocab_size, bias=False)
        if share_embeddings:
            self.generator.weight = self.embed.weight

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * math.sqrt(self.d_model) + self.positions[: tokens.size(1)]
        return self.dropout(x)

    def encode(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states and the source padding mask."""
        mask = source == self.pad_id
        return self.transformer.encoder(self._embed(source), src_key_padding_mask=mask), mask

    def decode(
        self, target: torch.Tensor, memory: torch.Tensor, source_mask: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits for every target prefix."""
        length = target.size(1)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=target.device), 1)
        out = self.transformer.decoder(
            self._embed(target),
            memory,
            tgt_mask=causal,
            tgt_key_padding_mask=target == self.pad_id,
            memory_key_padding_mask=source_mask,
            tgt_is_causal=True,
        )
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
