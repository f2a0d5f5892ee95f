"""The emulator, in one process: modeled time dominates, overruns are counted, collectives stay out.

No timing thresholds beyond ">= modeled": a padded segment can only be slower than its model.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from runtime.emulation.compute import EmulationStats, Emulator, calibrate
from whalelike.cluster import Emulation, Straggler


def test_segment_takes_at_least_its_modeled_time():
    emulator = Emulator(0.5, Emulation(base_gflops=1.0))
    modeled = emulator.modeled_seconds(2e7, 4)  # 2e7 / (0.5 * 1e9) = 40 ms
    assert_close(modeled, 0.04)
    start = time.perf_counter()
    with emulator.segment(2e7, 4):
        torch.ones(8).sum()
    assert time.perf_counter() - start >= modeled
    assert emulator.stats.segments == 1 and emulator.stats.overruns == 0
    assert_close(emulator.stats.modeled_s, modeled)
    assert emulator.stats.padded_s == emulator.stats.modeled_s >= emulator.stats.real_s


def test_overruns_are_counted_not_padded():
    emulator = Emulator(1.0, Emulation(base_gflops=1e12))  # modeled time ~0: every segment overruns
    for _ in range(3):
        with emulator.segment(1.0, 1):
            time.sleep(0.001)
    stats = emulator.stats
    assert stats.segments == stats.overruns == 3
    assert stats.padded_s == stats.real_s and stats.worst_overrun > 1


def test_disabled_emulator_measures_without_padding():
    emulator = Emulator.disabled()
    with emulator.segment(1e12, 1):
        pass
    assert not emulator.enabled and emulator.stats.segments == 1 and emulator.stats.overruns == 0
    assert emulator.stats.modeled_s == 0.0


def test_efficiency_curve_and_straggler_schedule():
    em = Emulation(base_gflops=1.0, half_efficiency_batch=4, stragglers=(Straggler(rank=1, factor=3.0, start_step=2, end_step=4),))
    emulator = Emulator(1.0, em, rank=1)
    # efficiency(b) = b / (b + 4): a batch of 4 runs at half the rate of an infinite batch
    assert_close(emulator.modeled_seconds(1e9, 4), 2.0)
    assert_close(emulator.modeled_seconds(1e9, 12), 4 / 3)
    emulator.step = 2
    assert_close(emulator.modeled_seconds(1e9, 4), 6.0)
    emulator.step = 4
    assert_close(emulator.modeled_seconds(1e9, 4), 2.0)
    assert Emulator(1.0, em, rank=0).straggle_factor() == 1.0


def test_deadline_ends_before_a_collective():
    """begin() ... wait_deadline() is how a comm hook keeps its collective outside the segment:
    the wait happens once, and later calls are no-ops."""
    emulator = Emulator(1.0, Emulation(base_gflops=1.0))
    emulator.begin(1e7, 1)  # 10 ms
    start = time.perf_counter()
    emulator.wait_deadline()
    assert time.perf_counter() - start > 0
    emulator.wait_deadline()
    assert emulator.stats.segments == 1


def test_pad_forward_pads_the_module_and_can_be_removed():
    emulator = Emulator(1.0, Emulation(base_gflops=1.0))
    model = nn.Linear(3, 2)
    unpad = emulator.pad_forward(model, flops_per_sample=5e6)  # 5 ms per sample
    start = time.perf_counter()
    model(torch.randn(4, 3))
    assert time.perf_counter() - start >= 0.02
    assert emulator.stats.segments == 1
    assert_close(emulator.stats.modeled_s, 0.02)
    unpad()
    model(torch.randn(4, 3))
    assert emulator.stats.segments == 1


def test_stats_since_a_snapshot():
    stats = EmulationStats(segments=5, overruns=1, modeled_s=2.0, real_s=1.0, padded_s=2.5, worst_overrun=1.5,
                           flops=8e6, matmul_s=1.25)
    earlier = EmulationStats(segments=2, overruns=1, modeled_s=0.5, real_s=0.25, padded_s=0.75, flops=2e6,
                             matmul_s=0.5)
    assert stats.since(earlier) == EmulationStats(3, 0, 1.5, 0.75, 1.75, 1.5, flops=6e6, matmul_s=0.75)
    assert stats.snapshot() == stats and stats.snapshot() is not stats


def test_segments_record_their_flops_and_matmul_time():
    """Stage segments (pad_forward's too) count FLOPs but no matmul time; matmul segments count both."""
    emulator = Emulator(1.0, Emulation(base_gflops=1.0))
    with emulator.segment(2e6, 1):                   # kind "stage" by default, 2 ms
        pass
    assert emulator.stats.flops == 2e6 and emulator.stats.matmul_s == 0.0
    with emulator.segment(1e6, 1, kind="matmul"):    # 1 ms
        pass
    assert emulator.stats.flops == 3e6
    assert emulator.stats.matmul_s >= 1e-3 and emulator.stats.padded_s >= 3e-3
    model = nn.Linear(3, 2)
    unpad = emulator.pad_forward(model, flops_per_sample=1e5)
    before = emulator.stats.snapshot()
    model(torch.randn(4, 3))
    unpad()
    step = emulator.stats.since(before)
    assert step.flops == 4e5 and step.matmul_s == 0.0 and step.segments == 1
    # a disabled emulator (real hardware) still counts FLOPs, so speeds can be measured
    disabled = Emulator.disabled()
    with disabled.segment(5e6, 1, kind="matmul"):
        pass
    assert disabled.stats.flops == 5e6 and disabled.stats.matmul_s == disabled.stats.padded_s


def test_calibrate_fits_real_compute_inside_the_fastest_modeled_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    result = calibrate(model, (x,), y, F.cross_entropy, speeds=[1.0, 0.5], ranks=4, cores=2, margin=2.0)
    assert result.flops > 0 and result.contention == 2.0
    # By construction the fastest device's modeled time is margin x contention x the real time.
    modeled = result.flops / (1.0 * result.base_gflops * 1e9)
    assert_close(modeled, 2.0 * 2.0 * result.real_s)
    with pytest.raises(ValueError, match="speeds must be positive"):
        calibrate(model, (x,), y, F.cross_entropy, speeds=[0.0], ranks=1)


def test_segments_without_modeled_work_never_overrun():
    """A FLOP-free stage, or a rank with an empty share, has nothing modeled: its real time is no
    overrun (it used to count one per segment, and the Engine warned on every run)."""
    emulator = Emulator(1.0, Emulation(base_gflops=1.0, half_efficiency_batch=4))
    for flops, samples in ((0.0, 4), (0.0, 0), (1e6, 0)):   # samples 0 used to divide by zero
        with emulator.segment(flops, samples):
            time.sleep(0.001)
    stats = emulator.stats
    assert stats.segments == 3 and stats.overruns == 0 and stats.worst_overrun == 0.0
    assert stats.modeled_s == 0.0 and stats.padded_s == stats.real_s > 0
    model = nn.Linear(3, 2)
    emulator.pad_forward(model, flops_per_sample=1e6)
    model(torch.randn(0, 3))   # an empty micro-batch
    assert emulator.stats.segments == 4 and emulator.stats.overruns == 0


def test_busy_for_is_the_time_inside_the_current_segment():
    emulator = Emulator.disabled()
    assert emulator.busy_for() is None
    with emulator.segment(1e6, 1):
        time.sleep(0.001)
        inside = emulator.busy_for()
    assert inside is not None and inside > 0
    assert emulator.busy_for() is None
    emulator.begin(1e6, 1)   # a backward whose comm hook ends the segment
    assert emulator.busy_for() is not None
    emulator.wait_deadline()
    assert emulator.busy_for() is None
