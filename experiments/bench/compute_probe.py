"""Compute probes at the start of a benchmark job: this host's engines on the job's own model.

The link probes (:mod:`experiments.bench.link_probe`) give the cost model its links from
the job itself; its engines come from a preset, micro-benchmarks of kernels timed alone at
fixed sizes on an idle machine. A step on a shared host runs them cold, beside the other
ranks, and pays work no kernel benchmark sees (a network's normalisation, attention and
embedding passes, which the model's flops leave out). So each job also times, once, on
every rank at the same time and before any strategy is built, the kernels of its own model
as a step runs them, nothing of them distributed:

* ``forward_backward``: one forward and backward pass of the model on the job's batch
  (no DDP, no K-FAC hooks);
* ``optimizer``: the benchmark's first-order step (SGD with momentum) on those gradients;
* ``pack``: packing the gradients into one flat buffer (``torch.cat``), the copy ``step()``
  runs before every collective; a gradient that travels alone, in its own storage
  (:func:`dpkfac.plan.fusion.travels_alone`: BERT's word embedding), is never packed, and
  neither is it here;
* ``precondition``: every K-FAC layer's update from its gradient, as ``step()`` computes
  it (:func:`dpkfac.strategies.base.precondition_layer`, eigenbases of the layer's sizes);
* ``factor``: every K-FAC layer's A and G factors from the activations and output
  gradients of that pass (the capture hooks' own calls);
* ``eigh``: every K-FAC layer's damped A and G factors of that pass eigendecomposed, as a
  decomposition step computes them (:meth:`dpkfac.curvature.KFACLayer.decompose`'s method).
  The preset's eigh rate was fitted on another machine's LAPACK: on this project's AVX-512
  host it priced a 769-wide eigh at 2.7× its time, which the paper setting, decomposing every
  step, pays in full;
* ``fold``: every K-FAC layer's batch factors of that pass folded into running averages,
  their non-finite checks read together, as a factor step does
  (:meth:`dpkfac.curvature.KFACLayer.update_factors`): per factor a few small kernels over
  its d² elements, which on ResNet-32 cost more than the write-back;
* ``host``: every K-FAC layer's update scaled (the KL clip) and written back into its
  ``.grad``, as ``step()`` ends: per layer a few small kernels and the package's Python,
  the "host" work per layer the cost model's ``step_other`` counts.

Each entry records its work as the cost model counts it (:mod:`dpkfac.costmodel.timing`)
and the median seconds over rounds that each time every kind once, in turn (interleaved,
as the job's strategies are), the most over ranks (compute phases are the busiest rank's).
:func:`experiments.bench.predict.probe_engines` scales the base preset's engines to them;
the network table's held-out predictions use them with the link probes. None of
it times a step or any strategy: the steps it predicts are measured after it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpkfac.costmodel.optimizers import step_bytes
from dpkfac.costmodel.shapes import shapes_from_model
from dpkfac.costmodel.timing import factor_work, fold_work, forward_backward_work
from dpkfac.curvature import EigenDecomposition, KFACLayer, helper_for
from dpkfac.curvature.factors import DEFAULT_METHOD
from dpkfac.plan.assignment import EIGH_COEFF
from dpkfac.plan.fusion import travels_alone

__all__ = ["COMPUTE_PROBE_KINDS", "COMPUTE_PROBE_REPEATS", "job_compute_probes", "probe_compute"]

#: Engine kinds probed, in the order :func:`experiments.bench.predict.probe_engines` fits them
#: (each entry's other kinds priced by the engines fitted before it).
COMPUTE_PROBE_KINDS = (
    "pack",
    "optimizer",
    "forward_backward",
    "precondition",
    "factor",
    "eigh",
    "fold",
    "host",
)
#: The running averages' decay in the ``fold`` probe (its time does not depend on it).
FOLD_DECAY = 0.95
#: Timed rounds of the probes (after one untimed), each timing every kind once: the job's
#: prediction carries a probe's noise whole, and 3 back-to-back repeats varied by a third
#: between jobs (BERT-base's forward/backward 39-61 ms on this host).
COMPUTE_PROBE_REPEATS = 7


def _interleaved_medians(
    probes: Mapping[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of each probe (to completion on ``device``) over ``repeats`` rounds,
    after one untimed round; each round times every probe once, in order.

    Interleaved, like the benchmark's strategies: a burst of load from elsewhere on a shared
    host hits one sample of every kind rather than all samples of one, and each kind runs
    after the others' work, as in a step, not warm after itself.
    """

    def run(fn: Callable[[], object]) -> float:
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - start

    for fn in probes.values():
        run(fn)
    samples: dict[str, list[float]] = {kind: [] for kind in probes}
    for _ in range(repeats):
        for kind, fn in probes.items():
            samples[kind].append(run(fn))
    return {kind: statistics.median(times) for kind, times in samples.items()}


