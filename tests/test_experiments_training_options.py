"""Trainer options: mixed precision, gradient accumulation, K-FAC schedules, resuming, devices.

* ``trainer.precision=bf16|fp16`` trains (autocast; fp16 with a checkpointed loss
  scaler, resumed bitwise) and, on the full digits preset, reaches 95% accuracy.
* ``trainer.max_grad_norm`` bounds the preconditioned (and, with fp16, unscaled) update.
* ``trainer.accumulate_grad_batches=2`` with half the batch equals the whole batch.
* K-FAC hyperparameters take schedules of the step (``experiments.schedules``),
  checked before anything is built and resumed bitwise.
* ``trainer.resume=auto`` continues the run folder's last checkpoint; ``null`` never.
* ``trainer.device=cuda`` without CUDA is one clear error; the start-up log names
  the preconditioner.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from experiments.config import ExperimentError, validate
from experiments.schedules import StepSchedule, build_step_schedules, kfac_schedule

DIGITS = ["experiment=digits_cnn", "data.batch_size=16"]
SCHEDULE = (
    "{_target_:experiments.schedules.kfac_schedule,base:%s,milestones:[2],gamma:%s,unit:step}"
)


@pytest.fixture(scope="module", autouse=True)
def _single_thread(single_thread: None) -> None:
    """Run this module with one intra-op thread (see conftest)."""


def _ckpt(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def _assert_same_state(
    a: dict, b: dict, keys=("model", "optimizer", "scheduler", "scaler")
) -> None:
    for key in keys:
        assert _flatten(a[key]).keys() == _flatten(b[key]).keys(), key
        for name, value in _flatten(a[key]).items():
            other = _flatten(b[key])[name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"{key}.{name}"
            else:
                assert value == other, f"{key}.{name}"


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix: tree}


# -- mixed precision -----------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision, train, tmp_path):
    out = tmp_path / precision
    result = train(*DIGITS, "trainer.max_steps=3", f"trainer.precision={precision}", out=out)
    assert result["steps"] == 3 and math.isfinite(result["train_loss"])
    scaler = _ckpt(out)["scaler"]
    if precision == "fp16":
        assert scaler is not None and scaler["scale"] > 0
    else:
        assert scaler is None


def test_fp16_resume_is_bitwise(train, tmp_path):
    common = [*DIGITS, "trainer.precision=fp16"]
    train(*common, "trainer.max_steps=4", out=tmp_path / "straight")
    train(*common, "trainer.max_steps=2", out=tmp_path / "first")
    resumed = train(
        *common,
        "trainer.max_steps=4",
        f"trainer.resume={tmp_path / 'first' / 'checkpoints' / 'last.pt'}",
        out=tmp_path / "second",
    )
    assert resumed["steps_this_run"] == 2
    _assert_same_state(_ckpt(tmp_path / "straight"), _ckpt(tmp_path / "second"))


#: Epochs of the default preset (of its 10) the mixed-precision runs are compared over: there
#: fp32 reaches 0.956, fp16 0.969 and bf16 0.947 (seed 0), and fp16 takes 23 s on this host.
MIXED_EPOCHS = 4


@pytest.mark.slow
def test_mixed_precision_learns_as_fp32_does(train, tmp_path):
    """The default preset on the real digits, in fp32, bf16 and fp16 from the same seed: the
    mixed-precision runs end within 0.02 of fp32's test accuracy, itself above 0.93."""
    accuracy = {
        precision: train(
            "data.fake=false",
            f"trainer.precision={precision}",
            f"trainer.max_epochs={MIXED_EPOCHS}",
            out=tmp_path / precision,
        )["accuracy"]
        for precision in ("32", "bf16", "fp16")
    }
    assert accuracy["32"] >= 0.93, accuracy
    for precision in ("bf16", "fp16"):
        assert accuracy[precision] >= accuracy["32"] - 0.02, accuracy


@pytest.mark.parametrize(
    ("precision", "strategy"),
    [("32", "dp_kfac"), ("fp16", "dp_kfac"), ("fp16", "dp_kfac_owner_overlap")],
)
def test_max_grad_norm_bounds_the_preconditioned_update(
    precision, strategy, train, compose, tmp_path
):
    """``trainer.max_grad_norm`` clips after ``pre.step()``: one SGD step (lr 1, no momentum
    or weight decay) moves the weights by the bound itself. With fp16 the clip sees unscaled
    gradients, also under the overlapped mode, where ``pre.step()`` takes them scaled."""
    from experiments.distributed import DistEnv
    from experiments.train import build_components

    bound = 1e-3
    common = [
        *DIGITS,
        f"strategy={strategy}",
        f"trainer.precision={precision}",
        "scheduler.warmup_epochs=0",
        "optimizer.lr=1.0",
        "optimizer.momentum=0.0",
        "optimizer.weight_decay=0.0",
        f"trainer.max_grad_norm={bound}",
        "trainer.max_steps=1",
    ]
    train(*common, out=tmp_path / "run")
    after = _ckpt(tmp_path / "run")["model"]
    parts = build_components(compose("data.fake=true", *common), DistEnv(), tmp_path / "data")
    moved = torch.cat(
        [(after[n] - p.detach()).flatten() for n, p in parts.model.named_parameters()]
    )
    assert float(moved.norm()) == pytest.approx(bound, rel=1e-3)


