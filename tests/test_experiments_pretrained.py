"""``model.pretrained=PATH``: BERT weights and tokenizer come from a local directory."""

from __future__ import annotations

import string
import warnings

import pytest
import torch

from experiments.config import ExperimentError
from experiments.models.bert import bert_for_question_answering


def _save_tiny_bert(path) -> None:
    """A tiny BERT-for-QA and its WordPiece tokenizer, as ``save_pretrained`` writes them."""
    from transformers import BertConfig, BertForQuestionAnswering, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase]
    vocab += [f"##{c}" for c in string.ascii_lowercase] + list(string.digits + string.punctuation)
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=512,
    )
    BertForQuestionAnswering(config).save_pretrained(path)


def test_pretrained_weights_load_from_a_local_directory(tmp_path) -> None:
    path = tmp_path / "bert"
    _save_tiny_bert(path)
    model = bert_for_question_answering(vocab_size=1, pretrained=str(path))
    from transformers import BertForQuestionAnswering

    saved = BertForQuestionAnswering.from_pretrained(str(path), local_files_only=True)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), saved.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with pytest.raises(ExperimentError, match=r"model\.pretrained"):
        bert_for_question_answering(vocab_size=1, pretrained=str(tmp_path / "missing"))


@pytest.mark.slow
def test_squad_preset_trains_from_a_pretrained_directory(train, tiny, tmp_path) -> None:
    path = tmp_path / "bert"
    _save_tiny_bert(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(
            "experiment=squad_bert",
            *tiny["squad_bert"],
            f"model.pretrained={path}",
            "trainer.max_steps=2",
        )
    assert result["steps"] == 2 and any("f1" in k for k in result), result
    # from_pretrained() hands back an eval-mode model: training must switch it to
    # train mode, or K-FAC's hooks never capture (and warn about every layer).
    never_fired = [str(w.message) for w in caught if "never captured" in str(w.message)]
    assert never_fired == []
