"""BERT for extractive question answering (Hugging Face ``transformers``)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from experiments.config import ExperimentError

# The fake-data model: small enough for a 2-step CPU smoke run at sequence length 384.
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


def bert_for_question_answering(
    vocab_size: int,
    pad_token_id: int = 0,
    tiny: bool = False,
    pretrained: str | None = None,
    hidden_size: int = 768,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    intermediate_size: int = 3072,
    hidden_dropout_prob: float = 0.1,
    attention_probs_dropout_prob: float = 0.1,
    max_position_embeddings: int = 512,
) -> nn.Module:
    """A ``BertForQuestionAnswering``, pretrained from a local folder or freshly initialised.

    Fine-tuning needs pretrained weights (the paper fine-tunes BERT-base); they are
    read from a local directory only, never downloaded.

    Args:
        vocab_size: Tokenizer vocabulary size (ignored with ``pretrained``).
        pad_token_id: The tokenizer's padding id.
        tiny: Use the tiny :data:`TINY` sizes (fake-data runs).
        pretrained: Directory written by ``save_pretrained`` (config and weights).
        hidden_size: Width of a fresh model.
        num_hidden_layers: Depth of a fresh model.
        num_attention_heads: Heads of a fresh model.
        intermediate_size: Feed-forward width of a fresh model.
        hidden_dropout_prob: Dropout on hidden states.
        attention_probs_dropout_prob: Dropout on attention weights.
        max_position_embeddings: Longest sequence of a fresh model.

    Raises:
        ExperimentError: ``pretrained`` is not a directory.
    """
    from transformers import BertConfig, BertForQuestionAnswering

    if pretrained is not None:
        path = Path(pretrained).expanduser()
        if not path.is_dir():
            raise ExperimentError(
                f"model.pretrained={pretrained}: {path} is not a directory (expected the output "
                "of save_pretrained, e.g. bert-base-uncased's config.json and weights)"
            )
        return BertForQuestionAnswering.from_pretrained(str(path), local_files_only=True)
    sizes = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "intermediate_size": intermediate_size,
    }
    if tiny:
        sizes = dict(TINY)
    config = BertConfig(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        hidden_dropout_prob=hidden_dropout_prob,
        attention_probs_dropout_prob=attention_probs_dropout_prob,
        max_position_embeddings=max_position_embeddings,
        **sizes,
    )
    return BertForQuestionAnswering(config)
