"""Tests for dpkfac.plan.fusion (the alpha-beta model, SPD-KFAC's fusion rule, size caps) and
the fit of the alpha-beta model to measured all-reduces (:func:`dpkfac.probes.fit_comm_model`)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import pytest

from dpkfac.plan.fusion import (
    CommModel,
    bucket_schedule,
    plan_buckets,
    simulate,
    size_cap_buckets,
)
from dpkfac.probes import fit_comm_model


def optimal_buckets(
    ready_times: Sequence[float],
    sizes_bytes: Sequence[int],
    model: CommModel,
) -> list[list[int]]:
    """The exact optimum that :func:`plan_buckets` is compared with: the bucketing with the
    earliest last finish under the timing model.

    A bucket's finish is non-decreasing in the previous bucket's finish, so
    the best plan for the first ``k`` tensors ends with some bucket
    ``[j, k)`` preceded by the best plan for the first ``j`` tensors:
    ``F[k] = min_j max(ready[k-1], F[j]) + time(bytes[j:k])``, ``F[0] = -inf``.
    This dynamic program is exact and costs ``O(n**2)``, cheap for the few
    hundred factors of a network. Ties go to fewer buckets.
    """
    n = len(ready_times)
    prefix = [0]
    for s in sizes_bytes:
        prefix.append(prefix[-1] + s)
    best = [-math.inf] + [math.inf] * n
    count = [0] * (n + 1)
    cut = [0] * (n + 1)
    for k in range(1, n + 1):
        for j in range(k):
            f = max(ready_times[k - 1], best[j]) + model.time(prefix[k] - prefix[j])
            if f < best[k] or (f == best[k] and count[j] + 1 < count[k]):
                best[k], count[k], cut[k] = f, count[j] + 1, j
    buckets: list[list[int]] = []
    k = n
    while k > 0:
        buckets.append(list(range(cut[k], k)))
        k = cut[k]
    return buckets[::-1]


def separate(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def single(n: int) -> list[list[int]]:
    return [list(range(n))] if n else []


def all_partitions(n: int) -> list[list[list[int]]]:
    out = []
    for r in range(n):
        for cuts in itertools.combinations(range(1, n), r):
            bounds = (0, *cuts, n)
            out.append([list(range(a, b)) for a, b in itertools.pairwise(bounds)])
    return out


def assert_partition(buckets: list[list[int]], n: int) -> None:
    assert all(buckets), "no empty bucket"
    assert [i for b in buckets for i in b] == list(range(n))


def random_case(rng: random.Random) -> tuple[list[float], list[int], CommModel]:
    n = rng.randint(1, 9)
    gaps = [rng.choice([0.0, rng.random(), 5 * rng.random()]) for _ in range(n)]
    ready = list(itertools.accumulate(gaps))
    sizes = [rng.choice([0, rng.randint(1, 100), rng.randint(1, 10_000)]) for _ in range(n)]
    model = CommModel(alpha=rng.choice([0.0, rng.random(), 3 * rng.random()]), beta=1e-3)
    return ready, sizes, model


# --- communication model --------------------------------------------------------------------


def test_comm_model_time() -> None:
    m = CommModel(alpha=2e-5, beta=1e-9)
    assert m.time(0) == pytest.approx(2e-5)
    assert m.time(1_000_000) == pytest.approx(2e-5 + 1e-3)
    with pytest.raises(ValueError):
        CommModel(alpha=-1.0, beta=0.0)
    with pytest.raises(ValueError):
        CommModel(alpha=0.0, beta=math.nan)


def test_fit_comm_model_recovers_exact_line() -> None:
    samples = [(n, 3e-5 + 2e-10 * n) for n in (1_000, 100_000, 10_000_000, 50_000_000)]
    m = fit_comm_model(samples)
    assert m.alpha == pytest.approx(3e-5, rel=1e-6)
    assert m.beta == pytest.approx(2e-10, rel=1e-9)


def test_fit_comm_model_least_squares_by_hand() -> None:
    # mean x = 1, mean y = 7/3, Sxy = 3, Sxx = 2: beta = 1.5, alpha = 7/3 - 1.5
    m = fit_comm_model([(0, 1.0), (1, 2.0), (2, 4.0)])
    assert m.beta == pytest.approx(1.5)
    assert m.alpha == pytest.approx(7 / 3 - 1.5)


def test_fit_comm_model_clamps_to_non_negative() -> None:
    # unconstrained: beta = 3, alpha = -3 -> through the origin: beta = (0 + 6) / (1 + 4)
    m = fit_comm_model([(1, 0.0), (2, 3.0)])
    assert (m.alpha, m.beta) == (0.0, pytest.approx(1.2))
    # negative slope -> constant model at the mean
    m = fit_comm_model([(1, 2.0), (2, 1.0)])
    assert (m.alpha, m.beta) == (pytest.approx(1.5), 0.0)


def test_fit_comm_model_needs_two_sizes() -> None:
    with pytest.raises(ValueError):
        fit_comm_model([(10, 1.0)])
    with pytest.raises(ValueError):
        fit_comm_model([(10, 1.0), (10, 2.0)])


# --- schedule -----------------------------------------------------------------------------


def test_bucket_schedule_by_hand() -> None:
    m = CommModel(alpha=1.0, beta=1.0)
    ready, sizes = [0.0, 1.0, 2.5], [10, 1, 1]
    assert bucket_schedule(separate(3), ready, sizes, m) == [(0, 11), (11, 13), (13, 15)]
    assert bucket_schedule([[0, 1], [2]], ready, sizes, m) == [(1, 13), (13, 15)]
    assert simulate(single(3), ready, sizes, m) == 2.5 + 1 + 12
    assert simulate([], [], [], m) == 0.0


@pytest.mark.parametrize("buckets", [[[0], [2], [1]], [[0, 2], [1]], [[0], [1]], [[0], [], [1, 2]]])
def test_simulate_rejects_non_partitions(buckets: list[list[int]]) -> None:
    with pytest.raises(ValueError):
        simulate(buckets, [0.0, 1.0, 2.0], [1, 1, 1], CommModel(1.0, 1.0))


def test_inputs_are_checked() -> None:
    m = CommModel(1.0, 1.0)
    with pytest.raises(ValueError):
        plan_buckets([1.0, 0.0], [1, 1], m)
    with pytest.raises(ValueError):
        plan_buckets([0.0], [1, 1], m)
    with pytest.raises(ValueError):
        plan_buckets([0.0], [-1], m)


# --- the greedy fusion rule --------------------------------------------------------------------


def test_plan_extremes() -> None:
    m = CommModel(alpha=1.0, beta=0.01)
    # all ready at once: no waiting, every merge saves alpha -> one bucket
    assert plan_buckets([0.0] * 4, [100] * 4, m) == [[0, 1, 2, 3]]
    # far apart: each collective ends (t = 2) before the next is ready -> no fusion
    assert plan_buckets([0.0, 10.0, 20.0], [100] * 3, m) == [[0], [1], [2]]
    assert plan_buckets([], [], m) == []
    # alpha = 0: merging never saves anything unless the bucket is queued anyway
    m0 = CommModel(alpha=0.0, beta=1.0)
    assert plan_buckets([0.0, 0.0, 1.0], [1, 1, 1], m0) == [[0], [1], [2]]


def test_plan_by_hand_queued_bucket_merges() -> None:
    m = CommModel(alpha=1.0, beta=1.0)
    ready, sizes = [0.0, 1.0, 2.5], [10, 1, 1]
    # [0] runs 0 -> 11. Tensor 1 is ready at 1 < 11 but waiting for it costs 1, not < alpha:
    # close. [1] is queued until 11; tensor 2 arrives at 2.5 < 11: merge for free.
    buckets = plan_buckets(ready, sizes, m)
    assert buckets == [[0], [1, 2]]
    assert simulate(buckets, ready, sizes, m) == 14.0
    assert simulate(separate(3), ready, sizes, m) == 15.0
    assert simulate(single(3), ready, sizes, m) == 15.5
    assert optimal_buckets(ready, sizes, m) == [[0], [1, 2]]


def test_plan_by_hand_short_wait_merges_and_greedy_is_not_optimal() -> None:
    m = CommModel(alpha=3.0, beta=1.0)
    ready, sizes = [0.0, 2.0, 5.0], [1, 0, 0]
    # [0] would run 0 -> 4; tensor 1 at 2: wait 2 < 3 -> merge, [0, 1] runs 2 -> 6.
    # Tensor 2 at 5 < 6 but wait 5 - 2 = 3 is not < 3 -> close; [2] runs 6 -> 9.
    buckets = plan_buckets(ready, sizes, m)
    assert buckets == [[0, 1], [2]]
    assert simulate(buckets, ready, sizes, m) == 9.0
    # the optimum keeps [0] alone (0 -> 4) and sends [1, 2] at 5 -> 8
    best = optimal_buckets(ready, sizes, m)
    assert best == [[0], [1, 2]]
    assert simulate(best, ready, sizes, m) == 8.0


def test_plan_no_worse_than_either_extreme_on_random_cases() -> None:
    """Holds for this rule, not just empirically.

    Induction over the walk: the current bucket's finish never exceeds tensor
    i's finish under one-bucket-per-tensor, nor ``ready[i] + alpha + beta *
    bytes[0..i]`` (the single bucket's finish when i is the last tensor).
    """
    rng = random.Random(2024)
    for _ in range(3000):
        ready, sizes, m = random_case(rng)
        n = len(ready)
        buckets = plan_buckets(ready, sizes, m)
        assert_partition(buckets, n)
        got = simulate(buckets, ready, sizes, m)
        tol = 1e-9 * max(1.0, abs(got))
        assert got <= simulate(separate(n), ready, sizes, m) + tol
        assert got <= simulate(single(n), ready, sizes, m) + tol
        assert simulate(optimal_buckets(ready, sizes, m), ready, sizes, m) <= got + tol


def test_plan_is_deterministic() -> None:
    rng = random.Random(5)
    for _ in range(50):
        ready, sizes, m = random_case(rng)
        assert plan_buckets(ready, sizes, m) == plan_buckets(list(ready), list(sizes), m)


def test_optimal_matches_brute_force() -> None:
    rng = random.Random(99)
    for _ in range(300):
        ready, sizes, m = random_case(rng)
        n = len(ready)
        best = optimal_buckets(ready, sizes, m)
        assert_partition(best, n)
        brute = min(simulate(b, ready, sizes, m) for b in all_partitions(n))
        assert simulate(best, ready, sizes, m) == pytest.approx(brute, rel=1e-12, abs=1e-12)


# --- size cap ---------------------------------------------------------------------------------


def test_size_cap_buckets() -> None:
    assert size_cap_buckets([3, 3, 3], 6) == [[0, 1], [2]]
    assert size_cap_buckets([10, 1, 1, 10, 1], 5) == [[0], [1, 2], [3], [4]]
    assert size_cap_buckets([2, 2, 2], 2) == [[0], [1], [2]]
    assert size_cap_buckets([0, 0, 5, 0], 5) == [[0, 1, 2, 3]]
    assert size_cap_buckets([], 5) == []
    with pytest.raises(ValueError):
        size_cap_buckets([1], 0)
    with pytest.raises(ValueError):
        size_cap_buckets([-1], 4)


def test_size_cap_respects_cap_on_random_cases() -> None:
    rng = random.Random(11)
    for _ in range(200):
        sizes = [rng.randint(0, 50) for _ in range(rng.randint(0, 30))]
        cap = rng.randint(1, 60)
        buckets = size_cap_buckets(sizes, cap)
        assert_partition(buckets, len(sizes))
        for b in buckets:
            assert len(b) == 1 or sum(sizes[i] for i in b) <= cap
        # maximal: the next tensor would have overflowed each closed bucket
        for b, nxt in itertools.pairwise(buckets):
            assert sum(sizes[i] for i in b) + sizes[nxt[0]] > cap
