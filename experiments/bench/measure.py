"""The per-rank timing loop of ``python -m experiments.bench``.

Each rank builds, for every strategy of the job, the model (identical
weights everywhere), a fixed synthetic batch of its own and the
preconditioner, runs ``warmup`` untimed steps (the first step places layers
and, for spd_kfac, profiles and fixes the fusion plan) and then ``steps``
measured ones. Before every step the ranks meet at a barrier, so each step is
timed from a common start and waiting caused by the previous step does not
leak into the next one. Subnormal floats are flushed to zero while the steps
run (:func:`flushed_denormals`).

Per step and rank this records wall-clock seconds of forward+backward,
``pre.step()``, ``optimizer.step()`` and the whole iteration, the
preconditioner's own per-phase timings, bytes and calls per collective
category and the K-FAC memory, all after ``reset_stats()`` at the start of the
step, and the whole process's memory tally (:func:`process_record`). The
first-order baseline (``strategy=none``) is SGD as users run it:
DistributedDataParallel (:func:`experiments.distributed.wrap_ddp`), whose
bucketed gradient all-reduces overlap the backward pass and are accounted by
:meth:`dpkfac.comm.Communicator.ddp_hook`; its forward+backward time therefore
includes what DDP leaves exposed, and it has no separately timed phase.

In the practical setting (factors every F steps, decompositions every I) the
update schedule is replaced by a cycle of step kinds (decomposition step,
factor-only step, plain step) so that every kind is measured within a few
steps; :mod:`experiments.bench.aggregate` weights the per-kind medians by how
often each kind occurs at F and I.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dpkfac.memory import cuda_peak_bytes, process_memory, reset_cuda_peak
from dpkfac.timeline import Timeline
from experiments.bench.compute_probe import cache_scratch, job_compute_probes
from experiments.bench.link_probe import evict, faithful_rate, network_record, probe_links, sync
from experiments.distributed import deadline
from experiments.network import node_link
from experiments.preconditioning import with_schedules

#: The optimizer every strategy's steps use, as :data:`dpkfac.costmodel.OPTIMIZER_STATE`
#: names it: what the predicted whole-process memory assumes (:class:`_Stepper`).
OPTIMIZER = "sgd_momentum"


def step_kinds(factor_update_steps: int, inv_update_steps: int) -> list[str]:
    """The cycle of step kinds measured for update intervals F and I.

    A decomposition step is always also a factor step (the step loop folds
    fresh factors in before decomposing), as step 0 of a real schedule is.
    Where both other kinds occur the plain step comes twice: at F=10 it is 90% of
    the row (:func:`experiments.bench.aggregate.kind_weights`), so its median
    carries the row's noise, and twice the samples halve what one slow step moves it.
    """
    f, i = factor_update_steps, inv_update_steps
    if f < 1 or i < 1:
        raise ValueError(f"update intervals must be >= 1, got {f}, {i}")
    kinds = ["decomp"]
    if i > f:
        kinds.append("factor")
    if f > 1:
        kinds += ["plain"] * (2 if i > f else 1)
    return kinds


def _schedule(kinds: list[str], due: tuple[str, ...]) -> Callable[[int], int]:
    """An interval callable for KFACPreconditioner that fires on the chosen kinds.

    The preconditioner updates at step ``s`` when ``s % interval(s) == 0``;
    returning 1 fires, returning ``s + 1`` (which never divides ``s >= 1``)
    does not.
    """

    def interval(step: int) -> int:
        return 1 if kinds[step % len(kinds)] in due else step + 1

    return interval


@contextlib.contextmanager
def flushed_denormals() -> Iterator[None]:
    """Flush subnormal floats to zero while the steps are timed, then restore the default.

    Every rank trains on one fixed batch, which the model soon fits: the loss
    reaches ~0, the output gradients ~1e-20, and the K-FAC factors built from
    them (and the backward pass itself) fill with subnormal numbers, which an
    x86 core computes on tens of times slower. One strategy then took 3-7x
    longer per step than its twin for a stretch of steps, at whatever place
    in ``strategies`` it happened to be: a property of the batch, not of the
    strategy. GPUs run subnormals at full speed, or flush them, so flushing
    here measures what a user's run meets. Restored on exit, since a world
    size of 1 runs in the caller's process.
    """
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def process_group(device: str, timeout_s: float) -> Iterator[tuple[int, int, torch.device]]:
    """Join the group described by the launcher's environment (none: single process)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield (
            (dist.get_rank(), dist.get_world_size(), dev) if dist.is_initialized() else (0, 1, dev)
        )
        return
    backend = "nccl" if dev.type == "cuda" else "gloo"
    # Joining has no timeout of its own that reliably fires when a peer is gone.
    with deadline("init_process_group", timeout_s, os.environ.get("RANK", "?")):
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield dist.get_rank(), dist.get_world_size(), dev
    finally:
        dist.destroy_process_group()


