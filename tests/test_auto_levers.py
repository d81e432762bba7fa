"""dp_kfac's "auto": the cost model chooses how the update travels, never what it is.

``grad_reduction="auto"`` and ``overlap="auto"`` leave to the first step the
gradient reduction (all-reduce, or reduce-scatter onto the owners with the
updates all-gathered) and the overlap with the backward pass. Every candidate
gives dp_kfac's update; the choice follows the tolerance rule, is the same on
every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from strategy_cases import batch, make_model, max_rel_err, run

import dpkfac
from dpkfac.capture import Parameters
from dpkfac.costmodel import PRESETS, choose_options, predict, zoo
from dpkfac.curvature import KFACLayer, helper_for
from dpkfac.options import KFACOptions
from dpkfac.plan import DPKFACOptions, scheme_of
from dpkfac.plan.hardware import scaled, wire_bytes

KW: dict[str, Any] = {"kl_clip": 0.01, "damping": 0.01, "collective_timeout": 60.0}


def test_the_candidates_are_every_exact_pair_of_levers() -> None:
    scheme = scheme_of("dp_kfac")
    auto = DPKFACOptions(grad_reduction="auto", overlap="auto")
    pairs = {(c.grad_reduction, c.overlap) for c in scheme.candidates(auto, 4)}
    assert pairs == {("allreduce", False), ("allreduce", True), ("owner", False), ("owner", True)}
    assert not scheme.resolved(auto) and scheme.may_overlap(auto)
    fixed = DPKFACOptions(grad_reduction="owner", overlap="auto")
    assert [(c.grad_reduction, c.overlap) for c in scheme.candidates(fixed, 4)] == [
        ("owner", False),
        ("owner", True),
    ]
    assert scheme.may_overlap(fixed)
    assert not scheme.may_overlap(DPKFACOptions(grad_reduction="owner"))
    with pytest.raises(ValueError, match="overlap must be a bool or 'auto', got 'yes'"):
        DPKFACOptions(overlap="yes")
    with pytest.raises(ValueError, match="unknown grad_reduction 'some'"):
        DPKFACOptions(grad_reduction="some")


def test_drain_auto_adds_the_ready_drain_to_the_overlapped_candidates_only() -> None:
    scheme = scheme_of("dp_kfac")
    auto = DPKFACOptions(grad_reduction="owner", overlap="auto", drain="auto")
    assert [(c.overlap, c.drain) for c in scheme.candidates(auto, 4)] == [
        (False, "last"),
        (True, "last"),
        (True, "ready"),
    ]
    assert not auto.resolved
    # Without overlap the drain has nothing to choose: no start-up measurement for it.
    assert DPKFACOptions(overlap=False, drain="auto").resolved
    ready = DPKFACOptions(grad_reduction="owner", overlap=True, drain="ready")
    assert (
        scheme.traits(ready).drain == "ready" and scheme.describe(ready) == "owner, overlap, ready"
    )
    assert scheme.traits(replace(ready, overlap=False)).drain == "last"
    with pytest.raises(ValueError, match="unknown drain 'soon'"):
        DPKFACOptions(drain="soon")


@pytest.mark.parametrize("intervals", [(1, 1), (10, 100)])
def test_auto_chooses_the_ready_drain_where_plain_steps_gain(intervals: tuple[int, int]) -> None:
    """BERT-base at P=64 on the V100 preset's links and engines, its hooks running as the
    backward does (gloo): with decompositions every step both drains are the same schedule
    (the last-launch drain is preferred); in the practical setting the plain steps'
    exchanges hide under the backward pass and the ready drain wins by more than the
    tolerance. On the preset itself (NCCL: the host queues work ahead of the device) the
    two are one schedule, and the last-launch drain is chosen."""
    shapes, base = zoo.ZOO["bert_base"]
    kfac = KFACOptions(
        factor_update_steps=intervals[0], inv_update_steps=intervals[1], kl_clip=base.kl_clip
    )
    scheme = scheme_of("dp_kfac")
    v100 = PRESETS["v100_ib100"]
    auto = DPKFACOptions(grad_reduction="owner", overlap="auto", drain="auto", hardware=v100)
    chosen, _ = choose_options(scheme, auto, shapes=shapes, world_size=64, kfac=kfac)
    assert (chosen.overlap, chosen.drain) == (True, "last")
    gloo = replace(auto, hardware=replace(v100, backend="gloo"))
    chosen, candidates = choose_options(scheme, gloo, shapes=shapes, world_size=64, kfac=kfac)
    by = {(c.options.overlap, c.options.drain): c.iteration for c in candidates}
    if intervals == (1, 1):
        assert by[(True, "ready")] == by[(True, "last")]
        assert (chosen.overlap, chosen.drain) == (True, "last")
    else:
        assert by[(True, "ready")] < by[(True, "last")] / 1.05
        assert (chosen.overlap, chosen.drain) == (True, "ready")


@pytest.mark.parametrize("intervals", [(1, 1), (10, 100)])
def test_auto_follows_the_tolerance_rule_at_scale(intervals: tuple[int, int]) -> None:
    """ResNet-32 at P=64 on the V100 preset: the fastest within 5%, fewest bytes among those."""
    shapes, base = zoo.ZOO["resnet32"]
    kfac = KFACOptions(
        factor_update_steps=intervals[0], inv_update_steps=intervals[1], kl_clip=base.kl_clip
    )
    auto = DPKFACOptions(grad_reduction="auto", overlap="auto", hardware="v100_ib100")
    chosen, candidates = choose_options(
        scheme_of("dp_kfac"), auto, shapes=shapes, world_size=64, kfac=kfac
    )
    assert len(candidates) == 4
    fastest = min(c.iteration for c in candidates)
    near = [c for c in candidates if c.iteration <= 1.05 * fastest]
    best = min(near, key=lambda c: (c.comm_bytes, c.wire_bytes))
    assert (chosen.grad_reduction, chosen.overlap) == (
        best.options.grad_reduction,
        best.options.overlap,
    )
    # The owner reduction is predicted no slower than the all-reduce without overlap.
    by = {(c.options.grad_reduction, c.options.overlap): c.iteration for c in candidates}
    assert by[("owner", False)] <= by[("allreduce", False)]
    # Overlapped, the owner reduction hides what the all-reduce overlap hides, in fewer bytes.
    assert by[("owner", True)] <= by[("allreduce", True)]
    # predict() resolves "auto" the same way.
    pred = predict(
        shapes,
        strategy="dp_kfac",
        world_size=64,
        hardware=PRESETS["v100_ib100"],
        kfac=kfac,
        options=auto,
    )
    assert pred.options == chosen


def test_auto_prices_the_gradients_of_the_other_parameters_too() -> None:
    """BERT-base's word embedding is no K-FAC layer, yet its gradient crosses the wire every
    step: "auto" prices the whole model (priced from the layers alone, a run chose the owner
    mode without overlap where it measured up to 29% slower)."""
    shapes, base = zoo.ZOO["bert_base"]
    order = shapes.param_order()
    others = [x for x in order if x[0] < 0]
    # Model order, as a run reports it: the embeddings first, so they are ready last.
    model = replace(shapes, order=(*others[:3], *(x for x in order if x[0] >= 0), *others[3:]))
    hw = scaled(PRESETS["v100_ib100"], network=0.01)
    kfac = KFACOptions(factor_update_steps=10, inv_update_steps=100, kl_clip=base.kl_clip)
    auto = DPKFACOptions(grad_reduction="auto", overlap="auto", hardware=hw)
    scheme = scheme_of("dp_kfac")
    _, whole = choose_options(scheme, auto, shapes=model, world_size=2, kfac=kfac)
    _, layers = choose_options(scheme, auto, shapes=list(shapes), world_size=2, kfac=kfac)
    rest = sum(n for _, n in others) * 4
    wire = hw.link("allreduce").time(1, wire_bytes("allreduce", rest, 2), 2)
    for w, c in zip(whole, layers, strict=True):
        assert w.label == c.label
        if not w.options.overlap:  # reduced in step(), after the backward pass
            assert w.iteration - c.iteration >= 0.9 * wire, w.label


def test_a_run_reports_every_trainable_parameter_in_model_order() -> None:
    """What a run hands "auto" (:meth:`dpkfac.capture.Parameters.layout`): each trainable
    parameter, in ``model.parameters()`` order, with its K-FAC layer's index or -1."""
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)
    )
    model[2].bias.requires_grad_(False)  # frozen: not reduced, not priced
    helper = helper_for(model[1])
    assert helper is not None
    layers = [KFACLayer("1", model[1], helper)]
    assert Parameters(model, layers).layout(layers) == [(-1, 40), (0, 12), (0, 3), (-1, 3)]


