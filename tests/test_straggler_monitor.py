"""The straggler monitor: smoothing, the relative-speed rule, bad input, and the exchange on 2 gloo
ranks (one process group running every distributed scenario). Recorded times are synthetic, so
detection is checked without timing thresholds; the emulator tests assert on modeled time and FLOPs.
"""
from __future__ import annotations

import math
import random

import pytest
from torch.testing import assert_close

from dist_utils import run_ranks
from runtime.emulation.compute import Emulator
from runtime.balance.straggler_monitor import Measured, SpeedChange, StragglerMonitor
from whalelike.cluster import Emulation, Straggler, round_robin_stragglers
from whalelike.errors import SpecError

FLOPS = 1e9   # per step and rank in the synthetic scenarios; 1 s of compute = 1 GFLOP/s


# -- single process: smoothing and the decision ------------------------------------------------------
def test_median_ignores_a_one_step_spike_and_follows_a_sustained_change():
    monitor = StragglerMonitor(0, 1, window=3)
    for step, seconds in enumerate([1.0, 1.0, 1.0]):
        monitor.record(step, FLOPS, seconds, matmul_s=0.5 * seconds)
    assert monitor.smoothed() == (1e9, 1.0, 0.5)
    monitor.record(3, FLOPS, 3.0, matmul_s=1.5)        # one slow step: the median stays
    assert monitor.smoothed()[0] == 1e9
    monitor.record(4, FLOPS, 1.0)
    assert monitor.smoothed()[0] == 1e9
    monitor.record(5, FLOPS, 1.0)
    monitor.record(6, FLOPS, 2.0)                      # sustained 2x from step 6 ...
    assert monitor.smoothed()[0] == 1e9
    monitor.record(7, FLOPS, 2.0)                      # ... shows on its second step (ceil(3 / 2))
    assert monitor.smoothed() == (0.5e9, 2.0, 0.0)
    monitor.reset()
    assert len(monitor.samples) == 0 and math.isnan(monitor.smoothed()[0])


def test_steps_without_measured_compute_have_no_speed():
    monitor = StragglerMonitor(0, 1, window=2)
    monitor.record(0, 0.0, 0.0)
    assert math.isnan(monitor.smoothed()[0])
    monitor.record(1, FLOPS, 0.5)
    assert monitor.smoothed()[0] == 2e9   # the median over the steps that measured compute


def test_steps_whose_emulation_overran_give_way_to_recent_clean_ones():
    """An overrun measured the loaded host, not the emulated device: a window with two overrunning
    steps (3 s and 5 s) takes the median of the last three clean steps instead, while they are
    among the last six; else the last three steps, overruns and all."""
    monitor = StragglerMonitor(0, 1, window=3)
    for step in (0, 1, 2):
        monitor.record(step, FLOPS, 1.0 + step / 10)
    monitor.record(3, FLOPS, 3.0, overran=True)
    monitor.record(4, FLOPS, 5.0, matmul_s=1.0, overran=True)
    assert monitor.smoothed() == (FLOPS / 1.1, 1.1, 0.0)          # steps 0-2
    monitor.record(5, FLOPS, 2.0, overran=True)
    assert monitor.smoothed()[0] == FLOPS / 1.1                    # steps 0-2: among the last six
    monitor.record(6, FLOPS, 4.0, overran=True)
    assert monitor.smoothed() == (FLOPS / 4.0, 4.0, 0.0)          # no longer: steps 4-6
    monitor.reset()
    monitor.record(7, FLOPS, 1.0)
    monitor.record(8, FLOPS, 4.0, overran=True)
    monitor.record(9, FLOPS, 2.0)                                  # two clean steps since the reset:
    assert monitor.smoothed()[:2] == (FLOPS / 2.0, 2.0)            # the last three, overrun and all


