"""Tokenizers trained at run time with Hugging Face ``tokenizers``.

Multi30K uses a joint BPE vocabulary learnt from its training split (as the
reference code builds its vocabulary from the data), and fake SQuAD runs use a
WordPiece tokenizer learnt from the fake corpus, since no pretrained one may be
downloaded. Training is not guaranteed to break ties identically in every
process, so rank 0 trains and every rank receives the same serialised
tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from experiments.distributed import DistEnv

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_bpe(lines: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-pair-encoding tokenizer whose decoder restores the original spacing.

    Words are split on whitespace with SentencePiece's metaspace marker, so
    ``decode(encode(text))`` gives detokenised text, as BLEU on raw references
    needs. Specials: ``<pad>`` = 0, ``<unk>``, ``<s>``, ``</s>``.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, UNK, BOS, EOS])
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def train_wordpiece(lines: Iterable[str], vocab_size: int) -> Tokenizer:
    """An uncased BERT-style WordPiece tokenizer with BERT's pair template.

    ``[CLS] question [SEP] context [SEP]`` with token type 1 for the context,
    like the tokenizer of ``bert-base-uncased``.
    """
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS))
    tokenizer.train_from_iterator(lines, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


def shared_tokenizer(env: DistEnv, train: Callable[[], Tokenizer]) -> Tokenizer:
    """Train on rank 0 only and give every rank the identical tokenizer."""
    serialised = train().to_str() if env.is_main else None
    return Tokenizer.from_str(env.broadcast_object(serialised))
