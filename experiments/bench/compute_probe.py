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
* ``eigh``: matrices of every K-FAC layer's A and G factors' sizes, of full rank as the
  running averages a step decomposes are (:func:`_full_rank_like`), damped and
  eigendecomposed, as a decomposition step computes them
  (:meth:`dpkfac.curvature.KFACLayer.decompose`'s method).
  The preset's eigh rate was fitted on another machine's LAPACK: on this project's AVX-512
  host it priced a 769-wide eigh at 2.7× its time, which the paper setting, decomposing every
  step, pays in full;
* ``fold``: every K-FAC layer's batch factors of that pass folded into running averages,
  their non-finite checks read together, as a factor step does
  (:meth:`dpkfac.curvature.KFACLayer.update_factors`): per factor a few small kernels over
  its d² elements, which on ResNet-32 cost more than the write-back;
* ``overlap`` (with two ranks or more; not an engine): how much of a transfer runs beside
  the forward/backward rather than taking turns with it on the rank's core
  (:func:`probe_overlap`), the cost model's ``Hardware.overlap``, which the network table's
  predictions otherwise take from a preset fitted on loopback;
* ``host``: a plain step's other work, the "host" work per layer the cost model's
  ``step_other`` counts: a real ``KFACPreconditioner.step()`` of the job's first K-FAC
  configuration on a copy of the model, on this rank alone (a group of one: nothing is
  communicated, nothing packed), after a backward pass, its wall time less its timed
  phases, as a row reads ``step_other`` (:func:`experiments.bench.aggregate.in_step`).
  That is every layer's update scaled (the KL clip) and written back into its ``.grad``,
  and the package's Python around each layer's phases. Timing the write-back alone priced
  ResNet-32's practical step at 1.0 ms where the rows measured 6.5-10 ms;
* ``launch`` (with two ranks or more): the same plain step at the job's world size on a
  process group of torch's fake backend (:func:`_fake_group`: its collectives move
  nothing and return at once), its wall time less its timed phases again. Beside the
  host probe's work it packs the step's buffers and runs the Python around each
  collective (planning its buffer, launching it, landing it): the cost model's
  "launch" call per collective, which a group of one never reaches (on loopback a
  traced ResNet-32 plain step spent about 3 ms there). Its work is the cost model's
  ``step_other`` of that step (:func:`dpkfac.costmodel.timing.step_other_work`). Where
  the fake backend cannot run the step (it copies one buffer into every slot of an
  all-gather, which the owner reduction's uneven shards do not fit) the job has no launch
  probe, with a warning, and the model's launches stay free.

Each entry records its work as the cost model counts it (:mod:`dpkfac.costmodel.timing`)
and its seconds over rounds that each time every kind once, in turn (interleaved, as the
job's strategies are): per round the most over ranks, then the median over rounds, the
statistic a row takes of its steps (compute phases are the busiest rank's).
:func:`experiments.bench.predict.probe_engines` scales the base preset's engines to them;
the network table's held-out predictions use them with the link probes. None of
it times a step or any strategy: the steps it predicts are measured after it.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpkfac import KFACPreconditioner
from dpkfac.costmodel.optimizers import step_bytes
from dpkfac.costmodel.predict import predict
from dpkfac.costmodel.shapes import ModelShapes, shapes_from_model
from dpkfac.costmodel.timing import factor_work, fold_work, forward_backward_work
from dpkfac.curvature import EigenDecomposition, KFACLayer, helper_for
from dpkfac.curvature.factors import DEFAULT_METHOD
from dpkfac.options import KFACOptions
from dpkfac.plan.assignment import EIGH_COEFF
from dpkfac.plan.fusion import travels_alone
from dpkfac.plan.presets import CPU_GLOO_LOCAL
from experiments.bench.aggregate import in_step
from experiments.bench.link_probe import FLUSH_BYTES, evict, sync
from experiments.preconditioning import split_options, with_schedules

log = logging.getLogger(__name__)

__all__ = [
    "COMPUTE_PROBE_KINDS",
    "COMPUTE_PROBE_REPEATS",
    "OVERLAP_KIND",
    "cache_bytes",
    "cache_scratch",
    "job_compute_probes",
    "probe_compute",
    "probe_overlap",
]

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
    "launch",
)
#: The kind of the compute probes' entry that says how much of a transfer runs beside
#: compute (not an engine: :func:`probe_overlap`).
OVERLAP_KIND = "overlap"
#: Rounds of the overlap probe (each times the transfer alone, the compute alone and both).
OVERLAP_REPEATS = 5
#: The overlap probe's transfer takes about this share of the compute's time alone (so it
#: ends inside it), within these bytes.
OVERLAP_SHARE = 0.5
OVERLAP_BYTES = (2**16, 2**26)
#: The overlap probe's sizing all-reduce (float32 elements: 1 MiB).
OVERLAP_SIZING_NUMEL = 2**18
#: The running averages' decay in the ``fold`` probe (its time does not depend on it).
FOLD_DECAY = 0.95
#: Timed rounds of the probes (after one untimed), each timing every kind once: the job's
#: prediction carries a probe's noise whole, and 3 back-to-back repeats varied by a third
#: between jobs (BERT-base's forward/backward 39-61 ms on this host).
COMPUTE_PROBE_REPEATS = 7


def _interleaved_rounds(
    probes: Mapping[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
    scratch: torch.Tensor | None = None,
) -> dict[str, list[float]]:
    """Seconds of each probe (to completion on ``device``; or the seconds it returns, where
    it times its own part of the call) in each of ``repeats`` rounds, after one untimed
    round; each round times every probe once, in order.

    Interleaved, like the benchmark's strategies: a burst of load from elsewhere on a shared
    host hits one sample of every kind rather than all samples of one. And cold: before each
    call ``scratch`` (the size of the last-level cache, :func:`cache_bytes`) is written, as
    a step's other work and the other strategies' model copies evict what a kind would find
    warm after itself (the memory-bound kinds, packing, the optimizer and the write-back,
    took 1.3-2x as long). And together: with a group up, the ranks meet at a barrier before
    each call, as they do before each step, so each round's most over ranks is of the same
    work run at once, as a step's is. That did not close what separates the forward/backward
    probe from the same pass between the steps: over the committed network table's jobs
    (practical setting) it reads a median 12% (ResNet-32 and BERT-base) below the K-FAC
    rows' forward/backward. It reads like the pass of the one config whose step follows
    SGD's in the job's rotation (SGD's ends with the eviction and its ``no_sync`` pass);
    every config that follows another K-FAC step runs the same pass 8-12% slower. It grows
    with the configs a job holds: in a BERT-base job of 5 configs and SGD (practical, 1 Gbit/s)
    the probe read 42.6 ms and the K-FAC configs' plain steps 39-42, with a pass of a
    hook-free copy in the rotation 41-42 (in a ResNet-32 job, the probe 102.0 and the copy
    101.1). What slows a pass when 15 configs take turns is not found, so the network
    table's predictions price the forward/backward by the pass timed in the rotation where
    the job has one (:func:`experiments.bench.predict.probe_hardware`).
    """

    def run(fn: Callable[[], object]) -> float:
        if scratch is not None:
            evict(scratch, device)
        if dist.is_initialized():
            dist.barrier()
        start = clock()
        seconds = fn()
        sync(device)
        # A probe that times its own part of the call (a step's work outside its phases).
        return seconds if isinstance(seconds, float) else clock() - start

    for fn in probes.values():
        run(fn)
    samples: dict[str, list[float]] = {kind: [] for kind in probes}
    for _ in range(repeats):
        for kind, fn in probes.items():
            samples[kind].append(run(fn))
    return samples


def _least_over_ranks(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def stretch_over_transfer(
    transfer_s: float, compute_s: float, beside_s: float
) -> tuple[float, float]:
    """One round of :func:`probe_overlap`: the compute's stretch with the transfer beside it
    (``beside_s``, both together, less ``compute_s`` alone), and that stretch over the
    transfer's time beside the compute (all of ``transfer_s``, unless it outlived the
    compute): 0 where the transfer ran free beside it, 1 where they took turns."""
    stretch = max(beside_s - compute_s, 0.0)
    return stretch, stretch / max(min(transfer_s, beside_s), 1e-9)


def probe_overlap(
    compute: Callable[[], object],
    compute_s: float,
    device: torch.device,
    repeats: int = OVERLAP_REPEATS,
) -> dict[str, Any]:
    """How much of a transfer runs beside compute on this host: ``Hardware.overlap``, timed.

    An all-reduce sized to take about :data:`OVERLAP_SHARE` of ``compute`` (the job's
    forward/backward, ``compute_s`` alone) is launched, the compute run and timed, then the
    transfer waited for. Where the transfer takes turns with the compute on the rank's core
    (gloo's thread, the kernel's TCP on an emulated node's link), the compute stretches by
    that share of it: the cost model books ``1 - overlap`` of a transfer that runs during
    compute as serial (:func:`dpkfac.costmodel.timing.exposed`), so ``overlap`` is one less
    the stretch over the transfer's time beside the compute. Each round times the transfer
    alone (least over ranks, as the link probes do), the compute alone and both; the stretch
    ratio is each round's; the medians over rounds are averaged over ranks, so every rank
    returns the same entry. A collective: every rank of the default group calls it.

    Returns:
        ``kind`` (:data:`OVERLAP_KIND`), ``overlap`` in [0, 1], ``nbytes`` (the all-reduce's
        buffer), and the medians ``transfer_s``, ``compute_s`` and ``stretch_s``.
    """

    def timed(fn: Callable[[], object]) -> float:
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - start

    sizing = torch.zeros(OVERLAP_SIZING_NUMEL, device=device)
    timed(lambda: dist.all_reduce(sizing))
    per_byte = _least_over_ranks(timed(lambda: dist.all_reduce(sizing)), device) / sizing.nbytes
    low, high = OVERLAP_BYTES
    nbytes = int(min(max(OVERLAP_SHARE * compute_s / max(per_byte, 1e-12), low), high)) // 4 * 4
    buf = torch.zeros(nbytes // 4, device=device)
    transfers, computes, stretches, ratios = [], [], [], []
    for _ in range(repeats):
        transfers.append(_least_over_ranks(timed(lambda: dist.all_reduce(buf)), device))
        computes.append(timed(compute))
        sync(device)
        dist.barrier()
        start = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        compute()
        sync(device)
        beside = time.perf_counter() - start
        assert work is not None
        work.wait()
        stretch, ratio = stretch_over_transfer(transfers[-1], computes[-1], beside)
        stretches.append(stretch)
        ratios.append(ratio)
    medians = [statistics.median(v) for v in (ratios, computes, stretches)]
    means = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(means)
    ratio, compute_s, stretch_s = (float(v) / dist.get_world_size() for v in means.tolist())
    return {
        "kind": OVERLAP_KIND,
        "overlap": min(max(1.0 - ratio, 0.0), 1.0),
        "nbytes": nbytes,
        "transfer_s": statistics.median(transfers),
        "compute_s": compute_s,
        "stretch_s": stretch_s,
    }


def _busiest_median(rounds: list[list[float]], device: torch.device) -> list[float]:
    """Per kind (one list of seconds per round each), the median over rounds of the most over
    ranks in each round: the statistic a row takes of its steps (a step waits for the slowest
    rank; the median over steps), so a probe and the phase it prices are read alike. The
    same on every rank (a collective where a group is up)."""
    samples = torch.tensor(rounds, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    return [statistics.median(times) for times in samples.tolist()]


def cache_bytes(device: torch.device) -> int:
    """The last-level cache of ``device`` in bytes: a scratch that size, written, evicts what
    a probe left warm (a GPU's L2; a CPU's largest cache as Linux lists it under
    ``/sys/devices/system/cpu/cpu0/cache``; :data:`~experiments.bench.link_probe.FLUSH_BYTES`
    where nothing says)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size) or FLUSH_BYTES
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=FLUSH_BYTES)


def cache_scratch(device: torch.device) -> torch.Tensor:
    """A float32 scratch on ``device`` of :func:`cache_bytes`: written before a timed call
    (:func:`~experiments.bench.link_probe.evict`), it leaves that call cold."""
    return torch.zeros(cache_bytes(device) // 4, device=device)


def _full_rank_like(factor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A symmetric positive definite matrix of ``factor``'s size, dtype and device, of full
    rank: what a step decomposes. A step's running average is of full rank after a few
    factor steps, while one pass's batch factor has rank at most its rows (256 for
    BERT-base's 769-wide factors here), and an eigensolver deflates it: 1.3x faster."""
    d = factor.shape[0]
    x = torch.randn(4 * d, d, generator=gen, dtype=torch.float64)
    return (x.T @ x / (4 * d)).to(factor)


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
    preconditioner: Mapping[str, Any] | None = None,
    repeats: int = COMPUTE_PROBE_REPEATS,
) -> list[dict[str, Any]]:
    """Time this host's engines on ``model`` (a copy of the job's; its gradients are left
    set and its weights are stepped once per optimizer repeat, so pass a throwaway copy).

    Every rank calls it when a process group is up (the entries are then the same on
    every rank: per round the most over ranks, then the median); alone, its own times.
    ``preconditioner``: the ``KFACPreconditioner`` arguments of the ``host`` probe's plain
    step (its update intervals and process group are the probe's; default: dp_kfac's).

    Returns:
        One entry per kind of :data:`COMPUTE_PROBE_KINDS` (``precondition``, ``factor``
        and ``host`` only with K-FAC layers): ``kind``, ``work`` (kind -> [calls, amount],
        the cost model's units) and ``seconds``.
        With a group of two ranks or more, one entry more: :func:`probe_overlap` of the
        forward/backward (kind :data:`OVERLAP_KIND`).
    """
    device = next(model.parameters()).device
    step_model = copy.deepcopy(model)  # the host probe's, before the probes' hooks
    together = dist.is_initialized() and dist.get_world_size() > 1
    launch_model = copy.deepcopy(model) if together else None  # the launch probe's
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
            factors()  # the pass's batch factors, folded as a factor step does
            matrices = [x.pending_factor(w) for _, x in captured for w in ("A", "G")]
            full_rank = [_full_rank_like(m, gen) for m in matrices]

            def decompose() -> None:
                for m in full_rank:
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
        updates = [g for _, g in grad_matrices()]
        options = dict(preconditioner or {})
        step, pre = _plain_step(step_model, batch, loss, options, lr, device)
        update_bytes = sum(g.numel() * g.element_size() for g in updates)
        # step_other_bytes: each update read and written, and with the KL clip scaled first.
        copies = 4.0 if pre.options.kl_clip is not None else 2.0
        work = {"pack": (0.0, copies * update_bytes), "host": (float(len(updates)), 0.0)}
        probes["host"] = _work(work), step
        if launch_model is not None:
            group = _fake_group()
            launch, _ = _plain_step(launch_model, batch, loss, options, lr, device, group)
            try:
                launch()  # the first step (placement), untimed
            except RuntimeError as err:
                # The fake backend copies one buffer into every rank's slot of an
                # all-gather: the owner reduction's uneven shards (NCCL's path, which the
                # fake backend takes) do not fit. Every rank fails alike; the model's
                # launches stay free for this job.
                name = options.get("strategy")
                log.warning("no launch probe: %s's plain step on a fake group: %s", name, err)
            else:
                work = _plain_step_other(shapes, options, dist.get_world_size())
                probes["launch"] = _work(work), launch
    scratch = cache_scratch(device)
    fns = {k: fn for k, (_, fn) in probes.items()}
    rounds = _interleaved_rounds(fns, repeats, device, scratch=scratch)
    kinds = [k for k in COMPUTE_PROBE_KINDS if k in probes]
    seconds = _busiest_median([rounds[k] for k in kinds], device)
    out = [
        {"kind": k, "work": probes[k][0], "seconds": float(t)}
        for k, t in zip(kinds, seconds, strict=True)
    ]
    if dist.is_initialized() and dist.get_world_size() > 1:
        out.append(probe_overlap(fwd_bwd, seconds[kinds.index("forward_backward")], device))
    return out


#: The host probe's update intervals: factors and decompositions at its first (untimed)
#: step only, every timed step plain.
NEVER = 10**9


def _own_group() -> dist.ProcessGroup | None:
    """A process group of this rank alone (every rank makes every rank's, in rank order, as
    ``new_group`` asks); None without a group up, where a preconditioner is alone anyway."""
    if not dist.is_initialized():
        return None
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _fake_group() -> dist.ProcessGroup:
    """A process group over every rank on torch's fake backend: its collectives return at
    once and move nothing, so a step on it runs all of the package's Python around its
    collectives (packing, launching, landing) at the job's world size and none of the
    transfers. Every rank calls it, as ``new_group`` asks."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    return dist.new_group(backend="fake")


def _plain_step_other(
    shapes: ModelShapes, options: Mapping[str, Any], world_size: int
) -> dict[str, tuple[float, float]]:
    """The work of a plain step of ``options``' preconditioner outside its timed phases on
    ``world_size`` ranks, as the cost model counts it (``step_other``): the copies, a
    "host" call per layer written back and a "launch" per collective; the busiest rank's,
    as the probe's seconds are the most over ranks."""
    name, common, own = split_options(options)
    common.update(factor_update_steps=NEVER, inv_update_steps=NEVER)
    prediction = predict(
        shapes,
        strategy=name,
        world_size=world_size,
        hardware=CPU_GLOO_LOCAL,
        kfac=KFACOptions(**common),
        options=own,
    )
    works = [w["step_other"] for w in prediction.plain.work]
    return dict(max(works, key=lambda w: CPU_GLOO_LOCAL.time(w, world_size)))


def _plain_step(
    model: nn.Module,
    batch: Any,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    options: Mapping[str, Any],
    lr: float,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> tuple[Callable[[], float], KFACPreconditioner]:
    """The ``host`` and ``launch`` probes: a call that runs a backward pass and a plain
    ``step()`` of a preconditioner on ``model`` and returns the step's seconds outside its
    timed phases; and that preconditioner. On ``group``, or by default on this rank alone
    (a group of one: nothing is communicated, nothing packed)."""
    kwargs = {**options, "lr": lr, "process_group": group or _own_group()}
    kwargs.update(factor_update_steps=NEVER, inv_update_steps=NEVER)
    pre = KFACPreconditioner(model, **kwargs)

    def step() -> float:
        pre.reset_stats()
        model.zero_grad(set_to_none=True)
        loss(model, batch).backward()
        sync(device)
        in_hooks = pre.timings()
        start = time.perf_counter()
        pre.step()
        sync(device)
        wall = time.perf_counter() - start
        return max(wall - in_step(pre.timings(), in_hooks), 0.0)

    return step, pre


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
        preconditioner=with_schedules(kfac),
    )