class _Stepper:
    """One rank's model, batch, optimizer and preconditioner (or the first-order all-reduce)."""

    def __init__(
        self, spec: dict[str, Any], member: dict[str, Any], rank: int, device: torch.device
    ) -> None:
        from dataclasses import fields

        from dpkfac import KFACPreconditioner
        from dpkfac.comm import Communicator
        from dpkfac.stats import CommStats, PhaseTimer
        from dpkfac.strategies import strategy_class
        from experiments.bench.workloads import build
        from experiments.distributed import wrap_ddp

        self.name = str(member["name"])
        model_spec = spec["model"]
        self.bench = build(model_spec["config"], model_spec["batch"], seed=spec["seed"])
        self.model = self.bench.model.to(device)
        batch = self.bench.make_batch(spec["seed"] * 1000 + 17 * (rank + 1))
        self.batch = {k: v.to(device) for k, v in batch.items()}
        self.device = device
        # OPTIMIZER names this optimizer for the predicted process memory.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=spec["lr"], momentum=0.9)
        self.kinds = step_kinds(spec["factor_update_steps"], spec["inv_update_steps"])
        self.pre = None
        if member["kfac"] is not None:
            # The strategy config's arguments (``strategy`` is its algorithm); schedules
            # of the step are instantiated here. Update intervals follow the step kinds.
            kwargs = with_schedules(member["kfac"])
            strategy = kwargs.get("strategy")
            options = fields(strategy_class(strategy).scheme.Options) if strategy else ()
            if "auto_intervals" in {f.name for f in options}:
                # A strategy that prices the schedule (grouped's "auto") is told the
                # setting's intervals: the cycle of step kinds below is not the run's.
                intervals = (int(spec["factor_update_steps"]), int(spec["inv_update_steps"]))
                kwargs.setdefault("auto_intervals", intervals)
            self.pre = KFACPreconditioner(
                self.model,
                factor_update_steps=_schedule(self.kinds, ("decomp", "factor")),
                inv_update_steps=_schedule(self.kinds, ("decomp",)),
                lr=spec["lr"],
                **kwargs,
            )
        else:
            # SGD as users run it: DDP, its bucketed all-reduces overlapping the backward
            # pass, accounted by the communicator's hook (wire bytes and calls per bucket).
            self.stats, self.timer = CommStats(), PhaseTimer(device)
            self.comm = Communicator(stats=self.stats, timer=self.timer, device=device)
            if self.comm.active and self.comm.size > 1:
                cap_mb = float(member["view"]["bucket_cap_mb"])
                self.model = wrap_ddp(self.model, device, cap_mb)
                self.model.register_comm_hook(None, self.comm.ddp_hook())
        comm = self.pre.comm if self.pre is not None else self.comm
        comm.isolate = bool(spec.get("isolate_comm", False))
        self.timeline: Timeline | None = None
        # DDP's local reference pass evicts the cache first, as another strategy's step does.
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        self._scratch = cache_scratch(device) if ddp else None

    def trace_into(self, timeline: Timeline) -> None:
        """Record this strategy's steps, phases and collectives on ``timeline``."""
        self.timeline = timeline
        if self.pre is not None:
            self.pre.timeline = timeline
        else:
            self.timer.timeline = timeline

    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """The measured ``records`` with what the row records of the model and strategy."""
        strategy = getattr(self.pre, "strategy", None)
        # spd_kfac's fusion buckets as fixed after profiling, and the hardware model it
        # measured at start-up to place decompositions: the cost model replays both.
        plan = getattr(strategy, "fusion_plan", None)
        hardware: Any = getattr(getattr(strategy, "options", None), "hardware", None)
        return {
            "records": records,
            "kfac_layers": len(self.pre.layers) if self.pre is not None else 0,
            "params": sum(p.numel() for p in self.model.parameters()),
            "fusion_plan": [[list(key) for key in bucket] for bucket in plan] if plan else None,
            "hardware": hardware.to_json() if hasattr(hardware, "to_json") else None,
            # What the strategy chose for this run (grouped's k and f), "" when nothing.
            "configuration": "" if strategy is None else strategy.scheme.describe(strategy.options),
        }

    def _span(self, name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        """A span of the step on the timeline, if one records (else nothing)."""
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(name, "step", strategy=self.name, **args)

    def _local_fwd_bwd(self) -> float | None:
        """Seconds of DDP SGD's forward/backward again, with no reduction (``no_sync``), after
        its step (None for any other stepper). Its gradients are discarded.

        The step's own forward/backward holds the reductions DDP left exposed; this is the
        same work without them, timed in turn with the steps, cold like them: the reference
        the network page splits SGD's step at (its compute, and the rest the wire).
        """
        model, scratch = self.model, self._scratch
        if scratch is None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return None
        evict(scratch, self.device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with model.no_sync():
            self.bench.loss(model, self.batch).backward()
        sync(self.device)
        seconds = time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return seconds

    def step(self, index: int) -> dict[str, Any]:
        """Run and time one training step; everything is read after a fresh reset."""
        if dist.is_initialized():
            dist.barrier()
        sync(self.device)
        if self.pre is not None:
            self.pre.reset_stats()
        else:
            self.stats.reset()
            self.timer.reset()
        reset_cuda_peak(self.device)
        kind = self.kinds[index % len(self.kinds)] if self.pre is not None else "decomp"
        span = self._span
        with span("step", step=index, kind=kind):
            t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            with span("forward"):
                loss = self.bench.loss(self.model, self.batch)
            with span("backward"):
                loss.backward()
                sync(self.device)
            t1 = time.perf_counter()
            # Phases timed inside the forward and backward hooks (factors, and with dp_kfac's
            # overlap also reductions, decompositions and preconditioning).
            in_fwd_bwd = self.pre.timings() if self.pre is not None else {}
            if self.pre is not None:
                with span("pre.step()"):
                    self.pre.step()
                    sync(self.device)
            t2 = time.perf_counter()
            with span("optimizer.step()"):
                self.optimizer.step()
                sync(self.device)
            t3 = time.perf_counter()
        if self.pre is not None:
            phases, comm = self.pre.timings(), self.pre.comm_stats()
            memory = self.pre.memory_usage()
        else:
            phases, comm = self.timer.as_dict(), self.stats.as_dict()
            memory = {"factors_bytes": 0, "decompositions_bytes": 0, "buffers_bytes": 0}
        record = {
            "step": index,
            "kind": kind,
            "loss": float(loss.detach()),
            "fwd_bwd_wall": t1 - t0,
            "phases_in_fwd_bwd": in_fwd_bwd,
            "step_wall": t2 - t1,
            "optimizer": t3 - t2,
            "iteration": t3 - t0,
            "phases": phases,
            "comm": comm,
            "memory": memory,
            "process_memory": process_record(self.model, self.optimizer, self.pre, self.device),
        }
        local = self._local_fwd_bwd()  # after the step's record: it discards the gradients
        if local is not None:
            record["fwd_bwd_local"] = local
        return record


def run_rank(spec: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    """Benchmark one rank; the entry point handed to the elastic launcher.

    With several strategies (``spec["strategies"]``) every rank builds one
    model copy (identical initial weights, the same batch) and one
    preconditioner per strategy, and the strategies take turns step by step,
    the order rotating every step. A burst of load from other processes on a
    shared machine then hits every strategy alike, so ratios between them
    stay meaningful where absolute times do not.

    Args:
        spec: plain-dict job description (see ``experiments.bench.run.job_spec``).

    Returns:
        This rank's result: ``rank``, ``world_size``, ``device``, ``backend``
        and, per strategy name, the measured step ``records``, the number of
        K-FAC layers, parameters and what the strategy chose (:meth:`_Stepper.summary`). With
        ``spec["gather"]`` (ranks started by torchrun rather than by the
        benchmark itself) every rank's result, in rank order, on every rank.
    """
    torch.set_num_threads(int(spec.get("threads", 1)))
    warmup = int(spec["warmup"])
    group = process_group(spec.get("device", "auto"), float(spec.get("timeout_s", 300)))
    with flushed_denormals(), group as (rank, size, device):
        # On an emulated network, the highest rate it carries faithfully (its rate restored
        # after); then the links as this job's steps meet them, before any model is built.
        link, probing = node_link(), spec.get("probes", True)
        faithful = faithful_rate(device, link) if link is not None and probing else None
        probes = probe_links(device) if probing else []
        # This host's engines on the job's own model, timed alone before any strategy.
        compute = job_compute_probes(spec, rank, device) if probing else []
        steppers = [_Stepper(spec, member, rank, device) for member in spec["strategies"]]
        records: dict[str, list[dict[str, Any]]] = {s.name: [] for s in steppers}
        # The measured steps' timeline (spec["trace"]), not the warm-up's.
        timeline = Timeline(rank=rank, enabled=False) if spec.get("trace") else None
        for stepper in steppers if timeline is not None else ():
            stepper.trace_into(timeline)
        for index in range(warmup + int(spec["steps"])):
            if timeline is not None:
                timeline.enabled = index >= warmup
            for k in range(len(steppers)):
                stepper = steppers[(index + k) % len(steppers)]
                record = stepper.step(index)
                if index >= warmup:
                    records[stepper.name].append(record)
        result = {
            "rank": rank,
            "world_size": size,
            "device": str(device),
            "backend": dist.get_backend() if dist.is_initialized() else "none",
            "link_probes": probes,
            "compute_probes": compute,
            "network": network_record(link, faithful),
            "strategies": {s.name: s.summary(records[s.name]) for s in steppers},
            "trace": None if timeline is None else timeline.trace(),
        }
        if spec.get("gather") and dist.is_initialized():
            everyone: list[Any] = [None] * size
            dist.all_gather_object(everyone, result)
            return everyone
        return result


def process_record(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, pre: Any, device: torch.device
) -> dict[str, int]:
    """The whole-process tally after a step (:func:`dpkfac.process_memory`), as a record holds it.

    Bytes by category plus ``kfac`` and ``total``; on CUDA also ``peak_cuda``,
    the allocator's peak during the step (reset at its start), which sees the
    activations and transient buffers the tally cannot.
    """
    out = process_memory(model, optimizer, pre).as_dict()
    if (peak := cuda_peak_bytes(device)) is not None:
        out["peak_cuda"] = peak
    return out