def test_bad_precision_is_named(train):
    with pytest.raises(ExperimentError, match=r"trainer.precision=16: expected 32, bf16 or fp16"):
        train("trainer.precision=16")


# -- gradient accumulation ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["dp_kfac", "d_kfac", "none"])
def test_accumulation_equals_the_whole_batch(strategy, train, tmp_path):
    common = ["experiment=digits_cnn", f"strategy={strategy}", "trainer.max_steps=4"]
    whole = train(*common, "data.batch_size=16", out=tmp_path / "whole")
    parts = train(
        *common,
        "data.batch_size=8",
        "trainer.accumulate_grad_batches=2",
        out=tmp_path / "parts",
    )
    assert whole["steps"] == parts["steps"] == 4
    assert whole["epochs"] == parts["epochs"]  # same steps per epoch
    a, b = _ckpt(tmp_path / "whole"), _ckpt(tmp_path / "parts")
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    if strategy != "none":
        for name, entry in a["preconditioner"]["layers"].items():
            for which in ("A", "G"):
                torch.testing.assert_close(
                    entry[which], b["preconditioner"]["layers"][name][which], rtol=1e-4, atol=1e-7
                )
    assert math.isclose(whole["train_loss"], parts["train_loss"], rel_tol=1e-4)


def test_accumulation_drops_a_trailing_partial_group(train, tmp_path):
    # 160 fake training images, 16 per batch: 10 batches per epoch, 3 steps of 3.
    result = train(
        *DIGITS, "trainer.max_epochs=2", "trainer.accumulate_grad_batches=3", out=tmp_path / "r"
    )
    assert result["steps"] == 6 and result["epochs"] == 2


def test_accumulating_more_batches_than_an_epoch_has_is_named(train):
    with pytest.raises(ExperimentError, match=r"10 batch.*accumulate_grad_batches=11"):
        train(*DIGITS, "trainer.accumulate_grad_batches=11")


# -- K-FAC hyperparameter schedules --------------------------------------------------


def test_kfac_schedule_values():
    damping = kfac_schedule(steps_per_epoch=10, base=0.002, milestones=[40, 80], gamma=0.5)
    assert [damping(s) for s in (0, 399, 400, 799, 800)] == [0.002, 0.002, 0.001, 0.001, 0.0005]
    every = kfac_schedule(
        steps_per_epoch=7, base=10, milestones=[1, 3], gamma=10, unit="step", integer=True
    )
    assert [every(s) for s in (0, 1, 2, 3)] == [10, 100, 100, 1000]
    assert all(isinstance(every(s), int) for s in range(5))
    assert kfac_schedule(steps_per_epoch=1, base=1, milestones=[0], gamma=0.1, integer=True)(0) == 1
    assert isinstance(damping, StepSchedule)
    with pytest.raises(ValueError, match="unit must be one of"):
        kfac_schedule(steps_per_epoch=1, base=1.0, unit="epochs")
    with pytest.raises(ValueError, match="gamma must be a positive"):
        kfac_schedule(steps_per_epoch=1, base=1.0, gamma=0)


def test_schedule_nodes_are_built_with_the_epoch_length(compose):
    cfg = compose("experiment=imagenet_resnet50", f"strategy.inv_update_steps={SCHEDULE % (5, 2)}")
    built = build_step_schedules(cfg.strategy, steps_per_epoch=100)
    assert set(built) == {"damping", "inv_update_steps"}
    assert built["damping"](3999) == 0.002 and built["damping"](4000) == 0.001
    assert [built["inv_update_steps"](s) for s in (1, 2)] == [5, 10]
    assert isinstance(built["inv_update_steps"](0), int)


def test_bad_schedules_are_named_before_anything_is_built(compose):
    validate(compose("experiment=imagenet_resnet50"))
    with pytest.raises(ExperimentError, match=r"strategy.damping.*unit must be one of"):
        validate(compose("experiment=imagenet_resnet50", "strategy.damping.unit=epochs"))
    with pytest.raises(ExperimentError, match=r"strategy.damping.*base must be a positive"):
        validate(compose("experiment=imagenet_resnet50", "strategy.damping.base=-1"))
    with pytest.raises(ExperimentError, match=r"strategy.kl_clip"):
        validate(compose(f"strategy.kl_clip={SCHEDULE % (0.0, 1)}"))