def test_changed_compares_shares_of_the_total_speed():
    monitor = StragglerMonitor(0, 4, threshold=0.10)
    reference = [4e9, 4e9, 2e9, 2e9]

    def measured(speeds):
        return Measured(7, speeds, [1.0] * 4, [0.0] * 4)

    assert monitor.changed(measured([2e9, 2e9, 1e9, 1e9]), reference) == []          # everyone slowed alike
    assert monitor.changed(measured([4.2e9, 3.8e9, 2.1e9, 1.9e9]), reference) == []  # +-5% noise
    changes = monitor.changed(measured([4e9, 4e9, 1e9, 2e9]), reference)             # rank 2 slowed 2x
    assert [c.rank for c in changes] == [2]   # the others' shares grew by 9.1%: below the threshold
    slow = changes[0]
    assert (slow.old_speed, slow.new_speed) == (2e9, 1e9)
    assert_close(slow.ratio, (1 / 11) / (2 / 12))
    # 3x: the others' shares grow by 20%, past the threshold, so they are listed too
    assert [c.rank for c in monitor.changed(measured([4e9, 4e9, 2e9 / 3, 2e9]), reference)] == [0, 1, 2, 3]
    # a mild slow-down of one rank of two: only past the threshold counts
    pair = StragglerMonitor(0, 2, threshold=0.10)
    assert pair.changed(Measured(0, [1e9, 0.85e9], [1.0] * 2, [0.0] * 2), [1e9, 1e9]) == []
    assert [c.rank for c in pair.changed(Measured(0, [1e9, 0.75e9], [1.0] * 2, [0.0] * 2), [1e9, 1e9])] == [0, 1]
    # an unknown speed (a rank that measured no compute) reports nothing
    assert pair.changed(Measured(0, [1e9, math.nan], [1.0] * 2, [0.0] * 2), [1e9, 1e9]) == []


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=0, world_size=2, window=0), r"window must be an integer >= 1 .*got 0"),
    (dict(rank=0, world_size=2, exchange_every=0), r"exchange_every must be an integer >= 1 .*got 0"),
    (dict(rank=0, world_size=2, threshold=0.0), r"threshold must be in \(0, 1\), .*got 0\.0"),
    (dict(rank=0, world_size=2, threshold=1.5), r"threshold must be in \(0, 1\), .*got 1\.5"),
    (dict(rank=0, world_size=2, threshold=float("nan")), r"threshold must be in \(0, 1\), .*got nan"),
    (dict(rank=2, world_size=2), r"rank must be in 0\.\.1 \(world_size 2\), got 2"),
    (dict(rank=-1, world_size=2), r"rank must be an integer >= 0 .*got -1"),
    (dict(rank=0, world_size=0), r"world_size must be an integer >= 1 .*got 0"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(SpecError, match=r"^StragglerMonitor: " + message):
        StragglerMonitor(**kwargs)


def test_bad_records_and_references():
    monitor = StragglerMonitor(0, 2)
    with pytest.raises(SpecError, match=r"compute_s must be a finite number >= 0, got -1\.0"):
        monitor.record(0, FLOPS, -1.0)
    with pytest.raises(SpecError, match=r"flops must be a finite number >= 0, got nan"):
        monitor.record(0, float("nan"), 1.0)
    with pytest.raises(SpecError, match=r"matmul_s \(2\) is part of compute_s and cannot exceed it \(1\)"):
        monitor.record(0, FLOPS, 1.0, matmul_s=2.0)
    monitor.record(3, FLOPS, 1.0)
    with pytest.raises(SpecError, match=r"step must increase, got step 3 after step 3"):
        monitor.record(3, FLOPS, 1.0)
    measured = Measured(3, [1e9, 1e9], [1.0, 1.0], [0.0, 0.0])
    with pytest.raises(SpecError, match=r"need one speed per rank \(2\), got 3 reference"):
        monitor.changed(measured, [1e9, 1e9, 1e9])
    with pytest.raises(SpecError, match=r"reference speeds must be > 0 FLOP/s"):
        monitor.changed(measured, [1e9, -1e9])


def test_passenger_vectors_summed_over_ranks_give_every_rank_all_figures():
    """What rides in a step's all-reduce: each rank's figures in its own slot; the sum (what the
    all-reduce computes) read back on any rank is the same Measured an all-gather would give."""
    import torch

    from runtime.control.exchange import Passenger

    monitors = [StragglerMonitor(r, 3, window=1) for r in range(3)]
    for r, m in enumerate(monitors):
        m.record(0, flops=1e9 * (r + 1), compute_s=0.5, matmul_s=0.25)
    passengers = [Passenger(9, m.outgoing) for m in monitors]
    summed = sum(p.fill() for p in passengers)
    for p in passengers:
        assert not p.carried
        p.arrived(summed)
        assert p.carried
    for m, p in zip(monitors, passengers):
        measured = m.received(0, p.vector)
        assert measured == Measured(0, [2e9, 4e9, 6e9], [0.5] * 3, [0.25] * 3)
    with pytest.raises(SpecError, match="expected 9 values"):
        monitors[0].received(0, torch.zeros(6))


def test_exchange_off_its_steps_communicates_nothing():
    """No process group exists here: a call that tried to communicate would raise."""
    monitor = StragglerMonitor(0, 2, exchange_every=4)
    monitor.record(1, FLOPS, 1.0)
    assert monitor.exchange(1) is None and monitor.exchange(6) is None


# -- the emulator feeds the monitor: matmul-only stragglers and the round-robin schedule -----------------
def test_matmul_straggler_slows_matmul_segments_only():
    em = Emulation(base_gflops=1.0, stragglers=(Straggler(rank=0, factor=4.0, ops="matmul"),))
    emulator = Emulator(1.0, em, rank=0)
    with emulator.segment(1e6, 1, kind="stage"):      # 1 ms modeled, not slowed
        pass
    stage = emulator.stats.snapshot()
    with emulator.segment(1e6, 1, kind="matmul"):     # 1 ms modeled, x4
        pass
    matmul = emulator.stats.since(stage)
    assert_close(stage.modeled_s, 1e-3)
    assert_close(matmul.modeled_s, 4e-3)
    assert stage.matmul_s == 0.0 and matmul.matmul_s == matmul.padded_s >= matmul.modeled_s
    assert emulator.stats.flops == 2e6 and matmul.flops == 1e6
    # an "all" straggler slows both kinds; another rank is not slowed
    both = Emulation(base_gflops=1.0, stragglers=(Straggler(rank=0, factor=4.0),))
    assert_close(Emulator(1.0, both, rank=0).modeled_seconds(1e6, 1, "stage"), 4e-3)
    assert_close(Emulator(1.0, em, rank=1).modeled_seconds(1e6, 1, "matmul"), 1e-3)
    with pytest.raises(ValueError, match=r"segment kind must be one of 'stage', 'matmul' .*got 'conv'"):
        emulator.begin(1e6, 1, kind="conv")


def test_round_robin_slows_one_rank_at_a_time():
    stragglers = round_robin_stragglers([1, 2, 3], factor=2.0, period=2, start_step=1, end_step=8, ops="matmul")
    assert [(s.rank, s.start_step, s.end_step) for s in stragglers] == [(1, 1, 3), (2, 3, 5), (3, 5, 7), (1, 7, 8)]
    assert all(s.factor == 2.0 and s.ops == "matmul" for s in stragglers)
    emulation = Emulation(base_gflops=1.0, stragglers=stragglers)
    emulators = [Emulator(1.0, emulation, rank=r) for r in range(4)]
    slowed_by_step = []
    for step in range(10):
        for emulator in emulators:
            emulator.step = step
        slowed_by_step.append([e.rank for e in emulators if e.straggle_factor("matmul") > 1])
        assert all(e.straggle_factor("stage") == 1.0 for e in emulators)
    assert slowed_by_step == [[], [1], [1], [2], [2], [3], [3], [1], [], []]
    # without end_step: one full rotation
    once = round_robin_stragglers([0, 1], factor=3, period=5)
    assert [(s.rank, s.start_step, s.end_step) for s in once] == [(0, 0, 5), (1, 5, 10)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(ranks=[], factor=2.0, period=1), r"ranks must list at least one rank"),
    (dict(ranks=[0], factor=2.0, period=0), r"period must be an integer >= 1 .*got 0"),
    (dict(ranks=[0], factor=0.0, period=1), r"factor must be a number > 0 .*got 0\.0"),
    (dict(ranks=[0], factor=2.0, period=1, start_step=4, end_step=4), r"end_step must be > start_step \(4\), got 4"),
    (dict(ranks=[0], factor=2.0, period=1, ops="conv"), r"ops must be one of 'all', 'matmul' .*got 'conv'"),
])
def test_round_robin_bad_input(kwargs, message):
    with pytest.raises(SpecError, match=message):
        round_robin_stragglers(**kwargs)


