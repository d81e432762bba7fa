"""Data paths, fake twins in the official formats, models and metrics of the presets."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.data.cifar import CIFAR10Data
from experiments.data.imagenet import ImageNetData
from experiments.data.loading import EpochSampler, SeededDataset
from experiments.data.multi30k import Multi30KData
from experiments.data.squad import SquadData
from experiments.distributed import DistEnv
from experiments.models.cifar_resnet import CIFARResNet
from experiments.models.translation import TranslationTransformer
from experiments.schedules import inverse_sqrt, warmup_multistep
from experiments.tasks.question_answering import best_span

LOADER = {"batch_size": 4, "eval_batch_size": 4, "num_workers": 0}


def test_fake_cifar_is_in_the_official_pickle_format(tmp_path):
    data = CIFAR10Data(root=None, fake=True, **LOADER)
    data.setup(DistEnv(), tmp_path)
    with open(tmp_path / "fake_data" / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    assert batch["data"].shape == (52, 3072) and batch["data"].dtype == np.uint8
    assert len(data.train_dataset) == 5 * 52 and len(data.eval_dataset) == 64
    image, label = data.train_dataset[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10


def test_fake_imagenet_is_jpeg_class_folders(tmp_path):
    data = ImageNetData(root=None, fake=True, image_size=32, **LOADER)
    data.setup(DistEnv(), tmp_path)
    assert len(list((tmp_path / "fake_data" / "train").glob("n*/*.JPEG"))) == 64
    assert data.model_kwargs() == {"num_classes": 4}
    assert data.eval_dataset[0][0].shape == (3, 32, 32)


def test_squad_windows_label_the_answer_tokens(tmp_path):
    data = SquadData(root=None, fake=True, max_seq_length=384, doc_stride=128, **LOADER)
    data.setup(DistEnv(), tmp_path)
    raw = json.loads((tmp_path / "fake_data" / "train-v1.1.json").read_text())
    assert raw["version"] == "1.1" and raw["data"][0]["paragraphs"][0]["qas"][0]["answers"]
    tokenizer = data.tokenizer
    long_contexts = 0
    for feature in data.train_dataset:
        start, end = int(feature["start_positions"]), int(feature["end_positions"])
        assert feature["input_ids"].shape == (384,)
        if start == 0:  # the answer is outside this window
            long_contexts += 1
            continue
        span = tokenizer.decode(feature["input_ids"][start : end + 1])
        assert span.replace(" ", "")  # a non-empty span of context words
    assert long_contexts > 0  # doc_stride windows were made for the long contexts
    # Perfect logits for every window give EM 100 via the real post-processing.
    task = data.build_task()
    records = []
    for index in range(len(data.eval_dataset)):
        offsets = task.window_offsets[index]
        example = task.window_example[index]
        answer = task.answers[example]
        s_char = answer["answer_start"][0]
        e_char = s_char + len(answer["text"][0])
        starts, ends = np.full(384, -10.0), np.full(384, -10.0)
        for k, o in enumerate(offsets):
            if o is not None and o[0] == s_char:
                starts[k] = 10.0
            if o is not None and o[1] == e_char:
                ends[k] = 10.0
        records.append((index, starts, ends))
    scores = task.score(records)
    assert scores["exact_match"] == pytest.approx(100.0) and scores["f1"] == pytest.approx(100.0)


def test_best_span_respects_context_and_length():
    context = "alpha beta gamma delta"
    offsets = [None, (0, 5), (6, 10), (11, 16), (17, 22), None]
    start = np.array([9.0, 1, 5, 0, 0, 9])
    end = np.array([9.0, 0, 0, 5, 1, 9])
    assert (
        best_span([(start, end, offsets)], context, max_answer_length=30, n_best=6) == "beta gamma"
    )
    assert best_span([(start, end, offsets)], context, max_answer_length=1, n_best=6) in {
        "beta",
        "gamma",
    }


def test_multi30k_bpe_roundtrip_and_bleu(tmp_path):
    data = Multi30KData(root=None, fake=True, **LOADER)
    data.setup(DistEnv(), tmp_path)
    lines = (tmp_path / "fake_data" / "train.en").read_text().splitlines()
    assert len(lines) == 300
    assert data.tokenizer.decode(data.tokenizer.encode(lines[0]).ids) == lines[0]
    task = data.build_task()
    perfect = task.score(list(enumerate(data.references)))
    assert perfect["bleu"] == pytest.approx(100.0)
    assert task.score([(i, "") for i in range(len(data.references))])["bleu"] == 0.0


def test_multi30k_reads_gzipped_files_and_names_missing_ones(tmp_path):
    import gzip

    root = tmp_path / "m30k"
    root.mkdir()
    for name in ("train.de", "train.en", "val.de"):
        with gzip.open(root / f"{name}.gz", "wt") as f:
            f.write("Ein Hund.\nEine Frau.\n")
    from experiments.config import ExperimentError

    data = Multi30KData(root=str(root), fake=False, eval_split="val", vocab_size=60, **LOADER)
    with pytest.raises(ExperimentError, match=f"{root}/val.en does not exist.*multi30k"):
        data.setup(DistEnv(), tmp_path)
    with gzip.open(root / "val.en.gz", "wt") as f:
        f.write("A dog.\nA woman.\n")
    data.setup(DistEnv(), tmp_path)
    assert data.references == ["A dog.", "A woman."]


def test_translation_model_decodes():
    model = TranslationTransformer(vocab_size=20, d_model=16, nhead=2, dim_feedforward=32).eval()
    source = torch.tensor([[2, 5, 6, 3], [2, 7, 3, 0]])
    assert model(source, source[:, :-1]).shape == (2, 3, 20)
    out = model.greedy_decode(source, bos=2, eos=3, max_len=5)
    assert out.shape[0] == 2 and out.shape[1] <= 6 and bool((out[:, 0] == 2).all())


@pytest.mark.parametrize(("depth", "params"), [(32, 0.46e6), (110, 1.7e6)])
def test_cifar_resnet_sizes_match_the_paper(depth, params):
    model = CIFARResNet(num_classes=10, depth=depth)
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(params, rel=0.03)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="6n"):
        CIFARResNet(num_classes=10, depth=33)


def test_epoch_sampler_shards_cover_once_and_resume_midway():
    shards = [list(EpochSampler(10, rank, 3, seed=7)) for rank in range(3)]
    indices = [i for shard in shards for _, i in shard]
    assert len(indices) == 9 and len(set(indices)) == 9
    sampler = EpochSampler(10, 1, 3, seed=7)
    sampler.set_epoch(0, start=1)
    assert list(sampler) == shards[1][1:]
    sampler.set_epoch(1)
    assert list(sampler) != shards[1]


def test_round_robin_loader_deals_each_rank_its_own_batches(tmp_path):
    """One loader of every rank's batches, dealt in turn (batch j to rank j % P, as
    accelerate's prepare deals them): rank r gets train_loader's batches, epoch by epoch,
    each epoch cut to the trainer's steps (3 ranks, 2 micro-batches per step)."""
    from experiments.data.digits import DigitsData

    data = DigitsData(root=None, fake=True, batch_size=7, eval_batch_size=8, num_workers=0)
    data.setup(DistEnv(), tmp_path)
    world, k = 3, 2
    steps = data.steps_per_epoch(DistEnv(0, world), k)
    dealt = data.round_robin_train_loader(DistEnv(0, world), seed=5, accumulate_grad_batches=k)
    for epoch in range(2):
        dealt.sampler.set_epoch(epoch)
        batches = list(dealt)
        # 160 training images: 7 batches of 7 per rank, 3 steps of 2; the 7th is left out.
        assert (steps, len(batches)) == (3, world * steps * k)
        for rank in range(world):
            own = data.train_loader(DistEnv(rank, world), seed=5)
            own.batch_sampler.sampler.set_epoch(epoch)
            wanted = list(own)[: steps * k]
            for got, want in zip(batches[rank::world], wanted, strict=True):
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_seeded_dataset_makes_augmentation_reproducible():
    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(1)

    data = SeededDataset(Noisy())
    before = torch.get_rng_state()
    assert torch.equal(data[(123, 0)], data[(123, 0)])
    assert not torch.equal(data[(123, 0)], data[(124, 0)])
    assert torch.equal(before, torch.get_rng_state())  # the global stream is untouched


