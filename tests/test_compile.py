"""``torch.compile`` with K-FAC (dpkfac/compile.py, docs/usage.md "torch.compile").

Under Dynamo the capture hooks put two opaque operators into the model's graph
instead of being traced: a compiled model trains like the eager one, compiles
to one graph with the capture and one without (no graph break, whatever the
schedule), emits no Dynamo warning about K-FAC's code, and its compilation is
never booked as K-FAC work in ``timings()``.

The fast tests compile with Dynamo's CompileCounter (the graph run as traced)
or "aot_eager" (AOTAutograd's forward and backward graphs, no code generation);
one slow test compiles with the default backend (inductor).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from dist_utils import run_ranks
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

import dpkfac

#: Factors every 2 steps, decompositions every 4: factor, plain and decomposition steps.
SCHEDULE = {"factor_update_steps": 2, "inv_update_steps": 4}
#: Dynamo graphs of a compiled model over any schedule (docs/usage.md says so).
GRAPHS = 2


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch: Dynamo caches per code object (nn.Sequential's
    forward is shared by every test), and its counters are global."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model() -> nn.Module:
    """A Conv2d (the shifted A kernel, with its cached tables) whose output is modified in
    place, and two Linear layers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    )


def _batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 2, 6, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    pre: dpkfac.KFACPreconditioner,
    steps: int,
    *,
    rank: int = 0,
    after_step: Callable[[int], None] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """SGD with K-FAC for ``steps`` steps; the parameters after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = []
    for step in range(steps):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(forward(x), y)
        opt.zero_grad()
        loss.backward()
        pre.step()
        opt.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if after_step is not None:
            after_step(step)
    return params


def _assert_same_training(
    got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]
) -> None:
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        for name in b:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=f"{step} {name}")


def _factors(pre: dpkfac.KFACPreconditioner) -> dict[str, torch.Tensor | None]:
    return {f"{n}.{w}": layer.factor(w) for n, layer in pre.layers.items() for w in ("A", "G")}


def test_compiled_model_trains_like_eager() -> None:
    """dp_kfac at P=1 over factor, plain and decomposition steps, compiled as one graph
    (fullgraph); the preconditioner takes the compiled wrapper (the model's layer names)."""
    model = _model()
    pre = dpkfac.KFACPreconditioner(model, **SCHEDULE)
    ref = _train(model, model, pre, 9)

    model = _model()
    # fullgraph: a graph break would raise.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    cpre = dpkfac.KFACPreconditioner(compiled, **SCHEDULE)
    got = _train(model, compiled, cpre, 9)

    assert list(cpre.layers) == list(pre.layers) == ["0", "3", "5"]
    _assert_same_training(got, ref)
    for key, factor in _factors(pre).items():
        torch.testing.assert_close(_factors(cpre)[key], factor, rtol=1e-5, atol=1e-8)


def test_preconditioner_built_after_the_compiled_model_ran() -> None:
    """Dynamo does not guard on module hooks: a graph compiled before the preconditioner
    existed runs without its hooks, which K-FAC reports; torch._dynamo.reset() after
    building the preconditioner recompiles with them, and training matches eager."""

    def run(compile_it: bool, reset: bool) -> list[dict[str, torch.Tensor]]:
        model = _model()
        forward = torch.compile(model, backend=CompileCounter()) if compile_it else model
        x, y = _batch(99)
        nn.functional.mse_loss(forward(x), y).backward()  # before any preconditioner exists
        model.zero_grad(set_to_none=True)
        pre = dpkfac.KFACPreconditioner(model, **SCHEDULE)
        if reset:
            torch._dynamo.reset()
        return _train(model, forward, pre, 4)

    with pytest.warns(RuntimeWarning, match=r"never captured.*torch\._dynamo\.reset\(\)"):
        run(True, reset=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "never captured" would be raised
        _assert_same_training(run(True, reset=True), run(False, reset=False))


@pytest.mark.parametrize(("factor_every", "decompose_every", "steps"), [(2, 4, 12), (10, 100, 21)])
def test_one_graph_with_capture_and_one_without_and_no_dynamo_warnings(
    caplog: pytest.LogCaptureFixture, factor_every: int, decompose_every: int, steps: int
) -> None:
    """Over factor, plain and decomposition steps, exactly two graphs are compiled: the
    first step's (with the capture operators) and the second's (without). Dynamo traces
    no frame of K-FAC's (two frames in all), breaks no graph, and says nothing about
    K-FAC's clock or cached tables."""
    model = _model()
    cnt = CompileCounter()
    compiled = torch.compile(model, backend=cnt)
    pre = dpkfac.KFACPreconditioner(
        model, factor_update_steps=factor_every, inv_update_steps=decompose_every
    )
    seen: list[int] = []
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        _train(model, compiled, pre, steps, after_step=lambda _: seen.append(cnt.frame_count))

    assert seen == [1] + [GRAPHS] * (steps - 1)
    assert counters["frames"]["total"] == counters["frames"]["ok"] == GRAPHS
    assert counters["stats"]["unique_graphs"] == GRAPHS
    assert not counters["graph_break"], dict(counters["graph_break"])
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    for word in ("perf_counter", "lru_cache", "graph break", "Graph break", "recompile"):
        assert not [m for m in messages if word in m], (word, messages)
    # Every layer was captured at every factor step (none warned "never captured").
    assert not [m for m in messages if "never captured" in m]
    assert all(layer.ever_captured for layer in pre.layers.values())


class _SlowBackend:
    """A backend that takes ``delay`` seconds per graph (compile time that is certain to be
    counted in factor_compute if a compilation ran inside the capture's timed phase)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.slept = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        time.sleep(self.delay)
        self.slept += self.delay
        return gm.forward


def test_compile_time_is_not_booked_as_factor_compute() -> None:
    """The first step compiles (its wall time holds the backend's delay), yet its
    factor_compute is a fraction of that delay: the capture runs in the graph's operators,
    after the compilation."""
    model = _model()
    backend = _SlowBackend(delay=3.0)
    compiled = torch.compile(model, backend=backend)
    pre = dpkfac.KFACPreconditioner(model, **SCHEDULE)
    times: list[tuple[float, float, float]] = []
    start = time.perf_counter()

    def record(step: int) -> None:
        nonlocal start
        now = time.perf_counter()
        times.append((now - start, pre.timings()["factor_compute"], backend.slept))
        pre.reset_stats()
        start = time.perf_counter()

    _train(model, compiled, pre, 3, after_step=record)
    (wall0, factor0, slept0), (_, factor1, _), (_, factor2, _) = times
    assert slept0 >= backend.delay and wall0 >= slept0, times  # step 0 compiled
    assert factor0 > 0 and factor2 > 0 and factor1 == 0.0, times  # factor steps 0 and 2
    # Had a compilation run inside the timed capture, factor_compute would hold its delay:
    # step 0's would exceed step 2's (no compilation) by at least the delay. Step 0's own
    # first-time work measured up to 1.1 s on this 2-core machine under load (with the 1 s
    # delay the old bound, a quarter of it, failed there), so the delay is 3 s and the
    # bound is relative to step 2.
    assert factor0 < factor2 + 0.5 * backend.delay, times


def _ranks_train(rank: int, world_size: int) -> dict[str, Any]:
    """Per rank: eager and compiled runs of dp_kfac with the fidelity probe (whose shadow
    capture runs on the ranks that do not own a layer), without DDP and with it (compiled
    outside DDP and inside), and in the overlapped mode (reduction from the backward's hooks)."""
    out: dict[str, Any] = {}
    modes = (
        "eager",
        "compiled",
        "ddp_eager",
        "compile_ddp",
        "ddp_compile",
        "overlap_eager",
        "overlap_compiled",
    )
    for mode in modes:
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        cnt = CompileCounter()
        forward: nn.Module = model
        if mode == "compiled":
            forward = torch.compile(model, backend="aot_eager")
        elif mode == "ddp_eager":
            forward = DistributedDataParallel(model)
        elif mode == "compile_ddp":
            forward = torch.compile(DistributedDataParallel(model), backend=cnt)
        elif mode == "ddp_compile":
            forward = DistributedDataParallel(torch.compile(model, backend=cnt))
        elif mode == "overlap_compiled":
            forward = torch.compile(model, backend=cnt)
        extra = {"overlap": True} if mode.startswith("overlap") else {"fidelity_every": 3}
        # The preconditioner unwraps every wrapper: a compiled DDP model is a DDP model.
        pre = dpkfac.KFACPreconditioner(forward, strategy="dp_kfac", **extra, **SCHEDULE)
        params = _train(model, forward, pre, 6, rank=rank)
        out[mode] = {
            "params": params,
            "fidelity": pre.fidelity(),
            "ddp": pre.ddp,
            "layers": list(pre.layers),
            "frames": cnt.frame_count,
            "breaks": sum(counters["graph_break"].values()),
        }
    return out


@pytest.mark.distributed
def test_compiled_model_trains_like_eager_on_two_ranks() -> None:
    results = run_ranks(_ranks_train, 2)
    for rank, out in enumerate(results):
        _assert_same_training(out["compiled"]["params"], out["eager"]["params"])
        assert out["compiled"]["fidelity"] == out["eager"]["fidelity"] != {}
        assert out["compiled"]["breaks"] == 0
        _assert_same_training(out["overlap_compiled"]["params"], out["overlap_eager"]["params"])
        assert out["overlap_compiled"]["frames"] == GRAPHS
        for mode in ("compile_ddp", "ddp_compile"):
            _assert_same_training(out[mode]["params"], out["ddp_eager"]["params"])
            assert out[mode]["ddp"] and out[mode]["layers"] == ["0", "3", "5"], (rank, mode)
        # Compiled inside DDP: the model's two graphs. DDP compiled (torch.compile(DDP(model)))
        # has graph breaks of DDP's own and Dynamo's DDP optimizer splits graphs at DDP's
        # buckets, with K-FAC or without: only the training is checked there.
        assert out["ddp_compile"]["frames"] == GRAPHS
        assert out["ddp_compile"]["breaks"] == 0
        # The ranks agree bitwise (dp_kfac broadcasts each layer's update from its owner).
        for name, tensor in out["compiled"]["params"][-1].items():
            assert torch.equal(tensor, results[0]["compiled"]["params"][-1][name])


def _strategies_train(rank: int, world_size: int, strategies: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in strategies:
        for compiled in (False, True):
            torch._dynamo.reset()
            model = _model()
            cnt = CompileCounter()
            forward = torch.compile(model, backend=cnt) if compiled else model
            pre = dpkfac.KFACPreconditioner(forward, strategy=strategy, **SCHEDULE)
            out[f"{strategy}/{compiled}"] = (_train(model, forward, pre, 5, rank=rank), cnt)
    return {k: (params, cnt.frame_count) for k, (params, cnt) in out.items()}


@pytest.mark.distributed
def test_every_strategy_trains_like_eager_compiled_on_two_ranks() -> None:
    """The strategies hand factors on as the capture builds them (pipelined reductions):
    from the compiled graph's operators too, in the same order on every rank."""
    strategies = ["d_kfac", "spd_kfac", "kaisa", "grouped"]
    for out in run_ranks(_strategies_train, 2, strategies):
        for strategy in strategies:
            got, frames = out[f"{strategy}/True"]
            _assert_same_training(got, out[f"{strategy}/False"][0])
            assert frames == GRAPHS, strategy


@pytest.mark.slow
def test_inductor_trains_like_eager() -> None:
    """The default backend (generated kernels; 15-60 s of compilation here, depending on
    inductor's cache): two graphs, factors equal to float32 rounding (1e-5 of their scale),
    parameters within that rounding amplified by the eigendecomposition (1e-4 of their scale)."""
    model = _model()
    pre = dpkfac.KFACPreconditioner(model, **SCHEDULE)
    ref = _train(model, model, pre, 5)

    model = _model()
    compiled = torch.compile(model)
    cpre = dpkfac.KFACPreconditioner(model, **SCHEDULE)
    got = _train(model, compiled, cpre, 5)

    assert counters["stats"]["unique_graphs"] == GRAPHS
    assert not counters["graph_break"]
    for key, factor in _factors(pre).items():
        assert factor is not None
        # float32 sums in another order: inductor's kernels reduce differently with the
        # thread count (2e-6 of the scale seen with one thread), so allow 1e-5 of it.
        torch.testing.assert_close(
            _factors(cpre)[key], factor, rtol=0, atol=1e-5 * factor.abs().max().item()
        )
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        for name in b:
            scale = b[name].abs().max().item()
            assert (a[name] - b[name]).abs().max().item() <= 1e-4 * scale, (step, name)
