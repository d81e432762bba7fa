"""The curvature-fidelity probe (dpkfac/fidelity.py; ``fidelity_every``, ``fidelity_layers``).

At a probe step the owner of a layer preconditions the averaged gradient with
its own batch's damped factors (a) and with the factors averaged over all ranks
(b); ``cosine`` and ``rel_error = ‖a − b‖/‖b‖`` reach every rank through one
small all-reduce. The probe must be invisible to training (bitwise), cost
exactly one extra all-reduce of the probed factors plus the metric vector, and
read nothing on the host in the hooks or in ``step()``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import STRATEGY_VARIANTS, batch, make_model, make_preconditioner
from test_core_host_sync import reads_per_phase
from torch import nn

import dpkfac
from dpkfac.fidelity import probed_names, select_layers
from dpkfac.options import KFACOptions
from experiments.loggers import fidelity_metrics

LAYERS = ("conv", "fc1", "fc2")  # TinyNet's K-FAC layers, in module order
#: (A side, G side) of TinyNet's layers: conv 2·3·3+1, 3; fc1 48+1, 5; fc2 5 (no bias), 4.
DIMS = {"conv": (19, 3), "fc1": (49, 5), "fc2": (5, 4)}


def _train(
    rank: int,
    world_size: int,
    variant: str,
    same_batches: bool,
    steps: int,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """Train TinyNet with SGD; return the probe values after every step and the stats."""
    model = make_model()
    pre = make_preconditioner(model, variant, **overrides)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(steps):
        x, y = batch(step, 0 if same_batches else rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        history.append(pre.fidelity())
    held = {
        name: [layer.factors[w].running is not None for w in ("A", "G")]
        + [layer.has_pending(w) for w in ("A", "G")]
        for name, layer in pre.layers.items()
    }
    return {
        "history": history,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "comm": pre.comm_stats(),
        "timings": pre.timings(),
        "owners": {name: layer.owner for name, layer in pre.layers.items()},
        "held": held,
        "memory": pre.memory_usage(),
    }


def _probe_values(out: dict[str, Any]) -> list[tuple[str, int, float, float]]:
    """Every (layer, step, cosine, rel_error) newly reported after a step."""
    rows = []
    for step, snapshot in enumerate(out["history"]):
        for name, m in snapshot.items():
            if m["step"] == step:
                rows.append((name, step, m["cosine"], m["rel_error"]))
    return rows


# ------------------------------------------------------------------ the values


@pytest.mark.distributed
@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_identical_batches_give_cosine_one(variant: str) -> None:
    outs = run_ranks(_train, 2, variant, True, 4, {"fidelity_every": 1})
    rows = _probe_values(outs[0])
    assert [r[:2] for r in rows] == [(LAYERS[s % 3], s) for s in range(4)]
    for name, step, cosine, rel_error in rows:
        assert abs(cosine - 1.0) < 1e-6, (variant, name, step, cosine)
        assert rel_error < 1e-6, (variant, name, step, rel_error)
    assert outs[0]["history"] == outs[1]["history"]


@pytest.mark.distributed
@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_different_batches_give_cosine_below_one_on_every_rank(variant: str) -> None:
    outs = run_ranks(_train, 2, variant, False, 3, {"fidelity_every": 1})
    rows = _probe_values(outs[0])
    assert len(rows) == 3
    for name, step, cosine, rel_error in rows:
        assert cosine < 0.99, (variant, name, step, cosine)
        assert rel_error > 0.01, (variant, name, step, rel_error)
        assert math.isfinite(cosine) and -1.0 <= cosine <= 1.0
    # Exactly the same values on every rank (one all-reduce of the owner's).
    assert outs[0]["history"] == outs[1]["history"]


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["dp_kfac", "d_kfac"])
def test_three_ranks(variant: str) -> None:
    same = run_ranks(_train, 3, variant, True, 3, {"fidelity_every": 1})
    for _, _, cosine, rel_error in _probe_values(same[0]):
        assert abs(cosine - 1.0) < 1e-6 and rel_error < 1e-6
    diff = run_ranks(_train, 3, variant, False, 3, {"fidelity_every": 1})
    rows = _probe_values(diff[0])
    assert len(rows) == 3 and all(c < 0.99 for _, _, c, _ in rows)
    assert diff[0]["history"] == diff[1]["history"] == diff[2]["history"]


def test_single_rank_is_trivially_one() -> None:
    out = _train(0, 1, "dp_kfac", False, 3, {"fidelity_every": 1})
    for _, _, cosine, rel_error in _probe_values(out):
        assert abs(cosine - 1.0) < 1e-12 and rel_error < 1e-12
    assert "fidelity_allreduce" not in out["comm"]  # nothing to communicate


# ------------------------------------------------- against a dense reference


def _linear_batch(rank: int, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=g)


def _linear_probe(rank: int, world_size: int, strategy: str, method: str) -> dict[str, Any]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    weight = torch.cat([model[0].weight, model[0].bias[:, None]], 1).detach().clone()
    pre = dpkfac.KFACPreconditioner(
        model,
        strategy=strategy,
        compute_method=method,
        damping=0.05,
        kl_clip=None,
        collective_timeout=60.0,
        fidelity_every=1,
    )
    x, y = _linear_batch(rank)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return {"fidelity": pre.fidelity()["0"], "owner": pre.layers["0"].owner, "weight": weight}


def _dense_reference(
    weight: torch.Tensor, world_size: int, owner: int, method: str, damping: float
) -> tuple[float, float]:
    """cosine and rel_error from A, G and ∇W built by hand, in float64, densely."""
    a_factors, g_factors, grads = [], [], []
    for rank in range(world_size):
        x, y = _linear_batch(rank)
        n = x.shape[0]
        a = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)  # bias column
        g = torch.softmax(a @ weight.t(), 1) - F.one_hot(y, 3).double()  # per-example dL/dz
        a_factors.append(a.t() @ a / n)
        g_factors.append(g.t() @ g / n)
        grads.append(g.t() @ a / n)  # gradient of the batch-mean loss
    grad = torch.stack(grads).mean(0)

    def update(a_f: torch.Tensor, g_f: torch.Tensor) -> torch.Tensor:
        if method == "eigen":  # (G ⊗ A + γI)⁻¹ vec(∇W), row-major vec
            k = torch.kron(g_f, a_f) + damping * torch.eye(g_f.shape[0] * a_f.shape[0]).double()
            return torch.linalg.solve(k, grad.reshape(-1)).reshape(grad.shape)
        root = math.sqrt(damping)  # (G + √γI)⁻¹ ∇W (A + √γI)⁻¹
        g_inv = torch.linalg.inv(g_f + root * torch.eye(g_f.shape[0]).double())
        a_inv = torch.linalg.inv(a_f + root * torch.eye(a_f.shape[0]).double())
        return g_inv @ grad @ a_inv

    here = owner if owner >= 0 else 0  # a layer no one rank owns is compared on rank 0
    mine = update(a_factors[here], g_factors[here])
    ref = update(torch.stack(a_factors).mean(0), torch.stack(g_factors).mean(0))
    cosine = float((mine * ref).sum() / (mine.norm() * ref.norm()))
    return cosine, float((mine - ref).norm() / ref.norm())


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "method"), [("dp_kfac", "eigen"), ("d_kfac", "eigen"), ("dp_kfac", "inverse")]
)
def test_matches_dense_float64_reference(strategy: str, method: str) -> None:
    outs = run_ranks(_linear_probe, 2, strategy, method)
    got, owner = outs[0]["fidelity"], outs[0]["owner"]
    assert outs[1]["fidelity"] == got
    cosine, rel_error = _dense_reference(outs[0]["weight"], 2, owner, method, 0.05)
    assert cosine < 0.999  # the two batches differ: a real comparison
    assert got["cosine"] == pytest.approx(cosine, rel=1e-9, abs=1e-12)
    assert got["rel_error"] == pytest.approx(rel_error, rel=1e-9, abs=1e-12)
    assert got["step"] == 0


# ------------------------------------------------------- invisible to training


def _off_and_on(rank: int, world_size: int, variant: str) -> dict[str, Any]:
    common: dict[str, Any] = {"factor_update_steps": 2, "inv_update_steps": 3, "kl_clip": 0.01}
    if variant == "spd_kfac_local":
        # Its local-or-broadcast rule follows a hardware model measured at start-up, which
        # two runs on a loaded machine can measure apart: both take one model, so that
        # what differs between them is the probe alone.
        common["hardware"] = "cpu_gloo_local"
    off = _train(rank, world_size, variant, False, 7, common)
    on = _train(rank, world_size, variant, False, 7, {**common, "fidelity_every": 1})
    return {"off": off, "on": on}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_probe_leaves_training_bitwise_unchanged(variant: str) -> None:
    for rank, out in enumerate(run_ranks(_off_and_on, 2, variant)):
        off, on = out["off"], out["on"]
        assert len(_probe_values(on)) == 7  # every step probed, factor steps or not
        for name, p in off["params"].items():
            assert torch.equal(p, on["params"][name]), (variant, rank, name)
        # No factor held or pending that the run without the probe does not hold:
        # dp_kfac's non-owners keep holding nothing.
        assert off["held"] == on["held"], (variant, rank)
        assert off["memory"]["factors_bytes"] == on["memory"]["factors_bytes"]
        assert off["memory"]["decompositions_bytes"] == on["memory"]["decompositions_bytes"]
        if variant.startswith("dp_kfac"):
            for name, owner in on["owners"].items():
                if owner != rank:
                    assert on["held"][name] == [False] * 4, (rank, name)
        # The other categories' traffic is untouched (spd_kfac's number of calls
        # follows its fusion plan, built from measured ready times: bytes only).
        extra = {k: v for k, v in on["comm"].items() if k != "fidelity_allreduce"}
        if variant.startswith("spd_kfac"):
            extra = {k: v["bytes"] for k, v in extra.items()}
            assert extra == {k: v["bytes"] for k, v in off["comm"].items()}, variant
        else:
            assert extra == off["comm"], variant
        assert "fidelity_allreduce" not in off["comm"]
        assert "fidelity" not in off["timings"] and "fidelity" in on["timings"]
        assert "fidelity_comm" in on["timings"]


# ------------------------------------------------------------------ accounting


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["dp_kfac", "spd_kfac", "kaisa_mem_opt"])
def test_extra_bytes_are_one_factor_allreduce_plus_the_metric_vector(variant: str) -> None:
    steps, every = 7, 2  # probes at 0, 2, 4, 6: conv, fc1, fc2, conv
    outs = run_ranks(_train, 2, variant, False, steps, {"fidelity_every": every})
    expected = 0
    for step in range(0, steps, every):
        a_dim, g_dim = DIMS[LAYERS[(step // every) % 3]]
        expected += 8 * (a_dim**2 + g_dim**2) + 8 * 2  # float64 factors + [cosine, rel_error]
    for out in outs:
        stats = out["comm"]["fidelity_allreduce"]
        assert stats["bytes"] == expected
        assert stats["calls"] == 2 * len(range(0, steps, every))
        assert stats["wire_bytes"] == expected  # ring all-reduce at P=2: 2·n·(P−1)/P = n


@pytest.mark.distributed
def test_selected_layers_travel_in_one_allreduce() -> None:
    outs = run_ranks(
        _train, 2, "dp_kfac", False, 3, {"fidelity_every": 3, "fidelity_layers": ["fc.*"]}
    )
    stats = outs[0]["comm"]["fidelity_allreduce"]
    factors = sum(8 * (a * a + g * g) for a, g in (DIMS["fc1"], DIMS["fc2"]))
    assert stats == {"bytes": factors + 8 * 4, "calls": 2, "wire_bytes": factors + 8 * 4}
    assert set(outs[0]["history"][-1]) == {"fc1", "fc2"}


# ------------------------------------------------------------ host reads


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["dp_kfac", "d_kfac", "spd_kfac", "kaisa_comm_opt"])
def test_probe_adds_no_host_reads(variant: str) -> None:
    off = run_ranks(reads_per_phase, 2, variant, {"fidelity_every": 0})
    on = run_ranks(reads_per_phase, 2, variant, {"fidelity_every": 1})
    for a, b in zip(off, on, strict=True):
        assert a["hooks"] == b["hooks"] == [0, 0, 0]
        assert a["steps"] == b["steps"]
        assert b["probes"] == 3


# --------------------------------------------------------------- options


def test_rotation_visits_layers_in_module_order() -> None:
    out = _train(0, 1, "dp_kfac", False, 8, {"fidelity_every": 2})
    rows = _probe_values(out)
    assert [(name, step) for name, step, _, _ in rows] == [
        ("conv", 0),
        ("fc1", 2),
        ("fc2", 4),
        ("conv", 6),
    ]
    assert probed_names(3, 2, LAYERS, None) == []
    assert probed_names(10, 5, LAYERS, None) == ["fc2"]
    assert probed_names(10, 5, LAYERS, ["fc1"]) == ["fc1"]
    assert probed_names(10, 0, LAYERS, None) == []


def test_layer_selection() -> None:
    assert select_layers(LAYERS, None) is None
    assert select_layers(LAYERS, ["fc2", "conv"]) == ["conv", "fc2"]  # module order
    assert select_layers(LAYERS, ["fc\\d"]) == ["fc1", "fc2"]
    with pytest.raises(ValueError, match="'fc'"):
        select_layers(LAYERS, ["fc"])  # a full match, not a search


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"fidelity_every": -1}, "-1"),
        ({"fidelity_every": 1.5}, "1.5"),
        ({"fidelity_every": True}, "True"),
        ({"fidelity_every": "5"}, "'5'"),
        ({"fidelity_layers": []}, r"\[\]"),
        ({"fidelity_layers": 3}, "3"),
        ({"fidelity_layers": [3]}, "3"),
        ({"fidelity_layers": ["("]}, r"'\('"),
    ],
)
def test_bad_options_name_the_value(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        KFACOptions(**kwargs)
    with pytest.raises(ValueError, match=named):
        make_preconditioner(make_model(), "dp_kfac", **kwargs)


def test_unknown_layer_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="'decoder'"):
        make_preconditioner(make_model(), "dp_kfac", fidelity_every=1, fidelity_layers=["decoder"])
    # A skipped layer is no K-FAC layer.
    with pytest.raises(ValueError, match="'fc2'"):
        make_preconditioner(
            make_model(), "dp_kfac", fidelity_every=1, fidelity_layers="fc2", skip_layers="fc2"
        )


def test_off_by_default() -> None:
    options = KFACOptions()
    assert options.fidelity_every == 0 and options.fidelity_layers is None
    out = _train(0, 1, "dp_kfac", False, 2, {})
    assert out["history"] == [{}, {}]
    assert "fidelity" not in out["timings"]
    assert KFACOptions(fidelity_layers="fc1").fidelity_layers == ("fc1",)


# --------------------------------------------------------------- the trainer


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """History rows of an offline W&B run, read from its ``.wandb`` file.

    The file is a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of
    records, each with a 7-byte header: crc32, length, type full/first/middle/last)
    of ``wandb_internal_pb2.Record`` messages; wandb >= 0.20 no longer ships a
    Python reader for it.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, rows = 32768, 7, b"", []
    while pos < len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(buf)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def test_fidelity_metric_names() -> None:
    values = {
        "conv": {"cosine": 0.5, "rel_error": 2.0, "step": 4},
        "fc": {"cosine": 1.0, "rel_error": 0.0, "step": 2},
    }
    assert fidelity_metrics(values, 4) == {
        "fidelity/conv/cosine": 0.5,
        "fidelity/conv/rel_error": 2.0,
    }
    assert fidelity_metrics({}, 4) == {}