def test_schedules_reach_the_preconditioner_and_resume_bitwise(compose, train, tmp_path):
    from experiments.models.digits_cnn import DigitsCNN
    from experiments.train import _build_preconditioner

    scheduled = [
        f"strategy.damping={SCHEDULE % (0.1, 0.5)}",
        f"strategy.kl_clip={SCHEDULE % (0.001, 0.1)}",
        f"strategy.factor_update_steps={SCHEDULE % (1, 2)}",
        f"strategy.inv_update_steps={SCHEDULE % (2, 2)}",
    ]
    cfg = compose(*DIGITS, *scheduled)
    model = DigitsCNN(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = _build_preconditioner(cfg, model, optimizer, steps_per_epoch=10, scaler=None)
    options = pre.options
    assert (options.damping(1), options.damping(2)) == (0.1, 0.05)
    assert math.isclose(options.kl_clip(2), 1e-4)
    assert (options.factor_update_steps(1), options.factor_update_steps(2)) == (1, 2)
    assert (options.inv_update_steps(1), options.inv_update_steps(2)) == (2, 4)

    common = [*DIGITS, *scheduled]
    train(*common, "trainer.max_steps=5", out=tmp_path / "straight")
    train(*common, "trainer.max_steps=3", out=tmp_path / "first")
    resumed = train(
        *common,
        "trainer.max_steps=5",
        f"trainer.resume={tmp_path / 'first' / 'checkpoints' / 'last.pt'}",
        out=tmp_path / "second",
    )
    assert resumed["steps_this_run"] == 2
    a, b = _ckpt(tmp_path / "straight"), _ckpt(tmp_path / "second")
    _assert_same_state(a, b, keys=("model", "optimizer", "preconditioner"))


# -- resuming, devices, start-up log ---------------------------------------------------


def test_resume_auto_continues_the_run_folder(train, tmp_path):
    out = tmp_path / "run"
    assert train(*DIGITS, "trainer.max_steps=2", out=out)["steps_this_run"] == 2
    again = train(*DIGITS, "trainer.max_steps=3", out=out)  # trainer.resume=auto (default)
    assert (again["steps"], again["steps_this_run"]) == (3, 1)
    fresh = train(*DIGITS, "trainer.max_steps=3", "trainer.resume=null", out=out)
    assert (fresh["steps"], fresh["steps_this_run"]) == (3, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_clear_error_that_names_the_fix(train):
    for setting in ("cuda", "cuda:1"):
        with pytest.raises(ExperimentError) as raised:
            train(f"trainer.device={setting}", "trainer.max_steps=1")
        assert str(raised.value) == (
            f"trainer.device={setting} but CUDA is not available on this machine; use "
            "trainer.device=auto (a GPU where there is one, else the CPU) or trainer.device=cpu"
        )


def test_startup_log_names_the_preconditioner(train, caplog):
    with caplog.at_level(logging.INFO, logger="experiments.train"):
        train(*DIGITS, "trainer.max_steps=1")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "KFACPreconditioner(strategy='dp_kfac', method='eigen', layers=4" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_a_gpu(precision, train, tmp_path):
    """The trainer's AMP path on CUDA: autocast, fp16 scaler, K-FAC state on the GPU."""
    out = tmp_path / precision
    result = train(
        *DIGITS,
        "trainer.device=cuda",
        f"trainer.precision={precision}",
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=2",
        out=out,
    )
    assert result["steps"] == 4 and math.isfinite(result["train_loss"])
    assert (_ckpt(out)["scaler"] is not None) == (precision == "fp16")


# -- threads per rank ---------------------------------------------------------------------


def test_threads_auto_divides_the_cores_among_the_local_ranks(monkeypatch):
    from experiments.distributed import available_cores, threads_per_rank

    cores = available_cores()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(3) == 3
    assert threads_per_rank("auto", 1) == cores
    assert threads_per_rank("auto", 2 * cores) == 1  # never zero
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # what torchrun tells each rank
    assert threads_per_rank("auto") == max(1, cores // 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert threads_per_rank("auto") == cores


@pytest.mark.parametrize("env, wanted", [("3", 3), ("1", 1), ("0", None), ("x", None), ("", None)])
def test_threads_auto_keeps_the_omp_num_threads_a_user_or_torchrun_set(monkeypatch, env, wanted):
    """OMP_NUM_THREADS is the process's own choice (torchrun sets 1 for several local ranks);
    an unusable value falls back to dividing the cores."""
    from experiments.distributed import available_cores, threads_per_rank

    monkeypatch.setenv("OMP_NUM_THREADS", env)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    expected = wanted if wanted is not None else max(1, available_cores() // 2)
    assert threads_per_rank("auto") == expected
    assert threads_per_rank(5) == 5  # an explicit trainer.threads wins


@pytest.mark.parametrize("value, shown", [("0", "0"), ("-1", "-1"), ("many", "'many'")])
def test_bad_threads_are_named(train, value, shown):
    with pytest.raises(ExperimentError) as raised:
        train(f"trainer.threads={value}")
    assert str(raised.value) == (
        f"invalid value trainer.threads={shown}: expected auto or a positive integer"
    )


def test_threads_are_set_for_the_run_recorded_and_restored(train, tmp_path, caplog):
    import json

    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    with caplog.at_level(logging.INFO, logger="experiments.train"):
        result = train(*DIGITS, "trainer.max_steps=1", f"trainer.threads={wanted}", out=tmp_path)
    assert result["threads_per_rank"] == wanted
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["final"]["threads_per_rank"] == wanted
    assert f"{wanted} thread(s) per rank" in caplog.text
    assert torch.get_num_threads() == before  # the caller's own setting comes back
