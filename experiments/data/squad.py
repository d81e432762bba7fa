"""SQuAD v1.1 from the official JSON files, through Hugging Face ``datasets``.

Examples (question, context, answers) are turned into fixed-length features
the usual way: question and context are tokenised as a pair, long contexts are
split into overlapping windows (``doc_stride``), and each training window
labels the answer's first and last token (or [CLS] when the answer is not
inside it). Evaluation windows keep their character offsets so that the task
can map predicted token spans back to text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from experiments.config import ExperimentError
from experiments.data.loading import DataModule
from experiments.data.tokenization import corpus_wordpiece
from experiments.distributed import DistEnv
from experiments.tasks.base import Task
from experiments.tasks.question_answering import QuestionAnsweringTask

TRAIN_FILE, DEV_FILE = "train-v1.1.json", "dev-v1.1.json"
_WORDS = [
    "river",
    "castle",
    "painter",
    "museum",
    "engine",
    "harbor",
    "violin",
    "orchard",
    "comet",
    "glacier",
    "treaty",
    "library",
    "falcon",
    "tunnel",
    "marble",
    "lantern",
    "compass",
    "meadow",
    "bridge",
    "canyon",
    "festival",
    "island",
    "garden",
    "theory",
]


def _fake_article(rng: np.random.Generator, index: int, questions: int, answers: int) -> dict:
    """One article of random prose whose answers are spans of its context."""
    paragraphs = []
    for p in range(2):
        # Some contexts are longer than a 384-token window, to exercise doc_stride.
        length = int(rng.choice([25, 60, 420]))
        words = [str(w) for w in rng.choice(_WORDS, size=length)]
        context = " ".join(words) + "."
        qas = []
        for q in range(questions):
            spans = []
            for _ in range(answers):
                start = int(rng.integers(0, length - 3))
                size = int(rng.integers(1, 4))
                char = len(" ".join(words[:start])) + (1 if start else 0)
                spans.append({"text": " ".join(words[start : start + size]), "answer_start": char})
            question = f"which {words[int(rng.integers(0, length))]} is near the {words[0]}?"
            qas.append({"id": f"fake-{index}-{p}-{q}", "question": question, "answers": spans})
        paragraphs.append({"context": context, "qas": qas})
    return {"title": f"Fake_{index}", "paragraphs": paragraphs}


def write_squad_json(path: Path, articles: int, questions: int, answers: int, seed: int) -> None:
    """Write a file in SQuAD v1.1's layout: data / paragraphs / qas / answers."""
    rng = np.random.default_rng(seed)
    payload = {
        "version": "1.1",
        "data": [_fake_article(rng, i, questions, answers) for i in range(articles)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def read_squad(path: Path, cache_dir: str | None) -> Any:
    """One row per question: id, title, context, question, answers{text, answer_start}."""
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()  # the run has its own progress bar
    raw = load_dataset(
        "json", data_files=str(path), field="data", split="train", cache_dir=cache_dir
    )

    def flatten(batch: dict[str, list]) -> dict[str, list]:
        rows: dict[str, list] = {k: [] for k in ("id", "title", "context", "question", "answers")}
        for title, paragraphs in zip(batch["title"], batch["paragraphs"], strict=True):
            for paragraph in paragraphs:
                for qa in paragraph["qas"]:
                    rows["id"].append(qa["id"])
                    rows["title"].append(title)
                    rows["context"].append(paragraph["context"])
                    rows["question"].append(qa["question"].lstrip())
                    rows["answers"].append(
                        {
                            "text": [a["text"] for a in qa["answers"]],
                            "answer_start": [a["answer_start"] for a in qa["answers"]],
                        }
                    )
        return rows

    return raw.map(flatten, batched=True, remove_columns=raw.column_names)


class _Indexed(Dataset):
    """Yields (features, position) so predictions can be matched to their windows."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[dict, int]:
        return self.dataset[index], index


class SquadData(DataModule):
    """SQuAD v1.1 windows for a BERT-style question-answering model.

    Args:
        tokenizer: Directory of a pretrained fast tokenizer (the model's); None is
            only allowed with ``fake``, where a WordPiece tokenizer is built from
            the fake corpus's words (the same in every run).
        max_seq_length: Window length in tokens (question + context + specials).
        doc_stride: Overlap between consecutive windows of one context.
        max_answer_length: Longest predicted answer, in tokens.
        n_best: Start/end candidates considered per window.
        cache_dir: Hugging Face datasets cache (None: its default; fake runs use
            the scratch folder).
        **kwargs: See :class:`~experiments.data.loading.DataModule`.
    """

    name = "SQuAD v1.1"
    source = (
        "Get train-v1.1.json and dev-v1.1.json from https://rajpurkar.github.io/SQuAD-explorer/ "
        "into data.root."
    )

    def __init__(
        self,
        tokenizer: str | None = None,
        max_seq_length: int = 384,
        doc_stride: int = 128,
        max_answer_length: int = 30,
        n_best: int = 20,
        cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not 0 < doc_stride < max_seq_length // 2:
            raise ExperimentError(
                f"invalid value data.doc_stride={doc_stride}: expected 0 < doc_stride < "
                f"data.max_seq_length / 2 = {max_seq_length // 2}"
            )
        self.tokenizer_path = tokenizer
        self.max_seq_length = max_seq_length
        self.doc_stride = doc_stride
        self.max_answer_length = max_answer_length
        self.n_best = n_best
        self.cache_dir = cache_dir
        self.tokenizer: Any = None

    def required_paths(self) -> list[str]:
        """The official training and development files."""
        return [TRAIN_FILE, DEV_FILE]

    def write_fake(self, root: Path) -> None:
        """Six training and three development articles (two answers per dev question)."""
        write_squad_json(root / TRAIN_FILE, articles=6, questions=3, answers=1, seed=0)
        write_squad_json(root / DEV_FILE, articles=3, questions=2, answers=2, seed=1)
        self.cache_dir = self.cache_dir or str(root / "hf_cache")

    def _load_tokenizer(self, root: Path) -> Any:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if self.tokenizer_path is None:
            if not self.fake:
                raise ExperimentError(
                    "squad needs a pretrained tokenizer: set model.pretrained=PATH (a local "
                    "directory written by save_pretrained, e.g. bert-base-uncased)"
                )
            contexts = read_squad(root / TRAIN_FILE, self.cache_dir)
            corpus = list(contexts["context"]) + list(contexts["question"])
            tokenizer = corpus_wordpiece(corpus)  # the same in every run and on every rank
            return PreTrainedTokenizerFast(
                tokenizer_object=tokenizer,
                unk_token="[UNK]",
                pad_token="[PAD]",
                cls_token="[CLS]",
                sep_token="[SEP]",
                mask_token="[MASK]",
                model_input_names=["input_ids", "token_type_ids", "attention_mask"],
            )
        path = Path(self.tokenizer_path).expanduser()
        if not path.is_dir():
            raise ExperimentError(f"tokenizer directory {path} does not exist (model.pretrained)")
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if not tokenizer.is_fast:
            raise ExperimentError(
                f"the tokenizer in {path} is not a fast tokenizer (offsets needed)"
            )
        return tokenizer

    def _encode(self, examples: dict[str, list]) -> Any:
        return self.tokenizer(
            examples["question"],
            examples["context"],
            truncation="only_second",
            max_length=self.max_seq_length,
            stride=self.doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length",
        )

    def _train_features(self, examples: dict[str, list]) -> dict[str, list]:
        enc = self._encode(examples)
        sample_map = enc.pop("overflow_to_sample_mapping")
        offsets = enc.pop("offset_mapping")
        enc["start_positions"], enc["end_positions"] = [], []
        for i, window in enumerate(offsets):
            cls = enc["input_ids"][i].index(self.tokenizer.cls_token_id)
            sequence = enc.sequence_ids(i)
            answers = examples["answers"][sample_map[i]]
            first = sequence.index(1)
            last = len(sequence) - 1 - sequence[::-1].index(1)
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            if not (window[first][0] <= start_char and window[last][1] >= end_char):
                enc["start_positions"].append(cls)  # answer not in this window
                enc["end_positions"].append(cls)
                continue
            start = first
            while start <= last and window[start][0] <= start_char:
                start += 1
            end = last
            while end >= first and window[end][1] >= end_char:
                end -= 1
            enc["start_positions"].append(start - 1)
            enc["end_positions"].append(end + 1)
        return enc

    def _eval_features(self, examples: dict[str, list]) -> dict[str, list]:
        enc = self._encode(examples)
        sample_map = enc.pop("overflow_to_sample_mapping")
        enc["example_id"] = []
        for i in range(len(enc["input_ids"])):
            sequence = enc.sequence_ids(i)
            enc["example_id"].append(examples["id"][sample_map[i]])
            enc["offset_mapping"][i] = [
                tuple(o) if sequence[k] == 1 else None
                for k, o in enumerate(enc["offset_mapping"][i])
            ]
        return enc

    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """Tokenise both splits into windows (cached by Hugging Face datasets)."""
        assert root is not None
        self.tokenizer = self._load_tokenizer(root)
        train_examples = read_squad(root / TRAIN_FILE, self.cache_dir)
        self.eval_examples = read_squad(root / DEV_FILE, self.cache_dir)
        train = train_examples.map(
            self._train_features, batched=True, remove_columns=train_examples.column_names
        )
        self.eval_features = self.eval_examples.map(
            self._eval_features, batched=True, remove_columns=self.eval_examples.column_names
        )
        inputs = list(self.tokenizer.model_input_names)
        train = train.with_format("torch", columns=[*inputs, "start_positions", "end_positions"])
        evaluation = self.eval_features.select_columns(inputs).with_format("torch")
        return train, _Indexed(evaluation)

    def build_task(self) -> Task:
        """Span prediction scored by exact match and F1."""
        return QuestionAnsweringTask(
            examples=self.eval_examples,
            features=self.eval_features,
            max_answer_length=self.max_answer_length,
            n_best=self.n_best,
        )

    def model_kwargs(self) -> dict[str, Any]:
        """Vocabulary size, padding id, and whether to build the tiny fake-run model."""
        return {
            "vocab_size": len(self.tokenizer),
            "pad_token_id": self.tokenizer.pad_token_id,
            "tiny": self.fake and self.tokenizer_path is None,
        }
