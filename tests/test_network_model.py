"""The cost model on a link-bound network: gloo's kinds from its all-reduce, and step()'s
memory passes outside its timed phases (exact values on small inputs)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
from dist_utils import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from dpkfac.costmodel import PRESETS, Engine, Hardware, Link, predict, predict_sgd, timing
from dpkfac.costmodel.shapes import as_model_shapes
from dpkfac.costmodel.timing import step_other_bytes
from dpkfac.costmodel.traffic import Collective
from dpkfac.options import KFACOptions
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.exchange import update_nbytes
from dpkfac.plan.hardware import COLLECTIVE_KINDS, gloo_link, wire_bytes
from experiments.bench import predict as bench_predict

AR = Link(alpha=1e-4, beta=8e-9, alpha_log2p=2e-5)


@pytest.mark.parametrize("p", [2, 4])
def test_gloo_kinds_are_its_algorithms_bytes_on_the_all_reduce_link(p: int) -> None:
    assert gloo_link("allreduce", AR, p) is AR
    # (P-1)/P of the buffer, as accounted: the sharded kinds go by one alltoallv.
    for kind in ("broadcast", "all_gather", "reduce_scatter"):
        assert gloo_link(kind, AR, p) == AR
    reduce = gloo_link("reduce", AR, p)
    assert (reduce.alpha, reduce.beta) == (AR.alpha, pytest.approx(AR.beta * (1 + 1 / p)))
    # A reduce-scatter and an all-gather move what one all-reduce moves.
    n = 1 << 20
    whole = AR.time(1, wire_bytes("allreduce", n, p), p)
    kinds = ("reduce_scatter", "all_gather")
    halves = sum(gloo_link(k, AR, p).time(1, wire_bytes(k, n, p), p) for k in kinds)
    assert halves == pytest.approx(whole + AR.latency(p))
    with pytest.raises(ValueError, match="unknown collective kind"):
        gloo_link("gather", AR, p)


def _entry(kind: str, nbytes: int, seconds: float, **extra: int) -> dict:
    return {"kind": kind, "nbytes": nbytes, "seconds": seconds, "world_size": 2, **extra}


def _row(entries: list[dict], network: str = "emulated") -> dict:
    return {"link_probes": json.dumps(entries), "network": network, "backend": "gloo"}


def test_a_link_bound_job_derives_what_its_probes_do_not_time() -> None:
    # An all-reduce at 8 ns per wire byte (1 Gbit/s) and 0.1 ms; a lone root's broadcast
    # that returned long before its bytes arrived (no ``calls``: the probe before the fix).
    allreduce = [_entry("allreduce", n, 1e-4 + 8e-9 * n) for n in (1 << 16, 1 << 24)]
    lone = [_entry("broadcast", n, 1e-6 * (1 + n / 2**20)) for n in (1 << 16, 1 << 24)]
    links = bench_predict.probe_links(_row(allreduce + lone))
    assert set(links) == set(COLLECTIVE_KINDS)
    ar = links["allreduce"]
    assert (ar.alpha, ar.beta) == (pytest.approx(1e-4), pytest.approx(8e-9))
    assert links["broadcast"] == gloo_link("broadcast", ar, 2)
    assert links["reduce_scatter"] == gloo_link("reduce_scatter", ar, 2)
    # Loopback (the scaling table's held-out links): the probes are fitted as they are.
    loop = bench_predict.probe_links(_row(allreduce + lone, network="loopback"))
    assert set(loop) == {"allreduce", "broadcast"}
    assert loop["broadcast"].beta < ar.beta / 10
    # A broadcast probe rooted at every rank (``calls``) is fitted, per call and wire byte.
    every = [
        _entry("broadcast", n, 2 * (5e-5 + 8e-9 * wire_bytes("broadcast", n, 2)), calls=2)
        for n in (1 << 16, 1 << 24)
    ]
    fitted = bench_predict.probe_links(_row(allreduce + every))["broadcast"]
    assert (fitted.alpha, fitted.beta) == (pytest.approx(5e-5), pytest.approx(8e-9))
    hw = bench_predict.probe_hardware(_row(allreduce + lone))
    assert hw.links["reduce"] == gloo_link("reduce", ar, 2)
    assert hw.engines == PRESETS["cpu_gloo_local"].engines


#: Two Linear layers (a_dim with the bias column): 3x4 and 5x2, float32, batch 8.
SHAPES = as_model_shapes(
    [LayerShape.linear("a", 3, 4, batch_size=8), LayerShape.linear("b", 5, 2, batch_size=8)]
)
MEMORY = Hardware(
    "memory",
    {"allreduce": Link(1e-4, 1e-9)},
    {
        "matmul": Engine(1e12),
        "eigh": Engine(1e12),
        "inverse": Engine(1e12),
        "memory": Engine(1e9),
        "forward_backward": Engine(1e12),
    },
    backend="gloo",
)


def test_step_other_bytes_pack_every_buffer_and_write_every_update_back() -> None:
    updates = 4 * (4 * 4 + 2 * 6)  # (3+1)x4 and (5+1)x2 float32 updates
    colls = [Collective("grad_allreduce", "allreduce", 112, 2)]
    colls.append(Collective("precond_broadcast", "broadcast", 64, 2))
    assert step_other_bytes(SHAPES, [], itemsize=4, kl_clip=False) == 2 * updates
    assert step_other_bytes(SHAPES, [], itemsize=4, kl_clip=True) == 4 * updates
    assert step_other_bytes(SHAPES, colls, itemsize=4, kl_clip=True) == 2 * 176 + 4 * updates


#: Each factor's fold, d² (6·4 + 2) bytes in float32: layer a's two 4x4, layer b's 6x6 and 2x2.
FOLDS = {"a": (2.0, 26.0 * (16 + 16)), "b": (2.0, 26.0 * (36 + 4))}


def test_step_other_is_in_every_kfac_iteration_and_never_in_sgds() -> None:
    kfac = KFACOptions(kl_clip=None)
    pred = predict(SHAPES, strategy="dp_kfac", world_size=2, hardware=MEMORY, kfac=kfac)
    step = pred.steps[(False, False)]  # a plain step: no factor to fold
    packed = sum(2 * c.nbytes for c in step.collectives)
    updates = 4 * (4 * 4 + 2 * 6)
    assert step.breakdown["step_other"] == pytest.approx((packed + 2 * updates) / 1e9)
    assert step.iteration == pytest.approx(sum(step.breakdown.values()))
    assert "step_other" not in predict_sgd(SHAPES, world_size=2, hardware=MEMORY).update.breakdown
    overlapped = predict(
        SHAPES,
        strategy="dp_kfac",
        world_size=2,
        hardware=MEMORY,
        kfac=kfac,
        options={"overlap": True},
    )
    # The overlapped mode packs its buffers in the backward hooks: the same copies, there.
    over = overlapped.steps[(False, False)]
    packed = sum(2 * c.nbytes for c in over.collectives)
    assert over.breakdown["step_other"] == pytest.approx(2 * updates / 1e9)
    assert over.breakdown["hooks"] == pytest.approx(packed / 1e9)
    assert "hooks" not in step.breakdown


@pytest.mark.parametrize(
    ("strategy", "overlap"), [("dp_kfac", False), ("dp_kfac", True), ("d_kfac", False)]
)
def test_a_factor_step_folds_what_each_rank_built(strategy: str, overlap: bool) -> None:
    """Each rank folds the batch factors it built (dp_kfac: its owned layers; d_kfac: every
    layer) outside the timed phases: in step(), or overlapped (dp_kfac's mode) in the hook that
    launches the last bucket, inside the backward pass (booked with the hooks' work); a plain
    step folds nothing."""
    kfac = KFACOptions(kl_clip=None)
    options = {"overlap": True} if overlap else None
    pred = predict(
        SHAPES, strategy=strategy, world_size=2, hardware=MEMORY, kfac=kfac, options=options
    )
    where, other = ("hooks", "step_other") if overlap else ("step_other", "hooks")
    plan = pred.plan
    for r, work in enumerate(pred.update.work):
        built = [s.name for i, s in enumerate(SHAPES) if plan.captures(r, i)]
        if strategy == "d_kfac":
            assert built == ["a", "b"]
        want = (sum(FOLDS[n][0] for n in built), sum(FOLDS[n][1] for n in built))
        assert work[where]["fold"] == want
        assert "fold" not in work.get(other, {})
        assert "fold" not in pred.steps[(False, False)].work[r].get(where, {})
    if strategy == "dp_kfac":  # each layer's factors are built, and folded, once
        folds = [w[where]["fold"][0] for w in pred.update.work if "fold" in w[where]]
        assert sum(folds) == 4.0
    fold = max(w[where]["fold"][1] for w in pred.update.work) / 1e9  # "memory" at 1 GB/s
    assert pred.update.breakdown[where] >= fold


def _measured(kind: str, latency: float) -> Hardware:
    """MEMORY with a measured per-call engine ``kind`` (the preset leaves it free)."""
    return replace(MEMORY, engines={**MEMORY.engines, kind: Engine(math.inf, latency)})


def test_a_measured_host_engine_prices_every_layer_written_back() -> None:
    host = _measured("host", 1e-5)
    kfac = KFACOptions(kl_clip=None)
    free = predict(SHAPES, strategy="dp_kfac", world_size=2, hardware=MEMORY, kfac=kfac)
    timed = predict(SHAPES, strategy="dp_kfac", world_size=2, hardware=host, kfac=kfac)
    extra = timed.update.breakdown["step_other"] - free.update.breakdown["step_other"]
    assert extra == pytest.approx(2 * 1e-5)  # two K-FAC layers
    assert MEMORY.engine("host").time(5, 0) == 0.0  # not measured: free


@pytest.mark.parametrize("overlap", [False, True])
def test_a_measured_launch_engine_prices_every_collective_where_it_is_launched(
    overlap: bool,
) -> None:
    """One "launch" call per collective: in ``step()``'s other work, or, for the overlapped
    mode's reductions and exchanges, in the backward hooks' work that launches them."""
    launch = _measured("launch", 1e-4)
    kfac = KFACOptions(kl_clip=None)
    options = {"grad_reduction": "owner", "overlap": True} if overlap else None
    args = {"strategy": "dp_kfac", "world_size": 2, "kfac": kfac, "options": options}
    free = predict(SHAPES, hardware=MEMORY, **args).plain
    timed = predict(SHAPES, hardware=launch, **args).plain
    launched = len(timed.rank_collectives[0])
    assert launched >= 2
    where = "hooks" if overlap else "step_other"
    assert timed.work[0][where]["launch"] == (float(launched), 0.0)
    extra = timed.breakdown[where] - free.breakdown.get(where, 0.0)
    assert extra == pytest.approx(launched * 1e-4)
    assert MEMORY.engine("launch").time(5, 0) == 0.0  # not measured: free


def _start_up(rank: int, world_size: int) -> dict:
    from dpkfac.comm import Communicator
    from dpkfac.costmodel.fitting import calibrate
    from dpkfac.probes import start_up_hardware
    from dpkfac.stats import CommStats

    stats = CommStats()
    hw = start_up_hardware(Communicator(stats=stats), calibrate)
    return {"hardware": hw.to_json(), "setup": stats.as_dict().get("setup", {})}


@pytest.mark.distributed
def test_the_start_up_measurement_times_the_gradients_link() -> None:
    """A strategy that measures its hardware at start-up ("auto", spd_kfac's placement)
    times the all-reduce too, not only the broadcast, and derives gloo's other kinds from
    it: the preset's all-reduce is a loopback's, which priced a 1 Gbit/s network's
    gradients as if at 14 Gbit/s. Every rank agrees; the setup traffic is what the plans
    book for it."""
    from dpkfac.plan.probes import MEASURE_COLLECTIVES

    results = run_ranks(_start_up, 2)
    assert results[0]["hardware"] == results[1]["hardware"]
    hw = Hardware.from_json(results[0]["hardware"])
    preset = PRESETS["cpu_gloo_local"]
    allreduce = hw.links["allreduce"]
    assert allreduce != preset.links["allreduce"] and allreduce.beta > 0
    for kind in ("reduce", "reduce_scatter", "all_gather"):
        assert hw.links[kind] == gloo_link(kind, allreduce, 2)
    assert hw.links["broadcast"] != preset.links["broadcast"]
    booked = {"calls": len(MEASURE_COLLECTIVES), "bytes": sum(n for _, n in MEASURE_COLLECTIVES)}
    for r in results:
        assert {k: r["setup"][k] for k in booked} == booked
    assert hw.backend == "gloo"


def test_the_start_up_measurement_keeps_the_groups_backend() -> None:
    """The measured model is the group's, backend included (it decides how the owner
    reduction's shards travel, and whether the hooks run ahead of the device): measured on
    the in-process group it says "threads", not the CPU preset's "gloo"."""
    from experiments.threads import run_threads

    results = run_threads(_start_up, 2, timeout=120)
    assert {Hardware.from_json(r["hardware"]).backend for r in results} == {"threads"}


def test_the_fold_is_priced_as_a_streaming_pass_where_not_measured() -> None:
    """Without a measured "fold" engine a fold is priced as the streaming copy a landing
    is ("unpack", kept as timed alone by a fit of a run's phases), never as "memory",
    which a fit uses as the factor phase's nuisance term."""
    slow_memory = Hardware(
        "h",
        {"allreduce": AR},
        {
            "matmul": Engine(1e12),
            "eigh": Engine(1e12),
            "inverse": Engine(1e12),
            "memory": Engine(1e6),
            "unpack": Engine(1e10, 1e-6),
        },
    )
    assert slow_memory.engine("fold") == slow_memory.engine("unpack")
    assert slow_memory.engine("pack") == slow_memory.engine("unpack")
    assert MEMORY.engine("fold") == MEMORY.engine("memory")  # no unpack: its own fallback


_SHARE = st.lists(
    st.tuples(st.floats(0, 10, allow_nan=False), st.floats(0, 10, allow_nan=False)), max_size=4
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_SHARE, min_size=1, max_size=3))
def test_the_compute_or_send_bound_is_below_every_split_and_exact_for_one_rank(
    shares: list[list[tuple[float, float]]],
) -> None:
    """Every way of splitting each rank's items between computing them before the point
    (the slowest rank delays it) and sending them after it (the busiest link carries them)
    gains at least the bound; with one rank some split gains exactly it."""
    bound = timing.compute_or_send_bound(shares)
    choices = [itertools.product((True, False), repeat=len(share)) for share in shares]
    best = math.inf
    for split in itertools.product(*choices):
        before = max(
            sum(c for (c, _), b in zip(sh, s, strict=True) if b)
            for sh, s in zip(shares, split, strict=True)
        )
        after = max(
            sum(e for (_, e), b in zip(sh, s, strict=True) if not b)
            for sh, s in zip(shares, split, strict=True)
        )
        best = min(best, before + after)
    assert bound <= best + 1e-9
    if len(shares) == 1:
        assert bound == pytest.approx(best)


def test_early_updates_are_the_cheaper_of_each_layers_compute_and_bytes_per_sender() -> None:
    """Four 512x512 layers at P=2, the first two completed only by the last bucket:
    under dp_kfac each layer's owner sends its update, so the layers outside ``late`` add,
    per owner, the lesser of their preconditioning and their bytes on the link; under
    d_kfac every rank preconditions every layer for itself and nothing is sent."""
    shapes = as_model_shapes(
        [LayerShape(f"l{i}", "linear", 512, 512, batch_size=8) for i in range(4)]
    )
    hw = PRESETS["v100_ib100"]
    plan = predict(shapes, strategy="dp_kfac", world_size=2, hardware=hw).plan
    assert plan is not None
    owners = [[i for i in range(4) if plan.sends_update(r, i)] for r in range(2)]
    assert sorted(owners[0] + owners[1]) == [0, 1, 2, 3]
    update = sum(update_nbytes(512, 512, with_kl=True, itemsize=4))
    compute = timing.precondition_seconds(shapes[0], hw)
    late = {0, 1}
    for spb, each in ((1e-12, update * 1e-12), (1.0, compute)):  # bytes cheaper, then compute
        got = timing.early_update_seconds(shapes, plan, late, hw, seconds_per_byte=spb)
        assert got == pytest.approx(max(len(set(o) - late) for o in owners) * each)
    assert timing.early_update_seconds(shapes, plan, set(range(4)), hw, seconds_per_byte=1.0) == 0
    d_plan = predict(shapes, strategy="d_kfac", world_size=2, hardware=hw).plan
    assert d_plan is not None
    assert timing.early_update_seconds(shapes, d_plan, set(), hw, seconds_per_byte=1.0) == 0
