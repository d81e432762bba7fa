"""The benchmark's start-up compute probes: the job's own model's work, timed, and the
engines scaled to them (exact values on small inputs)."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from test_benchmark_tables import MLP_COLUMNS

from dpkfac.costmodel import PRESETS, Engine
from dpkfac.costmodel import predict as costmodel_predict
from dpkfac.costmodel.optimizers import step_bytes
from dpkfac.costmodel.timing import factor_work, forward_backward_work
from dpkfac.options import KFACOptions
from dpkfac.plan import fusion
from dpkfac.plan.assignment import EIGH_COEFF
from experiments.bench import compute_probe, predict
from experiments.bench.compute_probe import (
    COMPUTE_PROBE_KINDS,
    OVERLAP_KIND,
    job_compute_probes,
)

SPEC = {
    "model": {
        "config": json.loads(MLP_COLUMNS["model_config"]),
        "batch": json.loads(MLP_COLUMNS["model_batch"]),
    },
    "seed": 0,
    "lr": 0.1,
    "strategies": [
        {"name": "none", "kfac": None},
        {"name": "dp_kfac", "kfac": {"strategy": "dp_kfac", "damping": 0.003}},
    ],
}


def test_the_probes_are_timed_in_interleaved_rounds() -> None:
    """Each round times every kind once, in turn, after one untimed round; a kind's entry is
    the median of its rounds, so one slow round (a burst of load elsewhere) moves no kind."""
    now = [0.0]
    calls: list[str] = []

    def probe(kind: str, costs: list[float]) -> Any:
        left = iter(costs)

        def run() -> None:
            calls.append(kind)
            now[0] += next(left)

        return run

    probes = {"a": probe("a", [9, 1, 2, 30]), "b": probe("b", [9, 5, 50, 4])}
    rounds = compute_probe._interleaved_rounds(probes, 3, torch.device("cpu"), lambda: now[0])
    assert calls == ["a", "b"] * 4
    assert rounds == {"a": [1, 2, 30], "b": [5, 50, 4]}
    assert compute_probe._busiest_median(list(rounds.values()), torch.device("cpu")) == [2, 5]


def _starts(rank: int, world_size: int) -> dict[str, list[float]]:
    """When each probe call began on this rank (wall clock), rank 1 slow in its first call."""
    starts: dict[str, list[float]] = {"a": [], "b": []}

    def probe(kind: str) -> Any:
        def run() -> None:
            starts[kind].append(time.time())
            if rank == 1 and kind == "a" and len(starts["a"]) == 1:
                time.sleep(0.5)

        return run

    compute_probe._interleaved_rounds({k: probe(k) for k in starts}, 2, torch.device("cpu"))
    return starts


@pytest.mark.distributed
def test_the_ranks_start_every_probe_call_together() -> None:
    """A barrier before each call, as before each step: rank 1's slow first call holds rank
    0's next call back, so the ranks run each call at once (as a step's ranks do), not
    half a second apart for the rest of the rounds."""
    first, second = run_ranks(_starts, 2)
    for kind in ("a", "b"):
        for t0, t1 in zip(first[kind], second[kind], strict=True):
            assert abs(t0 - t1) < 0.3  # not 0.5: the barrier, not the sleep, sets them
    assert first["b"][0] - first["a"][0] >= 0.5  # rank 0 waited for rank 1


def _busiest(rank: int, world_size: int) -> list[float]:
    rounds = [[1.0, 5.0, 3.0], [4.0, 2.0, 2.0]]
    return compute_probe._busiest_median([rounds[rank]], torch.device("cpu"))


@pytest.mark.distributed
def test_a_probe_is_read_as_a_row_reads_its_steps() -> None:
    """Per round the most over ranks, then the median over rounds (a row: per step the most
    over ranks, then the median over steps); the median per rank, then the most, would be
    3: the busier rank of a round is not always the same one."""
    assert run_ranks(_busiest, 2) == [[4.0], [4.0]]


def test_the_probes_scratch_is_the_size_of_the_last_level_cache() -> None:
    from pathlib import Path

    from experiments.bench.link_probe import FLUSH_BYTES

    size = compute_probe.cache_bytes(torch.device("cpu"))
    listed = list(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    if not listed:
        assert size == FLUSH_BYTES
        return
    units = {"K": 2**10, "M": 2**20}
    sizes = [int(t[:-1]) * units[t[-1]] for p in listed if (t := p.read_text().strip())]
    assert size == max(sizes)


def test_every_engine_is_timed_on_the_jobs_own_model() -> None:
    entries = job_compute_probes(SPEC, 0, torch.device("cpu"))
    # Alone there is no collective to launch: no launch probe.
    assert [e["kind"] for e in entries] == [k for k in COMPUTE_PROBE_KINDS if k != "launch"]
    assert all(e["seconds"] > 0 for e in entries)
    work = {e["kind"]: e["work"] for e in entries}
    shapes, _ = predict.row_shapes({**MLP_COLUMNS})
    params = shapes.num_params
    # Packing every gradient once: read and written; SGD with momentum's one pass.
    assert work["pack"] == {"pack": [0.0, 2.0 * 4 * params]}
    assert work["optimizer"] == {"optimizer": [1.0, float(step_bytes(params, 4, "sgd_momentum"))]}
    fb = forward_backward_work(shapes)["forward_backward"]
    assert work["forward_backward"] == {"forward_backward": [fb[0], fb[1]]}
    flops = sum(4.0 * s.g_dim * s.a_dim * (s.g_dim + s.a_dim) for s in shapes)
    assert work["precondition"] == {"precondition": [float(len(shapes)), flops]}
    factors: dict[str, list[float]] = {}
    for s in shapes:
        for which in "AG":
            for kind, (c, a) in factor_work(s, which, "expand", 4).items():
                got = factors.setdefault(kind, [0.0, 0.0])
                got[0], got[1] = got[0] + c, got[1] + a
    assert work["factor"] == factors
    # Each layer's two factors decomposed, at the cost model's 2 EIGH_COEFF d**3 flops each.
    eigh = sum(2 * EIGH_COEFF * float(d) ** 3 for s in shapes for d in (s.a_dim, s.g_dim))
    assert work["eigh"] == {"eigh": [2.0 * len(shapes), pytest.approx(eigh)]}
    # Each factor's fold: its non-finite check and running average, d² (6·4 + 2) bytes.
    folded = sum(d * d * (6 * 4 + 2) for s in shapes for d in (s.a_dim, s.g_dim))
    assert work["fold"] == {"fold": [2.0 * len(shapes), float(folded)]}
    updates = sum(4 * s.a_dim * s.g_dim for s in shapes)  # scaled, then copied into .grad
    assert work["host"] == {"pack": [0.0, 4.0 * updates], "host": [float(len(shapes)), 0.0]}


def test_the_pack_probe_packs_what_the_communicator_packs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gradient that travels alone, in its own storage, is never packed: nor here."""
    from experiments.bench.workloads import build

    bench = build(SPEC["model"]["config"], SPEC["model"]["batch"])
    sizes = [p.numel() * 4 for p in bench.model.parameters()]
    monkeypatch.setattr(fusion, "ALONE_BYTES", max(sizes))
    entries = job_compute_probes(SPEC, 0, torch.device("cpu"))
    (work,) = [e["work"] for e in entries if e["kind"] == "pack"]
    alone = [n for n in sizes if n >= max(sizes)]
    assert work == {"pack": [0.0, 2.0 * (sum(sizes) - sum(alone))]}


