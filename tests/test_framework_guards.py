"""The core's refusals and warnings for the misuses training frameworks make easy (issue 44).

Whatever wraps the loop (Hugging Face Trainer, accelerate, Lightning, or a hand-written
one), ``step()`` itself notices: a DDP wrapper added after the preconditioner was built
on the bare module (followed where exact, else refused), a call inside ``no_sync`` or
mid-accumulation, a backward count other than ``accumulation_steps``, and an optimizer
that already holds state at K-FAC's first update (a resume that forgot the preconditioner).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import batch, make_model, make_preconditioner
from torch.nn.parallel import DistributedDataParallel

import dpkfac


def _train(
    forward: torch.nn.Module, pre: dpkfac.KFACPreconditioner, rank: int, steps: int = 3
) -> list[torch.Tensor]:
    opt = torch.optim.SGD(forward.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(forward(x), y).backward()
        pre.step()
        opt.step()
    inner = forward.module if isinstance(forward, DistributedDataParallel) else forward
    return [p.detach().clone() for p in inner.parameters()]


def _wrapped_later(rank: int, world_size: int) -> dict[str, Any]:
    """Built on the bare module, then wrapped: the same training as built on DDP, and no
    second all-reduce of the gradients."""
    model = make_model()
    late = make_preconditioner(model, "dp_kfac")
    ddp = DistributedDataParallel(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        params_late = _train(ddp, late, rank)
    model = make_model()
    ddp = DistributedDataParallel(model)
    built = make_preconditioner(ddp, "dp_kfac")
    params_built = _train(ddp, built, rank)
    # DDP around a module that holds the model (as Lightning wraps the LightningModule).
    model = make_model()
    inside = make_preconditioner(model, "dp_kfac")
    _train(DistributedDataParallel(torch.nn.Sequential(model)), inside, rank)
    # The overlapped mode reduces from its own hooks: following DDP is not exact, so refuse.
    model = make_model()
    overlap = make_preconditioner(model, "dp_kfac", overlap=True)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = batch(0, rank)
    F.cross_entropy(ddp(x), y).backward()
    try:
        overlap.step()
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    del opt
    return {
        "late": params_late,
        "built": params_built,
        "ddp": late.ddp,
        "ddp_inside": inside.ddp,
        "inside_bytes": inside.comm_stats().get("grad_allreduce", {}).get("bytes", 0),
        "grad_bytes": late.comm_stats().get("grad_allreduce", {}).get("bytes", 0),
        "built_bytes": built.comm_stats().get("grad_allreduce", {}).get("bytes", 0),
        "refused": refused,
    }


@pytest.mark.distributed
def test_ddp_added_after_construction_is_followed_or_refused() -> None:
    for out in run_ranks(_wrapped_later, 2):
        assert out["ddp"], "the preconditioner did not follow the DDP wrapper"
        assert out["grad_bytes"] == out["built_bytes"] == 0  # DDP alone reduced the gradients
        assert out["ddp_inside"] and out["inside_bytes"] == 0
        for a, b in zip(out["late"], out["built"], strict=True):
            assert torch.equal(a, b)
        assert "wrapped in DistributedDataParallel after" in out["refused"]
        assert "Build the preconditioner on the DDP model" in out["refused"]


def _inside_no_sync(rank: int, world_size: int) -> list[str]:
    model = make_model()
    ddp = DistributedDataParallel(model)
    pre = make_preconditioner(ddp, "dp_kfac", accumulation_steps=2)
    messages = []
    for step in range(2):
        with ddp.no_sync():
            x, y = batch(step, rank)
            (F.cross_entropy(ddp(x), y) / 2).backward()
            with pytest.warns(RuntimeWarning, match="inside DDP's no_sync") as got:
                pre.step()  # the accelerate loop without the sync_gradients guard
            messages.append(str(got[0].message))
    return messages


@pytest.mark.distributed
def test_step_inside_no_sync_warns_every_time() -> None:
    for messages in run_ranks(_inside_no_sync, 2):
        assert len(messages) == 2
        assert all("accelerator.sync_gradients" in m for m in messages)


def test_mid_accumulation_warns_and_a_gate_skips() -> None:
    model = make_model()
    pre = make_preconditioner(model, "d_kfac", accumulation_steps=2)
    x, y = batch(0, 0)
    (F.cross_entropy(model(x), y) / 2).backward()
    partial = r"after 1 backward pass\(es\), but accumulation_steps=2"
    with pytest.warns(RuntimeWarning, match=partial):
        pre.step()
    # An integration that knows which calls are optimizer steps skips the others silently.
    pre.synced = lambda: False
    (F.cross_entropy(model(x), y) / 2).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pre.step()
    assert pre.steps == 1


def test_optimizer_with_state_at_the_first_update_warns_once() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()  # a run resumed with its optimizer's state ...
    opt.zero_grad()
    pre = make_preconditioner(model, "d_kfac")  # ... and a fresh preconditioner
    with pytest.warns(RuntimeWarning, match=r"load_state_dict") as got:
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
    assert sum("already holds state" in str(w.message) for w in got) == 1
    # Restored properly, nothing is said.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = make_preconditioner(model, "d_kfac")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()


def test_import_dpkfac_imports_no_framework() -> None:
    """The integrations import their frameworks themselves: ``import dpkfac`` needs torch."""
    import subprocess
    import sys

    code = (
        "import sys, dpkfac, dpkfac.integrations; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
