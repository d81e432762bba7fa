"""The order of calls: a loop that calls ``pre.step()`` too early is refused on every step.

``opt.zero_grad(); pre.step(); loss.backward(); opt.step()`` warned once, at
step 0, and then trained with plain SGD without a further word: every later
``pre.step()`` followed a backward pass (the previous iteration's) whose
gradients the optimizer had used and ``zero_grad`` had cleared. These tests run
that loop, and the right one, through the paths the gradients can take (DDP,
accumulation, the overlapped mode with its own hooks and as DDP's hook, a loss
scaler, gradient clipping) and check every step's outcome.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import batch, make_model
from test_core_host_sync import counting_host_reads

import dpkfac
from dpkfac.capture import CALL_ORDER

STEPS = 4
SEEN_TWICE = (
    "dpkfac: step() was called without a backward pass since the last step() (step 0): nothing "
    "was done, and the gradients were left as they are (the same gradients are never "
    "preconditioned twice); the order of calls is zero_grad → backward → pre.step → opt.step"
)
USED_AND_CLEARED = (
    "dpkfac: step() at step 0 found the gradients of the last backward pass already used by "
    "optimizer.step() and cleared by zero_grad() (every K-FAC gradient is None): the model takes "
    "plain SGD steps, not K-FAC's. Nothing was done. The order of calls is "
    "zero_grad → backward → pre.step → opt.step (pre.step() after loss.backward(), before "
    "optimizer.step())"
)
USED = USED_AND_CLEARED.replace(" and cleared by zero_grad() (every K-FAC gradient is None)", "")


def zeroed(step: int) -> str:
    return (
        f"dpkfac: step() at step {step} found the gradient of every K-FAC layer zero, set after "
        "the backward pass wrote it (as zero_grad(set_to_none=False) does): if pre.step() runs "
        "before loss.backward(), K-FAC preconditions zeros and the model takes plain SGD steps. "
        "The order of calls is zero_grad → backward → pre.step → opt.step"
    )


def _run(rank: int, case: dict[str, Any]) -> list[str]:
    """``STEPS`` iterations of the case's loop; each step's outcome: ``ok``, ``warn: ...``
    (the preconditioner's warnings, joined) or ``raise: ...``."""
    model: torch.nn.Module = make_model()
    if case.get("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if case.get("scaler") else None
    pre = dpkfac.KFACPreconditioner(
        model,
        kl_clip=0.01,
        grad_scaler=scaler,
        accumulation_steps=case.get("k", 1),
        **case.get("options", {}),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    misordered = case.get("misordered", False)
    outcomes = []

    def precondition() -> str:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                pre.step()
            except RuntimeError as err:
                return f"raise: {err}"
        said = [str(w.message) for w in seen if str(w.message).startswith("dpkfac")]
        return "warn: " + " | ".join(said) if said else "ok"

    for step in range(STEPS):
        if case.get("manual"):  # no optimizer: zero by hand, update by hand
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        else:
            opt.zero_grad(set_to_none=case.get("set_to_none", True))
        if misordered:
            outcomes.append(precondition())
        for micro in range(case.get("k", 1)):
            x, y = batch(step * 10 + micro, rank)
            loss = F.cross_entropy(model(x), y) / case.get("k", 1)
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None and not pre.takes_scaled_gradients:
            scaler.unscale_(opt)
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        if not misordered:
            outcomes.append(precondition())
        if case.get("manual"):
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return outcomes


def _cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: _run(rank, case) for name, case in cases.items()}


#: The misordered loop refused from step 1 on (step 0 has seen no backward pass yet).
REFUSED_EVERY_STEP = [f"warn: {SEEN_TWICE}"] + [f"raise: {USED_AND_CLEARED}"] * (STEPS - 1)

LOCAL_CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "set_to_none=False": {"set_to_none": False},
    "accumulation": {"k": 2},
    "clipped": {"clip": True},
    "scaler": {"scaler": True},
    "manual": {"manual": True},
    "d_kfac": {"options": {"strategy": "d_kfac"}},
}

DISTRIBUTED_CASES: dict[str, dict[str, Any]] = {
    "own reduction": {},
    "ddp": {"ddp": True},
    "ddp scaler accumulation": {"ddp": True, "scaler": True, "k": 2},
    "overlap": {"options": {"overlap": True}},
    "overlap owner scaler": {
        "options": {"overlap": True, "grad_reduction": "owner"},
        "scaler": True,
    },
    "overlap ddp": {"ddp": True, "options": {"overlap": True}},
}


@pytest.mark.parametrize("name", sorted(LOCAL_CASES))
def test_the_right_order_never_warns(name: str) -> None:
    assert _run(0, LOCAL_CASES[name]) == ["ok"] * STEPS


@pytest.mark.parametrize("name", sorted(LOCAL_CASES))
def test_the_misordered_loop_is_refused_on_every_step(name: str) -> None:
    case = {**LOCAL_CASES[name], "misordered": True}
    expected = list(REFUSED_EVERY_STEP)
    if name == "set_to_none=False":  # zeros instead of None: the optimizer's step tells
        expected[1:] = [f"raise: {USED}"] * (STEPS - 1)
    if name == "manual":  # no optimizer to see, zeros to read: a warning on every factor step
        expected[1:] = [f"warn: {zeroed(step)}" for step in range(STEPS - 1)]
    assert _run(0, case) == expected


@pytest.mark.distributed
def test_every_gradient_path_refuses_the_misordered_loop_and_accepts_the_right_one() -> None:
    cases = {
        **{f"{name} right": case for name, case in DISTRIBUTED_CASES.items()},
        **{
            f"{name} misordered": {**case, "misordered": True}
            for name, case in DISTRIBUTED_CASES.items()
        },
    }
    for rank, results in enumerate(run_ranks(_cases, 2, cases)):
        for name in DISTRIBUTED_CASES:
            assert results[f"{name} right"] == ["ok"] * STEPS, (rank, name)
            assert results[f"{name} misordered"] == REFUSED_EVERY_STEP, (rank, name)


def test_the_zero_check_costs_no_host_read_of_its_own() -> None:
    """Gradients changed after the backward pass (clipping) get the zero check, inside the one
    read of a factor step; gradients left as the backward wrote them skip it."""
    for clip in (False, True):
        model = make_model()
        pre = dpkfac.KFACPreconditioner(model, kl_clip=0.01, inv_update_steps=100)
        reads = []
        for step in range(4):
            model.zero_grad()
            x, y = batch(step, 0)
            F.cross_entropy(model(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            with counting_host_reads() as in_step:
                pre.step()
            if step > 1:
                reads.append(len(in_step))
        assert reads == [1, 1], clip


def test_messages_name_the_order() -> None:
    assert CALL_ORDER == "zero_grad → backward → pre.step → opt.step"
    for message in (SEEN_TWICE, USED_AND_CLEARED, USED, zeroed(0)):
        assert CALL_ORDER in message
