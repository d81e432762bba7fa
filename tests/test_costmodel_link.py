"""The cost model's shared link (:mod:`dpkfac.costmodel.link`): process groups' transfers
sharing one link fairly, its busy periods, and compute slowed beside them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpkfac.costmodel.link import busy_periods, paced_end, share


def test_one_lane_is_a_queue() -> None:
    assert share([[(0.0, 1.0), (0.5, 2.0), (5.0, 1.0)]]) == [[1.0, 3.0, 6.0]]


def test_two_lanes_share_the_link_equally() -> None:
    # Two transfers of a second each, from the same moment: both end at 2 s.
    assert share([[(0.0, 1.0)], [(0.0, 1.0)]]) == [[2.0], [2.0]]
    # A small exchange launched beside a large bucket ends at twice its own time, and
    # delays the bucket by its own time (the link is never idle).
    big, small = share([[(0.0, 10.0)], [(1.0, 0.5)]])
    assert small == [pytest.approx(2.0)]
    assert big == [pytest.approx(10.5)]


def test_a_transfer_needs_a_finite_start_and_length() -> None:
    with pytest.raises(ValueError, match="finite"):
        share([[(math.nan, 1.0)]])
    with pytest.raises(ValueError, match="seconds >= 0"):
        share([[(0.0, -1.0)]])


# Seconds of none, or of a microsecond or more (the simulation settles below a picosecond).
seconds = st.floats(0.0, 3.0).map(lambda x: 0.0 if x < 1e-6 else x)
transfers = st.lists(st.tuples(st.floats(0.0, 10.0), seconds), min_size=0, max_size=6)


@given(st.lists(transfers, min_size=1, max_size=3))
@settings(max_examples=200, deadline=None)
def test_sharing_conserves_work_and_order(drawn: list[list[tuple[float, float]]]) -> None:
    """Each lane completes in order, none before its start plus its own seconds, and the
    link never idles while a transfer is ready: it carries exactly the transfers' seconds
    and is done when one queue of every transfer, served by readiness, would be."""
    lanes = [sorted(lane) for lane in drawn]  # a lane's launches come in order
    done = share(lanes)
    for lane, ends in zip(lanes, done, strict=True):
        assert len(ends) == len(lane)
        assert ends == sorted(ends)
        for (ready, seconds), end in zip(lane, ends, strict=True):
            assert end >= ready + seconds - 1e-9
    t = 0.0
    for ready, seconds in sorted(x for lane in lanes for x in lane if x[1] > 0.0):
        t = max(t, ready) + seconds
    periods = busy_periods(lanes, done)
    assert (periods[-1][1] if periods else 0.0) == pytest.approx(t)
    carried = sum(b - a for a, b in periods)
    assert carried == pytest.approx(sum(s for lane in lanes for _, s in lane), abs=1e-6)


def test_busy_periods_merge_the_spans() -> None:
    lanes = [[(0.0, 1.0), (3.0, 1.0)], [(0.5, 1.0)]]
    done = share(lanes)
    assert busy_periods(lanes, done) == [(0.0, pytest.approx(2.0)), (3.0, 4.0)]


def test_compute_runs_at_its_pace_only_beside_the_link() -> None:
    periods = [(1.0, 3.0)]
    assert paced_end(0.0, 0.5, periods, 0.5) == 0.5  # done before the link starts
    assert paced_end(0.0, 2.0, periods, 0.5) == 3.0  # 1 s alone, then 1 s at half pace
    assert paced_end(0.0, 3.0, periods, 0.5) == 4.0  # ... and 1 s alone after it
    assert paced_end(2.0, 1.0, periods, 1.0) == 3.0  # full overlap: no slowdown
    assert paced_end(1.0, 1.0, periods, 0.0) == 4.0  # no overlap: waits out the link


def test_a_rank_of_an_owner_scheme_builds_its_own_factors_in_the_backward() -> None:
    """The overlapped mode's launches follow each rank's own backward: an owner builds the
    batch factors of its layers only, so its buckets are ready sooner than a pass that
    builds every layer's (traced on BERT-base at P=2: 61-63 ms, where pricing every
    layer's factors gave 80 ms)."""
    from dpkfac.costmodel import PRESETS, zoo
    from dpkfac.costmodel.timing import factor_work, timeline

    shapes, _ = zoo.ZOO["resnet32"]
    hw = PRESETS["v100_ib100"]
    _, _, bare = timeline(shapes, hw, "expand", 4, factors=False)
    _, _, every = timeline(shapes, hw, "expand", 4)
    _, _, nothing = timeline(shapes, hw, "expand", 4, built=())
    first = next(i for i, c in enumerate(shapes.captured) if c)
    _, _, one = timeline(shapes, hw, "expand", 4, built=(first,))
    assert nothing == pytest.approx(bare)
    own = sum(hw.time(factor_work(shapes[first], w, "expand", 4), 1) for w in "AG")
    assert one - bare == pytest.approx(own)
    assert bare < one < every


@pytest.mark.parametrize("model", ["resnet32", "bert_base"])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_overlapped_schedule_settles(model: str, backend: str) -> None:
    """The schedule is iterated to its fixed point (exchanges slow the gradient transfers
    the drain waits for): on the zoo's models, both drains, P=2 and 64 and a host that
    shares its cores with the transfers or not, it settles (no warning), and no kind of
    step is priced above the plain owner mode's."""
    import warnings
    from dataclasses import replace

    from dpkfac.costmodel import PRESETS, predict, zoo

    shapes, _ = zoo.ZOO[model]
    owner = {"grad_reduction": "owner"}
    for overlap in (1.0, 0.6):
        hw = replace(PRESETS["v100_ib100"], backend=backend, overlap=overlap)
        for p in (2, 64):
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                plain = predict(
                    shapes, strategy="dp_kfac", world_size=p, hardware=hw, options=owner
                )
                for drain in ("last", "ready"):
                    options = {**owner, "overlap": True, "drain": drain}
                    step = predict(
                        shapes, strategy="dp_kfac", world_size=p, hardware=hw, options=options
                    )
                    for kind, priced in step.steps.items():
                        assert priced.breakdown["grad_comm"] >= 0.0
                        assert priced.iteration <= plain.steps[kind].iteration * (1 + 1e-9)


def test_a_schedule_that_does_not_settle_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpkfac.costmodel import PRESETS, predict, timing, zoo

    shapes, _ = zoo.ZOO["resnet32"]
    monkeypatch.setattr(timing, "_SCHEDULE_PASSES", 1)  # the first pass guesses no exchange
    options = {"grad_reduction": "owner", "overlap": True}
    with pytest.warns(RuntimeWarning, match="did not settle in 1 passes"):
        predict(
            shapes,
            strategy="dp_kfac",
            world_size=4,
            hardware=PRESETS["v100_ib100"],
            options=options,
        )
