"""The owner reduction overlapped with the backward pass, with and without DDP's engine.

dp_kfac with ``grad_reduction="owner", overlap=True`` reduce-scatters each backward
bucket's K-FAC gradients onto their owners, preconditions a layer once its bucket is
reduced and all-gathers the updates (broadcasts per owner on gloo), inside the
backward pass. On a DistributedDataParallel model the same engine is DDP's
communication hook. Checked here, in float64 at P = 2, 3 and 4 against the ordinary
dp_kfac step (all-reduce, no overlap, no DDP):

* the gradients ``step()`` writes agree to 1e-12, with and without DDP (bucket views
  or copies, one bucket or many), with ``no_sync`` accumulation, and with the KL clip;
* replicas stay bitwise identical;
* the wire bytes per step are at most 1.02x DDP SGD's, and exactly the cost model's;
* with a loss scaler and an overflow forced on one rank's local gradient only, every
  rank skips the same steps and reverts the same factor folds;
* on one rank the whole step's work is done inside the backward pass.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import batch, embed_batch, embed_net, make_model, make_preconditioner
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpkfac.comm import Communicator
from dpkfac.costmodel import PRESETS, predict, shapes_from_model
from dpkfac.options import KFACOptions
from dpkfac.plan.dp_kfac import DRAINS

TOL = 1e-12
STEPS = 6
SMALL = 300 / 2**20  # bytes of a bucket cap that cuts the tiny model into several buckets

#: name -> (options of the run; "ddp": None (no DDP), "views" or "copies"; "micro": micro-batches)
CASES: dict[str, dict[str, Any]] = {
    "own-hooks": {"ddp": None},
    "own-hooks-small-buckets-kl": {"ddp": None, "bucket_cap_mb": SMALL, "kl_clip": 0.01},
    "own-hooks-accum-intervals": {
        "ddp": None,
        "micro": 2,
        "factor_update_steps": 2,
        "inv_update_steps": 3,
    },
    "ddp-views": {"ddp": "views"},
    "ddp-copies-small-buckets-kl": {"ddp": "copies", "ddp_cap": SMALL, "kl_clip": 0.01},
    "ddp-no-sync-accum-kl": {"ddp": "views", "micro": 2, "kl_clip": 0.01, "inv_update_steps": 2},
    "ddp-allreduce-overlap": {"ddp": "views", "ddp_cap": SMALL, "grad_reduction": "allreduce"},
}


def _wrap(model: nn.Module, how: str | None, cap_mb: float | None) -> nn.Module:
    if how is None:
        return model
    kwargs: dict[str, Any] = {"gradient_as_bucket_view": how == "views"}
    if cap_mb is not None:
        kwargs["bucket_cap_mb"] = cap_mb
    return DistributedDataParallel(model, **kwargs)


def _train(rank: int, case: dict[str, Any], overlapped: str | None) -> dict[str, Any]:
    """Run STEPS steps; the gradients step() wrote, the parameters, the stats of each step.
    ``overlapped``: the overlapped mode's drain (None: the reference)."""
    options = dict(case)
    how, cap = options.pop("ddp"), options.pop("ddp_cap", None)
    micro = options.pop("micro", 1)
    if micro > 1:
        options["accumulation_steps"] = micro
    inner = make_model()
    if overlapped:
        options.setdefault("grad_reduction", "owner")
        model = _wrap(inner, how, cap)
        pre = make_preconditioner(model, "dp_kfac", overlap=True, drain=overlapped, **options)
    else:  # the reference: the ordinary dp_kfac step, gradients all-reduced by it
        options.pop("grad_reduction", None)
        model = inner
        pre = make_preconditioner(model, "dp_kfac", **options)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9)
    grads, params, stats = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        pre.reset_stats()
        for m in range(micro):
            x, y = batch(10 * step + m, rank)
            last = m == micro - 1
            sync = model.no_sync() if (how and overlapped and not last) else torch.enable_grad()
            with sync:
                (F.cross_entropy(model(x), y) / micro).backward()
        pre.step()
        grads.append({n: p.grad.detach().clone() for n, p in inner.named_parameters()})
        opt.step()
        params.append({n: p.detach().clone() for n, p in inner.named_parameters()})
        stats.append(pre.comm_stats())
    return {"grads": grads, "params": params, "stats": stats}


