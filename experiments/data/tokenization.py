"""Tokenizers trained at run time with Hugging Face ``tokenizers``.

Multi30K uses a joint BPE vocabulary learnt from its training split (as the
reference code builds its vocabulary from the data); training is not guaranteed to
break ties identically in every process, so rank 0 trains and every rank receives
the same serialised tokenizer. Fake SQuAD runs, for which no pretrained tokenizer
may be downloaded, use a WordPiece tokenizer whose vocabulary is the fake corpus's
words, built rather than learnt, so every run and every rank gets the same one.
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


def corpus_wordpiece(lines: Iterable[str]) -> Tokenizer:
    """An uncased BERT-style WordPiece tokenizer whose vocabulary is the corpus's words.

    ``[CLS] question [SEP] context [SEP]`` with token type 1 for the context, like the
    tokenizer of ``bert-base-uncased``. The vocabulary is built, not learnt: the specials,
    then every character of the corpus (alone and as a ``##`` continuation, so any word can
    be spelt), then every word, each group sorted. It is therefore a function of the text:
    ``tokenizers``' WordPiece trainer breaks ties by hash order and learns another
    vocabulary in every process, which gave the same fake data other token ids in a
    resumed run, or in the next run of a comparison.
    """
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words: set[str] = set()
    for line in lines:
        pieces = pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line))
        words.update(word for word, _ in pieces)
    chars = sorted({c for word in words for c in word})
    vocab = [*BERT_SPECIALS, *chars, *(f"##{c}" for c in chars)]
    vocab += sorted(words - set(vocab))
    tokenizer = Tokenizer(
        models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]")
    )
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
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
