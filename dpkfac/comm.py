"""Collectives with byte/time accounting, fused buckets and triangle packing.

Every collective of the package goes through :class:`Communicator`, which

* fuses a list of tensors into flat buckets (one per dtype, optionally split
  at a byte cap) so the number of collectives does not grow with the number
  of layers;
* can send only the upper triangle of symmetric factors;
* counts the bytes of every buffer handed to torch.distributed per category
  and times waiting on it in the category's phase;
* launches every collective asynchronously and waits with a timeout, so a
  hang becomes an error that names the phase and the rank instead of a
  silent deadlock;
* starts the calls of collectives launched inside :meth:`Communicator.together`
  in turns, so that broadcasts from several roots cross on the links;
* optionally (``isolate``, for measurements) meets the other ranks at a
  barrier before a phase's first collective, timed as ``comm_sync``, so a
  phase's time is its transfers alone and not also the wait for slower ranks.

With no initialised process group (or a group of one rank) every call is a
no-op that records nothing, which is what makes world size 1 communication-free.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dpkfac.device import DeviceMismatch, HostReader, TableCache, check_device
from dpkfac.plan.fusion import fused_buckets, shard_rounds, travels_alone
from dpkfac.plan.hardware import sharded_by_alltoall
from dpkfac.stats import PHASE_OF_CATEGORY, CommStats, PhaseTimer

T = TypeVar("T")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the configured timeout."""


#: The most bytes one rank sends one peer in one call of gloo's rooted and sharded
#: collectives (broadcast, reduce, alltoallv). gloo's TCP pair carries one large message per
#: direction in turn, not both at once, wherever two transfers cross on a link: at P=2 on the
#: emulated 1 Gbit/s network, 14 MB each way took 243 ms as one alltoallv and 122 ms cut into
#: calls of 512 KiB per peer launched together (the link's rate both ways). Broadcasts rooted
#: at either rank cross only where their calls take turns (:meth:`Communicator.together`):
#: 9 MiB from each rank took 143-152 ms cut and launched one root after the other, as long as
#: two transfers in turn, and 87-93 ms with the roots' calls alternating. On loopback the cut
#: cost nothing measurable (27 ms against 27 ms for the 14 MB alltoallv). gloo's ring
#: all-reduce sends its buffer in segments already and runs at the link's rate uncut.
GLOO_MESSAGE_BYTES = 512 * 2**10


