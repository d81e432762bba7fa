"""Checkpoints: resuming is bitwise, and unusable checkpoints fail naming the file."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from experiments.checkpoint import CheckpointDir, atomic_save, load_checkpoint
from experiments.config import ExperimentError

# (preset, strategy, extra overrides): plain CNN; augmentation through a loader
# worker; dropout in a Transformer.
CASES = [
    ("digits_cnn", "dp_kfac", []),
    ("cifar10_resnet32", "d_kfac", ["data.num_workers=1", "model.depth=8"]),
    ("multi30k_transformer", "spd_kfac", []),
]


def _state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_bitwise_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"  # NaN == NaN


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "strategy", "extra"), CASES)
def test_resume_is_bitwise_identical(preset, strategy, extra, train, tiny, tmp_path):
    common = [f"experiment={preset}", f"strategy={strategy}", *tiny[preset], *extra]
    straight = train(*common, "trainer.max_steps=4", out=tmp_path / "straight")
    train(*common, "trainer.max_steps=2", out=tmp_path / "first")
    resumed = train(
        *common,
        "trainer.max_steps=4",
        f"trainer.resume={tmp_path / 'first' / 'checkpoints' / 'last.pt'}",
        out=tmp_path / "second",
    )
    assert resumed["steps"] == 4 and resumed["steps_this_run"] == 2
    a = _state(tmp_path / "straight" / "checkpoints" / "last.pt")
    b = _state(tmp_path / "second" / "checkpoints" / "last.pt")
    for key in ("model", "optimizer", "scheduler", "preconditioner", "rng", "step"):
        _assert_bitwise_equal(a[key], b[key], key)
    metrics = [k for k in straight if k in ("accuracy", "bleu", "f1", "exact_match")]
    assert metrics and all(straight[k] == resumed[k] for k in metrics)


@pytest.fixture
def checkpoint(train, tmp_path):
    train("trainer.max_steps=1", out=tmp_path / "base")
    return tmp_path / "base" / "checkpoints" / "last.pt"


def test_other_world_size_continues_with_a_warning(checkpoint, train, tmp_path, caplog):
    """An elastic restart with another number of ranks continues, not bitwise, and says so."""
    state = _state(checkpoint)
    state["world_size"] = 2
    state["preconditioner"]["world_size"] = 2
    two = tmp_path / "two_ranks.pt"
    torch.save(state, two)
    with (
        caplog.at_level(logging.WARNING, logger="experiments.trainer"),
        pytest.warns(RuntimeWarning, match="world_size=2.*world_size=1.*not a bitwise"),
    ):
        result = train("trainer.max_steps=3", f"trainer.resume={two}")
    assert (result["steps"], result["steps_this_run"]) == (3, 2)
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"resuming {two}, written by 2 rank(s), with 1" in warning
    assert "RNG states cannot be restored for a different world size" in warning


def test_other_strategy_is_refused(checkpoint, train):
    with pytest.raises(ExperimentError, match=f"{checkpoint}.*strategy 'dp_kfac'.*'d_kfac'"):
        train("strategy=d_kfac", "trainer.max_steps=2", f"trainer.resume={checkpoint}")


def test_corrupt_and_missing_files_are_named(checkpoint, train, tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(ExperimentError, match=f"checkpoint file {corrupt} is corrupt"):
        train("trainer.max_steps=2", f"trainer.resume={corrupt}")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ExperimentError, match=f"{other} is corrupt or not a checkpoint .missing"):
        load_checkpoint(other, world_size=1, strategy="dp_kfac")
    missing = tmp_path / "missing.pt"
    with pytest.raises(ExperimentError, match=f"checkpoint file {missing} does not exist"):
        train("trainer.max_steps=2", f"trainer.resume={missing}")


def test_resuming_a_finished_run_only_evaluates(checkpoint, train):
    result = train("trainer.max_steps=1", f"trainer.resume={checkpoint}")
    assert (result["steps"], result["steps_this_run"]) == (1, 0)
    assert "accuracy" in result


def test_checkpoint_dir_is_atomic_and_pruned(tmp_path):
    folder = CheckpointDir(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        folder.save({"step": step}, step)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["last.pt", "step_000000002.pt", "step_000000003.pt"]
    assert _state(tmp_path / "ckpt" / "last.pt")["step"] == 3

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    target = tmp_path / "x.pt"
    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"bad": Unpicklable()}, target)
    assert not target.exists()
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary file left behind
