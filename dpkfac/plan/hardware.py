"""Hardware models: alpha-beta links per collective kind and compute engines per kernel kind.

Time is predicted from *work*, a mapping ``kind -> (calls, amount)``:

* a **collective kind** (``"allreduce"``, ``"broadcast"``, ``"reduce"``) costs
  ``calls * alpha(P) + beta * amount`` where ``amount`` is the *wire bytes*
  one rank sends under the bandwidth-optimal algorithm (ring all-reduce:
  ``2 (P-1)/P`` of the buffer; broadcast and reduce: ``(P-1)/P``), exactly
  the ``wire_bytes`` that :meth:`dpkfac.KFACPreconditioner.comm_stats`
  reports. With wire bytes, ``1/beta`` is what NCCL's tests call the *bus
  bandwidth*, which is (nearly) independent of ``P``, so one beta serves every
  world size; ``alpha(P) = alpha + alpha_log2p * log2(P)`` lets the start-up
  latency grow like a tree with the number of ranks.
* a **compute kind** (``"factor"``, ``"eigh"``, ``"inverse"``,
  ``"precondition"``, ``"forward_backward"``, falling back to ``"matmul"``)
  costs ``calls * latency + amount / rate`` with ``amount`` in flops;
  ``"memory"`` is memory-bound traffic (``amount`` in bytes, ``rate`` in
  bytes/s, free when not given); ``"host"`` is the host's per-call work of
  ``step()`` (calls, latency only; free when not given), ``"launch"`` the host's work
  around each collective the step launches (calls, latency only; free when not
  given); ``"unpack"`` is the landing of a received buffer (:func:`landing_bytes`:
  averaging it, copying it back into its tensors, or rebuilding full factors from triangle-packed
  buffers; bytes written; falls back to ``"memory"``), and ``"pack"`` the
  copies that gather tensors into one buffer or write one back (bytes read and
  written; falls back to ``"unpack"``, the same streaming copy); ``"fold"`` is a
  factor step's fold of a batch factor into its running average, its non-finite check
  included (bytes read and written; falls back to ``"unpack"``, like ``"pack"``: a fit
  of a run's phases leaves that engine as timed alone, where ``"memory"`` is a factor
  phase's nuisance term).

Both forms are linear in their parameters, so the cost model
(:func:`dpkfac.costmodel.fitting.calibrate`) fits them to measured
``(work, seconds)`` samples (:class:`Sample`) by non-negative least squares.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

__all__ = [
    "COLLECTIVE_KINDS",
    "COMPUTE_KINDS",
    "Engine",
    "Hardware",
    "Link",
    "Sample",
    "Work",
    "add_work",
    "drains_early",
    "gloo_link",
    "scaled",
    "sharded_by_alltoall",
    "wire_bytes",
]

#: Collective kinds; "reduce", "reduce_scatter" and "all_gather" fall back to "broadcast"
#: when not given.
COLLECTIVE_KINDS = ("allreduce", "broadcast", "reduce", "reduce_scatter", "all_gather")
#: Compute kinds; all but eigh and inverse fall back to "matmul".
COMPUTE_KINDS = (
    "matmul",
    "factor",
    "memory",
    "unpack",
    "eigh",
    "inverse",
    "precondition",
    "forward_backward",
    "optimizer",
    "pack",
    "host",
    "launch",
    "fold",
)

#: ``kind -> (calls, amount)``: amount is wire bytes for collectives, flops for compute.
Work = dict[str, tuple[float, float]]


def wire_bytes(kind: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for one collective over a buffer of ``nbytes``.

    The one formula (an integer floor per buffer): the communicator accounts every
    collective it launches with it (:meth:`dpkfac.stats.CommStats.as_dict`), so
    predicted and measured ``wire_bytes`` agree exactly.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    factor = 2 if kind == "allreduce" else 1
    return factor * nbytes * (world_size - 1) // world_size


def landing_bytes(
    kind: str, nbytes: int, world_size: int, unpack_bytes: int = 0, *, own: bool = False
) -> float:
    """Bytes one rank writes, on average over ranks, to land one collective's buffer.

    Mirrors the passes :class:`dpkfac.comm.Communicator` runs when a collective
    is waited on (so they are timed in its phase): a mean divides the received
    flat buffer by ``P`` and copies it back into its tensors (all-reduce on every
    rank, a reduce on its root, a reduce-scatter on each rank's own shard); a
    broadcast or all-gather copies back what a rank received, ``(P-1)/P`` of the
    buffer. ``unpack_bytes``: full matrices rebuilt from a triangle-packed buffer,
    which replace the plain copy back. ``own``: the buffer is the tensor's own storage
    (:func:`~dpkfac.plan.fusion.travels_alone`): nothing is copied back, and a mean's
    division is the only pass. DDP's buckets are views of the gradients, divided as they
    are copied in (no landing), and are not priced here.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    p = max(world_size, 1)
    if kind in ("broadcast", "all_gather"):
        return 0.0 if own else nbytes * (p - 1) / p
    received = nbytes if kind == "allreduce" else nbytes / p
    if own:
        return received
    return received + (unpack_bytes if unpack_bytes else received)


def add_work(total: Work, kind: str, calls: float, amount: float) -> None:
    """Accumulate ``calls`` and ``amount`` of ``kind`` into ``total`` in place."""
    c, a = total.get(kind, (0.0, 0.0))
    total[kind] = (c + calls, a + amount)


@dataclass(frozen=True)
class Link:
    """Alpha-beta model of one collective kind.

    Attributes:
        alpha: start-up seconds per collective at ``P = 1`` (the constant part).
        beta: seconds per wire byte (1 / bus bandwidth).
        alpha_log2p: extra start-up seconds per doubling of the world size.
    """

    alpha: float
    beta: float
    alpha_log2p: float = 0.0

    def latency(self, world_size: int) -> float:
        """Start-up seconds of one collective over ``world_size`` ranks."""
        return self.alpha + self.alpha_log2p * math.log2(max(world_size, 1))

    def time(self, calls: float, wire: float, world_size: int) -> float:
        """Seconds for ``calls`` collectives sending ``wire`` bytes in all."""
        return calls * self.latency(world_size) + self.beta * wire


@dataclass(frozen=True)
class Engine:
    """Throughput model of one kind of kernel.

    Attributes:
        rate: achieved flop/s on the kernel's work (``inf``: free).
        latency: fixed seconds per call (launch and Python overhead).
    """

    rate: float
    latency: float = 0.0

    def time(self, calls: float, flops: float) -> float:
        """Seconds for ``calls`` kernels doing ``flops`` in all."""
        return calls * self.latency + (0.0 if math.isinf(self.rate) else flops / self.rate)


@dataclass(frozen=True)
class Hardware:
    """One rank's device and the network between ranks.

    Attributes:
        name: preset name.
        links: alpha-beta model per collective kind (at least "allreduce").
        engines: compute model per kind (at least "matmul", "eigh", "inverse").
        sources: where the numbers come from (citations or a calibration run).
        backend: the torch.distributed backend ("nccl", "gloo"): what decides which
            collectives a run may use (gloo has no all-gather of uneven shards).
        overlap: fraction of a collective launched during the forward/backward
            pass that runs concurrently with it (spd_kfac's pipelined factor
            all-reduces). 1 on GPUs, whose copy engines and NCCL kernels run
            beside compute; about 0.9 for gloo on CPU ranks with a core each
            (fitted), where the transfer thread takes turns with the compute.
    """

    name: str
    links: Mapping[str, Link]
    engines: Mapping[str, Engine]
    sources: tuple[str, ...] = field(default=())
    overlap: float = 1.0
    backend: str = "nccl"

    def __post_init__(self) -> None:
        if "allreduce" not in self.links:
            raise ValueError("Hardware needs an 'allreduce' link")
        missing = {"matmul", "eigh", "inverse"} - set(self.engines)
        if missing:
            raise ValueError(f"Hardware lacks engines {sorted(missing)}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    def link(self, kind: str) -> Link:
        """The model of collective ``kind`` (reduce, reduce_scatter, all_gather -> broadcast ->
        allreduce fallback)."""
        chain = {
            "reduce": ("reduce", "broadcast"),
            "reduce_scatter": ("reduce_scatter", "broadcast"),
            "all_gather": ("all_gather", "broadcast"),
            "broadcast": ("broadcast",),
        }
        for k in (*chain.get(kind, (kind,)), "allreduce"):
            if k in self.links:
                return self.links[k]
        raise AssertionError("unreachable: allreduce is required")

    def engine(self, kind: str) -> Engine:
        """The model of compute ``kind``.

        Falls back to "matmul"; "pack" and "fold" to "unpack" (streaming passes over
        buffers, as a received buffer's landing); "unpack" and "optimizer"
        (memory-bound passes) to "memory", and "memory", "host" and "launch" (the host's
        work per call of ``step()`` and per collective it launches, which only a
        measurement in the job gives) to free.
        """
        if kind in ("pack", "fold") and kind not in self.engines:
            kind = "unpack"
        if kind in ("unpack", "optimizer") and kind not in self.engines:
            kind = "memory"
        if kind in ("memory", "host", "launch"):
            return self.engines.get(kind, Engine(math.inf))
        return self.engines.get(kind, self.engines["matmul"])

    def time(self, work: Mapping[str, tuple[float, float]], world_size: int) -> float:
        """Predicted seconds for ``work`` on ``world_size`` ranks."""
        total = 0.0
        for kind, (calls, amount) in work.items():
            if kind in COLLECTIVE_KINDS:
                total += self.link(kind).time(calls, amount, world_size)
            else:
                total += self.engine(kind).time(calls, amount)
        return total

    # ------------------------------------------------------------- persistence
    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text of this model; also written to ``path`` when given."""
        text = json.dumps(
            {
                "name": self.name,
                "links": {k: asdict(v) for k, v in self.links.items()},
                "engines": {k: asdict(v) for k, v in self.engines.items()},
                "sources": list(self.sources),
                "overlap": self.overlap,
                "backend": self.backend,
            },
            indent=2,
        )
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Hardware:
        """Inverse of :meth:`to_json`; accepts JSON text or a file path."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        return cls(
            name=data["name"],
            links={k: Link(**v) for k, v in data["links"].items()},
            engines={k: Engine(**v) for k, v in data["engines"].items()},
            sources=tuple(data.get("sources", ())),
            overlap=float(data.get("overlap", 1.0)),
            backend=str(data.get("backend", "nccl")),
        )


# ------------------------------------------------------------------ samples
@dataclass(frozen=True)
class Sample:
    """One measurement: ``seconds`` spent on ``work`` at ``world_size`` ranks."""

    work: Mapping[str, tuple[float, float]]
    seconds: float
    world_size: int = 1

    @classmethod
    def collective(
        cls, kind: str, nbytes: int, seconds: float, world_size: int, calls: int = 1
    ) -> Sample:
        """``calls`` collectives of ``kind``, each over a buffer of ``nbytes``."""
        wire = calls * wire_bytes(kind, nbytes, world_size)
        return cls({kind: (calls, wire)}, seconds, world_size)

    @classmethod
    def compute(cls, kind: str, flops: float, seconds: float, calls: int = 1) -> Sample:
        """``calls`` kernels of ``kind`` doing ``flops`` in all."""
        if kind not in COMPUTE_KINDS:
            raise ValueError(f"unknown compute kind {kind!r}; expected one of {COMPUTE_KINDS}")
        return cls({kind: (calls, flops)}, seconds)


def scaled(hardware: Hardware, *, network: float = 1.0, compute: float = 1.0) -> Hardware:
    """A copy ``network``/``compute`` times faster (for what-if and monotonicity checks)."""
    return replace(
        hardware,
        links={
            k: Link(v.alpha / network, v.beta / network, v.alpha_log2p / network)
            for k, v in hardware.links.items()
        },
        engines={
            k: Engine(v.rate * compute, v.latency / compute) for k, v in hardware.engines.items()
        },
    )


def sharded_by_alltoall(backend: str) -> bool:
    """Whether ``backend``'s sharded collectives (a reduce-scatter or all-gather of owners'
    shards of different sizes) go by its all-to-all of uneven splits (gloo's alltoallv).

    gloo has no all-gather of uneven shards, and its reduce-scatter all-reduces the whole
    input (twice the bytes a reduce-scatter needs) and completes no future, which a DDP
    communication hook must return. Its ``all_to_all_single`` with split sizes sends each
    shard once, straight to the rank that needs it, in both directions at once, and
    completes a future: a reduce-scatter is each rank sending every owner its part (the
    owner sums what arrives), an all-gather each rank sending its shard to every rank.
    Both put a bandwidth-optimal ring's bytes on the wire (the accounted
    :func:`wire_bytes`, shards balanced). The rooted reduces a hook fell back to before
    sent half as many bytes again (gloo reduces to a root by a reduce-scatter then a
    gather: :func:`gloo_link`), and per-owner broadcasts loaded one direction of each link
    at a time.
    """
    return backend == "gloo"


def drains_early(backend: str) -> bool:
    """Whether the overlapped mode's ready drain (``drain="ready"``,
    :meth:`~dpkfac.plan.traits.Traits.drains_in_hooks`) runs on ``backend``; where it does
    not, it is the last-launch drain, in the engine and in the cost model alike.

    Not on NCCL, for two reasons. The host queues work ahead of the GPU: a hook runs when
    the backward pass is queued, not when it runs, so asking there whether a reduction has
    completed on the device seldom finds it, and work queued there runs after the
    backward's queued kernels anyway. And an NCCL kernel waits on the device until every
    rank has launched its collective: exchanges launched from the hooks at times that
    differ between ranks would interleave with the gradient buckets of the other process
    group in orders that differ between ranks, which can deadlock. gloo (each group served
    by its own threads) and the in-process groups run such interleavings.
    """
    return backend != "nccl"


def gloo_link(kind: str, allreduce: Link, world_size: int) -> Link:
    """gloo's ``kind`` on a network where every transfer is bound by the same link rate,
    derived from its all-reduce (an alpha-beta fit per *accounted* wire byte, :func:`wire_bytes`).

    The accounted wire bytes are the bandwidth-optimal algorithms' (``(P-1)/P`` of the
    buffer for every kind but the all-reduce), and gloo's ring all-reduce sends exactly its
    ``2 (P-1)/P``, so its ``beta`` is the link's seconds per byte. gloo's other kinds send
    what their own algorithms send (gloo/*.cc, torch's ProcessGroupGloo.cpp), used as a step
    uses them: with every rank rooting its share (owners, decomposers), on gloo's worker
    threads side by side. Per accounted wire byte, relative to the all-reduce's ``beta``:

    * ``broadcast``: a binomial tree; every non-root receives the buffer once, so over
      balanced roots a rank sends ``(P-1)/P`` of the bytes, as accounted: 1;
    * ``all_gather``: the communicator's gather of owners' shards runs as alltoallv
      (:func:`sharded_by_alltoall`), each rank's shard once to every rank, ``(P-1)/P`` of
      the buffer per rank over balanced owners: 1;
    * ``reduce``: a ring reduce-scatter, ``(P-1)/P`` of the buffer per rank, then each
      rank's chunk to the root, ``1/P`` more over balanced roots: ``1 + 1/P``;
    * ``reduce_scatter``: alltoallv too, every rank's part once to its owner: 1.

    The start-up ``alpha`` is the all-reduce's per collective call (the same host and link).
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    p = max(int(world_size), 1)
    if kind == "allreduce":
        return allreduce
    factor = 1.0 + 1.0 / p if kind == "reduce" else 1.0
    return Link(allreduce.alpha, factor * allreduce.beta, allreduce.alpha_log2p)
