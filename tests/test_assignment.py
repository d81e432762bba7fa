"""Tests for dpkfac.plan.assignment: cost models, LPT, round robin, factor placement."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dpkfac.plan.assignment import (
    COSTS,
    EIGH_COEFF,
    LayerShape,
    assign_factors,
    assign_layers,
    compute_cost,
    compute_cost_inverse,
    factor_decomposition_cost,
    load_imbalance,
    lpt_assign,
    memory_cost,
    rank_loads,
    round_robin_assign,
)


def brute_force_opt(costs: list[float], world_size: int) -> float:
    """Smallest busiest-rank load over every assignment."""
    best = math.inf
    for assignment in itertools.product(range(world_size), repeat=len(costs)):
        best = min(best, max(rank_loads(assignment, costs, world_size)))
    return best


# --- LayerShape and cost models -------------------------------------------------------------


def test_layer_shape_constructors() -> None:
    lin = LayerShape.linear("ffn", 768, 3072, batch_size=4, positions=384)
    assert (lin.kind, lin.a_dim, lin.g_dim, lin.positions, lin.batch_size) == (
        "linear",
        769,
        3072,
        384,
        4,
    )
    assert LayerShape.linear("fc", 10, 5, bias=False).a_dim == 10
    conv = LayerShape.conv2d("c", 64, 128, (3, 3), (56, 56), batch_size=32)
    assert (conv.kind, conv.a_dim, conv.g_dim, conv.positions) == ("conv2d", 576, 128, 3136)
    assert LayerShape.conv2d("c", 64, 64, (3, 3), (7, 7), bias=True, groups=2).a_dim == 289


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "lstm"},
        {"a_dim": 0},
        {"g_dim": -1},
        {"positions": 0},
        {"batch_size": 0},
    ],
)
def test_layer_shape_rejects_bad_fields(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "name": "x",
        "kind": "linear",
        "a_dim": 2,
        "g_dim": 3,
        "positions": 1,
        "batch_size": 1,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError):
        LayerShape(**fields)  # type: ignore[arg-type]


def test_cost_values_by_hand() -> None:
    s = LayerShape("l", "linear", a_dim=2, g_dim=3, positions=5, batch_size=2)
    # construction N*T*(a^2+g^2) = 10*13 = 130; eigh 4.5*(8+27) = 157.5
    assert EIGH_COEFF == 4.5
    assert compute_cost(s) == pytest.approx(287.5)
    assert compute_cost_inverse(s) == pytest.approx(130 + 35)
    assert memory_cost(s) == 13
    assert factor_decomposition_cost(10) == pytest.approx(4500)
    assert factor_decomposition_cost(10, coeff=1.0) == pytest.approx(1000)
    assert COSTS["compute"] is compute_cost and COSTS["memory"] is memory_cost


def test_compute_cost_grows_with_batch_only_through_construction() -> None:
    small = LayerShape("l", "conv2d", 576, 64, positions=100, batch_size=1)
    big = LayerShape("l", "conv2d", 576, 64, positions=100, batch_size=3)
    assert compute_cost(big) - compute_cost(small) == pytest.approx(200 * (576**2 + 64**2))


# --- LPT and round robin ----------------------------------------------------------------------


def test_lpt_graham_tight_case() -> None:
    # LPT gives {3,2,2} and {3,2}: 7, while the optimum {3,3},{2,2,2} is 6.
    costs = [3.0, 3.0, 2.0, 2.0, 2.0]
    assignment = lpt_assign(costs, 2)
    assert assignment == [0, 1, 0, 1, 0]
    assert rank_loads(assignment, costs, 2) == [7.0, 5.0]
    assert brute_force_opt(costs, 2) == 6.0


def test_lpt_ties_by_index_and_lowest_rank() -> None:
    assert lpt_assign([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    # order: item 1 (3), item 0 (2), item 2 (2); item 2 goes to the lighter rank 1.
    assert lpt_assign([2, 3, 2], 2) == [1, 0, 1]
    # zero cost leaves rank 0 the least loaded (lowest rank on ties)
    assert lpt_assign([0, 0, 0], 3) == [0, 0, 0]


def test_lpt_more_ranks_than_items_leaves_ranks_empty() -> None:
    assignment = lpt_assign([5.0, 1.0], 4)
    assert assignment == [0, 1]
    assert rank_loads(assignment, [5.0, 1.0], 4) == [5.0, 1.0, 0.0, 0.0]
    assert lpt_assign([], 3) == []


def test_lpt_single_rank() -> None:
    assert lpt_assign([4.0, 2.0, 9.0], 1) == [0, 0, 0]


@pytest.mark.parametrize("bad", [[-1.0], [math.nan], [math.inf]])
def test_lpt_rejects_bad_costs(bad: list[float]) -> None:
    with pytest.raises(ValueError):
        lpt_assign(bad, 2)


def test_world_size_must_be_positive() -> None:
    for fn in (lambda: lpt_assign([1.0], 0), lambda: round_robin_assign(3, 0)):
        with pytest.raises(ValueError):
            fn()


def test_lpt_within_graham_bound_of_brute_force_optimum() -> None:
    rng = random.Random(1234)
    for _ in range(150):
        world_size = rng.choice([2, 3, 4])
        n = rng.randint(1, 6 if world_size == 4 else 7)
        costs = [float(rng.choice([rng.randint(1, 10), rng.randint(1, 1000)])) for _ in range(n)]
        assignment = lpt_assign(costs, world_size)
        assert sorted(set(assignment)) <= list(range(world_size))
        lpt_max = max(rank_loads(assignment, costs, world_size))
        opt = brute_force_opt(costs, world_size)
        assert opt <= lpt_max <= (4 / 3 - 1 / (3 * world_size)) * opt + 1e-9


def test_lpt_is_deterministic_and_equivariant_to_item_order() -> None:
    rng = random.Random(7)
    costs = [rng.random() for _ in range(40)]
    base = lpt_assign(costs, 5)
    assert base == lpt_assign(list(costs), 5)
    perm = list(range(40))
    rng.shuffle(perm)
    permuted = lpt_assign([costs[i] for i in perm], 5)
    # distinct costs: the same item goes to the same rank whatever its index
    assert permuted == [base[i] for i in perm]


def test_round_robin() -> None:
    assert round_robin_assign(5, 2) == [0, 1, 0, 1, 0]
    assert round_robin_assign(2, 4) == [0, 1]
    assert round_robin_assign(0, 3) == []


# --- layers and factors ---------------------------------------------------------------------


def _shapes() -> list[LayerShape]:
    return [
        LayerShape.linear("small", 10, 10, batch_size=8),
        LayerShape.linear("big", 1000, 1000, batch_size=8),
        LayerShape.linear("mid", 300, 300, batch_size=8),
        LayerShape.linear("big2", 900, 900, batch_size=8),
    ]


def test_assign_layers_methods_and_costs() -> None:
    shapes = _shapes()
    assert assign_layers(shapes, 2, method="round_robin") == [0, 1, 0, 1]
    # compute: big -> 0, big2 -> 1, mid -> 1, small -> 1
    assert assign_layers(shapes, 2) == [1, 0, 1, 1]
    assert assign_layers(shapes, 2, cost="memory") == [1, 0, 1, 1]
    # a callable cost that reverses the ranking: small (1/11) outweighs the other three
    assert assign_layers(shapes, 2, cost=lambda s: 1.0 / s.a_dim) == [0, 1, 1, 1]
    assert assign_layers(shapes, 8) == [3, 0, 2, 1]
    with pytest.raises(ValueError):
        assign_layers(shapes, 2, cost="flops")
    with pytest.raises(ValueError):
        assign_layers(shapes, 2, method="random")


def test_assign_layers_best_never_worse_than_either() -> None:
    rng = random.Random(3)
    for _ in range(50):
        shapes = [
            LayerShape.linear(f"l{i}", rng.choice([64, 768, 3072]), rng.choice([64, 768, 3072]))
            for i in range(rng.randint(1, 30))
        ]
        costs = [compute_cost(s) for s in shapes]
        p = rng.choice([2, 3, 4, 8])
        best, lpt, rr = (
            max(rank_loads(assign_layers(shapes, p, method=m), costs, p))
            for m in ("best", "lpt", "round_robin")
        )
        assert best == min(lpt, rr)


def test_assign_factors_threshold_and_placement() -> None:
    dims = [2048, 512, 1024, 100]
    assert assign_factors(dims, 2, local_threshold=1024) == [0, None, 1, None]
    # no threshold: 2048 alone on rank 0 outweighs everything else on rank 1
    assert assign_factors(dims, 2) == [0, 1, 1, 1]
    assert assign_factors(dims, 8) == [0, 2, 1, 3]
    assert assign_factors(dims, 2, local_threshold=4096) == [None] * 4
    assert assign_factors([], 3) == []


def test_assign_factors_splits_a_and_g_of_one_layer() -> None:
    # one layer, two equal factors, two ranks: A and G go to different ranks
    assert assign_factors([1024, 1024], 2) == [0, 1]


def test_rank_loads_counts_local_items_on_every_rank() -> None:
    assert rank_loads([0, None, 1], [1.0, 2.0, 3.0], 2) == [3.0, 5.0]
    with pytest.raises(ValueError):
        rank_loads([0, 2], [1.0, 1.0], 2)
    with pytest.raises(ValueError):
        rank_loads([0], [1.0, 1.0], 2)


def test_load_imbalance() -> None:
    assert load_imbalance([3.0, 1.0]) == 1.5
    assert load_imbalance([2.0, 2.0]) == 1.0
    assert load_imbalance([0.0, 0.0]) == 1.0
    assert load_imbalance([4.0, 0.0, 0.0, 0.0]) == 4.0
    with pytest.raises(ValueError):
        load_imbalance([])


def test_bert_and_resnet_like_balancing_lowers_busiest_rank() -> None:
    """On BERT-base shapes LPT beats round robin where round robin is uneven."""
    per_block = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
    shapes = [
        LayerShape.linear(f"l{i}.{j}", d_in, d_out, batch_size=4, positions=384)
        for i in range(12)
        for j, (d_in, d_out) in enumerate(per_block)
    ] + [LayerShape.linear("qa", 768, 2, batch_size=4, positions=384)]
    costs = [compute_cost(s) for s in shapes]
    for p in (16, 64):
        rr = max(rank_loads(assign_layers(shapes, p, method="round_robin"), costs, p))
        lpt = max(rank_loads(assign_layers(shapes, p), costs, p))
        assert lpt < rr
        assert lpt >= max(max(costs), sum(costs) / p)
