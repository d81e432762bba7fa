"""Multi30K task 1 (Elliott et al. 2016) from the official sentence-aligned text files."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from experiments.data.loading import DataModule
from experiments.data.tokenization import BOS, EOS, PAD, shared_tokenizer, train_bpe
from experiments.distributed import DistEnv
from experiments.tasks.base import Task
from experiments.tasks.translation import TranslationTask

FAKE_VOCAB_SIZE = 200
# (German, English) phrase pairs the fake corpus is composed from.
_SUBJECTS = [("ein hund", "a dog"), ("eine frau", "a woman"), ("ein mann", "a man"),
             ("zwei kinder", "two children"), ("ein junge", "a boy")]  # fmt: skip
_VERBS = [("läuft", "runs"), ("spielt", "plays"), ("sitzt", "sits"), ("steht", "stands")]
_PLACES = [("im park", "in the park"), ("auf der straße", "on the street"),
           ("am strand", "on the beach"), ("im schnee", "in the snow")]  # fmt: skip


def write_parallel_files(
    root: Path, splits: dict[str, int], langs: tuple[str, str], seed: int = 0
) -> None:
    """Write ``<split>.<lang>`` files of aligned, randomly composed sentences."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, count in splits.items():
        pairs = []
        for _ in range(count):
            parts = [table[int(rng.integers(len(table)))] for table in (_SUBJECTS, _VERBS, _PLACES)]
            de = " ".join(p[0] for p in parts).capitalize() + "."
            en = " ".join(p[1] for p in parts).capitalize() + "."
            pairs.append((de, en))
        for column, lang in enumerate(langs):
            (root / f"{split}.{lang}").write_text("\n".join(p[column] for p in pairs) + "\n")


def _read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


class _Pairs(Dataset):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


class Multi30KData(DataModule):
    """Multi30K sentence pairs, BPE-encoded with a joint vocabulary.

    Args:
        src_lang: Source language suffix (``de``).
        tgt_lang: Target language suffix (``en``).
        vocab_size: Joint BPE vocabulary size.
        max_length: Longest encoded sentence, in tokens (longer ones are cut).
        eval_split: Split scored by BLEU (``val`` or ``test_2016_flickr``).
        label_smoothing: Label smoothing of the training loss.
        decode_extra_tokens: Greedy translations may be this much longer than the source.
        **kwargs: See :class:`~experiments.data.loading.DataModule`.
    """

    name = "Multi30K"
    source = (
        "Get the task-1 raw files (train, val, test_2016_flickr in de and en; plain or .gz) "
        "from https://github.com/multi30k/dataset (data/task1/raw) into data.root."
    )

    def __init__(
        self,
        src_lang: str = "de",
        tgt_lang: str = "en",
        vocab_size: int = 8000,
        max_length: int = 100,
        eval_split: str = "test_2016_flickr",
        label_smoothing: float = 0.1,
        decode_extra_tokens: int = 50,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.decode_extra_tokens = decode_extra_tokens
        self.langs = (src_lang, tgt_lang)
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.eval_split = eval_split
        self.label_smoothing = label_smoothing
        self.tokenizer: Any = None
        self.references: list[str] = []

    def required_paths(self) -> list[str]:
        """Both languages of the training and the evaluation split."""
        return [f"{split}.{lang}" for split in ("train", self.eval_split) for lang in self.langs]

    def find(self, root: Path, rel: str) -> Path | None:
        """The file as distributed, or its gzipped form."""
        for path in (root / rel, root / f"{rel}.gz"):
            if path.exists():
                return path
        return None

    def write_fake(self, root: Path) -> None:
        """300 training pairs (two full batches of the preset) and 16 per evaluation split."""
        splits = {"train": 300, "val": 16, "test_2016_flickr": 16}
        write_parallel_files(root, splits, self.langs)
        self.vocab_size = FAKE_VOCAB_SIZE

    def _encode(self, lines: list[str]) -> list[torch.Tensor]:
        bos, eos = self.tokenizer.token_to_id(BOS), self.tokenizer.token_to_id(EOS)
        out = []
        for enc in self.tokenizer.encode_batch(lines):
            ids = [bos, *enc.ids[: self.max_length - 2], eos]
            out.append(torch.tensor(ids, dtype=torch.long))
        return out

    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """Read the splits, learn BPE on the training text (rank 0), encode."""
        assert root is not None
        files = {}
        for split in ("train", self.eval_split):
            for lang in self.langs:
                path = self.find(root, f"{split}.{lang}")
                if path is None:
                    raise self.not_found(root / f"{split}.{lang}")
                files[split, lang] = _read_lines(path)
        src, tgt = self.langs
        corpus = files["train", src] + files["train", tgt]
        self.tokenizer = shared_tokenizer(env, lambda: train_bpe(corpus, self.vocab_size))
        train = list(
            zip(self._encode(files["train", src]), self._encode(files["train", tgt]), strict=True)
        )
        sources = self._encode(files[self.eval_split, src])
        self.references = files[self.eval_split, tgt]
        return _Pairs(train), _Pairs([(s, i) for i, s in enumerate(sources)])

    def collate(self, train: bool) -> Any:
        """Pad to the longest sentence of the batch."""
        pad = self.tokenizer.token_to_id(PAD)

        def pairs(
            batch: list[tuple[torch.Tensor, torch.Tensor]],
        ) -> tuple[torch.Tensor, torch.Tensor]:
            sources, targets = zip(*batch, strict=True)
            return (
                pad_sequence(sources, batch_first=True, padding_value=pad),
                pad_sequence(targets, batch_first=True, padding_value=pad),
            )

        def indexed(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
            sources, index = zip(*batch, strict=True)
            return pad_sequence(sources, batch_first=True, padding_value=pad), torch.tensor(index)

        return pairs if train else indexed

    def build_task(self) -> Task:
        """Translation scored by BLEU against the raw references."""
        return TranslationTask(
            self.tokenizer, self.references, self.label_smoothing, self.decode_extra_tokens
        )

    def model_kwargs(self) -> dict[str, Any]:
        """Joint vocabulary size and padding id."""
        return {
            "vocab_size": self.tokenizer.get_vocab_size(),
            "pad_id": self.tokenizer.token_to_id(PAD),
        }
