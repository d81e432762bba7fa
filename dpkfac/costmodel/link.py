"""Transfers of several process groups sharing one link: when each completes.

The overlapped mode (:mod:`dpkfac.overlap`) puts its update exchanges on a process
group of their own, beside the gradient buckets' group, so that an exchange is not
queued behind a bucket launched before it. Each group runs its collectives one after
another (one gloo context, or one NCCL communicator's stream), but two groups'
transfers are on the link together: two sets of TCP connections, or two NCCL
communicators' kernels, on the same NIC. Neither waits for the other; they share the
bandwidth. A traced BERT-base step (P=2, paper setting, 1 Gbit/s emulated) shows it:
an update exchange of 1.2 MB launched while the 23 MB embedding bucket was on the wire
completed 7.8 ms later, where alone on the link it needs 4.9 ms and queued behind the
bucket it would have waited 150 ms.

:func:`share` is that link as a fluid model: each group (a *lane*) serves its
transfers in order, and the lanes with a transfer under way split the link equally
(processor sharing, what TCP's and NCCL's per-connection fairness gives on average).
The link is never idle while a transfer is ready, so the last completion is where a
single queue would put it; only the order of completions differs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["busy_periods", "paced_end", "share"]

_EPS = 1e-12


def share(lanes: Sequence[Sequence[tuple[float, float]]]) -> list[list[float]]:
    """Per lane, when each of its transfers completes.

    Args:
        lanes: per lane (a process group), its transfers in launch order as
            ``(ready, seconds)``: when it may start (its launch; it also waits for the
            lane's previous transfer) and how long it takes alone on the link.

    Returns:
        Per lane, per transfer, its completion time, in the same order.
    """
    for lane in lanes:
        for ready, seconds in lane:
            if not (math.isfinite(ready) and math.isfinite(seconds) and seconds >= 0.0):
                raise ValueError(
                    f"a transfer needs a finite start and seconds >= 0, got {(ready, seconds)}"
                )
    done: list[list[float]] = [[] for _ in lanes]
    head = [0] * len(lanes)  # each lane's transfer under way or next
    left = [lane[0][1] if lane else 0.0 for lane in lanes]  # its seconds still to send
    now = 0.0

    def settle() -> None:
        """Complete, at ``now``, every lane head with nothing left to send."""
        for i, lane in enumerate(lanes):
            while head[i] < len(lane) and lane[head[i]][0] <= now and left[i] <= _EPS:
                done[i].append(now)
                head[i] += 1
                left[i] = lane[head[i]][1] if head[i] < len(lane) else 0.0

    while True:
        settle()
        busy = [
            i for i, lane in enumerate(lanes) if head[i] < len(lane) and lane[head[i]][0] <= now
        ]
        waiting = [
            lane[head[i]][0]
            for i, lane in enumerate(lanes)
            if head[i] < len(lane) and lane[head[i]][0] > now
        ]
        if not busy and not waiting:
            return done
        if not busy:
            now = min(waiting)
            continue
        rate = 1.0 / len(busy)
        step = min(left[i] / rate for i in busy)
        if waiting:
            step = min(step, min(waiting) - now)
        now += step
        for i in busy:
            left[i] = max(0.0, left[i] - step * rate)


def busy_periods(
    lanes: Sequence[Sequence[tuple[float, float]]], done: Sequence[Sequence[float]]
) -> list[tuple[float, float]]:
    """When the link carries something: the union, sorted, of every transfer's span.

    A transfer runs from its start (its ``ready``, or its lane's previous completion,
    whichever is later) to its completion in ``done`` (:func:`share`'s answer for
    ``lanes``)."""
    spans = []
    for lane, ends in zip(lanes, done, strict=True):
        previous = -math.inf
        for (ready, _), end in zip(lane, ends, strict=True):
            spans.append((max(ready, previous), end))
            previous = end
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def paced_end(
    start: float, seconds: float, periods: Sequence[tuple[float, float]], pace: float
) -> float:
    """When ``seconds`` of compute started at ``start`` end, run at ``pace`` (of full
    speed) within ``periods`` (sorted, disjoint: :func:`busy_periods`) and at full
    speed outside: on a host whose transfers take turns with the compute on its cores
    (``Hardware.overlap`` below 1), the compute beside a transfer slows down."""
    if seconds <= 0.0 or pace >= 1.0:
        return start + max(seconds, 0.0)
    t, left = start, seconds
    for a, b in periods:
        if b <= t:
            continue
        if a > t:
            if t + left <= a:
                return t + left
            left -= a - t
            t = a
        if pace > 0.0 and left <= (b - t) * pace:
            return t + left / pace
        left -= (b - t) * max(pace, 0.0)
        t = b
    return t + left
