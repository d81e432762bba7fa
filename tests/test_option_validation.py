"""Bad option values fail with a ValueError naming the option and the value (issue: faults).

Constants are checked at construction; a callable's value is checked whenever it
is read, so a schedule that goes wrong at step 30 fails at step 30 with the step
named, instead of corrupting the factors or dividing by zero.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from strategy_cases import batch, make_model

import dpkfac


def _steps(pre: dpkfac.KFACPreconditioner, model: torch.nn.Module, n: int = 3) -> None:
    for step in range(n):
        x, y = batch(step, 0)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()


@pytest.mark.parametrize(
    ("option", "bad", "pattern"),
    [
        ("factor_decay", 1.5, r"factor_decay returned 1\.5 at step 0; it must return a number in"),
        ("factor_decay", math.nan, r"factor_decay returned nan at step 0"),
        ("inv_update_steps", 0, r"inv_update_steps returned 0 at step 0; it must return an int"),
        ("inv_update_steps", 2.7, r"inv_update_steps returned 2\.7"),
        ("factor_update_steps", -3, r"factor_update_steps returned -3"),
        ("lr", -1.0, r"lr returned -1\.0 at step 0; it must return a finite number > 0"),
        ("lr", math.nan, r"lr returned nan"),
        ("damping", 0.0, r"damping returned 0\.0"),
        ("kl_clip", math.inf, r"kl_clip returned inf"),
    ],
)
def test_a_callable_returning_a_bad_value_is_named_with_its_step(
    option: str, bad: Any, pattern: str
) -> None:
    model = make_model()
    kwargs: dict[str, Any] = {"kl_clip": 0.01, option: lambda step: bad}
    with pytest.raises(ValueError, match=pattern):  # the first read: construction or a step
        pre = dpkfac.KFACPreconditioner(model, **kwargs)
        _steps(pre, model)


def test_a_schedule_is_checked_when_its_value_changes() -> None:
    model = make_model()
    pre = dpkfac.KFACPreconditioner(model, factor_decay=lambda step: 0.9 if step < 2 else 1.5)
    _steps(pre, model, 2)
    with pytest.raises(ValueError, match=r"factor_decay returned 1\.5 at step 2"):
        _steps(pre, model, 1)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"pi_damping": "no", "compute_method": "inverse"}, "pi_damping must be True or False"),
        ({"skip_layers": 5}, "skip_layers must be a regex string or a list of them, got 5"),
        ({"grad_scaler": "yes"}, "grad_scaler must be a torch.amp.GradScaler"),
        ({"fidelity_layers": ["nope"]}, "fidelity_layers entry 'nope' matches no K-FAC layer"),
        ({"factor_decay": math.nan}, r"factor_decay must be in \[0, 1\), got nan"),
        ({"timing": "sometimes"}, "unknown timing 'sometimes'"),
    ],
)
def test_bad_constants_are_refused_at_construction(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        dpkfac.KFACPreconditioner(make_model(), **kwargs)


def test_skip_layers_none_means_no_layer_is_skipped() -> None:
    pre = dpkfac.KFACPreconditioner(make_model(), skip_layers=None)
    assert pre.options.skip_layers == () and len(pre.layers) == 3


# ------------------------------------------------------------------ step() guards
def test_step_before_backward_warns_and_leaves_the_gradients_alone() -> None:
    model = make_model()
    pre = dpkfac.KFACPreconditioner(model, kl_clip=0.01)
    _steps(pre, model, 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    x, _ = batch(1, 0)
    model(x)  # a forward, no backward
    with pytest.warns(RuntimeWarning, match=r"without a backward pass since the last step\(\)"):
        pre.step()
    assert pre.steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n  # not preconditioned a second time


def test_a_second_step_on_the_same_gradients_does_nothing() -> None:
    model = make_model()
    pre = dpkfac.KFACPreconditioner(model, kl_clip=0.01)
    _steps(pre, model, 2)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match="step 2"):
        pre.step()
    assert pre.steps == 2
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, once[n]), n


def test_the_guard_sees_backward_under_ddp() -> None:
    """DDP writes gradients through its reducer; the hooks still fire (no warning)."""
    import datetime

    import torch.distributed as dist
    from dist_utils import free_port

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        pre = dpkfac.KFACPreconditioner(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _steps(pre, model, 2)
        assert pre.steps == 2
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ errors that teach
def test_an_unknown_keyword_names_the_closest_option_and_every_accepted_one() -> None:
    with pytest.raises(ValueError) as raised:
        dpkfac.KFACPreconditioner(make_model(), dampening=0.003)
    assert str(raised.value) == (
        "unknown option 'dampening' for strategy 'dp_kfac'; did you mean 'damping'? Accepted: "
        "common options: ['accumulation_steps', 'bucket_cap_mb', 'collective_timeout', "
        "'compute_method', 'damping', 'decomposition_dtype', 'factor_decay', 'factor_dtype', "
        "'factor_method', 'factor_update_steps', 'fidelity_every', 'fidelity_layers', "
        "'grad_scaler', 'host_reader', 'inv_update_steps', 'kl_clip', 'lr', 'options', "
        "'pi_damping', 'process_group', 'skip_layers', 'strategy', 'timing', 'weight_sharing']; "
        "options of strategy 'dp_kfac': ['assignment', 'assignment_cost', 'auto_intervals', "
        "'auto_tolerance', 'drain', 'grad_reduction', 'hardware', 'overlap']"
    )


def test_several_unknown_keywords_get_a_suggestion_each_where_one_is_close() -> None:
    with pytest.raises(ValueError) as raised:
        dpkfac.KFACPreconditioner(
            make_model(), strategy="kaisa", grad_worker_frac=0.5, lrr=0.1, zzz=1
        )
    assert str(raised.value).startswith(
        "unknown options ['grad_worker_frac', 'lrr', 'zzz'] for strategy 'kaisa'; did you mean "
        "'grad_worker_fraction' for 'grad_worker_frac', 'lr' for 'lrr'? Accepted: common options: "
    )
    assert str(raised.value).endswith(
        "options of strategy 'kaisa': ['grad_worker_fraction', 'lazy_factor_sync', 'placement', "
        "'triangle']"
    )


def test_a_keyword_near_nothing_lists_what_is_accepted_without_a_guess() -> None:
    with pytest.raises(ValueError) as raised:
        dpkfac.KFACPreconditioner(make_model(), strategy="d_kfac", qqqq=1)
    assert str(raised.value).startswith(
        "unknown option 'qqqq' for strategy 'd_kfac'. Accepted: common options: ['accumulation_"
    )


@pytest.mark.parametrize("spelling", ["dp_kfac", "DP-KFAC", "Dp_Kfac", "dp-kfac", "DP_KFAC"])
def test_strategy_names_are_read_in_any_case_with_dash_or_underscore(spelling: str) -> None:
    pre = dpkfac.KFACPreconditioner(make_model(), strategy=spelling)
    assert pre.strategy_name == "dp_kfac"  # and written in the one registered spelling


def test_an_unknown_strategy_name_gets_the_closest_one() -> None:
    with pytest.raises(ValueError) as raised:
        dpkfac.KFACPreconditioner(make_model(), strategy="DP-KFCA")
    assert str(raised.value) == (
        "unknown strategy 'DP-KFCA'; did you mean 'dp_kfac'? Expected one of ['d_kfac', "
        "'dp_kfac', 'grouped', 'kaisa', 'spd_kfac'], in any case, with '-' or '_'"
    )
    with pytest.raises(ValueError) as raised:
        dpkfac.KFACPreconditioner(make_model(), strategy="adam")
    assert str(raised.value) == (
        "unknown strategy 'adam'; expected one of ['d_kfac', 'dp_kfac', 'grouped', 'kaisa', "
        "'spd_kfac'], in any case, with '-' or '_'"
    )


def test_a_checkpoint_of_another_spelling_loads() -> None:
    model = make_model()
    pre = dpkfac.KFACPreconditioner(model, kl_clip=0.01)
    _steps(pre, model, 1)
    state = {**pre.state_dict(), "strategy": "DP-KFAC"}
    dpkfac.KFACPreconditioner(make_model(), kl_clip=0.01).load_state_dict(state)


def test_the_common_options_are_one_list() -> None:
    """KFACOptions is the list of common options: the preconditioner's keywords, their
    defaults, its docstring and conf/kfac/common.yaml all follow it."""
    import inspect
    from dataclasses import MISSING, fields
    from pathlib import Path

    import yaml

    from dpkfac.options import KFACOptions
    from dpkfac.preconditioner import KFACPreconditioner

    common = {f.name: f.default for f in fields(KFACOptions)}
    assert all(d is not MISSING for d in common.values())
    params = inspect.signature(KFACPreconditioner.__init__).parameters
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert set(common) <= set(keywords), sorted(set(common) - set(keywords))
    for name, default in common.items():
        assert keywords[name] == default or (name == "skip_layers" and keywords[name] == ()), name
    # Keywords beyond the list are the preconditioner's own, named here.
    assert set(keywords) - set(common) == {
        "strategy",
        "options",
        "process_group",
        "grad_scaler",
        "host_reader",
    }
    doc = inspect.getdoc(KFACPreconditioner) or ""
    for name in keywords:
        assert f"    {name}:" in doc, f"{name} is not in KFACPreconditioner's docstring"
    conf = yaml.safe_load((Path(__file__).parents[1] / "conf" / "kfac" / "common.yaml").read_text())
    assert set(conf) - {"_target_"} <= set(common), sorted(set(conf) - set(common))
