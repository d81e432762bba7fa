"""dp_kfac with ``overlap=True`` gives the update of ``overlap=False``, with either drain.

Float64, tiny models (a conv net with GroupNorm, a conv net with BatchNorm, so
parameters K-FAC leaves alone are reduced in the buckets too), P = 1, 2, 3 on
gloo, factor and decomposition intervals above one, ``accumulation_steps=2``,
the KL clip on and off, one bucket and many: the gradients written by
``step()`` match the non-overlapped run's within 1e-10, every rank holds the
same parameters, and ``comm_stats()`` has the same categories and bytes.
Also: no host read in the hooks, non-finite factors skipped with a warning as
without overlap, and the configurations overlap refuses.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import batch, make_model, make_preconditioner
from test_core_host_sync import reads_per_phase
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import dpkfac
from dpkfac.strategies import DPKFACOptions

TOL = 1e-10
STEPS = 6


class BNNet(nn.Module):
    """Conv -> BatchNorm -> conv (no bias) -> Linear: BatchNorm's parameters are not K-FAC's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 3, 3, stride=2, bias=False)
        self.fc = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


def _model(kind: str) -> nn.Module:
    if kind == "tiny":
        return make_model()
    torch.manual_seed(0)
    return BNNet().double()


#: name -> (model, preconditioner keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("tiny", {}),
    "tiny-intervals-kl": (
        "tiny",
        {"factor_update_steps": 2, "inv_update_steps": 3, "kl_clip": 0.01},
    ),
    "tiny-accum-kl": ("tiny", {"accumulation_steps": 2, "kl_clip": 0.01, "inv_update_steps": 2}),
    "bn-small-buckets": ("bn", {"bucket_cap_mb": 300 / 2**20, "factor_update_steps": 2}),
    "bn-kl-accum-buckets": (
        "bn",
        {"bucket_cap_mb": 600 / 2**20, "kl_clip": 0.001, "accumulation_steps": 2},
    ),
    "bn-pi-inverse": ("bn", {"compute_method": "inverse", "pi_damping": True, "kl_clip": 0.01}),
}


#: The runs compared: the ordinary step, and the overlapped mode with each drain.
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "last": {"overlap": True},
    "ready": {"overlap": True, "drain": "ready"},
}