def _probe(rank: int, world_size: int) -> list[dict[str, Any]]:
    return job_compute_probes(SPEC, rank, torch.device("cpu"))


@pytest.mark.distributed
def test_probes_agree_on_every_rank() -> None:
    results = run_ranks(_probe, 2)
    assert results[0] == results[1]  # the most over ranks, agreed by an all-reduce
    # With two ranks, one entry more: how much of a transfer ran beside the forward/backward.
    assert [e["kind"] for e in results[0]] == [*COMPUTE_PROBE_KINDS, OVERLAP_KIND]
    # The launch probe's plain step at P=2: beside the host probe's write-back, the cost
    # model's packing and one launch per collective (dp_kfac: the gradients' all-reduce and
    # one fused broadcast per owner), the busiest rank's.
    work = {e["kind"]: e["work"] for e in results[0][:-1]}
    shapes, _ = predict.row_shapes({**MLP_COLUMNS})
    kfac = KFACOptions(damping=0.003, factor_update_steps=10**9, inv_update_steps=10**9)
    plain = costmodel_predict(
        shapes, strategy="dp_kfac", world_size=2, hardware=PRESETS["cpu_gloo_local"], kfac=kfac
    ).plain
    busiest = max(w["step_other"]["pack"][1] for w in plain.work)
    assert work["launch"]["launch"] == [float(len(plain.rank_collectives[0])), 0.0] == [3.0, 0.0]
    assert work["launch"]["host"] == work["host"]["host"]
    assert work["launch"]["pack"] == [0.0, busiest]
    assert busiest > work["host"]["pack"][1]  # the gradients and updates packed too
    overlap = results[0][-1]
    assert 0.0 <= overlap["overlap"] <= 1.0
    low, high = compute_probe.OVERLAP_BYTES
    assert low <= overlap["nbytes"] <= high and overlap["nbytes"] % 4 == 0
    assert overlap["transfer_s"] > 0 and overlap["compute_s"] > 0


