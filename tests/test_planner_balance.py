"""Load balancing primitives: speed-proportional shares, Whale Algorithm 1, Poplar accumulation,
uneven tensor-parallel shards."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.shares.batch_shares import (
    DoesNotFit, Slot, accumulation_sizes, balance_memory, balanced_shares, proportional_shares,
)
from planner.shares.shard_sizes import even_layout, granularity, shard_layout, split_dimension

speeds_st = st.lists(st.floats(min_value=0.1, max_value=100.0), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(speeds=speeds_st, extra=st.integers(0, 500), minimum=st.integers(0, 3))
def test_proportional_shares_sum_and_monotone(speeds, extra, minimum):
    total = minimum * len(speeds) + extra
    shares = proportional_shares(total, speeds, minimum)
    assert sum(shares) == total
    assert all(s >= minimum for s in shares)
    for i, a in enumerate(speeds):
        for j, b in enumerate(speeds):
            if a > b:
                assert shares[i] >= shares[j], (speeds, shares)


@settings(max_examples=200, deadline=None)
@given(speeds=speeds_st, total=st.integers(1, 500))
def test_proportional_shares_minimise_the_slowest_device(speeds, total):
    """Moving one sample between any two devices never lowers the makespan."""
    shares = proportional_shares(total, speeds)
    makespan = max(s / v for s, v in zip(shares, speeds))
    for i in range(len(speeds)):
        for j in range(len(speeds)):
            if i != j and shares[i] > 0:
                moved = list(shares)
                moved[i] -= 1
                moved[j] += 1
                assert max(s / v for s, v in zip(moved, speeds)) >= makespan - 1e-12


def test_proportional_shares_examples():
    assert proportional_shares(100, [2.0, 1.0, 1.0]) == [50, 25, 25]
    assert proportional_shares(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    assert proportional_shares(7, [4.0, 2.0, 1.0]) == [4, 2, 1]
    with pytest.raises(ValueError):
        proportional_shares(2, [1.0, 1.0, 1.0], minimum=1)


def test_whale_algorithm_1_moves_load_off_the_peak():
    # device 0 is fastest but holds only 10 samples; the others take its excess, the faster first
    slots = [Slot(4.0, 10), Slot(2.0, 100), Slot(1.0, 100)]
    shares = proportional_shares(70, [s.speed for s in slots])
    assert shares == [40, 20, 10]
    balanced = balance_memory(shares, slots, lambda i, n: n / slots[i].cap)
    assert balanced[0] == 10 and sum(balanced) == 70
    assert balanced[1] > balanced[2]
    # the excess is spread so both valleys finish as close together as possible
    assert abs(balanced[1] / 2.0 - balanced[2] / 1.0) <= 1


def test_whale_algorithm_1_reports_the_shortfall():
    slots = [Slot(1.0, 5), Slot(1.0, 5)]
    with pytest.raises(DoesNotFit) as e:
        balanced_shares(13, slots, lambda i, n: n / 5)
    assert e.value.shortfall == 3 and e.value.capacity == 10


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_balanced_shares_never_exceed_caps(data):
    n = data.draw(st.integers(1, 8))
    speeds = data.draw(st.lists(st.floats(0.1, 10.0), min_size=n, max_size=n))
    caps = data.draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    total = data.draw(st.integers(n, 200))
    slots = [Slot(s, c) for s, c in zip(speeds, caps)]
    try:
        shares = balanced_shares(total, slots, lambda i, k: k / caps[i])
    except DoesNotFit:
        assert total > sum(caps)
        return
    assert sum(shares) == total
    assert all(1 <= s <= c for s, c in zip(shares, caps))
    # equal memory: the faster device never gets fewer samples
    for i in range(n):
        for j in range(n):
            if caps[i] == caps[j] and speeds[i] > speeds[j]:
                assert shares[i] >= shares[j]


def test_poplar_accumulation_sizes():
    assert accumulation_sizes(10, 4) == [4, 4, 2]
    assert accumulation_sizes(8, 4) == [4, 4]
    assert accumulation_sizes(3, 40) == [3]
    with pytest.raises(DoesNotFit):
        accumulation_sizes(3, 0)


@settings(max_examples=200, deadline=None)
@given(dim=st.integers(1, 5000), speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=8))
def test_shard_sizes_sum_to_the_dimension(dim, speeds):
    if dim < len(speeds):
        with pytest.raises(ValueError):
            split_dimension(dim, speeds, [1.0] * len(speeds))
        return
    sizes = split_dimension(dim, speeds, [1.0] * len(speeds))
    g = granularity(dim, len(speeds))
    assert sum(sizes) == dim
    assert all(s >= g and s % g == 0 for s in sizes)
    for i, a in enumerate(speeds):
        for j, b in enumerate(speeds):
            # a faster device never gets less; speeds one float rounding apart (10.0 and
            # 9.999999999999998) tie in the finishing-time key, and ties go to the lower index
            if a > b * (1 + 1e-12):
                assert sizes[i] >= sizes[j]


def test_shards_proportional_to_speed_and_memory_capped():
    layout = shard_layout({"fc1": 4096, "head": 1000}, [3.0, 1.0], [1.0, 1.0])
    assert layout.shard_sizes == {"fc1": [3072, 1024], "head": [752, 248]}
    assert layout.fractions[0] == pytest.approx(0.75, abs=0.01)
    # the fast device can hold only 60% of the stage
    capped = shard_layout({"fc1": 4096}, [3.0, 1.0], [0.6, 1.0])
    assert capped.shard_sizes["fc1"][0] <= 0.6 * 4096
    assert sum(capped.shard_sizes["fc1"]) == 4096
    with pytest.raises(DoesNotFit):
        shard_layout({"fc1": 4096}, [1.0, 1.0], [0.4, 0.4])
    assert even_layout({"fc1": 4096}, 4).shard_sizes == {"fc1": [1024] * 4}
    assert even_layout({}, 2).fractions == [0.5, 0.5]
