"""Rooted collectives (broadcast, reduce onto one rank) on gloo, cut into calls.

gloo's TCP pair carries one large message per direction in turn, so where two transfers
cross on a link (two owners broadcasting at once) each would run at half the link's rate:
the communicator cuts a rooted collective's buffer into consecutive pieces, launched
together into the same buffer (:func:`dpkfac.comm.message_calls`). The books
still count one collective per bucket, as the cost model prices it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import broadcast_roots, run_ranks

import dpkfac.comm as comm_module
from dpkfac.comm import Communicator

SIZES = (5, 1, 7)  # elements of the tensors, float64: 104 bytes in one bucket


def _rooted(rank: int, world_size: int, message: int | None) -> dict[str, Any]:
    if message is not None:
        comm_module.GLOO_MESSAGE_BYTES = message
    comm = Communicator()
    root = world_size - 1
    sent = [
        torch.arange(n, dtype=torch.float64) + 10.0 * i + 100.0 * rank for i, n in enumerate(SIZES)
    ]
    bcast = comm.broadcast(sent, root, "precond_broadcast", async_op=True)
    works = len(bcast.works)
    comm.wait(bcast)
    reduced = [torch.full((n,), float(rank + 1), dtype=torch.float64) for n in SIZES]
    comm.reduce_mean(reduced, 0, "grad_allreduce")
    return {
        "sent": sent,
        "reduced": reduced,
        "works": works,
        "calls": comm_module.message_calls("gloo", 8 * sum(SIZES)),
        "stats": comm.stats.as_dict(),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("message", [None, 24, 8])
def test_rooted_collectives_cut_into_calls_are_exact(world_size: int, message: int | None) -> None:
    results = run_ranks(_rooted, world_size, message)
    root = world_size - 1
    mean = sum(range(1, world_size + 1)) / world_size
    for rank, out in enumerate(results):
        for i, (t, n) in enumerate(zip(out["sent"], SIZES, strict=True)):
            assert torch.equal(t, torch.arange(n, dtype=torch.float64) + 10.0 * i + 100.0 * root)
        for t in out["reduced"]:
            assert torch.equal(t, torch.full_like(t, mean if rank == 0 else rank + 1.0)), rank
        # One bucket each: one collective in the books, in this many calls on gloo.
        assert out["works"] == out["calls"]
        assert out["calls"] == (1 if message is None else -(-8 * sum(SIZES) // message))
        assert out["stats"]["precond_broadcast"]["calls"] == 1
        assert out["stats"]["grad_allreduce"]["calls"] == 1


def _together(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank roots one broadcast (root r sends the first ``len(SIZES) - r`` tensors),
    launched inside ``together()``; the order the calls started in, per root."""
    comm_module.GLOO_MESSAGE_BYTES = 8  # one float64 per call
    with broadcast_roots() as started:
        comm = Communicator()
        sizes = {root: SIZES[: len(SIZES) - root] for root in range(world_size)}
        sent = {
            root: [
                torch.arange(n, dtype=torch.float64) + 10.0 * i + 100.0 * root
                if rank == root
                else torch.zeros(n, dtype=torch.float64)
                for i, n in enumerate(sizes[root])
            ]
            for root in range(world_size)
        }
        with comm.together():
            handles = [
                comm.broadcast(sent[r], r, "decomposition_broadcast", async_op=True)
                for r in range(world_size)
            ]
            held = [len(h.works) for h in handles]
        launched = [len(h.works) for h in handles]
        for handle in handles:
            comm.wait(handle)
        order = list(started)
        # Waiting inside the block launches what it holds (and does not hang).
        late = [torch.full((3,), float(rank), dtype=torch.float64)]
        with comm.together():
            comm.wait(comm.broadcast(late, 0, "precond_broadcast", async_op=True))
            late_value = float(late[0][0])
        return {
            "sent": sent,
            "held": held,
            "launched": launched,
            "order": order,
            "late": late_value,
            "stats": comm.stats.as_dict(),
        }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcasts_launched_together_take_turns_and_are_exact(world_size: int) -> None:
    """Inside ``together()`` nothing starts until the block ends; then every root's calls
    take turns (the first call of each root, then the second, ...), on every rank alike, and
    each broadcast lands whole. The books count one broadcast per root, as before."""
    results = run_ranks(_together, world_size)
    calls = {r: sum(SIZES[: len(SIZES) - r]) for r in range(world_size)}  # 8-byte calls
    expected = [r for turn in range(max(calls.values())) for r in calls if turn < calls[r]]
    for rank, out in enumerate(results):
        assert out["held"] == [0] * world_size
        assert out["launched"] == [calls[r] for r in range(world_size)]
        assert out["order"] == expected, rank
        for root, tensors in out["sent"].items():
            for i, t in enumerate(tensors):
                want = torch.arange(t.numel(), dtype=torch.float64) + 10.0 * i + 100.0 * root
                assert torch.equal(t, want), (rank, root, i)
        assert out["late"] == 0.0
        assert out["stats"]["decomposition_broadcast"]["calls"] == world_size
        assert out["stats"]["decomposition_broadcast"]["bytes"] == 8 * sum(calls.values())