def _probe_owner(rank: int, world_size: int) -> list[dict[str, Any]]:
    owner = {"strategy": "dp_kfac", "damping": 0.003, "grad_reduction": "owner"}
    spec = {**SPEC, "strategies": [{"name": "dp_kfac_owner", "kfac": owner}]}
    return job_compute_probes(spec, rank, torch.device("cpu"))


@pytest.mark.distributed
def test_a_step_the_fake_backend_cannot_run_drops_the_launch_probe_alone() -> None:
    """The owner reduction's uneven all-gather does not fit the fake backend's copies: no
    launch probe for that job (the model's launches stay free), every other probe kept."""
    first, second = run_ranks(_probe_owner, 2)
    assert first == second
    kinds = [k for k in COMPUTE_PROBE_KINDS if k != "launch"]
    assert [e["kind"] for e in first] == [*kinds, OVERLAP_KIND]


@pytest.mark.parametrize(
    ("transfer", "compute", "beside", "stretch", "ratio"),
    [
        (0.02, 0.04, 0.04, 0.0, 0.0),  # beside a sleep: the transfer runs free
        (0.02, 0.04, 0.035, 0.0, 0.0),  # faster together (noise): no stretch, not negative
        (0.02, 0.04, 0.06, 0.02, 1.0),  # they took turns on the core: the whole transfer
        (0.02, 0.04, 0.05, 0.01, 0.5),  # half of it
        (0.08, 0.04, 0.08, 0.04, 0.5),  # it outlived the compute: over its time beside it
    ],
)
def test_a_round_reads_the_computes_stretch_over_the_transfer_beside_it(
    transfer: float, compute: float, beside: float, stretch: float, ratio: float
) -> None:
    """What :func:`probe_overlap` takes of each round (its timed value is a benchmark's, not a
    test's: a loaded host's jitter moved a sleeping compute's from 0.8 to 0.4)."""
    got = compute_probe.stretch_over_transfer(transfer, compute, beside)
    assert got == pytest.approx((stretch, ratio))


def test_the_overlap_probe_sets_the_hardwares_overlap_and_no_engine() -> None:
    engines = [{"kind": "eigh", "work": {"eigh": [6, 3e9]}, "seconds": 0.05}]
    entry = {"kind": OVERLAP_KIND, "overlap": 0.75, "nbytes": 4, "transfer_s": 0.02}
    row = {"compute_probes": json.dumps([*engines, {**entry, "compute_s": 0.05}])}
    hw = predict.probe_hardware(row)
    assert hw.overlap == 0.75
    assert OVERLAP_KIND not in predict.probe_engines(row, PRESETS["cpu_gloo_local"])
    assert hw.engines == predict.probe_hardware({"compute_probes": json.dumps(engines)}).engines
    # Rows without it keep the preset's (fitted on loopback).
    assert predict.probe_hardware({"compute_probes": json.dumps(engines)}).overlap == (
        PRESETS["cpu_gloo_local"].overlap
    )


