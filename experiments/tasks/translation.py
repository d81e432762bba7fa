"""Machine translation: label-smoothed token cross-entropy, greedy decoding, BLEU."""

from __future__ import annotations

from typing import Any

import sacrebleu
import torch
import torch.nn.functional as F
from torch import nn

from experiments.data.tokenization import BOS, EOS, PAD
from experiments.tasks.base import Task


class TranslationTask(Task):
    """Teacher-forced training, greedy decoding, corpus BLEU on detokenised text.

    Args:
        tokenizer: The joint ``tokenizers.Tokenizer`` (decodes to plain text).
        references: Reference translations of the evaluation split, raw text, in order.
        label_smoothing: Label smoothing of the training loss.
        decode_extra_tokens: How much longer than its source a translation may grow.
    """

    primary_metric = "bleu"

    def __init__(
        self,
        tokenizer: Any,
        references: list[str],
        label_smoothing: float,
        decode_extra_tokens: int = 50,
    ) -> None:
        self.tokenizer = tokenizer
        self.decode_extra_tokens = decode_extra_tokens
        self.references = references
        self.label_smoothing = label_smoothing
        self.pad = tokenizer.token_to_id(PAD)
        self.bos = tokenizer.token_to_id(BOS)
        self.eos = tokenizer.token_to_id(EOS)

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy over the non-padding target tokens."""
        source, target = batch
        logits = model(source, target[:, :-1])
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            target[:, 1:].reshape(-1),
            ignore_index=self.pad,
            label_smoothing=self.label_smoothing,
        )

    def predict(self, model: nn.Module, batch: Any) -> list[Any]:
        """One record per sentence: (index, detokenised greedy translation)."""
        source, index = batch
        tokens = model.greedy_decode(
            source, self.bos, self.eos, source.size(1) + self.decode_extra_tokens
        )
        texts = self.tokenizer.decode_batch(tokens.tolist(), skip_special_tokens=True)
        return list(zip(index.tolist(), texts, strict=True))

    def score(self, records: list[Any]) -> dict[str, float]:
        """sacreBLEU (13a tokenisation) of the translations against the references."""
        hypotheses = dict(records)
        ordered = [hypotheses[i] for i in range(len(self.references))]
        bleu = sacrebleu.corpus_bleu(ordered, [self.references])
        return {"bleu": float(bleu.score), "examples": float(len(ordered))}
