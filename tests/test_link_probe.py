"""The benchmark's start-up link probes: the same entries on every rank, fitted into links."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from dist_utils import broadcast_roots, run_ranks

from dpkfac.plan.hardware import wire_bytes
from experiments.bench import predict
from experiments.bench.link_probe import highest_faithful, probe_links


def _probe(rank: int, world_size: int) -> list[dict[str, Any]]:
    return probe_links(torch.device("cpu"), numels=(256, 65536), repeats=2)


@pytest.mark.distributed
def test_probes_agree_on_every_rank_and_fit_links() -> None:
    results = run_ranks(_probe, 2)
    assert results[0] == results[1]  # least time over ranks, agreed by an all-reduce
    entries = results[0]
    assert [(e["kind"], e["nbytes"]) for e in entries] == [
        (kind, 4 * n) for kind in ("allreduce", "broadcast") for n in (256, 65536)
    ]
    assert all(e["seconds"] > 0 and e["world_size"] == 2 for e in entries)
    # A broadcast rooted at every rank, all timed together; one all-reduce at a time.
    assert [e["calls"] for e in entries] == [1, 1, 2, 2]
    links = predict.probe_links({"link_probes": json.dumps(entries)})
    assert set(links) == {"allreduce", "broadcast"}
    for kind, link in links.items():
        big = next(e for e in entries if e["kind"] == kind and e["nbytes"] == 4 * 65536)
        # Two sizes, two unknowns: the fit reproduces the larger probe (up to NNLS clipping).
        calls = big["calls"]
        fitted = link.time(calls, calls * wire_bytes(kind, big["nbytes"], 2), 2)
        assert big["seconds"] / 2 <= fitted <= 2 * big["seconds"]


def _probe_order(rank: int, world_size: int) -> list[int]:
    """The roots of the broadcast calls one probe of 64 Ki floats per root starts, on gloo
    cut into 64 KiB calls (4 per root)."""
    import dpkfac.comm as comm_module

    comm_module.GLOO_MESSAGE_BYTES = 64 * 2**10
    with broadcast_roots() as started:
        probe_links(torch.device("cpu"), kinds=("broadcast",), numels=(65536,), repeats=1)
    return started


@pytest.mark.distributed
def test_the_broadcast_probe_launches_as_a_step_does() -> None:
    """Through the communicator, together: each root's broadcast cut into gloo's message
    calls, the roots' calls taking turns (as the strategies' decompositions and updates)."""
    for started in run_ranks(_probe_order, 2):
        assert started == [0, 1] * 4 * 2  # 4 calls per root, one untimed and one timed repeat


def test_no_probes_on_one_rank_and_rows_without_them() -> None:
    assert probe_links(torch.device("cpu")) == []
    assert predict.probe_links({}) == {}
    assert predict.probe_links({"link_probes": "[]"}) == {}


def test_the_faithful_rate_is_the_top_of_the_unbroken_run_of_faithful_rungs() -> None:
    def rung(gbit: float, ratio: float) -> dict[str, Any]:
        wire = 0.1 / gbit
        return {"rate_bps": int(gbit * 1e9), "seconds": ratio * wire, "wire_seconds": wire}

    ladder = [rung(1, 1.04), rung(2, 1.15), rung(4, 1.3), rung(6, 1.02)]
    assert highest_faithful(ladder) == 2 * 10**9  # 6 Gbit/s passing again does not count
    assert highest_faithful(ladder, tolerance=1.5) == 6 * 10**9
    assert highest_faithful([rung(1, 2.0), rung(2, 1.0)]) == 0
    assert highest_faithful([]) == 0


def test_a_link_bound_fit_prices_large_transfers_as_the_largest_probe_saw_them() -> None:
    """On an emulated network a step is its large transfers: the 16 MiB all-reduce's time is
    what the fitted link must give, however fast the token bucket's burst sent 64 KiB."""
    # A job's probes at 1 Gbit/s (BERT-base, results/raw/network.csv): 64 KiB and 2 MiB ran
    # above the rate (the burst), 16 MiB at 96.5% of it.
    seconds = {65536: 0.000637, 2097152: 0.016125, 16777216: 0.139031}
    entries = [
        {"kind": "allreduce", "nbytes": n, "seconds": s, "world_size": 2, "calls": 1}
        for n, s in seconds.items()
    ]
    row = {"link_probes": json.dumps(entries), "network": "emulated", "backend": "gloo"}
    big = 16777216

    def priced(link_bound: bool) -> float:
        link = predict.probe_links(row, link_bound=link_bound)["allreduce"]
        return link.time(1, wire_bytes("allreduce", big, 2), 2)

    assert priced(True) == pytest.approx(seconds[big], rel=0.01)
    # Relative residuals (loopback, where every size matters alike) miss it by about 4%.
    assert priced(False) < 0.97 * seconds[big]