def _sgd_wire(rank: int, world_size: int) -> int:
    """Wire bytes one step of DDP SGD sends on this model (DDP's default buckets)."""
    inner = make_model()
    model = DistributedDataParallel(inner)
    comm = Communicator()
    model.register_comm_hook(None, comm.ddp_hook())
    x, y = batch(0, rank)
    for _ in range(2):  # the second iteration runs on DDP's rebuilt buckets
        comm.stats.reset()
        F.cross_entropy(model(x), y).backward()
    return sum(v["wire_bytes"] for v in comm.stats.as_dict().values())


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"sgd_wire": _sgd_wire(rank, world_size)}
    for name, case in CASES.items():
        out[name] = {o: _train(rank, case, o) for o in (None, *DRAINS)}
    return out


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_owner_overlap_gives_dp_kfacs_update_in_sgds_bytes(world_size: int) -> None:
    results = run_ranks(_all, world_size, timeout=240)
    for name in CASES:
        for rank, res, drain in ((r, res, d) for r, res in enumerate(results) for d in DRAINS):
            plain, over = res[name][None], res[name][drain]
            for step in range(STEPS):
                err = _rel(over["grads"][step], plain["grads"][step])
                assert err < TOL, (name, drain, rank, step, err)
        for step, drain in ((s, d) for s in range(STEPS) for d in DRAINS):  # replicas bitwise
            first = results[0][name][drain]["params"][step]
            for res in results[1:]:
                other = res[name][drain]["params"][step]
                assert all(torch.equal(first[k], other[k]) for k in first), (name, drain, step)
    for res in results:
        for name, case in CASES.items():
            if case.get("grad_reduction") == "allreduce":
                continue
            # Steps after the first (which places the layers on the ordinary path).
            for stats in (s for d in DRAINS for s in res[name][d]["stats"][1:]):
                wire = sum(v["wire_bytes"] for v in stats.values())
                assert wire <= 1.02 * res["sgd_wire"], (name, wire, res["sgd_wire"])


# ------------------------------------------------------------------ cost model
def _measured(rank: int, world_size: int, how: str | None, kl: bool) -> dict[str, Any]:
    inner = make_model()
    model = _wrap(inner, how, SMALL)
    pre = make_preconditioner(
        model,
        "dp_kfac",
        grad_reduction="owner",
        overlap=True,
        kl_clip=0.01 if kl else None,
        bucket_cap_mb=SMALL,
    )
    for step in range(3):
        pre.reset_stats()
        inner.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    return pre.comm_stats()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("how", [None, "views"])
def test_predicted_bytes_and_calls_equal_measured(world_size: int, how: str | None) -> None:
    """Per backward bucket (DDP's under DDP): the reduce-scatter (rooted reduces where gloo's
    reduce-scatter has no future for DDP's hook) and the update exchange."""
    measured = run_ranks(_measured, world_size, how, True)
    # DDP rebuilds its buckets in the order autograd made the gradients ready.
    shapes = shapes_from_model(make_model(), batch(0, 0)[0], ready_order=True)
    kfac = KFACOptions(damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1, bucket_cap_mb=SMALL)
    pred = predict(
        shapes,
        strategy="dp_kfac",
        options={"grad_reduction": "owner", "overlap": True},
        world_size=world_size,
        hardware=PRESETS["cpu_gloo_local"],
        param_itemsize=8,
        kfac=kfac,
        ddp=how is not None,
    )
    for rank, stats in enumerate(measured):
        assert stats == pred.update.comm_of(rank), (rank, stats, pred.update.comm_of(rank))
    # Two buckets at least (one would be one reduce-scatter and one all-reduce).
    assert measured[0]["grad_allreduce"]["calls"] >= 3


# ------------------------------------------------------------------ loss scaler
FORCED = {2, 4}  # steps whose local gradient overflows on the last rank only