def _train(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_model().double()
    pre = dpkfac.KFACPreconditioner(
        model, strategy="dp_kfac", factor_dtype=torch.float64, **KW, **options
    )
    batches = [
        tuple(t.double() if t.is_floating_point() else t for t in batch(s, rank)) for s in range(4)
    ]
    out = run(model, pre, batches)
    opts = pre.strategy.options
    return {
        "params": out["params"],
        "choice": (opts.grad_reduction, opts.overlap),
        "candidates": len(pre.choice),
        "overlap_installed": pre.overlap is not None,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hardware", ["cpu_gloo_local", "v100_ib100"])
def test_every_choice_gives_dp_kfacs_update_identically_on_every_rank(
    world_size: int, hardware: str
) -> None:
    auto = {"grad_reduction": "auto", "overlap": "auto", "hardware": hardware}
    chosen = run_ranks(_train, world_size, auto)
    plain = run_ranks(_train, world_size, {})
    assert len({out["choice"] for out in chosen}) == 1
    assert chosen[0]["candidates"] == 4 and chosen[0]["overlap_installed"]
    for got, want in zip(chosen, plain, strict=True):
        for a, b in zip(got["params"], want["params"], strict=True):
            assert max_rel_err(a, b) < 1e-10
    for a, b in zip(
        chosen[0]["params"][-1].values(), chosen[-1]["params"][-1].values(), strict=True
    ):
        assert torch.equal(a, b)  # replicas bitwise identical


def test_a_loss_scaler_keeps_every_candidate() -> None:
    """The overlapped mode takes the scaled gradients (``takes_scaled_gradients``), so a loss
    scaler rules nothing out: "auto" prices all four pairs."""
    model = make_model()
    scaler = torch.amp.GradScaler("cpu")
    pre = dpkfac.KFACPreconditioner(
        model,
        strategy="dp_kfac",
        grad_reduction="auto",
        overlap="auto",
        hardware="cpu_gloo_local",
        grad_scaler=scaler,
        **KW,
    )
    assert pre.overlap is not None and pre.takes_scaled_gradients
    assert "chosen at the first step" in pre.gradient_path
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch(0, 0)
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    pre.step()
    scaler.step(opt)
    assert len(pre.choice) == 4
