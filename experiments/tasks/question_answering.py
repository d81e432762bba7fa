"""Extractive question answering: span loss, logits-to-text post-processing, EM/F1.

The model scores every token as the answer's start and end. A prediction is
the best-scoring valid span over all windows of an example: start and end
inside the context, end not before start, at most ``max_answer_length``
tokens, searched among the ``n_best`` highest starts and ends of each window
(the standard SQuAD post-processing). Scores come from torchmetrics' SQuAD
metric (exact match and F1 against all reference answers, in percent).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import nn
from torchmetrics.functional.text import squad

from experiments.tasks.base import Task


def best_span(
    windows: list[tuple[np.ndarray, np.ndarray, list[tuple[int, int] | None]]],
    context: str,
    max_answer_length: int,
    n_best: int,
) -> str:
    """The text of the highest-scoring valid span over an example's windows.

    Args:
        windows: Per window: start logits, end logits and the character offsets
            of each token (None outside the context).
        context: The example's context.
        max_answer_length: Longest span in tokens.
        n_best: How many top starts and ends to pair up per window.
    """
    best_score, best_text = -np.inf, ""
    for start_logits, end_logits, offsets in windows:
        starts = np.argsort(start_logits)[::-1][:n_best]
        ends = np.argsort(end_logits)[::-1][:n_best]
        for s in starts:
            for e in ends:
                if offsets[s] is None or offsets[e] is None:
                    continue
                if e < s or e - s + 1 > max_answer_length:
                    continue
                score = start_logits[s] + end_logits[e]
                if score > best_score:
                    best_score = score
                    best_text = context[offsets[s][0] : offsets[e][1]]
    return best_text


class QuestionAnsweringTask(Task):
    """SQuAD-style span prediction with a ``*ForQuestionAnswering`` model.

    Args:
        examples: Evaluation examples (``id``, ``context``, ``answers``).
        features: Their windows (``example_id``, ``offset_mapping``), in the
            order of the evaluation dataset.
        max_answer_length: Longest predicted answer in tokens.
        n_best: Start/end candidates per window.
    """

    primary_metric = "f1"

    def __init__(self, examples: Any, features: Any, max_answer_length: int, n_best: int) -> None:
        self.ids = list(examples["id"])
        self.contexts = dict(zip(self.ids, examples["context"], strict=True))
        self.answers = dict(zip(self.ids, examples["answers"], strict=True))
        self.window_example = list(features["example_id"])
        self.window_offsets = list(features["offset_mapping"])
        self.max_answer_length = max_answer_length
        self.n_best = n_best

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's own loss: mean cross-entropy of the start and end positions."""
        return model(**batch).loss

    def predict(self, model: nn.Module, batch: Any) -> list[Any]:
        """One record per window: (window index, start logits, end logits)."""
        inputs, index = batch
        out = model(**inputs)
        starts = out.start_logits.float().cpu().numpy()
        ends = out.end_logits.float().cpu().numpy()
        return list(zip(index.tolist(), starts, ends, strict=True))

    def predictions(self, records: list[Any]) -> dict[str, str]:
        """Answer text per example id, from all windows' logits."""
        windows: dict[str, list] = defaultdict(list)
        for index, start, end in records:
            example = self.window_example[index]
            windows[example].append((start, end, self.window_offsets[index]))
        return {
            ex: best_span(windows[ex], self.contexts[ex], self.max_answer_length, self.n_best)
            for ex in self.ids
        }

    def score(self, records: list[Any]) -> dict[str, float]:
        """Exact match and F1 (percent) against every reference answer."""
        answers = self.predictions(records)
        preds = [{"prediction_text": answers[ex], "id": ex} for ex in self.ids]
        target = [
            {
                "answers": {
                    "text": list(self.answers[ex]["text"]),
                    "answer_start": list(self.answers[ex]["answer_start"]),
                },
                "id": ex,
            }
            for ex in self.ids
        ]
        result = squad(preds, target)
        return {
            "exact_match": float(result["exact_match"]),
            "f1": float(result["f1"]),
            "examples": float(len(self.ids)),
        }