def test_engines_are_scaled_until_they_give_the_probes_seconds() -> None:
    base = predict.probe_hardware({})
    assert base.engines == PRESETS["cpu_gloo_local"].engines  # no probes: the preset's
    entries = [
        {"kind": "pack", "work": {"pack": [0, 4e6]}, "seconds": 1e-3},
        {"kind": "optimizer", "work": {"optimizer": [1, 1e7]}, "seconds": 2e-3},
        {"kind": "forward_backward", "work": {"forward_backward": [3, 6e9]}, "seconds": 0.2},
        {"kind": "factor", "work": {"factor": [4, 1e8], "memory": [0, 6.13e6]}, "seconds": 5e-3},
        {"kind": "eigh", "work": {"eigh": [6, 3e9]}, "seconds": 0.05},
        {"kind": "host", "work": {"pack": [0, 8e6], "host": [10, 0]}, "seconds": 3e-3},
    ]
    engines = predict.probe_engines({"compute_probes": json.dumps(entries)}, base)
    assert set(engines) == {"pack", "optimizer", "forward_backward", "factor", "eigh", "host"}
    assert engines["eigh"].time(6, 3e9) == pytest.approx(0.05)
    assert engines["pack"].time(0, 4e6) == pytest.approx(1e-3)
    # The preset has no "host" engine (free): the probe less its 2 ms of copies, per call.
    assert engines["host"] == Engine(math.inf, pytest.approx(1e-4))
    # The launch probe: its copies (4 ms) and the host's calls (1 ms) priced by the engines
    # fitted before it, the rest per collective.
    launch = {"pack": [0, 1.6e7], "host": [10, 0], "launch": [4, 0]}
    with_launch = [*entries, {"kind": "launch", "work": launch, "seconds": 7e-3}]
    engines = predict.probe_engines({"compute_probes": json.dumps(with_launch)}, base)
    assert engines["launch"] == Engine(math.inf, pytest.approx(2e-3 / 4))
    opt = engines["optimizer"]  # the preset's optimizer is its memory engine
    assert opt.time(1, 1e7) == pytest.approx(2e-3)
    fb, preset = engines["forward_backward"], base.engine("forward_backward")
    assert fb.time(3, 6e9) == pytest.approx(0.2)
    assert fb.rate / preset.rate == pytest.approx(preset.latency / fb.latency)
    # The factor probe less its memory pass at the preset's memory rate (1 ms): 4 ms.
    assert base.engine("memory").rate == 6.13e9
    assert engines["factor"].time(4, 1e8) == pytest.approx(4e-3)
    hw = predict.probe_hardware({"compute_probes": json.dumps(entries)})
    assert hw.engines["factor"] == engines["factor"]
    assert hw.engines["eigh"] == engines["eigh"]
    assert hw.engines["inverse"] == base.engines["inverse"]  # not probed: the preset's


def test_a_probe_that_times_its_own_part_is_read_by_what_it_returns() -> None:
    """The host probe returns the seconds of its step outside the step's phases; the rounds
    take them rather than the whole call's (its backward pass included)."""
    now = [0.0]

    def own() -> float:
        now[0] += 10.0
        return 0.25

    rounds = compute_probe._interleaved_rounds({"own": own}, 2, torch.device("cpu"), lambda: now[0])
    assert rounds == {"own": [0.25, 0.25]}


@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_the_host_probe_is_a_plain_step_outside_its_phases(kl_clip: float | None) -> None:
    """A real preconditioner's plain steps on the model alone: the gradients are
    preconditioned in place, no decomposition after the first (untimed) call, and the
    seconds returned are the step's wall time less its timed phases."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    batch = (torch.randn(8, 6), torch.randint(0, 3, (8,)))

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    options = {"strategy": "dp_kfac", "damping": 0.003, "kl_clip": kl_clip}
    step, pre = compute_probe._plain_step(model, batch, loss, options, 0.1, torch.device("cpu"))
    assert pre.options.kl_clip == kl_clip
    for call in range(3):
        started = time.perf_counter()
        seconds = step()
        assert 0.0 <= seconds < time.perf_counter() - started
        if call:  # plain: the updates from the first call's decompositions
            timed = pre.timings()
            assert timed["decomposition"] == timed["factor_compute"] == 0.0 < timed["precondition"]
    preconditioned = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss(model, batch).backward()
    raw = [p.grad for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(preconditioned, raw, strict=True))


def test_the_pass_timed_in_the_steps_rotation_prices_the_forward_backward() -> None:
    """A job's hook-free pass timed in turn with its steps (DDP SGD's ``no_sync`` pass) stands
    for the forward/backward probe timed before them; nothing else moves."""
    entries = [
        {"kind": "forward_backward", "work": {"forward_backward": [3, 6e9]}, "seconds": 0.2},
        {"kind": "eigh", "work": {"eigh": [6, 3e9]}, "seconds": 0.05},
    ]
    row = {"compute_probes": json.dumps(entries)}
    alone, rotated = predict.probe_hardware(row), predict.probe_hardware(row, in_rotation_s=0.25)
    assert alone.engine("forward_backward").time(3, 6e9) == pytest.approx(0.2)
    assert rotated.engine("forward_backward").time(3, 6e9) == pytest.approx(0.25)
    assert rotated.engines["eigh"] == alone.engines["eigh"]
    # The job's pass: its SGD row's (the slowest rank per step, then the median); none where
    # no row has one (no SGD under DDP, or rows from before the pass: NaN read from CSV).
    job = [{"fwd_bwd_local_s": math.nan}, {"fwd_bwd_local_s": 0.25}, {}]
    assert predict.rotation_forward_backward(job) == 0.25
    assert predict.rotation_forward_backward(job[::2]) is None
