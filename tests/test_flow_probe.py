"""The flow probe: what collectives sharing one emulated link cost (bench.flow_probe)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments import network as net
from experiments.bench.flow_probe import SCENARIOS, SideFlows, predicted_ms, run_probe

shard = st.floats(0.0, 5.0)
pair = st.tuples(shard, shard)


@given(pair, st.lists(pair, min_size=1, max_size=3), st.floats(1.0, 50.0))
def test_the_byte_model_orders_the_scenarios(
    reduction: tuple[float, float], exchanges: list[tuple[float, float]], big: float
) -> None:
    """Balancing never adds bytes to the busier direction, and running the flows in turn never
    takes less than running them together; SGD's one bucket is the mean of both directions."""
    flows = SideFlows(reduction, exchanges, [0.0] * len(exchanges))
    even = flows.balanced()
    assert sum(even.reduction) == pytest.approx(sum(flows.reduction))
    assert even.sent_mb(0) == pytest.approx(even.sent_mb(1))
    assert even.sent_mb(0) == pytest.approx((flows.sent_mb(0) + flows.sent_mb(1)) / 2)
    ms = {name: predicted_ms(name, 100.0, big, flows) for name in SCENARIOS}
    assert ms["alone"] == 100.0
    assert ms["whole"] == pytest.approx(ms["balanced"])
    assert ms["balanced"] <= ms["beside"] + 1e-9 <= ms["in_turn"] + 2e-9


def test_side_flows_are_two_ranks_shards() -> None:
    with pytest.raises(ValueError, match="two ranks"):
        SideFlows((1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="1 exchanges but 2 delays"):
        SideFlows((1.0, 1.0), ((1.0, 1.0),), (0.0, 5.0))
    # Rank 0 sends rank 1's reduction shard and its own update shards.
    assert SideFlows((1.0, 2.0), ((3.0, 4.0),), (0.0,)).sent_mb(0) == 2.0 + 3.0


@pytest.mark.distributed
def test_every_scenario_runs_on_the_network_and_takes_its_wire_time() -> None:
    try:
        net.check_host()
    except net.NetworkUnavailable as err:
        pytest.skip(str(err))
    rate, big = 200 * 10**6, 1.0  # 1 MB: 40 ms on the wire at 200 Mbit/s
    flows = SideFlows((0.1, 0.2), ((0.1, 0.0), (0.1, 0.2)), (0.0, 0.0))
    out = run_probe(rate, big_mb=big, flows=flows, repeats=1, timeout_s=120)
    assert set(out["ms"]) == set(SCENARIOS)
    wire_ms = big * 1e6 * 8 / rate * 1e3
    assert out["ms"]["alone"] >= 0.8 * wire_ms, out
    # More bytes on a shaped link cannot cross faster than the all-reduce alone.
    for name in ("whole", "beside", "balanced", "in_turn"):
        assert out["ms"][name] >= 0.9 * out["ms"]["alone"], (name, out)