def test_trainer_logs_fidelity_when_a_probe_ran(train, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(
        "experiment=digits_cnn",
        "data.batch_size=16",
        "trainer.max_steps=6",
        "strategy.fidelity_every=2",
        "logger._target_=experiments.bench.fidelity.RecordingLogger",
        out=out,
    )
    rows = [json.loads(line) for line in (out / "fidelity.jsonl").read_text().splitlines()]
    # Probes at preconditioner steps 0, 2, 4, logged at optimizer steps 1, 3, 5; rotation.
    assert [(r["step"], r["layer"]) for r in rows] == [
        (1, "features.0"),
        (3, "features.2"),
        (5, "classifier.1"),
    ]
    for r in rows:  # one rank: the local factors are the averaged ones
        assert abs(r["cosine"] - 1.0) < 1e-6 and r["rel_error"] < 1e-5


@pytest.mark.slow
def test_wandb_offline_run_holds_the_fidelity_metrics(compose, tmp_path: Path) -> None:
    import wandb

    from experiments.train import run

    out = tmp_path / "run"
    cfg = compose(
        "experiment=digits_cnn",
        "data.fake=true",
        "data.batch_size=16",
        "trainer.max_steps=4",
        "trainer.progress_bar=false",
        "strategy.fidelity_every=3",
        "logger=wandb",
        f"output_dir={out}",
    )
    run(cfg)
    # finish() returns once the run is closed, not once W&B's service has written all of
    # it to the .wandb file (under load the file was read without its history rows):
    # tearing the service down waits for that.
    wandb.teardown()
    logged = [
        (row["_step"], sorted(k for k in row if k.startswith("fidelity/")))
        for row in _wandb_history(out)
        if any(k.startswith("fidelity/") for k in row)
    ]
    assert logged == [
        (1, ["fidelity/features.0/cosine", "fidelity/features.0/rel_error"]),
        (4, ["fidelity/features.2/cosine", "fidelity/features.2/rel_error"]),
    ]


def test_the_fidelity_table_summarises_each_layer_under_a_computed_takeaway(tmp_path):
    from experiments.bench import fidelity

    rows = [
        {
            "run": "r",
            "world_size": 2,
            "strategy": "dp_kfac",
            "step": s,
            "layer": layer,
            "cosine": c,
            "rel_error": e,
        }
        for s, (layer, c, e) in enumerate(
            [("conv", 1.0, 0.0), ("fc", 0.8, 0.5), ("conv", 0.98, 0.02), ("fc", 0.6, 1.5)]
        )
    ]
    summary = {r["layer"]: r for r in fidelity.layer_summary(rows)}
    assert summary["fc"]["cosine_mean"] == pytest.approx(0.7)
    assert summary["fc"]["cosine_min"] == pytest.approx(0.6)
    assert summary["fc"]["rel_error_mean"] == pytest.approx(1.0)
    assert summary["conv"]["probes"] == 2
    text = fidelity.write_markdown(rows, tmp_path / "fidelity.md").read_text()
    assert text.split("\n")[2].startswith(
        "**Takeaway.** At P=2, the update an owner builds from its own batch's factors has a "
        "mean cosine of 0.700–0.990"
    )
    assert "1 of them stay at 0.99 or above" in text
    assert "costs most at r's `fc` (mean cosine 0.700, worst 0.600" in text
    assert "| r | 2 | dp_kfac | `fc` | 0.700 | 0.600 | 1.000 | 2 |" in text


# ------------------------------------------------------- a probe that fails


def test_eigh_that_does_not_converge_in_float32_is_retried_in_float64(monkeypatch) -> None:
    """float32 LAPACK failed on local batch factors (rank <= batch) in MNIST-1D runs at P=64."""
    from dpkfac import fidelity

    eigh = torch.linalg.eigh

    def float32_fails(a: torch.Tensor) -> Any:
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return eigh(a)

    x = torch.randn(3, 6, dtype=torch.float64)
    factor = x.t() @ x  # rank 3 of 6: repeated zero eigenvalues
    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    dec = fidelity._eigen(factor.float(), torch.float32)
    d, q = eigh(factor.float().double())
    assert dec.d.dtype == dec.q.dtype == torch.float32
    assert torch.equal(dec.d, d.clamp(min=0.0).float()) and torch.equal(dec.q, q.float())


def test_a_failed_probe_is_skipped_with_a_warning_and_training_goes_on(monkeypatch) -> None:
    from dpkfac import fidelity

    def fails(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(fidelity, "damped_update", fails)
    with pytest.warns(UserWarning, match="fidelity probe of layer '[a-z0-9]+' at step [0-2] skip"):
        out = _train(0, 1, "dp_kfac", False, 3, {"fidelity_every": 1})
    values = _probe_values(out)
    assert [v[:2] for v in values] == [("conv", 0), ("fc1", 1), ("fc2", 2)]
    assert all(math.isnan(c) and math.isnan(e) for _, _, c, e in values)
    plain = _train(0, 1, "dp_kfac", False, 3, {"fidelity_every": 0})
    for name, p in plain["params"].items():
        assert torch.equal(out["params"][name], p), name  # the probe stays invisible