def _work(work: Mapping[str, tuple[float, float]]) -> dict[str, list[float]]:
    return {kind: [float(c), float(a)] for kind, (c, a) in work.items()}


def probe_compute(
    model: nn.Module,
    batch: Any,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    example_input: tuple[Any, ...],
    *,
    batch_size: int,
    lr: float,
    weight_sharing: str = "expand",
    skip_layers: list[str] | None = None,
    factor_method: str = DEFAULT_METHOD,
    damping: float = 1e-3,
    repeats: int = COMPUTE_PROBE_REPEATS,
) -> list[dict[str, Any]]:
    """Time this host's engines on ``model`` (a copy of the job's; its gradients are left
    set and its weights are stepped once per optimizer repeat, so pass a throwaway copy).

    Every rank calls it when a process group is up (the entries are then the same on
    every rank: the most over ranks); alone, its own times.

    Returns:
        One entry per kind of :data:`COMPUTE_PROBE_KINDS` (``precondition``, ``factor``
        and ``host`` only with K-FAC layers): ``kind``, ``work`` (kind -> [calls, amount],
        the cost model's units) and ``seconds``.
    """
    device = next(model.parameters()).device
    shapes = shapes_from_model(model, example_input, batch_size, skip_layers=skip_layers or [])
    modules = dict(model.named_modules())
    layers = []
    for s, hooked in zip(shapes, shapes.captured, strict=True):
        helper = helper_for(modules[s.name])
        if hooked and helper is not None:
            layers.append((s, KFACLayer(s.name, modules[s.name], helper)))
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []

    def capture(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            inputs[name] = args[0].detach()
            if output.requires_grad:
                output.register_hook(lambda g: grads.__setitem__(name, g.detach()))

        return hook

    for s, layer in layers:
        handles.append(layer.module.register_forward_hook(capture(s.name)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def fwd_bwd() -> None:
        model.zero_grad(set_to_none=True)
        loss(model, batch).backward()

    # kind -> (its work in the cost model's units, the call timed), in the order they run.
    probes: dict[str, tuple[dict[str, list[float]], Callable[[], object]]] = {}
    if dist.is_initialized():
        dist.barrier()
    try:
        fwd_bwd()  # the hooks keep the last pass's activations
    finally:
        for h in handles:
            h.remove()
    probes["forward_backward"] = _work(forward_backward_work(shapes)), fwd_bwd
    params = [p for p in model.parameters() if p.grad is not None]
    itemsize = params[0].element_size() if params else 4
    packed = [
        g.reshape(-1)
        for p in params
        if (g := p.grad) is not None and not travels_alone("allreduce", [g.nbytes])
    ]
    if packed:
        pack_work = _work({"pack": (0, 2 * sum(g.nbytes for g in packed))})
        probes["pack"] = pack_work, lambda: torch.cat(packed)
    numel = sum(p.numel() for p in params)
    optimizer_work = {"optimizer": (1, step_bytes(numel, itemsize, "sgd_momentum"))}
    probes["optimizer"] = _work(optimizer_work), optimizer.step
    if layers:
        from dpkfac.strategies.base import precondition_layer

        gen = torch.Generator().manual_seed(0)
        for _, layer in layers:
            for which in ("A", "G"):
                d = layer.dim(which)
                dec = EigenDecomposition(torch.randn(d, d, generator=gen), torch.rand(d))
                layer.set_decomposition(which, dec)
        with_grad = [(s, x) for s, x in layers if x.helper.grad_matrix() is not None]

        def grad_matrices() -> list[tuple[KFACLayer, torch.Tensor]]:
            pairs = [(x, x.helper.grad_matrix()) for _, x in with_grad]
            return [(x, g) for x, g in pairs if g is not None]

        def precondition() -> None:
            for _, x in with_grad:
                grad = x.helper.grad_matrix()
                assert grad is not None
                precondition_layer(x, grad, damping)

        flops = sum(4.0 * s.g_dim * s.a_dim * (s.g_dim + s.a_dim) for s, _ in with_grad)
        work = {"precondition": (float(len(with_grad)), flops)}
        probes["precondition"] = _work(work), precondition
        captured = [(s, x) for s, x in layers if s.name in inputs and s.name in grads]

        def factors() -> None:
            for s, x in captured:
                x.clear_pending()
                x.accumulate_a(inputs[s.name], weight_sharing, None, factor_method)
                x.accumulate_g(grads[s.name], weight_sharing, None, factor_method)

        total: dict[str, tuple[float, float]] = {}
        for s, _ in captured:
            for which in ("A", "G"):
                for kind, (c, a) in factor_work(s, which, weight_sharing, itemsize).items():
                    calls, amount = total.get(kind, (0.0, 0.0))
                    total[kind] = (calls + c, amount + a)
        if captured:
            probes["factor"] = _work(total), factors
            factors()  # the pass's batch factors, decomposed as a decomposition step does
            matrices = [x.pending_factor(w) for _, x in captured for w in ("A", "G")]

            def decompose() -> None:
                for m in matrices:
                    EigenDecomposition.compute(m, damping=damping, dtype=torch.float32)

            flops = sum(2 * EIGH_COEFF * float(m.shape[0]) ** 3 for m in matrices)
            work = {"eigh": (float(len(matrices)), flops)}
            probes["eigh"] = _work(work), decompose
            pending = [(x, w, x.pending_factor(w)) for _, x in captured for w in ("A", "G")]

            def fold() -> None:
                for x, w, m in pending:
                    x.set_pending(w, m)
                checks = [(x, w, ok) for _, x in captured for w, ok in x.finite_checks().items()]
                read = torch.stack([ok for _, _, ok in checks]).tolist()  # one host read
                finite: dict[str, dict[str, bool]] = {}
                for (x, w, _), ok in zip(checks, read, strict=True):
                    finite.setdefault(x.name, {})[w] = bool(ok)
                for _, x in captured:
                    x.update_factors(FOLD_DECAY, finite[x.name])

            index = {s.name: i for i, s in enumerate(shapes)}
            built = [index[s.name] for s, _ in captured]
            work = fold_work(shapes, built, matrices[0].element_size())
            probes["fold"] = _work(work), fold
        updates = [(x, precondition_layer(x, g, damping).matrix) for x, g in grad_matrices()]
        scale = torch.ones((), device=device)

        def write_back() -> None:
            for x, matrix in updates:
                x.helper.set_grad_matrix(matrix * scale)

        update_bytes = sum(m.numel() * m.element_size() for _, m in updates)
        work = {"pack": (0.0, 4.0 * update_bytes), "host": (float(len(updates)), 0.0)}
        probes["host"] = _work(work), write_back
    medians = _interleaved_medians({k: fn for k, (_, fn) in probes.items()}, repeats, device)
    kinds = [k for k in COMPUTE_PROBE_KINDS if k in probes]
    seconds = torch.tensor([medians[k] for k in kinds], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return [
        {"kind": k, "work": probes[k][0], "seconds": float(t)}
        for k, t in zip(kinds, seconds.tolist(), strict=True)
    ]


def job_compute_probes(spec: Mapping[str, Any], rank: int, device: torch.device) -> list[dict]:
    """:func:`probe_compute` of a benchmark job's model (a copy of its own, built and fed as
    the job's strategies are: ``spec`` is :func:`experiments.bench.run.job_spec`'s), with the
    K-FAC options of its first K-FAC config (weight sharing, skipped layers, factor method,
    damping)."""
    from experiments.bench.workloads import build

    model_spec = spec["model"]
    bench = build(model_spec["config"], model_spec["batch"], seed=int(spec["seed"]))
    model = bench.model.to(device)
    batch = bench.make_batch(int(spec["seed"]) * 1000 + 17 * (rank + 1))
    batch = {k: v.to(device) for k, v in batch.items()}
    kfac = next((m["kfac"] for m in spec["strategies"] if m["kfac"] is not None), None) or {}
    damping = kfac.get("damping", 1e-3)
    return probe_compute(
        model,
        batch,
        bench.loss,
        tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in bench.example_input),
        batch_size=bench.batch_size,
        lr=float(spec["lr"]),
        weight_sharing=str(kfac.get("weight_sharing", bench.weight_sharing)),
        skip_layers=list(kfac.get("skip_layers") or []),
        factor_method=str(kfac.get("factor_method", DEFAULT_METHOD)),
        damping=float(damping) if isinstance(damping, (int, float)) else 1e-3,
    )