def test_schedules():
    def lrs(factory, steps, **kwargs):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        scheduler = factory(optimizer, **kwargs)
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    steps = lrs(
        warmup_multistep,
        40,
        steps_per_epoch=10,
        total_steps=40,
        warmup_epochs=1,
        milestones=[2, 3],
        gamma=0.1,
    )
    assert steps[0] == pytest.approx(0.1) and steps[9] == pytest.approx(1.0)
    assert (
        steps[19] == pytest.approx(1.0)
        and steps[20] == pytest.approx(0.1)
        and steps[30] == pytest.approx(0.01)
    )
    noam = lrs(inverse_sqrt, 16, steps_per_epoch=1, total_steps=16, warmup_steps=4)
    assert max(noam) == pytest.approx(1.0) and noam.index(max(noam)) == 3
    assert noam[15] == pytest.approx(0.5)


@pytest.mark.slow
def test_multirun_sweeps_strategies(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "-m",
            "strategy=dp_kfac,d_kfac,spd_kfac",
            "data.fake=true",
            "trainer.max_steps=2",
            "trainer.progress_bar=false",
            "logger=none",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.parent.name for p in tmp_path.glob("*/metrics.json"))
    assert runs == ["0_dp_kfac", "1_d_kfac", "2_spd_kfac"]


def test_digits_validation_split_is_cut_from_training_images(tmp_path) -> None:
    """data.val_fraction holds out validation images from the training split only: the
    test split is the one the default run scores on, whatever the validation share."""
    from experiments.data.digits import DigitsData

    kw = {"root": None, "fake": False, "batch_size": 16, "eval_batch_size": 64, "num_workers": 0}
    plain = DigitsData(**kw)
    plain.setup(DistEnv(), tmp_path)
    held = DigitsData(**kw, val_fraction=0.1)
    held.setup(DistEnv(), tmp_path)
    assert plain.val_dataset is None
    assert held.val_dataset is not None
    n_train, n_val = len(held.train_dataset), len(held.val_dataset)
    assert n_train + n_val == len(plain.train_dataset) == 1437
    assert n_val == pytest.approx(0.1 * 1797, abs=1)
    assert torch.equal(held.eval_dataset.tensors[1], plain.eval_dataset.tensors[1])
    val_labels = held.val_dataset.tensors[1]
    assert set(val_labels.tolist()) == set(range(10))  # stratified
    with pytest.raises(ValueError, match=r"data.val_fraction=0.8"):
        DigitsData(**kw, val_fraction=0.8)