def _train(rank: int, kind: str, kwargs: dict[str, Any], mode: str) -> dict[str, Any]:
    model = _model(kind)
    pre = make_preconditioner(model, "dp_kfac", **MODES[mode], **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro = int(kwargs.get("accumulation_steps", 1))
    grads, params, stats = [], [], []
    for step in range(STEPS):
        pre.reset_stats()
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(10 * step + m, rank)
            (F.cross_entropy(model(x), y) / micro).backward()
        pre.step()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        stats.append(pre.comm_stats())
    return {"grads": grads, "params": params, "stats": stats}


def _both(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        kind, kwargs = CASES[name]
        out[name] = {mode: _train(rank, kind, kwargs, mode) for mode in MODES}
    return out


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for k in a:
        denom = b[k].abs().max().clamp(min=1e-30)
        worst = max(worst, float((a[k] - b[k]).abs().max() / denom))
    return worst


def _check(results: list[dict[str, Any]], names: list[str]) -> float:
    worst = 0.0
    for name in names:
        for rank, res, mode in ((r, res, m) for r, res in enumerate(results) for m in MODES):
            plain, overlapped = res[name]["plain"], res[name][mode]
            for step in range(STEPS):
                err = _max_err(overlapped["grads"][step], plain["grads"][step])
                worst = max(worst, err)
                assert err < TOL, (name, mode, rank, step, err)
                # The same categories and byte counts (calls can differ: bucket split).
                bytes_plain = {c: v["bytes"] for c, v in plain["stats"][step].items()}
                bytes_over = {c: v["bytes"] for c, v in overlapped["stats"][step].items()}
                assert bytes_over == bytes_plain, (name, rank, step)
                # Wire bytes: the same, but for each buffer's integer floor (the overlapped
                # buckets cut the gradients into other buffers).
                for c, v in plain["stats"][step].items():
                    w = overlapped["stats"][step][c]
                    slack = max(v["calls"], w["calls"], 1)
                    assert abs(w["wire_bytes"] - v["wire_bytes"]) < slack, (name, rank, step, c)
        for step, mode in ((s, m) for s in range(STEPS) for m in MODES):  # identical replicas
            first = results[0][name][mode]["params"][step]
            for res in results[1:]:
                other = res[name][mode]["params"][step]
                assert all(torch.equal(first[k], other[k]) for k in first), (name, mode, step)
    return worst


def test_overlap_equals_plain_on_one_rank() -> None:
    names = list(CASES)
    worst = _check([_both(0, 1, names)], names)
    print(f"P=1 max relative difference {worst:.3e}")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_overlap_equals_plain_distributed(world_size: int) -> None:
    names = list(CASES)
    worst = _check(run_ranks(_both, world_size, names), names)
    print(f"P={world_size} max relative difference {worst:.3e}")


def test_single_bucket_splits_its_kfac_gradients_from_the_rest() -> None:
    """With every gradient in one bucket (P = 2), the overlapped mode all-reduces the K-FAC
    layers' gradients first and the GroupNorm's after them, so no layer waits for a
    gradient it does not need: the same bytes in one more call; every other exchange is
    the same one."""
    results = run_ranks(_both, 2, ["tiny"])
    for res in results:
        for step in range(STEPS):
            over, plain = res["tiny"]["last"]["stats"][step], res["tiny"]["plain"]["stats"][step]
            grads_over, grads_plain = over.pop("grad_allreduce"), plain.pop("grad_allreduce")
            assert over == plain
            assert grads_over["bytes"] == grads_plain["bytes"]
            # Step 0 runs the ordinary step() (the placement is not final yet).
            assert (grads_plain["calls"], grads_over["calls"]) == (1, 1 if step == 0 else 2)


# ------------------------------------------------------------------ host reads
@pytest.mark.distributed
@pytest.mark.parametrize("drain", ["last", "ready"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_no_host_reads_in_hooks_and_at_most_one_per_step(world_size: int, drain: str) -> None:
    options = {"overlap": True, "drain": drain}
    for out in run_ranks(reads_per_phase, world_size, "dp_kfac", options):
        assert out["hooks"] == [0, 0, 0]
        assert max(out["steps"]) <= 1, out["steps"]


# ------------------------------------------------------------------ non-finite
def _poisoned(rank: int, world_size: int, overlap: bool) -> dict[str, Any]:
    """fc1's A is NaN at steps 0 and 1 (no running average yet), conv's A at step 3."""
    model = make_model()
    pre = make_preconditioner(model, "dp_kfac", overlap=overlap, kl_clip=0.01)
    poison = {0: "fc1", 1: "fc1", 3: "conv"}
    current = {"step": 0}

    def corrupt(name: str, module: nn.Module, args: Any, output: Any) -> None:
        state = pre.layers[name].factors["A"]
        if poison.get(current["step"]) == name and state.batch is not None:
            state.batch[0, 0] = float("nan")

    for name in ("conv", "fc1"):
        getattr(model, name).register_forward_hook(lambda m, a, o, n=name: corrupt(n, m, a, o))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, caught, factors = [], [], []
    for step in range(5):
        current["step"] = step
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pre.step()
        caught.append(sorted(str(w.message) for w in seen if "non-finite" in str(w.message)))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        factors.append(
            {
                f"{n}/{w}": (s.running is None, bool(torch.isfinite(s.running).all()))
                if s.running is not None
                else (True, True)
                for n, x in pre.layers.items()
                for w, s in x.factors.items()
            }
        )
        opt.step()
    return {"grads": grads, "warnings": caught, "factors": factors}


@pytest.mark.distributed
def test_non_finite_factors_are_skipped_with_a_warning_as_without_overlap() -> None:
    plain = run_ranks(_poisoned, 2, False)
    over = run_ranks(_poisoned, 2, True)
    for p, o in zip(plain, over, strict=True):
        assert o["warnings"] == p["warnings"]
        assert o["factors"] == p["factors"]
        for step in range(5):
            assert _max_err(o["grads"][step], p["grads"][step]) < TOL, step
            assert all(torch.isfinite(g).all() for g in o["grads"][step].values())
    assert sum(len(w) for r in over for w in r["warnings"]) == 3  # each on its owner only


# ------------------------------------------------------------------ refusals
def test_overlap_refuses_non_bools() -> None:
    assert DPKFACOptions(overlap=True, grad_reduction="owner").overlap is True
    with pytest.raises(ValueError, match="overlap must be a bool or 'auto', got 'yes'"):
        DPKFACOptions(overlap="yes")  # type: ignore[arg-type]


def test_with_a_grad_scaler_step_takes_the_scaled_gradients() -> None:
    """The overlapped mode runs before the scaler unscales (tests/test_overlap_owner.py)."""
    scaler = torch.amp.GradScaler("cpu")
    pre = dpkfac.KFACPreconditioner(make_model(), overlap=True, grad_scaler=scaler)
    assert pre.takes_scaled_gradients
    assert "before the loss scaler unscales them" in pre.gradient_path
    assert not dpkfac.KFACPreconditioner(make_model(), grad_scaler=scaler).takes_scaled_gradients


def _ddp_with_a_hook(rank: int, world_size: int) -> str:
    ddp = nn.parallel.DistributedDataParallel(make_model())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        dpkfac.KFACPreconditioner(ddp, overlap=True)
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.distributed
def test_overlap_says_why_a_ddp_model_with_its_own_hook_is_refused() -> None:
    """The mode runs as DDP's communication hook; DDP holds one, and a user's comes first."""
    (message,) = run_ranks(_ddp_with_a_hook, 1)
    assert "communication hook" in message and "overlap=False" in message


def test_too_many_backward_passes_raise() -> None:
    model = make_model()
    pre = make_preconditioner(model, "dp_kfac", overlap=True)
    for step in range(2):
        x, y = batch(step, 0)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    x, y = batch(5, 0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps=1 backward passes"):
        F.cross_entropy(model(x), y).backward()


def _engaged(rank: int, world_size: int) -> dict[str, Any]:
    model = _model("bn")
    pre = make_preconditioner(model, "dp_kfac", overlap=True, bucket_cap_mb=300 / 2**20)
    engine = pre.overlap
    out: dict[str, Any] = {"buckets": len(engine.buckets)}
    for step in range(3):
        x, y = batch(step, rank)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 2:
            state = engine.state
            out["launched"] = len(state.launched)
            out["processed"] = state.done
            out["preconditioned"] = sorted(state.results)
            out["owned"] = sorted(n for n, x in pre.layers.items() if x.owner == rank)
        pre.step()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_backward_pass_launches_every_bucket(world_size: int) -> None:
    """Every bucket is launched from the hooks; on one rank all work is done there too."""
    for out in run_ranks(_engaged, world_size):
        assert out["buckets"] > 1
        assert out["launched"] == out["buckets"]
        if world_size == 1:
            assert out["processed"] == out["buckets"]
            assert out["preconditioned"] == out["owned"]


# ------------------------------------------------------------------ cost model
@pytest.mark.parametrize("world_size", [2, 8, 32])
@pytest.mark.parametrize("model", ["resnet50", "bert_qa"])
def test_cost_model_overlap_is_no_slower_and_moves_the_same_bytes(
    model: str, world_size: int
) -> None:
    from dataclasses import replace

    from dpkfac.costmodel import PRESETS, bert_qa, predict, resnet50

    shapes = resnet50(batch_size=32) if model == "resnet50" else bert_qa()
    hw = PRESETS["v100_ib100"]
    plain = predict(shapes, strategy="dp_kfac", world_size=world_size, hardware=hw)
    over = predict(
        shapes, strategy="dp_kfac", options={"overlap": True}, world_size=world_size, hardware=hw
    )
    assert over.traits is not None and over.traits.overlapped_precondition
    assert set(over.overlapped_phases) == {"grad_comm", "precond_comm"}
    for key, step in over.steps.items():
        for category, counts in step.comm.items():
            want = plain.steps[key].comm[category]
            # The same bytes (on the wire up to a byte's floor per buffer); calls per backward
            # bucket and owner instead of per owner.
            assert counts["bytes"] == want["bytes"], category
            floors = counts["calls"] + want["calls"]
            assert abs(counts["wire_bytes"] - want["wire_bytes"]) <= floors, category
        assert step.iteration <= plain.steps[key].iteration + 1e-12
        # Compute is not hidden: only the communication waits shrink.
        for phase in ("forward_backward", "factor_compute", "decomposition", "precondition"):
            assert step.breakdown[phase] == pytest.approx(plain.steps[key].breakdown[phase])
    assert over.update.iteration < plain.update.iteration
    # The same state; the batch factors wait less (each layer folds as its backward ends).
    for o, q in zip(over.memory, plain.memory, strict=True):
        assert o["factors_bytes"] == q["factors_bytes"]
        assert o["decompositions_bytes"] == q["decompositions_bytes"]
        assert o["buffers_bytes"] <= q["buffers_bytes"]
    # No overlap in the hardware: the serial prediction.
    serial = predict(
        shapes,
        strategy="dp_kfac",
        options={"overlap": True},
        world_size=world_size,
        hardware=replace(hw, overlap=0.0),
    )
    base = predict(
        shapes, strategy="dp_kfac", world_size=world_size, hardware=replace(hw, overlap=0.0)
    )
    # Serial, the overlap costs what the plain step does plus the start-up of its extra
    # calls, and up to 2.5% more: the drain, stopped dead beside the link, is paced beside
    # the busy periods of the schedule without that pacing (its own would not settle), so
    # an exchange that pacing sends later counts both where it was and where it goes.
    extra = sum(
        (serial.update.comm[c]["calls"] - base.update.comm[c]["calls"])
        * hw.link(kind).latency(world_size)
        for c, kind in (("grad_allreduce", "allreduce"), ("precond_broadcast", "broadcast"))
    )
    floor = base.update.iteration + extra
    assert floor * (1 - 1e-9) <= serial.update.iteration <= 1.025 * floor


@pytest.mark.parametrize("cap_bytes", [600, 4_000, 25 * 2**20])
def test_placement_buckets_are_the_engines(cap_bytes: int) -> None:
    """The bucket placement balances (``LayerShape.bucket``, from the run's parameters in
    model order: :func:`dpkfac.costmodel.traffic.with_buckets`) is the engine's own: the
    bucket of :func:`dpkfac.overlap.backward_buckets` holding each layer's last gradient."""
    from dpkfac.costmodel.shapes import as_model_shapes
    from dpkfac.costmodel.traffic import with_buckets
    from dpkfac.overlap import backward_buckets
    from dpkfac.plan.assignment import LayerShape

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(50, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4)
    )
    kfac = [1, 3, 4]  # the Linear layers, in module order
    params = list(model.parameters())
    layer_of = {id(p): kfac.index(i) for i in kfac for p in model[i].parameters()}
    layout = [(layer_of.get(id(p), -1), p.numel()) for p in params]
    shapes = [LayerShape.linear(str(i), model[i].in_features, model[i].out_features) for i in kfac]
    others = as_model_shapes(shapes, other_params=[n for i, n in layout if i < 0])
    placed = with_buckets(
        shapes, replace(others, order=tuple(layout)), itemsize=4, cap_bytes=cap_bytes
    )
    backward = params[::-1]
    buckets = backward_buckets(backward, cap_bytes)
    engine = {}
    for b, held in enumerate(buckets):
        for i in held:
            if id(backward[i]) in layer_of:
                engine[layer_of[id(backward[i])]] = b
    assert [s.bucket for s in placed] == [engine[k] for k in range(len(kfac))]
    if cap_bytes == 600:
        assert len({s.bucket for s in placed}) > 1  # the small cap cuts layers apart


@pytest.mark.parametrize("model", ["resnet50", "bert_qa"])
def test_cost_model_exchanges_updates_after_the_last_launch_as_the_engine_does(
    model: str,
) -> None:
    """The engine preconditions and exchanges nothing before the backward pass has launched
    its last bucket (:mod:`dpkfac.overlap`: that work in an earlier hook would hold back the
    later buckets). So even with every transfer beside compute hidden (``overlap=1``) and
    the decompositions and preconditioning free, a step waits for the last bucket's
    reduction and every update exchange after it: a model that sent an early bucket's
    updates during the backward pass (this one's before) hid most of them (ResNet-50 at
    P=8: 1.8 ms waited of 10.1; BERT: 5.1 of 109.4)."""
    from dpkfac.costmodel import PRESETS, bert_qa, predict, resnet50
    from dpkfac.plan.hardware import Engine

    shapes = resnet50(batch_size=32) if model == "resnet50" else bert_qa()
    base = PRESETS["v100_ib100"]
    free = {k: Engine(rate=1e18, latency=0.0) for k in ("precondition", "eigh", "memory")}
    hw = replace(base, overlap=1.0, engines={**base.engines, **free})
    options = {"overlap": True, "grad_reduction": "owner"}
    over = predict(shapes, strategy="dp_kfac", options=options, world_size=8, hardware=hw, ddp=True)
    step = over.steps[(False, False)]  # a plain step: no factors, no decompositions

    def seconds(category: str) -> list[float]:
        colls = [c for c in step.collectives if c.category == category]
        return [hw.link(c.kind).time(1, c.wire_bytes, 8) for c in colls]

    after_backward = seconds("grad_allreduce")[-1] + sum(seconds("precond_broadcast"))
    waited = step.breakdown["grad_comm"] + step.breakdown["precond_comm"]
    assert waited == pytest.approx(after_backward, rel=0.02)


@pytest.mark.parametrize("model", ["resnet50", "bert_qa"])
def test_cost_model_prices_the_ready_drain_as_the_engine_runs_it(model: str) -> None:
    """``drain="ready"``: on a plain step the hooks exchange the buckets already reduced
    while the backward pass runs, so with free compute a step waits less than with the
    last-launch drain, yet never less than the last bucket's own transfer; on a
    decomposition step the engine drains at the last launch either way, and so does the
    model (the same prediction). On NCCL (:func:`~dpkfac.plan.hardware.drains_early`: the
    host runs ahead of the GPU, and interleaved groups could deadlock) the engine runs the
    last-launch drain, and so does the model."""
    from dpkfac.costmodel import PRESETS, bert_qa, predict, resnet50
    from dpkfac.plan.hardware import Engine

    shapes = resnet50(batch_size=32) if model == "resnet50" else bert_qa()
    base = PRESETS["v100_ib100"]
    free = {k: Engine(rate=1e18, latency=0.0) for k in ("precondition", "eigh", "memory")}
    hw = replace(base, overlap=1.0, engines={**base.engines, **free}, backend="gloo")

    def run(drain: str, hardware: Any = hw) -> Any:
        options = {"overlap": True, "grad_reduction": "owner", "drain": drain}
        return predict(
            shapes, strategy="dp_kfac", options=options, world_size=8, hardware=hardware, ddp=True
        )

    from dpkfac.plan.hardware import drains_early

    assert drains_early("gloo") and drains_early("threads") and not drains_early("nccl")
    nccl = replace(hw, backend="nccl")
    assert run("ready", nccl).steps == run("last", nccl).steps
    last, ready = run("last"), run("ready")
    assert ready.traits is not None and ready.traits.drain == "ready"
    assert ready.steps[(True, True)].iteration == last.steps[(True, True)].iteration
    step, before = ready.steps[(False, False)], last.steps[(False, False)]
    waited = step.breakdown["grad_comm"] + step.breakdown["precond_comm"]
    waited_last = before.breakdown["grad_comm"] + before.breakdown["precond_comm"]
    final = [c for c in step.collectives if c.category == "grad_allreduce"][-1]
    assert hw.link(final.kind).time(1, final.wire_bytes, 8) <= waited < 0.9 * waited_last
    assert step.comm == before.comm  # the same collectives