def message_calls(backend: str, largest_message_bytes: int) -> int:
    """How many calls one rooted or sharded collective is cut into on ``backend``, the largest
    message one rank sends one peer in it being ``largest_message_bytes``: on gloo each call
    carries a consecutive piece of every message, at most :data:`GLOO_MESSAGE_BYTES` of
    each, and the calls are launched together; one call elsewhere (NCCL pipelines its own
    chunks). Every rank knows every message's size, so every rank cuts alike. The cost model
    prices the collective as one (:mod:`dpkfac.plan.hardware`): its calls pipeline on the wire."""
    if backend != "gloo":
        return 1
    return max(1, -(-int(largest_message_bytes) // GLOO_MESSAGE_BYTES))


def _cuts(n: int, calls: int) -> list[int]:
    """Where ``calls`` consecutive, near-equal pieces of ``n`` elements start, and ``n``."""
    return [n * c // calls for c in range(calls + 1)]


def _sizes(cuts: Sequence[Sequence[int]], call: int) -> list[int]:
    """Each shard's piece in call ``call``, from every shard's :func:`_cuts`."""
    return [cut[call + 1] - cut[call] for cut in cuts]


def _views(tensors: Sequence[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Flat views of elements ``[lo, hi)`` of ``tensors`` laid end to end."""
    out, start = [], 0
    for t in tensors:
        end = start + t.numel()
        if end > lo and start < hi:
            out.append(t.reshape(-1)[max(lo - start, 0) : min(hi, end) - start])
        start = end
    return out


def _fill(tensors: Sequence[torch.Tensor], pieces: Sequence[torch.Tensor]) -> None:
    """Copy the elements of ``pieces`` laid end to end into ``tensors`` laid end to end (a
    tensor across a boundary between pieces is copied from the joined parts)."""
    at, offset = 0, 0  # the piece being read, and how far into it
    for t in tensors:
        need, taken = t.numel(), []
        while need:
            piece = pieces[at]
            take = min(need, piece.numel() - offset)
            if take:
                taken.append(piece[offset : offset + take])
            offset += take
            need -= take
            if offset == piece.numel():
                at, offset = at + 1, 0
        if taken:
            t.copy_((taken[0] if len(taken) == 1 else torch.cat(taken)).view_as(t))


def _triu(
    dim: int, device: torch.device, cache: TableCache | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indices for packing and unpacking the upper triangle of ``dim``².

    ``upper``: flat (row-major) index of every upper-triangle entry, in packed
    order. ``full``: for every entry (i, j) of the matrix, the packed index of
    (min(i, j), max(i, j)). Both directions are then a single ``index_select``,
    which on CPUs is several times faster than the two-dimensional
    advanced-index scatter ``out[rows, cols] = packed`` (measured: 3.6 ns per
    element against 0.5, which made unpacking cost as much as the transfer).
    Made on ``device`` and kept in ``cache`` (the communicator's).
    """

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = torch.triu_indices(dim, dim, device=device)
        upper = rows * dim + cols
        i = torch.arange(dim, device=device)
        lo = torch.minimum(i[:, None], i[None, :])
        hi = torch.maximum(i[:, None], i[None, :])
        full = lo * dim - lo * (lo - 1) // 2 + (hi - lo)
        index_dtype = torch.int32 if triangle_numel(dim) < 2**31 else torch.int64
        return upper, full.reshape(-1).to(index_dtype)

    return build() if cache is None else cache.get(("triu", dim, device), build)


def pack_triangle(matrix: torch.Tensor, cache: TableCache | None = None) -> torch.Tensor:
    """The upper triangle (diagonal included) of a symmetric matrix, row-major.

    ``cache`` keeps the index tensors between calls (None: made at each call).
    """
    upper, _ = _triu(matrix.shape[0], matrix.device, cache)
    return matrix.reshape(-1).index_select(0, upper)


def unpack_triangle(
    packed: torch.Tensor, dim: int, cache: TableCache | None = None
) -> torch.Tensor:
    """The symmetric matrix whose upper triangle is ``packed`` (``cache``: as above)."""
    _, full = _triu(dim, packed.device, cache)
    return packed.index_select(0, full).view(dim, dim)


def triangle_numel(dim: int) -> int:
    """Elements sent for a symmetric ``dim``² factor with triangle packing."""
    return dim * (dim + 1) // 2


#: Bucket layouts a communicator keeps (:meth:`Communicator._buckets`); a step has a few.
MAX_LAYOUTS = 256


def bucket_plan(
    tensors: Sequence[torch.Tensor], numels: Sequence[int], cap_bytes: int | None
) -> list[list[int]]:
    """Group tensor indices into buckets of one dtype and device, split at ``cap_bytes``,
    a large tensor alone (:func:`~dpkfac.plan.fusion.fused_buckets`, the rule the cost
    model prices, so predicted and measured collectives agree)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    buckets: list[list[int]] = []
    for indices in groups.values():
        sizes = [numels[i] * tensors[i].element_size() for i in indices]
        for run in fused_buckets(sizes, cap_bytes):
            buckets.append([indices[j] for j in run])
    return buckets


def in_place(alone: bool, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether one bucket of :func:`bucket_plan` travels in its tensor's own storage: a
    bucket that travels alone (``alone``, :func:`~dpkfac.plan.fusion.travels_alone` of its
    collective's kind, decided once per layout) whose tensor is contiguous. Otherwise its
    tensors are gathered into a new flat buffer."""
    return alone and tensors[0].is_contiguous()


def _flat(tensors: Sequence[torch.Tensor], own: bool) -> torch.Tensor:
    """The buffer one bucket travels in: its one tensor's own storage seen flat (``own``,
    :func:`in_place`), or its tensors gathered into a new buffer."""
    if own:
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


@dataclass
class Handle:
    """Pending collectives; :meth:`Communicator.wait` completes them and unpacks results."""

    category: str
    works: list = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)
    done: bool = False
    overlapped: bool = False


#: A collective launched inside :meth:`Communicator.together`: its handle, its calls not yet
#: started, and what the timeline records of it (category, kind, bytes).
_Held = tuple[Handle, list[Callable[[], object]], str, str, int]


class Communicator:
    """Accounted, fused, time-limited collectives over one process group.

    Args:
        group: the process group (None: the default group, if initialised).
        timeout: seconds to wait for any collective before raising
            :class:`CollectiveTimeout`.
        stats: where bytes and calls are recorded.
        timer: where waiting time is recorded, per category's phase.
        device: the run's device (the model's). Every buffer handed to a
            collective must live there (:func:`dpkfac.device.check_device`,
            raising :class:`~dpkfac.device.DeviceMismatch`): a CPU tensor
            would crash NCCL, and a tensor of another GPU would hang it.
            None: the current CUDA device under NCCL, else the CPU.
        host: how agreed values are read back on the host (a dry run's
            :class:`~dpkfac.device.DryRunReader`); default :class:`HostReader`.

    Attributes:
        isolate: when True, a collective launched while no other (non-overlapped)
            collective is in flight is preceded by a barrier, timed in phase
            ``comm_sync``. Waiting on a collective otherwise also waits for the
            slowest rank to arrive, and transfers from early ranks partly hide
            behind late ranks' compute; with the barrier a communication
            phase measures the transfers alone, which is what an alpha-beta
            model predicts. Costs one barrier per phase; for benchmarks only.
            Collectives launched with ``overlapped=True`` (spd-kfac's
            pipelined factor all-reduces) are never isolated.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float = 300.0,
        stats: CommStats | None = None,
        timer: PhaseTimer | None = None,
        device: torch.device | str | None = None,
        host: HostReader | None = None,
    ) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group if self.enabled else None
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.size = dist.get_world_size(group) if self.enabled else 1
        self.timeout = timeout
        # NCCL only moves CUDA tensors: small control tensors (placement
        # statistics, calibration buffers) are made on this device.
        backend = dist.get_backend(self.group) if self.enabled else "none"
        #: The torch.distributed backend ("none" without a process group).
        self.backend = str(backend)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.host = host if host is not None else HostReader()
        #: Triangle index tensors, kept per dimension on this run's devices.
        self.tables = TableCache()
        self.stats = stats if stats is not None else CommStats()
        self.timer = timer if timer is not None else PhaseTimer()
        self._isolate = False
        #: The name of this communicator's process group on a timeline (its track).
        self.label = "main"
        self._parent: Communicator | None = None
        self._in_flight: set[int] = set()
        #: Inside :meth:`together`: the collectives launched there, each its handle, its
        #: calls not yet started, and what the timeline records of it.
        self._held: list[_Held] | None = None
        #: :func:`bucket_plan` per layout (dtypes, devices and sizes of the tensors, the
        #: cap): a step hands the same layouts to the same collectives every time.
        self._layouts: dict[tuple[object, ...], list[tuple[list[int], bool]]] = {}

    @property
    def isolate(self) -> bool:
        """See the class docstring; a sub-communicator follows its parent's setting."""
        return self._parent.isolate if self._parent is not None else self._isolate

    @isolate.setter
    def isolate(self, value: bool) -> None:
        self._isolate = bool(value)

    @property
    def active(self) -> bool:
        """True when collectives actually run (more than one rank)."""
        return self.enabled and self.size > 1

    def subgroups(self, partition: Sequence[Sequence[int]]) -> dict[int, Communicator]:
        """Communicators over groups of this group's ranks, sharing its accounting.

        A collective: every rank calls it with the same ``partition`` (lists of
        group ranks), because creating a process group is one. A group of one
        rank gets a communicator that never communicates, and the whole group
        is this communicator itself.

        Returns:
            For each group this rank belongs to, its communicator, keyed by the
            group's index in ``partition``.
        """
        out: dict[int, Communicator] = {}
        for index, members in enumerate(partition):
            ranks = sorted(int(r) for r in members)
            if len(ranks) == self.size or not self.active:
                if self.rank in ranks:
                    out[index] = self
                continue
            if len(ranks) == 1:
                if ranks[0] == self.rank:
                    out[index] = self._solo()
                continue
            group = dist.new_group(
                [self.global_rank(r) for r in ranks],
                timeout=datetime.timedelta(seconds=self.timeout),
                use_local_synchronization=False,
            )
            if self.rank in ranks:
                assert isinstance(group, dist.ProcessGroup), "a member gets the group itself"
                sub = self._sibling(group)
                sub._parent = self
                sub.label = "ranks " + ",".join(map(str, ranks))
                out[index] = sub
        return out

    def _sibling(self, group: dist.ProcessGroup | None) -> Communicator:
        """A communicator over ``group`` sharing this one's accounting, device, host reader
        and tables."""
        sibling = Communicator(
            group,
            timeout=self.timeout,
            stats=self.stats,
            timer=self.timer,
            device=self.device,
            host=self.host,
        )
        sibling.tables = self.tables
        return sibling

    def duplicate(self, label: str) -> Communicator:
        """A communicator over a new process group of the same ranks, sharing everything else.

        Its collectives run beside this one's without ordering against them
        (dp_kfac's overlap broadcasts on it while gradients are reduced here).
        A collective at construction (every rank calls it). With one rank, or
        no process group, this communicator itself (it never communicates).
        ``label`` names its group on a timeline.
        """
        if not self.active:
            return self
        ranks = [self.global_rank(r) for r in range(self.size)]
        group = dist.new_group(
            ranks,
            timeout=datetime.timedelta(seconds=self.timeout),
            use_local_synchronization=True,
        )
        assert isinstance(group, dist.ProcessGroup), "every rank is a member of its duplicate"
        sibling = self._sibling(group)
        sibling.label = label
        return sibling

    def _solo(self) -> Communicator:
        """A communicator of this rank alone: every call is a no-op that records nothing."""
        solo = self._sibling(self.group)
        solo.enabled, solo.rank, solo.size, solo._parent = False, 0, 1, self
        return solo

    def global_rank(self, group_rank: int) -> int:
        """Translate a rank of this group to the global rank torch.distributed expects."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # ----------------------------------------------------------------- helpers
    def _buckets(
        self,
        tensors: Sequence[torch.Tensor],
        numels: Sequence[int],
        cap_bytes: int | None,
        kind: str,
    ) -> list[tuple[list[int], bool]]:
        """:func:`bucket_plan` of the tensors, each bucket with whether it travels alone in a
        ``kind`` collective (:func:`~dpkfac.plan.fusion.travels_alone`), planned once per
        layout."""
        layout = tuple((t.dtype, t.device, n) for t, n in zip(tensors, numels, strict=True))
        key: tuple[object, ...] = (cap_bytes, kind, *layout)
        if (planned := self._layouts.get(key)) is None:
            if len(self._layouts) >= MAX_LAYOUTS:  # shapes that keep changing: plan afresh
                self._layouts.clear()
            sizes = [n * t.element_size() for t, n in zip(tensors, numels, strict=True)]
            planned = self._layouts[key] = [
                (b, travels_alone(kind, [sizes[i] for i in b]))
                for b in bucket_plan(tensors, numels, cap_bytes)
            ]
        return planned

    def record(self, category: str, kind: str, nbytes: int) -> None:
        """Account one collective of ``kind`` ("allreduce", "rooted", "reduce_scatter" or
        "all_gather") over ``nbytes``: the whole buffer, a reduce-scatter's input or an
        all-gather's output (``P`` shards). A "rooted" collective (a broadcast or a reduce)
        sends what a broadcast does; the stats derive the wire bytes
        (:meth:`dpkfac.stats.CommStats.as_dict`)."""
        self.stats.record(category, "broadcast" if kind == "rooted" else kind, nbytes, self.size)

    def _launch(
        self, handle: Handle, fn: Callable[..., object], flat: torch.Tensor, **kwargs: object
    ) -> None:
        """Account, check the device of, and launch one asynchronous collective on ``flat``.

        Every tensor collective of the package goes through here, so the
        device rule (:func:`~dpkfac.device.check_device`) holds for all of them.
        """
        check_device(flat, self.device, handle.category)
        kind = "allreduce" if fn is dist.all_reduce else "rooted"
        nbytes = flat.numel() * flat.element_size()
        self.record(handle.category, kind, nbytes)
        self._isolated(handle)
        # A rooted collective sends its whole buffer to a peer: on gloo in consecutive pieces,
        # launched together (message_calls), into the same buffer.
        calls = 1 if kind == "allreduce" else message_calls(self.backend, nbytes)
        starts: list[Callable[[], object]] = [
            functools.partial(fn, piece, group=self.group, async_op=True, **kwargs)
            for piece in flat.tensor_split(calls)
        ]
        entry: _Held = (handle, starts, handle.category, getattr(fn, "__name__", kind), nbytes)
        if self._held is not None:
            self._held.append(entry)
        else:
            self._start([entry])

    def _start(self, entries: list[_Held]) -> None:
        """Start the calls of ``entries``, the collectives' calls taking turns: the first call
        of each, then the second of each, and so on (every rank in the same order)."""
        for turn in itertools.zip_longest(*(starts for _, starts, *_ in entries)):
            for (handle, *_), start in zip(entries, turn, strict=True):
                if start is not None:
                    handle.works.append(start())
        for handle, _, category, name, nbytes in entries:
            self._traced(category, name, nbytes, handle.works[-1])

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Launch the collectives started inside the block together, at its end, their calls
        taking turns (see :data:`GLOO_MESSAGE_BYTES`): broadcasts rooted at different ranks then
        cross on the links both ways, where launched one after the other each root's calls
        would all go first. Every rank must start the same collectives in the block, as
        everywhere. Waiting on one of them inside the block launches those held so far. A
        block inside another launches with the outer one's.
        """
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        except BaseException:
            self._held = None  # never launched: the other ranks fail at their timeout
            raise
        held, self._held = self._held, None
        self._start(held)

    def _traced(self, category: str, kind: str, nbytes: int, work: object) -> None:
        """Record a launched collective on the timer's timeline, if it has one (on a track
        named after this communicator's :attr:`label`)."""
        timeline = self.timer.timeline
        if timeline is not None and timeline.enabled:
            # A CUDA work's future completes at enqueue: its end is when it is seen done.
            on_cuda = self.device.type == "cuda"
            name, track = f"{category} {kind}", f"group {self.label}"
            timeline.collective(name, track, work, future=not on_cuda, bytes=nbytes)

    def ddp_hook(
        self, category: str = "grad_allreduce"
    ) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
        """A DDP communication hook that averages each bucket as DDP's default hook does,
        accounted in ``category`` and device-checked like every collective here.

        Register it with ``ddp_model.register_comm_hook(None, comm.ddp_hook())`` so
        :attr:`stats` counts DDP's gradient traffic (one all-reduce per bucket, as
        :func:`dpkfac.costmodel.traffic.ddp_collectives` predicts). The hook runs
        inside the backward pass: it neither waits nor reads anything on the host.
        """

        def hook(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            flat = bucket.buffer()
            check_device(flat, self.device, category)
            self.record(category, "allreduce", flat.numel() * flat.element_size())
            flat.div_(self.size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            nbytes = flat.numel() * flat.element_size()
            self._traced(category, "all_reduce", nbytes, work)
            return work.get_future().then(lambda fut: fut.value()[0])

        # DDP checks the hook's annotations as objects; this module's are strings.
        hook.__annotations__ = {
            "_": object,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        return hook

    def settled(
        self, handles: Sequence[Handle], value: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """A future that completes with ``value`` once ``handles`` are done and unpacked.

        For a DDP communication hook, which must return a future and never
        block: the handles' results are unpacked in the future's callback
        (where the collectives completed), not by :meth:`wait`, and the handles
        are then done. Nothing here reads the host.
        """
        handles = list(handles)
        works = [w for h in handles for w in h.works]

        def unpack(_: object) -> torch.Tensor:
            for h in handles:
                if not h.done:
                    for finish in h.finish:
                        finish()
                    h.done = True
            return value

        if not works:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(unpack(None))
            return done
        return torch.futures.collect_all([w.get_future() for w in works]).then(unpack)

    def _isolated(self, handle: Handle) -> None:
        """Meet every rank first when isolating and nothing else is in flight (see ``isolate``).

        In-flight handles are tracked only when isolating: nothing extra per
        collective in training runs.
        """
        if self.isolate and not handle.overlapped:
            if not self._in_flight:
                self._barrier()
            self._in_flight.add(id(handle))

    def _barrier(self) -> None:
        """Meet every rank (timed as ``comm_sync``), with the collective timeout."""
        with self.timer.phase("comm_sync"):
            work = dist.barrier(group=self.group, async_op=True)
            try:
                self._wait_work(work, self.timeout)
            except Exception as err:
                raise CollectiveTimeout(
                    f"dpkfac: barrier before a collective did not complete within "
                    f"{self.timeout:g}s on rank {self.rank}: {err}"
                ) from err

    @staticmethod
    def _wait_work(work: Any, timeout: float) -> None:
        """Wait for one work of torch.distributed, failing after ``timeout`` seconds.

        gloo's and NCCL's works take the timeout themselves. A work that wraps a
        future (an in-process group's, made by ``_create_work_from_future``)
        refuses any finite timeout; it is polled with ``is_completed()`` up to
        the deadline instead, so a hang on it still fails, and then waited on
        without one.
        """
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
            return
        except RuntimeError as err:
            if "finite timeout not implemented" not in str(err):
                raise
        deadline = time.monotonic() + timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not completed within {timeout:g}s")
            time.sleep(0.001)
        work.wait()

    def completed(self, handle: Handle) -> bool:
        """Whether ``handle``'s collectives have completed, asked without blocking or reading
        the device (``is_completed()`` of each work: on NCCL a query of its CUDA events); a
        collective still held by :meth:`together` has not. :meth:`wait` then returns at once,
        but still unpacks the results.

        Asked of the works even where the handle is ``done``: NCCL completes a work's future
        once the collective is queued, so a DDP hook's callback unpacks (and marks done) a
        handle whose transfer the device has not run yet.
        """
        if self._held and any(entry[0] is handle for entry in self._held):
            return False
        return all(work.is_completed() for work in handle.works)

    def wait(self, handle: Handle) -> None:
        """Block until ``handle`` completes (timed in its category's phase), then unpack."""
        if handle.done:
            return
        if self._held:  # inside together(): what it holds goes now, the block goes on
            held, self._held = self._held, []
            self._start(held)
        phase = PHASE_OF_CATEGORY.get(handle.category, handle.category)
        with self.timer.phase(phase):
            for work in handle.works:
                try:
                    self._wait_work(work, self.timeout)
                except Exception as err:  # gloo/NCCL raise several types on timeout
                    raise CollectiveTimeout(
                        f"dpkfac: {handle.category} collective failed or did not complete "
                        f"within {self.timeout:g}s on rank {self.rank} (phase {phase}): {err}"
                    ) from err
            if self.timer.timeline is not None:
                self.timer.timeline.observed(handle.works)
            for finish in handle.finish:
                finish()
        handle.done = True
        self._in_flight.discard(id(handle))

    # ------------------------------------------------------------- collectives
    def allreduce_mean(
        self,
        tensors: Sequence[torch.Tensor],
        category: str,
        *,
        triangle: bool = False,
        cap_bytes: int | None = None,
        async_op: bool = False,
        overlapped: bool = False,
    ) -> Handle:
        """Average tensors across ranks in place, fused into buckets.

        Args:
            tensors: tensors to average (square symmetric ones if ``triangle``).
            category: accounting category.
            triangle: send only upper triangles of the (symmetric) tensors.
            cap_bytes: split buckets at this size (None: one bucket per dtype).
            async_op: return before completion; call :meth:`wait` later.
            overlapped: launched to run beside computation (never isolated).
        """
        handle = Handle(category, overlapped=overlapped)
        if not self.active or not tensors:
            handle.done = True
            return handle
        tensors = list(tensors)
        numels = [triangle_numel(t.shape[0]) if triangle else t.numel() for t in tensors]
        for bucket, alone in self._buckets(tensors, numels, cap_bytes, "allreduce"):
            members = [tensors[i] for i in bucket]
            own = not triangle and in_place(alone, members)
            if triangle:
                flat = torch.cat([pack_triangle(t, self.tables) for t in members])
            else:
                flat = _flat(members, own)
            self._launch(handle, dist.all_reduce, flat)
            handle.finish.append(self._unpacker(flat, members, triangle, own=own))
        if not async_op:
            self.wait(handle)
        return handle

    def _unpacker(
        self,
        flat: torch.Tensor,
        tensors: list[torch.Tensor],
        triangle: bool,
        scale: bool = True,
        *,
        own: bool = False,
    ) -> Callable[[], None]:
        """Land a received buffer: average it (``scale``) and copy it back into ``tensors``,
        unless it is their own storage (``own``, :func:`in_place`)."""
        size = self.size

        def finish() -> None:
            offset = 0
            if scale:
                flat.div_(size)
            if own:  # the result lies where it arrived
                return
            for t in tensors:
                if triangle:
                    n = triangle_numel(t.shape[0])
                    t.copy_(unpack_triangle(flat[offset : offset + n], t.shape[0], self.tables))
                else:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

        return finish

    def broadcast(
        self,
        tensors: Sequence[torch.Tensor],
        src: int,
        category: str,
        *,
        cap_bytes: int | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Broadcast tensors from group rank ``src`` into the same-shaped tensors elsewhere."""
        return self._rooted(dist.broadcast, tensors, src, category, cap_bytes, async_op)

    def reduce_mean(
        self,
        tensors: Sequence[torch.Tensor],
        dst: int,
        category: str,
        *,
        cap_bytes: int | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Average tensors onto group rank ``dst`` only; other ranks' copies are left as is."""
        return self._rooted(dist.reduce, tensors, dst, category, cap_bytes, async_op)

    def _rooted(
        self,
        fn: Callable[..., object],
        tensors: Sequence[torch.Tensor],
        root: int,
        category: str,
        cap_bytes: int | None,
        async_op: bool,
    ) -> Handle:
        """A broadcast or reduce with one root: only the side that receives unpacks."""
        handle = Handle(category)
        if not self.active or not tensors:
            handle.done = True
            return handle
        tensors = list(tensors)
        is_reduce = fn is dist.reduce
        receives = self.rank == root if is_reduce else self.rank != root
        root_kw = {"dst": self.global_rank(root)} if is_reduce else {"src": self.global_rank(root)}
        kind = "reduce" if is_reduce else "broadcast"
        for bucket, alone in self._buckets(tensors, [t.numel() for t in tensors], cap_bytes, kind):
            members = [tensors[i] for i in bucket]
            own = in_place(alone, members)
            flat = _flat(members, own)
            self._launch(handle, fn, flat, **root_kw)
            if receives:
                handle.finish.append(self._unpacker(flat, members, False, scale=is_reduce, own=own))
        if not async_op:
            self.wait(handle)
        return handle

    def reduce_scatter_mean(
        self,
        shards: Sequence[Sequence[torch.Tensor]],
        category: str,
        *,
        cap_bytes: int | None = None,
        async_op: bool = False,
        overlapped: bool = False,
    ) -> Handle:
        """Average owner-contiguous tensors onto their owners: one reduce-scatter per round.

        ``shards[r]`` are the tensors group rank ``r`` owns (one dtype), the same
        list on every rank. Each round (:func:`~dpkfac.plan.fusion.shard_rounds`)
        hands every rank's next run, flattened, to one ``reduce_scatter`` of
        shards of different sizes (no padding: each owner's shard is as large as
        its tensors), which leaves each owner the average of its own; other
        ranks' copies are left as they are. On gloo the round goes by alltoallv
        (:func:`~dpkfac.plan.hardware.sharded_by_alltoall`): each rank sends every
        owner its part and the owner sums the ``P`` parts it receives. Every work
        completes a future (a DDP communication hook returns them). ``overlapped``:
        as in :meth:`allreduce_mean`.
        """
        return self._sharded(
            shards, category, cap_bytes, async_op, gather=False, overlapped=overlapped
        )

    def all_gather(
        self,
        shards: Sequence[Sequence[torch.Tensor]],
        category: str,
        *,
        cap_bytes: int | None = None,
        async_op: bool = False,
    ) -> Handle:
        """Every rank's own tensors to every rank: one all-gather of uneven shards per round.

        ``shards[r]`` are the tensors group rank ``r`` sends (filled on ``r``) and
        every other rank receives into (same shapes, one dtype), in the rounds of
        :meth:`reduce_scatter_mean`; on gloo each round is alltoallv, every rank
        sending its shard to every rank.
        """
        return self._sharded(shards, category, cap_bytes, async_op, gather=True)

    def _sharded(
        self,
        shards: Sequence[Sequence[torch.Tensor]],
        category: str,
        cap_bytes: int | None,
        async_op: bool,
        *,
        gather: bool,
        overlapped: bool = False,
    ) -> Handle:
        handle = Handle(category, overlapped=overlapped)
        if not self.active or not any(shards):
            handle.done = True
            return handle
        if len(shards) != self.size:
            raise ValueError(f"{len(shards)} shards for a group of {self.size} ranks")
        dtypes = {t.dtype for ts in shards for t in ts}
        if len(dtypes) != 1:
            raise ValueError(f"one dtype per sharded collective, got {sorted(map(str, dtypes))}")
        like = next(t for ts in shards for t in ts)
        sizes = [[t.numel() * t.element_size() for t in ts] for ts in shards]
        kind = "all_gather" if gather else "reduce_scatter"
        alltoall = sharded_by_alltoall(self.backend)
        for round_ in shard_rounds(sizes, cap_bytes):
            parts = [[shards[r][i] for i in idx] for r, idx in enumerate(round_)]
            numels = [sum(t.numel() for t in ts) for ts in parts]
            nbytes = sum(numels) * like.element_size()
            self.record(category, kind, nbytes)
            self._isolated(handle)
            if alltoall:
                works, finish = self._alltoall(parts, numels, like, category, gather=gather)
            else:
                flats = [
                    torch.cat([t.reshape(-1) for t in ts]) if ts else like.new_empty(0)
                    for ts in parts
                ]
                for flat in flats:
                    check_device(flat, self.device, category)
                if gather:  # the others' flats are receive buffers
                    work = dist.all_gather(flats, flats[self.rank], group=self.group, async_op=True)
                    finish = self._spread(flats, parts, skip=self.rank)
                else:
                    out = torch.empty_like(flats[self.rank])
                    work = dist.reduce_scatter(out, flats, group=self.group, async_op=True)
                    out_list = [out if r == self.rank else f for r, f in enumerate(flats)]
                    finish = self._spread(out_list, parts, only=self.rank, scale=True)
                works = [work]
            handle.finish.append(finish)
            handle.works.extend(works)
            # A round on the timeline: launched with its first call, ended with its last.
            self._traced(category, "all_to_all" if alltoall else kind, nbytes, works[-1])
        if not async_op:
            self.wait(handle)
        return handle

    def _alltoall(
        self,
        parts: list[list[torch.Tensor]],
        numels: list[int],
        like: torch.Tensor,
        category: str,
        *,
        gather: bool,
    ) -> tuple[list[Any], Callable[[], None]]:
        """One round of a sharded collective as alltoallv (``all_to_all_single`` with split
        sizes): its works, and what unpacks its result once they completed.

        A reduce-scatter sends rank ``r`` this rank's copy of ``parts[r]`` and receives
        ``P`` buffers of its own shard's size, one from each rank, which it sums and
        averages; an all-gather sends its own shard to every rank and receives every
        rank's. The round is cut into :func:`message_calls` calls,
        each carrying the next piece of every shard and launched together, so that both
        directions of a link carry data at once (gloo sends one large message per
        direction in turn). What it sends is packed in one copy, call after call.
        """
        size, me = self.size, self.rank
        calls = message_calls(self.backend, max(numels) * like.element_size())
        cuts = [_cuts(n, calls) for n in numels]
        # Per call c: what each peer gets (sent) and what arrives from each (received).
        sent = [parts[me]] * size if gather else parts
        sent_cuts = [cuts[me]] * size if gather else cuts
        views = [
            v
            for c in range(calls)
            for r in range(size)
            for v in _views(sent[r], sent_cuts[r][c], sent_cuts[r][c + 1])
        ]
        send = torch.cat(views) if views else like.new_empty(0)
        recv = like.new_empty(sum(numels) if gather else size * numels[me])
        check_device(send, self.device, category)
        works, received = [], []
        send_at = recv_at = 0
        for c in range(calls):
            piece = _sizes(cuts, c)
            send_splits = [piece[me]] * size if gather else piece
            recv_splits = piece if gather else [piece[me]] * size
            send_c = send[send_at : send_at + sum(send_splits)]
            recv_c = recv[recv_at : recv_at + sum(recv_splits)]
            send_at += send_c.numel()
            recv_at += recv_c.numel()
            works.append(
                dist.all_to_all_single(
                    recv_c,
                    send_c,
                    output_split_sizes=recv_splits,
                    input_split_sizes=send_splits,
                    group=self.group,
                    async_op=True,
                )
            )
            received.append(recv_c)
        if gather:
            # Rank r's shard arrives in pieces, call after call.
            pieces = [
                [got.split(_sizes(cuts, c))[r] for c, got in enumerate(received)]
                for r in range(size)
            ]
            return works, self._spread(pieces, parts, skip=me)

        def reduce() -> None:  # once the works completed: the P received parts, summed
            total = like.new_empty(numels[me])
            for c, got in enumerate(received):
                lo, hi = cuts[me][c], cuts[me][c + 1]
                torch.sum(got.view(size, hi - lo), 0, out=total[lo:hi])
            self._spread([total] * size, parts, only=me, scale=True)()

        return works, reduce

    def _spread(
        self,
        flats: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        parts: list[list[torch.Tensor]],
        *,
        skip: int | None = None,
        only: int | None = None,
        scale: bool = False,
    ) -> Callable[[], None]:
        """Copy received flat shards (each one tensor, or its consecutive pieces) back into
        their tensors (averaged with ``scale``)."""
        size = self.size

        def finish() -> None:
            for r, (flat, ts) in enumerate(zip(flats, parts, strict=True)):
                if r == skip or (only is not None and r != only):
                    continue
                pieces = [flat] if isinstance(flat, torch.Tensor) else list(flat)
                if scale:
                    for piece in pieces:
                        piece.div_(size)
                _fill(ts, pieces)

        return finish

    def gather_objects(self, obj: T, dst: int = 0) -> list[T] | None:
        """Pickle-gather ``obj`` from every rank onto group rank ``dst`` (checkpoints only).

        Returns:
            The per-rank objects on ``dst``; None elsewhere.
        """
        if not self.active:
            return [obj]
        self._check_object_device()
        # Filled with every rank's ``obj`` (each rank sends one of the same kind).
        out: list[Any] | None = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.global_rank(dst), group=self.group)
        return out

    def _check_object_device(self) -> None:
        """Object collectives over NCCL send through the current CUDA device: it must be ours."""
        if self.device.type != "cuda" or dist.get_backend(self.group) != "nccl":
            return
        current = torch.cuda.current_device()
        if self.device.index is not None and current != self.device.index:
            raise DeviceMismatch(
                f"dpkfac: the current CUDA device is cuda:{current} but this rank runs on "
                f"{self.device}: call torch.cuda.set_device({self.device.index}) before "
                "init_process_group (NCCL's object collectives send through the current device)"
            )

    def agree_max(self, values: Sequence[float], category: str = "setup") -> list[float]:
        """Element-wise maximum of host values across ranks (start-up agreement only).

        The values are sent from a tensor made on the run's device and read
        back through the host reader (one read; a dry run's reader returns
        this rank's own values). On one rank nothing is sent or read.
        """
        values = [float(v) for v in values]
        if not self.active or not values:
            return values
        work = torch.tensor(values, dtype=torch.float64, device=self.device)
        handle = Handle(category)
        self._launch(handle, dist.all_reduce, work, op=dist.ReduceOp.MAX)
        self.wait(handle)
        return [float(v) for v in self.host.read(work, values)]

    def allreduce_sum(self, tensor: torch.Tensor, category: str) -> None:
        """Sum one tensor across ranks in place, blocking (start-up link measurements)."""
        if not self.active:
            return
        handle = Handle(category)
        self._launch(handle, dist.all_reduce, tensor)
        self.wait(handle)