def _scaled(rank: int, world_size: int, how: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    inner = make_model().float()
    model = _wrap(inner, how, None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    pre = make_preconditioner(
        model, "dp_kfac", grad_reduction="owner", overlap=True, grad_scaler=scaler, kl_clip=0.01
    )
    assert pre.takes_scaled_gradients
    # The layer the last rank does not own: its local gradient overflows there alone.
    step_box = [0]
    victim = next(n for n, x in pre.layers.items() if x.owner != world_size - 1)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if rank == world_size - 1 and step_box[0] in FORCED:
            return torch.full_like(grad, float("inf"))
        return grad

    inner.get_submodule(victim).weight.register_hook(poison)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    skipped, factors, params = [], [], []
    for step in range(6):
        step_box[0] = step
        opt.zero_grad()
        x, y = batch(step, rank)
        scaler.scale(F.cross_entropy(model(x.float()), y)).backward()
        pre.step()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        factors.append(
            {
                n: [None if f is None else f.clone() for f in (x.a_factor, x.g_factor)]
                for n, x in pre.layers.items()
            }
        )
        params.append({n: p.detach().clone() for n, p in inner.named_parameters()})
    return {"skipped": skipped, "factors": factors, "params": params, "victim": victim}


@pytest.mark.distributed
@pytest.mark.parametrize("how", [None, "views"])
def test_an_overflow_on_one_rank_is_skipped_by_every_rank(how: str | None) -> None:
    results = run_ranks(_scaled, 3, how)
    want = [s in FORCED for s in range(6)]
    for res in results:
        assert res["skipped"] == want
        for step in FORCED:  # no factor of any layer moved on a skipped step, on any rank
            for name, pair in res["factors"][step].items():
                for f, g in zip(pair, res["factors"][step - 1][name], strict=True):
                    assert (f is None) == (g is None) and (f is None or torch.equal(f, g))
            assert all(
                torch.equal(a, b)
                for a, b in zip(
                    res["params"][step].values(), res["params"][step - 1].values(), strict=True
                )
            )
    for step in range(6):
        first = results[0]["params"][step]
        for res in results[1:]:
            assert all(torch.equal(first[k], res["params"][step][k]) for k in first)


def _scaled_equals_plain(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for scaled in (False, True):
        inner = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
        pre = make_preconditioner(
            inner,
            "dp_kfac",
            grad_reduction="owner",
            overlap=scaled,
            grad_scaler=scaler,
            kl_clip=0.01,
        )
        opt = torch.optim.SGD(inner.parameters(), lr=0.1)
        params = []
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step, rank)
            loss = F.cross_entropy(inner(x), y)
            if scaler is None:
                loss.backward()
                pre.step()
                opt.step()
            else:
                scaler.scale(loss).backward()
                pre.step()
                scaler.step(opt)
                scaler.update()
            params.append({n: p.detach().clone() for n, p in inner.named_parameters()})
        out[scaled] = params
    return out


@pytest.mark.distributed
def test_scaled_gradients_give_the_unscaled_update() -> None:
    """A power-of-two loss scale is exact: the KL clip divides out s², the scaler s."""
    for res in run_ranks(_scaled_equals_plain, 2):
        for a, b in zip(res[True], res[False], strict=True):
            assert _rel(a, b) < TOL


# ------------------------------------------------------------------ where work happens
def _inside(rank: int, world_size: int) -> dict[str, Any]:
    inner = make_model()
    model = DistributedDataParallel(inner, bucket_cap_mb=SMALL)
    pre = make_preconditioner(model, "dp_kfac", grad_reduction="owner", overlap=True)
    engine = pre.overlap
    assert engine is not None
    out: dict[str, Any] = {}
    for step in range(3):
        inner.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        if step == 2:
            state = engine.state
            assert state is not None
            out = {
                "launched": len(state.launched),
                "settled": state.done,
                "preconditioned": sorted(state.results),
                "layers": sorted(pre.layers),
            }
        pre.step()
    return out


@pytest.mark.distributed
def test_on_one_rank_the_backward_pass_does_the_whole_step() -> None:
    """DDP hands every bucket to the hook; with nothing in flight, every layer is
    preconditioned before backward() returns."""
    (out,) = run_ranks(_inside, 1)
    assert out["launched"] > 1 and out["settled"] == out["launched"]
    assert out["preconditioned"] == out["layers"]


def _twice(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(make_model())
    pre = make_preconditioner(model, "dp_kfac", grad_reduction="owner", overlap=True)
    for step in range(2):
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    x, y = batch(5, rank)
    F.cross_entropy(model(x), y).backward()
    try:
        F.cross_entropy(model(x), y).backward()
    except RuntimeError as err:
        return str(err)
    return ""


@pytest.mark.distributed
def test_a_second_synchronised_backward_names_no_sync() -> None:
    for message in run_ranks(_twice, 2):
        assert "no_sync" in message and "twice" in message


# ------------------------------------------------- a bucket whose rest lands late
DELAY_S = 0.5  # how long the embedding's all-reduce is held back after it completes


class _Late:
    """A work that completes :data:`DELAY_S` after it was launched, whatever the wire did:
    what the embedding's all-reduce is on a slow link, made deterministic."""

    def __init__(self, work: Any, due: float) -> None:
        self.work, self.due = work, due

    def is_completed(self) -> bool:
        return time.monotonic() >= self.due and bool(self.work.is_completed())

    def wait(self, timeout: Any = None) -> bool:
        time.sleep(max(0.0, self.due - time.monotonic()))
        return bool(self.work.wait(timeout=timeout))

    def get_future(self) -> torch.futures.Future[Any]:
        """Completes at the due time, set from a timer thread (a callback that slept would
        hold one of gloo's worker threads, and with it other collectives)."""
        out: torch.futures.Future[Any] = torch.futures.Future()

        def held(fut: torch.futures.Future[Any]) -> None:
            delay = max(0.0, self.due - time.monotonic())
            threading.Timer(delay, out.set_result, [fut.value()]).start()

        self.work.get_future().then(held)
        return out


def _late_rest(
    rank: int, world_size: int, how: str | None, reduction: str = "owner"
) -> dict[str, Any]:
    """Overlapped steps on EmbedNet (one bucket: the two Linears and the embedding) with the
    all-reduce of the bucket's non-K-FAC part (the embedding's gradient) held back; when
    each layer was preconditioned and each exchange launched, against when the held
    all-reduce was due; the gradients step() wrote, against the ordinary dp_kfac step's.
    ``reduction``: the gradients' (``grad_reduction``), whose update exchange is an
    all-gather under the owner reduction and broadcasts otherwise."""
    inner = embed_net()
    model: nn.Module = DistributedDataParallel(inner) if how else inner
    pre = make_preconditioner(model, "dp_kfac", grad_reduction=reduction, overlap=True)
    engine = pre.overlap
    assert engine is not None
    due: list[float] = []
    events: list[tuple[str, float]] = []
    name = "all_gather" if reduction == "owner" else "broadcast"
    allreduce, exchange = engine.comm.allreduce_mean, getattr(engine.bcast_comm, name)
    embedding = inner.embed.weight.numel()

    def held(tensors: Any, category: str, **kw: Any) -> Any:
        handle = allreduce(tensors, category, **kw)
        rest = any(t.numel() == embedding for t in tensors)
        if kw.get("overlapped") and rest:  # the engine's all-reduce of the embedding
            due.append(time.monotonic() + DELAY_S)
            handle.works = [_Late(w, due[-1]) for w in handle.works]
        return handle

    def sent(*args: Any, **kw: Any) -> Any:
        events.append(("exchange", time.monotonic()))
        return exchange(*args, **kw)

    precondition = engine._precondition

    def preconditioned(layer: Any) -> Any:
        events.append(("precondition", time.monotonic()))
        return precondition(layer)

    engine.comm.allreduce_mean = held  # type: ignore[method-assign]
    setattr(engine.bcast_comm, name, sent)
    engine._precondition = preconditioned  # type: ignore[method-assign]
    reference = embed_net()
    plain = make_preconditioner(reference, "dp_kfac")
    out: dict[str, Any] = {"errors": [], "early": [], "due": due}
    for step in range(4):
        for net, p in ((model, pre), (reference, plain)):
            ids, y = embed_batch(step, rank)
            F.cross_entropy(net(ids), y).backward()
            p.step()
        out["errors"].append(_rel(_grads(inner), _grads(reference)))
        inner.zero_grad()
        reference.zero_grad()
        if step >= 2 and due:  # DDP rebuilds its buckets after the first iteration
            out["early"].append([(kind, t < due[-1]) for kind, t in events])
        events.clear()
    return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["owner", "allreduce"])
@pytest.mark.parametrize("how", [None, "ddp"])
def test_a_late_bucket_rest_holds_back_no_preconditioning_or_exchange(
    how: str | None, reduction: str
) -> None:
    """The one bucket's K-FAC layers are preconditioned and their updates sent before the
    all-reduce of its embedding is due, whether their gradients are reduced onto their
    owners or all-reduced: the layers wait for their own gradients only."""
    for out in run_ranks(_late_rest, 2, how, reduction):
        assert max(out["errors"]) < TOL, out["errors"]
        assert out["early"] and len(out["due"]) >= 3
        for step in out["early"]:
            kinds = {kind for kind, _ in step}
            assert kinds == {"precondition", "exchange"}, step
            assert all(early for _, early in step), step


# ------------------------------------------------------------------ the ready drain
PAUSE_S = 0.03  # the backward pass's compute between two layers: longer than a bucket's transfer


class _Pause(torch.autograd.Function):
    """Identity whose backward sleeps: the backward pass's compute between two layers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(PAUSE_S)
        return grad


class _PausedNet(nn.Module):
    """Three Linears, the backward pass pausing before each of the first two."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(_Pause.apply(x)))
        return self.fc3(_Pause.apply(x))


def _paused_order(rank: int, world_size: int, how: str | None, drain: str) -> dict[str, Any]:
    """Launches of gradient buckets and of update exchanges, in the order this rank made
    them, on steps 2..4 (plain steps: no decomposition after step 0); the gradients
    against the ordinary dp_kfac step's."""
    inner = _PausedNet().double()
    model = _wrap(inner, how, SMALL)
    pre = make_preconditioner(
        model,
        "dp_kfac",
        grad_reduction="owner",
        overlap=True,
        drain=drain,
        bucket_cap_mb=SMALL,
        inv_update_steps=100,
    )
    reference = _PausedNet().double()
    plain = make_preconditioner(reference, "dp_kfac", inv_update_steps=100)
    engine = pre.overlap
    assert engine is not None
    events: list[str] = []
    launch, exchange = engine._launch, engine.bcast_comm.all_gather

    def launched(*args: Any, **kw: Any) -> Any:
        events.append("bucket")
        return launch(*args, **kw)

    def sent(*args: Any, **kw: Any) -> Any:
        events.append("exchange")
        return exchange(*args, **kw)

    engine._launch = launched  # type: ignore[method-assign]
    engine.bcast_comm.all_gather = sent  # type: ignore[method-assign]
    out: dict[str, Any] = {"orders": [], "errors": []}
    for step in range(5):
        for net, p in ((model, pre), (reference, plain)):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 6, generator=g, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=g)
            F.cross_entropy(net(x), y).backward()
            p.step()
        out["errors"].append(_rel(_grads(inner), _grads(reference)))
        inner.zero_grad()
        reference.zero_grad()
        if step >= 2:
            out["orders"].append(list(events))
        events.clear()
    out["path"] = pre.gradient_path
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("how", [None, "ddp"])
def test_the_ready_drain_exchanges_updates_while_the_backward_pass_runs(how: str | None) -> None:
    """With the backward pass pausing between layers (each in its own bucket), the ready
    drain launches the first buckets' update exchanges before the last bucket is launched;
    the last-launch drain launches none before it. Both give the ordinary step's gradients."""
    for drain in ("ready", "last"):
        for out in run_ranks(_paused_order, 2, how, drain):
            assert max(out["errors"]) < TOL, (drain, out["errors"])
            assert ("first hook that finds it reduced" in out["path"]) == (drain == "ready")
            for order in out["orders"]:
                last = len(order) - order[::-1].index("bucket") - 1
                assert order.count("bucket") == 3, order
                early = order[:last].count("exchange")
                assert (early >= 1) if drain == "ready" else (early == 0), (drain, order)