# -- 2 gloo ranks: the exchange and detection, every scenario in one process group --------------------
def _run(monitor: StragglerMonitor, rank: int, seconds_of, steps: int) -> dict:
    """Record ``seconds_of(rank, step)`` per step, exchange, compare with the first full-window
    speeds; the step of the first change and every decision, for the test to compare across ranks."""
    reference, first_change, decisions = None, None, []
    for step in range(steps):
        seconds = seconds_of(rank, step)
        monitor.record(step, FLOPS, seconds, matmul_s=0.25 * seconds)
        measured = monitor.exchange(step) if len(monitor.samples) == monitor.window else None
        if measured is None:
            decisions.append(None)
            continue
        if reference is None:
            reference = measured.speeds
        changes = monitor.changed(measured, reference)
        decisions.append((measured, changes))
        if changes and first_change is None:
            first_change = step
    return {"first_change": first_change, "decisions": decisions}


def _scenarios(rank: int, world_size: int) -> dict:
    out = {}
    # exchange: every rank gets every rank's smoothed figures
    monitor = StragglerMonitor(rank, world_size)
    for step in range(3):
        monitor.record(step, FLOPS * (rank + 1), 0.5 + step, matmul_s=0.1)
    out["exchange"] = monitor.exchange(2)
    # rank 1 slows 2x from step 6, for good
    onset = 6
    out["slowdown"] = _run(StragglerMonitor(rank, world_size), rank,
                           lambda r, step: 2.0 if r == 1 and step >= onset else 1.0, 14)
    # +-5% noise on both ranks, independent draws
    draws = {r: random.Random(r).choices([0.95, 0.97, 1.0, 1.03, 1.05], k=20) for r in range(world_size)}
    out["noise"] = _run(StragglerMonitor(rank, world_size, threshold=0.10), rank,
                        lambda r, step: draws[r][step], 20)
    # one step 3x slower on rank 0
    out["spike"] = _run(StragglerMonitor(rank, world_size), rank,
                        lambda r, step: 3.0 if r == 0 and step == 5 else 1.0, 12)
    # exchange_every=3: only steps 0, 3, 6, ... exchange (None elsewhere, on both ranks)
    sparse = StragglerMonitor(rank, world_size, exchange_every=3)
    exchanged = []
    for step in range(7):
        sparse.record(step, FLOPS, 1.0)
        exchanged.append(sparse.exchange(step) is not None)
    out["sparse"] = exchanged
    return out


def test_exchange_and_detection_on_two_ranks():
    results = run_ranks(_scenarios, 2)
    for scenario in ("exchange", "slowdown", "noise", "spike", "sparse"):
        assert results[0][scenario] == results[1][scenario], f"{scenario}: the ranks disagree"
    result = results[0]
    # medians of [0.5, 1.5, 2.5] s; speeds rank r: (r + 1) GFLOP / 1.5 s
    assert result["exchange"] == Measured(2, [1e9 / 1.5, 2e9 / 1.5], [1.5, 1.5], [0.1, 0.1])
    onset = 6
    first = result["slowdown"]["first_change"]
    assert first is not None and onset <= first < onset + 3
    measured, changes = result["slowdown"]["decisions"][first]
    assert measured.speeds == [1e9, 0.5e9]
    assert changes[1] == SpeedChange(1, 1e9, 0.5e9, (0.5 / 1.5) / 0.5)
    assert measured.matmul_s == [0.25, 0.5]
    assert result["noise"]["first_change"] is None
    assert result["spike"]["first_change"] is None
    assert result["sparse"] == [True, False, False, True, False, False, True]
