"""The hot path does not wait for the device: no host sync in hooks, at most one per step.

On a GPU, reading a device value on the host (``.item()``, ``float(t)``,
``bool(t)``, ``.tolist()``) or ``torch.cuda.synchronize()`` stalls the host
until every queued kernel is done; in a capture hook that ties the backward
pass to every collective in flight. These tests count such reads on CPU
tensors, where the same calls are made, so the property is checked without
a GPU. Decomposition steps are left out: ``eigh``'s own error checks read
the device (there is no non-checking ``eigh``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import STRATEGY_VARIANTS, batch, make_model, make_preconditioner

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def counting_host_reads() -> Iterator[list[str]]:
    """Count host reads of tensor values and device synchronisations in the block."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            seen.append(name)
            return original(self, *args, **kwargs)

        return read

    sync = torch.cuda.synchronize
    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        torch.cuda.synchronize = lambda *a, **k: seen.append("cuda.synchronize")
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = sync


def reads_per_phase(
    rank: int, world_size: int, variant: str, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Host reads in the hooks and in ``step()`` of steps 2..4 (``overrides``: preconditioner
    arguments); ``probes``: how many layers the fidelity probe reported."""
    model = make_model()
    options = {"kl_clip": 0.01, "inv_update_steps": 100, **(overrides or {})}
    pre = make_preconditioner(model, variant, **options)
    hooks, steps = [], []
    for step in range(5):
        x, y = batch(step, rank)
        model.zero_grad()
        with counting_host_reads() as in_hooks:
            F.cross_entropy(model(x), y).backward()
        with counting_host_reads() as in_step:
            pre.step()
        if step > 1:  # one-time work: placement, decompositions, spd_kfac's fusion plan
            hooks.append(len(in_hooks))
            steps.append(len(in_step))
    return {"hooks": hooks, "steps": steps, "probes": len(pre.fidelity())}


@pytest.mark.parametrize("variant", ["dp_kfac", "d_kfac", "spd_kfac"])
def test_no_host_reads_in_hooks_and_one_per_factor_step(variant: str) -> None:
    out = reads_per_phase(0, 1, variant)
    assert out["hooks"] == [0, 0, 0]
    # Factor steps: one read, the joint non-finite check of every factor.
    assert out["steps"] == [1, 1, 1]


@pytest.mark.distributed
@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_no_host_reads_in_hooks_and_one_per_factor_step_distributed(variant: str) -> None:
    for out in run_ranks(reads_per_phase, 2, variant):
        assert out["hooks"] == [0, 0, 0], variant
        assert max(out["steps"]) <= 1, (variant, out["steps"])
