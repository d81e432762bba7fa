"""Many ranks in one process: a thread per rank over an in-process process group.

``python -m experiments.train launcher=threads launcher.world_size=64`` runs the
training loop of 64 ranks as 64 threads of one process. Each thread joins a
process group of this module's backend (``threads``) through the ordinary
``torch.distributed.init_process_group``, so the training loop, the
preconditioner and every strategy run exactly the code they run under
torchrun: nothing in them knows the ranks are threads.

Three things make that hold.

* **A world per thread.** torch.distributed keeps its groups in one module
  global (``distributed_c10d._world``) and its C++ group registry per process;
  while threads are running, both are made thread-local, so each rank sees only
  its own default group and subgroups, as a process would. The private torch
  internals this takes live in :mod:`experiments.c10d_seam`, which checks them
  and names what moved when a torch upgrade changes them.
* **A group of our own** (:class:`ThreadGroup`). torch ships an in-process
  group for its own tests (``torch.testing._internal.distributed.multi_threaded_pg``);
  it has no rooted reduce, cannot all-gather shards of different sizes, has no
  timeout and hangs forever when a rank fails. This one has the collectives the
  strategies and the training loop use: all-reduce, broadcast, reduce,
  all-gather and reduce-scatter (also of uneven shards, done as ProcessGroupNCCL
  does them: one coalesced group of broadcasts, or of reduces, one per root),
  all-gather into a tensor, reduce-scatter of a tensor, gather, scatter and
  barrier, with the object collectives built on them. Every collective meets
  its group's other members in a shared :class:`ThreadWorld`; the last rank to
  arrive moves the data. Sums are taken in rank order.
* **One rank at a time** (the *turn*). Python's ``random``, numpy's and torch's
  global generators are per process: ``torch.manual_seed`` in one thread
  reseeds every other's. Under torchrun each rank owns them; here a rank runs
  only while it holds the world's turn, and the turn carries that rank's
  generator states in and out. A rank hands the turn on when it waits for
  others in a collective and takes it back before it continues. So every seed
  and every draw (model initialisation, dropout, per-sample augmentation, the
  RNG states a checkpoint saves) is the one that rank makes under torchrun,
  with no lock in the training code. The price: ranks compute one after
  another, never side by side (each may still use torch's intra-op threads).

A hang fails fast: when every running rank waits in a collective that cannot
complete, the world reports a deadlock at once, naming each rank and what it
waits for; a collective that sees no rank make progress for its group's
timeout fails naming the ranks it waits for. When one rank raises, every
other rank's pending and later collectives raise too, so the run ends with the
first rank's error.

Tests use :func:`run_threads`, the in-process twin of ``tests/dist_utils.run_ranks``:
``run_threads(fn, world_size, *args)`` returns ``fn(rank, world_size, *args)``
of every rank, each run in a joined ``threads`` group. A harness of its own
can make a :class:`ThreadWorld`, start a thread per rank and call
:func:`init_thread_group` in each.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from experiments import c10d_seam

T = TypeVar("T")

#: The backend name groups of this module register under (``dist.get_backend`` returns it).
BACKEND = "threads"

_RedOpType = dist.ReduceOp.RedOpType


class ThreadGroupError(RuntimeError):
    """A collective of a threaded group failed: mismatched calls, a timeout or a deadlock."""


class ThreadGroupAborted(ThreadGroupError):
    """The world was aborted (another rank failed, or a hang was detected) while waiting."""


# --------------------------------------------------------------------------- data movement

_ELEMENTWISE: dict[Any, Callable[[list[torch.Tensor], list[torch.Tensor]], None]] = {
    dist.ReduceOp.SUM: torch._foreach_add_,
    dist.ReduceOp.AVG: torch._foreach_add_,
    dist.ReduceOp.PRODUCT: torch._foreach_mul_,
    dist.ReduceOp.MIN: torch._foreach_minimum_,
    dist.ReduceOp.MAX: torch._foreach_maximum_,
}
_BITWISE = {
    dist.ReduceOp.BAND: torch.Tensor.bitwise_and_,
    dist.ReduceOp.BOR: torch.Tensor.bitwise_or_,
    dist.ReduceOp.BXOR: torch.Tensor.bitwise_xor_,
}


def _mismatch(what: str, src: torch.Tensor, dst: torch.Tensor) -> ThreadGroupError:
    return ThreadGroupError(
        f"{what}: {src.numel()} {src.dtype} elements into a buffer of {dst.numel()} {dst.dtype}"
    )


def _reduce_many(
    op: _RedOpType, parts: Sequence[Sequence[torch.Tensor]], what: Callable[[int], str]
) -> list[torch.Tensor]:
    """The reductions over ranks of ``parts[r][k]`` (rank r's k-th tensor), one per k.

    Accumulated in rank order, left to right, whichever thread arrived last,
    so a run's sums are the same every time. One foreach call per rank: a
    collective of P ranks costs P calls, not P x tensors.
    """
    if op not in _ELEMENTWISE and op not in _BITWISE:
        raise ThreadGroupError(f"reduce op {op.name} is not supported by the threads backend")
    accs = [t.detach().clone() for t in parts[0]]
    for rank in range(1, len(parts)):
        mine = parts[rank]
        if len(mine) != len(accs):
            raise ThreadGroupError(
                f"{what(0)}: rank {rank} reduces {len(mine)} tensors, rank 0 {len(accs)}"
            )
        terms = []
        for k, (acc, t) in enumerate(zip(accs, mine, strict=True)):
            if t.numel() != acc.numel() or t.dtype != acc.dtype:
                raise _mismatch(f"{what(k)}, from group rank {rank}", t, acc)
            terms.append(t.detach() if t.shape == acc.shape else t.detach().reshape(acc.shape))
        if op in _ELEMENTWISE:
            _ELEMENTWISE[op](accs, terms)
        else:
            for acc, t in zip(accs, terms, strict=True):
                _BITWISE[op](acc, t)
    if op == dist.ReduceOp.AVG:
        torch._foreach_div_(accs, float(len(parts)))
    return accs


def _copy_many(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], what: Callable[[int], str]
) -> None:
    """``dsts[i][:] = srcs[i]`` for every i, in one foreach call.

    Sizes and dtypes must agree element for element (NCCL would read or write
    past a shorter buffer; here it is an error naming ``what(i)``). Outputs
    are written through ``.detach()``: collectives change them behind
    autograd's back, as NCCL does. A tensor copied onto itself is skipped.
    """
    outs, ins = [], []
    for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise _mismatch(what(i), src, dst)
        if dst.shape != src.shape:
            src = src.reshape(dst.shape)
        elif dst.data_ptr() == src.data_ptr():
            continue
        outs.append(dst.detach())
        ins.append(src.detach())
    if outs:
        torch._foreach_copy_(outs, ins)


# --------------------------------------------------------------------------- one call


@dataclass
class _Call:
    """What one rank brings to a collective: its kind, root, reduce op and buffers."""

    kind: str
    root: int | None = None
    op: _RedOpType | None = None
    data: Any = None

    def signature(self) -> str:
        parts = [self.kind]
        if self.root is not None:
            parts.append(f"root {self.root}")
        if self.op is not None:
            parts.append(f"op {self.op.name}")
        return ", ".join(parts)


@dataclass
class _Coalesced:
    """A group of rooted operations, as one rank sees it (ProcessGroupNCCL's coalescing).

    The k-th operation is a broadcast (or reduce) rooted at group rank
    ``roots[k]``: ``sends[k]`` is what this rank contributes (read on the root
    only, for a broadcast), ``recvs[k]`` where the result lands (on every other
    rank for a broadcast, on the root only for a reduce). On the root they
    may differ: out of place, as NCCL's ``_broadcast_oop`` and ``_reduce_oop``.
    """

    kind: str  # "broadcast" or "reduce"
    roots: list[int]
    sends: list[torch.Tensor]
    recvs: list[torch.Tensor]


def _run_coalesced(groups: Sequence[_Coalesced], op: _RedOpType | None, name: str) -> None:
    """Execute one coalesced group given every rank's view of it (index = group rank)."""
    first = groups[0]
    for rank, mine in enumerate(groups):
        if mine.kind != first.kind or mine.roots != first.roots:
            raise ThreadGroupError(
                f"{name}: group ranks 0 and {rank} coalesce different operations "
                f"({first.kind}s rooted at {first.roots} and {mine.kind}s rooted at {mine.roots})"
            )
    roots = first.roots
    if first.kind == "broadcast":
        pairs = [(k, rank) for k, root in enumerate(roots) for rank in range(len(groups))]
        _copy_many(
            [groups[rank].recvs[k] for k, rank in pairs],
            [groups[roots[k]].sends[k] for k, _ in pairs],
            lambda i: (
                f"{name}: broadcast {pairs[i][0]} from group rank "
                f"{roots[pairs[i][0]]} to {pairs[i][1]}"
            ),
        )
    else:
        totals = _reduce_many(
            op if op is not None else dist.ReduceOp.SUM,
            [mine.sends for mine in groups],
            lambda k: f"{name}: reduce {k} onto group rank {roots[k]}",
        )
        _copy_many(
            [groups[root].recvs[k] for k, root in enumerate(roots)],
            totals,
            lambda k: f"{name}: reduce {k} onto group rank {roots[k]}",
        )


@torch.no_grad()
def _execute(calls: Sequence[_Call], name: str) -> None:
    """Move the data of one collective; ``calls[r]`` is group rank r's call."""
    first = calls[0]
    kind, root, op = first.kind, first.root, first.op
    n = len(calls)
    if kind == "barrier":
        return
    if kind in ("allreduce", "reduce"):
        assert op is not None
        totals = _reduce_many(op, [c.data for c in calls], lambda k: f"{name}: {kind} {k}")
        targets = calls if kind == "allreduce" else [calls[root]]  # type: ignore[index]
        _copy_many(
            [t for c in targets for t in c.data],
            [total for _ in targets for total in totals],
            lambda i: f"{name}: {kind} result {i % len(totals)}",
        )
    elif kind == "broadcast":
        assert root is not None
        others = [c for r, c in enumerate(calls) if r != root]
        _copy_many(
            [t for c in others for t in c.data],
            [t for _ in others for t in calls[root].data],
            lambda i: f"{name}: broadcast from group rank {root}",
        )
    elif kind == "coalesced":
        _run_coalesced([c.data for c in calls], op, name)
    elif kind == "allgather_base":  # equal chunks of one output tensor per rank
        dsts, srcs = [], []
        for dst_call in calls:
            out, mine = dst_call.data
            if out.numel() != n * mine.numel() or not out.is_contiguous():
                raise ThreadGroupError(
                    f"{name}: all_gather_into_tensor needs a contiguous output of {n} x "
                    f"{mine.numel()} elements, got {out.numel()}"
                )
            chunks = out.view(n, -1).unbind(0)
            dsts += chunks
            srcs += [c.data[1] for c in calls]
        _copy_many(dsts, srcs, lambda i: f"{name}: all_gather_into_tensor from {i % n}")
    elif kind == "reduce_scatter_base":
        assert op is not None
        for c in calls:
            if c.data[1].numel() != n * c.data[0].numel():
                raise ThreadGroupError(
                    f"{name}: reduce_scatter_tensor of {c.data[1].numel()} elements into "
                    f"{n} x {c.data[0].numel()}"
                )
        parts = [list(c.data[1].reshape(n, -1).unbind(0)) for c in calls]
        totals = _reduce_many(op, parts, lambda k: f"{name}: reduce_scatter_tensor {k}")
        _copy_many([c.data[0] for c in calls], totals, lambda k: f"{name}: to {k}")
    elif kind == "gather":
        assert root is not None
        outs = calls[root].data[0]
        if len(outs) != n:
            raise ThreadGroupError(
                f"{name}: gather onto group rank {root} into {len(outs)} buffers"
            )
        _copy_many(outs, [c.data[1] for c in calls], lambda i: f"{name}: gather from {i}")
    elif kind == "scatter":
        assert root is not None
        ins = calls[root].data[1]
        if len(ins) != n:
            raise ThreadGroupError(f"{name}: scatter from group rank {root} of {len(ins)} tensors")
        _copy_many([c.data[0] for c in calls], ins, lambda i: f"{name}: scatter to {i}")
    else:  # pragma: no cover - every kind ThreadGroup issues is handled above
        raise ThreadGroupError(f"{name}: unknown collective {kind}")


# --------------------------------------------------------------------------- the world


@dataclass
class _Slot:
    """The meeting point of one collective call: the n-th call of every member on one group."""

    group: str
    seq: int
    members: tuple[int, ...]  # global ranks, by group rank
    timeout_s: float
    calls: dict[int, _Call] = field(default_factory=dict)  # group rank -> call
    done: bool = False
    error: str | None = None
    left: int = 0
    started: float = field(default_factory=time.monotonic)

    def describe(self) -> str:
        kind = next(iter(self.calls.values())).signature() if self.calls else "collective"
        missing = [g for r, g in enumerate(self.members) if r not in self.calls]
        return (
            f"{kind} #{self.seq} on group {self.group!r} (ranks {list(self.members)}), "
            f"waiting for rank(s) {missing}"
        )


def _capture_rng() -> tuple[Any, Any, torch.Tensor]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _restore_rng(state: tuple[Any, Any, torch.Tensor]) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


class ThreadWorld:
    """What the ranks of one in-process run share.

    Holds the meeting points of collectives, the turn and the run's failure
    state. One world per run: groups of different worlds never meet.

    The turn is handed on directly: ranks ready to run wait in a queue, each
    on a condition of its own, and only the rank given the turn is woken.
    (Waking every member of a completed collective would make 255 threads
    contend for the GIL and the lock only to go back to sleep: measured at
    P=256, that took seconds per step.) A collective's members join the queue
    in group-rank order when it completes, so the order in which ranks run is
    the same in every run.

    Args:
        world_size: Number of ranks.
        timeout_s: The default group's timeout: a collective fails when no
            rank of the world has made progress for this long (rank threads
            take turns, so a long wait as such is no sign of a hang: with 256
            ranks computing one after another, the first to arrive at a
            collective waits for 255 others' work).

    Raises:
        ValueError: ``world_size`` below 1 or a timeout that is not positive.
    """

    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        #: The store init_process_group gets (each group gets a prefix of it).
        self.store = dist.HashStore()
        self._lock = threading.Lock()
        self._wake = [threading.Condition(self._lock) for _ in range(world_size)]
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._holder: int | None = None
        # Every rank starts ready, in rank order; its thread may start later.
        self._ready: collections.deque[int] = collections.deque(range(world_size))
        self._loaded: int | None = None
        initial = _capture_rng()
        self._rng = {rank: initial for rank in range(world_size)}
        self._live = set(range(world_size))
        self._blocked: dict[int, _Slot] = {}
        self._progress = time.monotonic()
        #: Why the world was aborted (None while it runs).
        self.aborted: str | None = None
        self._watchdog: threading.Thread | None = None

    # -- the turn ------------------------------------------------------------------

    def take_turn(self, rank: int) -> None:
        """Block until ``rank`` holds its first turn, its generator states loaded.

        Raises:
            ThreadGroupAborted: The world was aborted while waiting.
        """
        with self._lock:
            if self._holder is None and self._ready and self.aborted is None:
                self._pass_locked()
            self._await_turn_locked(rank)

    def _await_turn_locked(self, rank: int) -> None:
        while self._holder != rank and self.aborted is None:
            self._wake[rank].wait()
        if self._holder != rank:
            raise ThreadGroupAborted(f"rank {rank}: {self.aborted}")

    def _pass_locked(self) -> None:
        """Give the turn to the next ready rank (none: nobody runs), loading its states."""
        self._holder = None
        self._progress = time.monotonic()
        if not self._ready:
            self._check_deadlock_locked()
            return
        rank = self._ready.popleft()
        self._holder = rank
        if self._loaded != rank:
            # The previous holder is blocked or gone: its generators stop here.
            if self._loaded is not None:
                self._rng[self._loaded] = _capture_rng()
            _restore_rng(self._rng[rank])
            self._loaded = rank
        self._wake[rank].notify()

    def leave(self, rank: int) -> None:
        """``rank``'s thread ends: stop counting it as running and hand the turn on."""
        with self._lock:
            self._live.discard(rank)
            self._blocked.pop(rank, None)
            if rank in self._ready:
                self._ready.remove(rank)
            if self._holder == rank:
                self._pass_locked()
            else:
                self._check_deadlock_locked()

    # -- failure -------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Fail every pending and later collective of this world with ``reason``."""
        with self._lock:
            self._abort_locked(reason)

    def _abort_locked(self, reason: str) -> None:
        if self.aborted is None:
            self.aborted = reason
        for wake in self._wake:
            wake.notify_all()

    def _check_deadlock_locked(self) -> None:
        """Abort when nobody runs or is ready while ranks still wait in collectives.

        Every running rank is then waiting in a collective that needs a rank
        which is waiting in another one (or has ended): none can complete.
        """
        if self.aborted is None and self._holder is None and not self._ready and self._live:
            waits = "; ".join(
                f"rank {rank} waits in {self._blocked[rank].describe()}"
                for rank in sorted(self._live & set(self._blocked))
            )
            finished = sorted(set(range(self.world_size)) - self._live)
            ended = f"; rank(s) {finished} have ended" if finished else ""
            self._abort_locked(f"deadlock: {waits}{ended}")

    def _watch(self) -> None:
        """Abort a world in which nobody has made progress for a waiting group's timeout."""
        while True:
            time.sleep(0.5)
            with self._lock:
                if self.aborted is not None or not self._live:
                    return
                now = time.monotonic()
                for rank, slot in sorted(self._blocked.items()):
                    idle = now - max(slot.started, self._progress)
                    if idle > slot.timeout_s:
                        holder = (
                            f"rank {self._holder} holds the turn"
                            if self._holder is not None
                            else "no rank holds the turn"
                        )
                        self._abort_locked(
                            f"timeout: rank {rank} waited {idle:.0f} s (group timeout "
                            f"{slot.timeout_s:g} s) with no rank making progress, in "
                            f"{slot.describe()}; {holder}"
                        )
                        return

    def start_watchdog(self) -> None:
        """Start the thread that turns a silent hang into a timeout error (once)."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="threads-watchdog", daemon=True
            )
            self._watchdog.start()

    # -- collectives ---------------------------------------------------------------

    def join(
        self,
        group: str,
        seq: int,
        members: tuple[int, ...],
        group_rank: int,
        call: _Call,
        timeout_s: float,
    ) -> None:
        """Bring ``call`` to the ``seq``-th collective of ``group``; return once it is done.

        The caller holds the turn. The last member to arrive checks that every
        member made the same call, moves the data, queues the others and
        carries on; the others hand the turn on while they wait.

        Raises:
            ThreadGroupError: The members' calls disagree (kind, root, op or
                members), or the caller does not hold the turn.
            ThreadGroupAborted: The world was aborted while or before waiting.
        """
        rank = members[group_rank]
        with self._lock:
            if self.aborted is not None:
                raise ThreadGroupAborted(f"rank {rank}: {call.kind} not started: {self.aborted}")
            if self._holder != rank:
                raise ThreadGroupError(
                    f"rank {rank} made a collective call without holding the turn: rank "
                    "threads must be started by run_threads or launch"
                )
            key = (group, seq)
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(group, seq, members, timeout_s)
            if slot.members != members:
                slot.error = (
                    f"ranks disagree on the members of group {group!r}: {list(slot.members)} "
                    f"and {list(members)}"
                )
            slot.calls[group_rank] = call
            if len(slot.calls) == len(members):
                self._complete_locked(slot, rank)
            else:
                self._blocked[rank] = slot
                self._pass_locked()
                try:
                    self._await_turn_locked(rank)
                except ThreadGroupAborted:
                    self._blocked.pop(rank, None)
                    raise ThreadGroupAborted(
                        f"rank {rank}: {call.signature()} #{seq} on group {group!r} "
                        f"abandoned: {self.aborted}"
                    ) from None
            slot.left += 1
            if slot.left == len(members):
                del self._slots[key]
            if slot.error is not None:
                raise ThreadGroupError(f"rank {rank}: {slot.error}")

    def _complete_locked(self, slot: _Slot, last: int) -> None:
        calls = [slot.calls[r] for r in range(len(slot.members))]
        signatures = {c.signature() for c in calls}
        name = f"group {slot.group!r} call #{slot.seq}"
        if slot.error is None and len(signatures) > 1:
            made = "; ".join(
                f"rank {g}: {c.signature()}" for g, c in zip(slot.members, calls, strict=True)
            )
            slot.error = f"{name}: the ranks made different collective calls ({made})"
        if slot.error is None:
            try:
                _execute(calls, name)
            except ThreadGroupError as err:
                slot.error = str(err)
        slot.done = True
        for member in slot.members:
            if member != last:
                self._blocked.pop(member, None)
                self._ready.append(member)
        self._progress = time.monotonic()


# --------------------------------------------------------------------------- the group


def _done(result: Any) -> dist.Work:
    """A completed work (collectives here are synchronous) whose future holds ``result``."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return c10d_seam.work_from_future(future)


class ThreadGroup(dist.ProcessGroup):
    """A process group whose members are threads of this process (backend ``threads``).

    Made by ``dist.init_process_group("threads", ...)`` and ``dist.new_group``
    in a rank thread of a :class:`ThreadWorld` (see :func:`init_thread_group`),
    never directly. Collectives are synchronous: a call returns once every
    member has made it, with a completed work (its future holds the outputs,
    as DDP's communication hooks expect). A work's ``wait`` takes no finite
    timeout (torch's future-wrapping works refuse one); the world's watchdog
    bounds every wait instead.
    """

    def __init__(
        self,
        world: ThreadWorld,
        rank: int,
        size: int,
        name: str,
        members: tuple[int, ...],
        timeout_s: float,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs list only (store, rank, size)
        self._world = world
        self._rank = rank
        self._size = size
        self._name = name
        self._members = members
        self._timeout_s = timeout_s
        self._seq = 0

    def __repr__(self) -> str:
        members = list(self._members)
        return f"ThreadGroup({self._name!r}, rank {self._rank} of {self._size}, ranks {members})"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return BACKEND

    def _meet(self, call: _Call) -> None:
        seq = self._seq
        self._seq += 1
        self._world.join(self._name, seq, self._members, self._rank, call, self._timeout_s)

    # Signatures follow what torch.distributed's front end calls (``opts`` are its option
    # structs); torch's stubs list the C++ overloads instead, hence the ignores.

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = opts.reduceOp.op if opts is not None else dist.ReduceOp.SUM
        self._meet(_Call("allreduce", op=op, data=list(tensors)))
        return _done(list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:  # type: ignore[override]
        self._meet(_Call("broadcast", root=int(opts.rootRank), data=list(tensors)))
        return _done(list(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:  # type: ignore[override]
        """Rooted reduce: the root gets the result; other ranks' tensors are left as they
        are (NCCL's semantics; gloo may use them as scratch)."""
        op = opts.reduceOp.op
        self._meet(_Call("reduce", root=int(opts.rootRank), op=op, data=list(tensors)))
        return _done(list(tensors))

    def barrier(self, opts: Any = None) -> dist.Work:
        self._meet(_Call("barrier"))
        return _done([])

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Every rank's input into every rank's list of outputs, in rank order.

        Shards may differ in size between ranks (``outputs[0][r]`` as large as
        rank r's input). As in ProcessGroupNCCL, that is one coalesced group of
        broadcasts, one rooted at each rank, out of place on the root; shards of
        one size are the same group (NCCL would run one all-gather kernel; the
        data moved is the same).
        """
        roots: list[int] = []
        sends: list[torch.Tensor] = []
        recvs: list[torch.Tensor] = []
        for out_list, mine in zip(outputs, inputs, strict=True):
            if len(out_list) != self._size:
                raise ThreadGroupError(
                    f"all_gather on rank {self._members[self._rank]}: {len(out_list)} output "
                    f"tensors for {self._size} ranks"
                )
            for root, out in enumerate(out_list):
                roots.append(root)
                sends.append(mine if root == self._rank else out)
                recvs.append(out)
        ops = _Coalesced("broadcast", roots, sends, recvs)
        self._meet(_Call("coalesced", data=ops))
        return _done(outputs)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """The reduction of every rank's ``inputs[0][r]`` into rank r's output.

        Shards may differ in size between ranks. As in ProcessGroupNCCL: one
        coalesced group of reduces, the r-th rooted at rank r, out of place on
        the root; every input is left as it was.
        """
        op = opts.reduceOp.op if opts is not None else dist.ReduceOp.SUM
        roots: list[int] = []
        sends: list[torch.Tensor] = []
        recvs: list[torch.Tensor] = []
        for out, in_list in zip(outputs, inputs, strict=True):
            if len(in_list) != self._size:
                raise ThreadGroupError(
                    f"reduce_scatter on rank {self._members[self._rank]}: {len(in_list)} input "
                    f"tensors for {self._size} ranks"
                )
            for root, send in enumerate(in_list):
                roots.append(root)
                sends.append(send)
                recvs.append(out if root == self._rank else send)
        ops = _Coalesced("reduce", roots, sends, recvs)
        self._meet(_Call("coalesced", op=op, data=ops))
        return _done(outputs)

    def all_gather_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: Any = None,
    ) -> dist.Work:
        """``all_gather_into_tensor``: rank r's input into the r-th chunk of every output."""
        self._meet(_Call("allgather_base", data=(output, input)))
        return _done([output])

    def reduce_scatter_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        opts: Any = None,
    ) -> dist.Work:
        """``reduce_scatter_tensor``: every rank's r-th chunk reduced into rank r's output."""
        op = opts.reduceOp.op if opts is not None else dist.ReduceOp.SUM
        self._meet(_Call("reduce_scatter_base", op=op, data=(output, input)))
        return _done([output])

    # The names C++ callers and older torch versions use.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        root = int(opts.rootRank)
        outs = outputs[0] if outputs else []
        self._meet(_Call("gather", root=root, data=(outs, inputs[0])))
        return _done(outputs)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> dist.Work:
        root = int(opts.rootRank)
        ins = inputs[0] if inputs else []
        self._meet(_Call("scatter", root=root, data=(outputs[0], ins)))
        return _done(outputs)


# --------------------------------------------------------------------------- c10d plumbing


_install_lock = threading.Lock()
_install_count = 0
_saved_world: Any = None
_current = threading.local()


@contextlib.contextmanager
def _thread_local_c10d() -> Iterator[None]:
    """Make torch.distributed's group state thread-local while rank threads run.

    Nested and concurrent uses share one installation; the process's own
    state comes back when the last one ends.
    """
    global _install_count, _saved_world
    with _install_lock:
        if _install_count == 0:
            c10d_seam.check()
            _saved_world = c10d_seam.swap_world(c10d_seam.ThreadLocalWorld())
            c10d_seam.set_thread_isolation(True)
        _install_count += 1
    try:
        yield
    finally:
        with _install_lock:
            _install_count -= 1
            if _install_count == 0:
                c10d_seam.set_thread_isolation(False)
                c10d_seam.swap_world(_saved_world)
                _saved_world = None


def _create_group(options: Any, backend_options: Any = None) -> ThreadGroup:
    """The ``threads`` backend's constructor (torch.distributed calls it in the rank thread)."""
    world: ThreadWorld | None = getattr(_current, "world", None)
    if world is None:
        raise RuntimeError(
            "the threads backend makes groups only in rank threads of a ThreadWorld: "
            "use experiments.threads.run_threads or init_thread_group"
        )
    members = tuple(int(r) for r in options.global_ranks_in_group) or tuple(
        range(options.group_size)
    )
    timeout_s = options.timeout.total_seconds()
    return ThreadGroup(
        world, options.group_rank, options.group_size, str(options.group_id), members, timeout_s
    )


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu"])


def init_thread_group(world: ThreadWorld, rank: int, timeout_s: float | None = None) -> None:
    """Join ``world``'s default process group as ``rank``, from that rank's own thread.

    After it, ``torch.distributed`` works in this thread as in a process of a
    ``world.world_size``-rank job: ``get_rank()`` is ``rank``, and collectives,
    ``new_group`` and object collectives meet the other rank threads.
    :func:`run_threads` calls it; a harness of its own must also run inside
    the module's thread-local c10d state and take the turn (see ``_rank_main``).

    Args:
        world: The run's shared state.
        rank: This thread's rank.
        timeout_s: The default group's timeout (None: the world's).

    Raises:
        ValueError: ``rank`` outside ``[0, world.world_size)``.
    """
    if not 0 <= rank < world.world_size:
        raise ValueError(f"rank {rank} is outside a world of {world.world_size} ranks")
    _current.world, _current.rank = world, rank
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else world.timeout_s)
    dist.init_process_group(
        BACKEND, store=world.store, rank=rank, world_size=world.world_size, timeout=timeout
    )


def current_rank() -> int | None:
    """The rank of the calling rank thread (None outside rank threads)."""
    return getattr(_current, "rank", None)


# --------------------------------------------------------------------------- launching


@dataclass
class _Outcome:
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    #: Ranks in the order they failed; the first is the cause, later ones mostly its echo.
    order: list[int] = field(default_factory=list)


class RankFailed(Exception):
    """A rank of an in-process run raised; ``rank`` and ``error`` name the first to fail."""

    def __init__(self, rank: int, error: BaseException, others: dict[int, BaseException]) -> None:
        self.rank = rank
        self.error = error
        self.others = others
        echo = f" (and {len(others)} other rank(s) after it)" if others else ""
        super().__init__(f"rank {rank} failed{echo}: {type(error).__name__}: {error}")


def _rank_main(
    world: ThreadWorld,
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    outcome: _Outcome,
) -> None:
    """One rank thread: take the turn, join the group, run ``fn``, leave, report."""
    _current.world, _current.rank = world, rank
    try:
        world.take_turn(rank)
        init_thread_group(world, rank)
        try:
            outcome.results[rank] = fn(rank, world.world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as err:  # every failure is reported, assertion errors too
        with world._lock:
            outcome.errors[rank] = err
            outcome.order.append(rank)
        if not isinstance(err, ThreadGroupAborted):
            world.abort(f"rank {rank} failed: {type(err).__name__}: {err}")
    finally:
        world.leave(rank)
        _current.world = _current.rank = None


def launch(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` rank threads of a new world.

    Every rank runs in a joined ``threads`` group (:func:`init_thread_group`),
    with its own random generator states (see the module docstring: they start
    as this thread's are now, as forked processes' would), and leaves the
    group when ``fn`` returns. Logging below WARNING is kept from ranks other
    than 0, as the training entry point does under torchrun.

    Args:
        fn: The rank's work.
        world_size: Number of ranks.
        timeout_s: The default group's timeout (see :class:`ThreadWorld`).
        join_timeout_s: Bound on the whole run (None: none): when it passes,
            the world is aborted and the ranks still running are named.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RankFailed: A rank raised; the first rank to fail and its exception.
        TimeoutError: ``join_timeout_s`` passed; names the ranks still running.
        ValueError: ``world_size`` below 1.
    """
    world = ThreadWorld(world_size, timeout_s)
    outcome = _Outcome()
    launcher_rng = _capture_rng()
    with _thread_local_c10d(), _quiet_other_ranks(), _restored(launcher_rng):
        threads = [
            threading.Thread(
                target=_rank_main,
                args=(world, rank, fn, args, outcome),
                name=f"rank-{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        world.start_watchdog()
        for thread in threads:
            thread.start()
        deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
        for thread in threads:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(remaining)
        alive = [rank for rank, t in enumerate(threads) if t.is_alive()]
        if alive:
            world.abort(f"the run did not finish within {join_timeout_s:g} s")
            for thread in threads:
                thread.join(5.0)
            still = [rank for rank, t in enumerate(threads) if t.is_alive()]
            raise TimeoutError(
                f"ranks {alive} did not finish within {join_timeout_s:g} s"
                + (f" (ranks {still} did not stop after the abort)" if still else "")
            )
    if outcome.errors:
        first = outcome.order[0]
        causes = [r for r in outcome.order if not isinstance(outcome.errors[r], ThreadGroupAborted)]
        first = causes[0] if causes else first
        others = {r: e for r, e in outcome.errors.items() if r != first}
        raise RankFailed(first, outcome.errors[first], others) from outcome.errors[first]
    return [outcome.results[rank] for rank in range(world_size)]


def run_threads(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    group_timeout_s: float = 60.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` rank threads (tests' harness).

    The in-process twin of ``tests/dist_utils.run_ranks``: same call, same
    return value, failures reported as one ``AssertionError`` naming every
    failed rank with its traceback. The group's backend is ``threads``, which
    also all-gathers shards of different sizes (gloo cannot).

    Args:
        fn: The rank's work (need not be picklable: nothing leaves the process).
        world_size: Number of ranks.
        timeout: Bound on the whole run, in seconds.
        group_timeout_s: The default group's timeout.
    """
    import traceback

    try:
        return launch(fn, world_size, *args, timeout_s=group_timeout_s, join_timeout_s=timeout)
    except RankFailed as failure:
        errors = {failure.rank: failure.error, **failure.others}
        msg = [
            f"rank {rank} failed:\n{''.join(traceback.format_exception(err))}"
            for rank, err in sorted(errors.items())
        ]
        raise AssertionError(f"{failure}\n" + "\n".join(msg)) from None
    except TimeoutError as err:
        raise AssertionError(str(err)) from None


@contextlib.contextmanager
def _restored(state: tuple[Any, Any, torch.Tensor]) -> Iterator[None]:
    """Put the launching thread's generator states back when the ranks are done
    (a forked rank would not have moved its parent's either)."""
    try:
        yield
    finally:
        _restore_rng(state)


class _OtherRanks(logging.Filter):
    """Pass records of rank 0 (and of non-rank threads); of other ranks, warnings and worse."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        return rank is None or rank == 0 or record.levelno >= logging.WARNING


@contextlib.contextmanager
def _quiet_other_ranks() -> Iterator[None]:
    """Keep ranks other than 0 from logging below WARNING, on every root handler.

    Under torchrun each non-main process lowers its own root logger's level;
    threads share one logger, so the filter tells them apart by thread.
    """
    handlers = list(logging.getLogger().handlers)
    quiet = _OtherRanks()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
