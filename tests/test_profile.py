"""Online profiling (issue 20, items 1-2): ``whalelike profile`` recovers what the emulation was given.

On an emulated cluster of two ranks on two hosts (one device with its own efficiency curve and a
memory bandwidth for its non-matmul bytes), under the CLI as a user runs it (twice, the second run
from the cache, then on a cluster where one device cannot hold one sample, which stops both ranks
with its error): the largest batch of each device exactly (against a plain PyTorch
training step's peak memory, measured in this process: the emulated capacity sits between the
peaks of that batch and the next), each unit's time per sample within 5% of the emulator's own
model of its segments at every measured batch, the link's latency and bandwidth within 10% of the
emulated network's. Then, in this process: the search (Poplar's Algorithm 1) against any edge,
the alpha-beta fit, the speed curves (monotone, positive, no overshoot; a cubic spline's overshoot
shown), the profile file and the cache with their errors, and a unit-cut step's gradients against
the plain model's.

``build`` is also the profiled workload: the CLI loads ``tests/test_profile.py:build``.
"""
from __future__ import annotations

import dataclasses
import math
import re
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.devices.measured_speeds import measured_network
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.interpolate import CubicSpline
from torch.testing import assert_close

import whalelike as wl
from dist_utils import run_ranks
from planner.devices.profile import DeviceProfile, LinkProfile, Profile, ProfileError
from planner.devices.speed_curves import SpeedCurve
from runtime.emulation.compute import Emulator
from runtime.profiling import cache
from runtime.profiling.links import MAX_ROUNDS_FACTOR, Fastest, fit_alpha_beta, link_pairs
from runtime.profiling.search import NothingFitsError, find_max_batch, timed_batches
from runtime.profiling.steps import UnitStep
from runtime.training.memory_meter import MemoryMeter
from runtime.training.precision import Precision
from whalelike.cluster import Cluster
from whalelike.workload import Workload

HERE = Path(__file__).resolve()
TOKENS, FEATURES = 64, 16


# -- the profiled model: per-token MLPs (activations grow with the batch far more than the state) ----
class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate():
            self.a = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, FEATURES))
        with wl.replicate():
            self.b = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, FEATURES))
            self.head = nn.Linear(FEATURES, 10)

    def forward(self, x):
        return self.head(self.b(self.a(x)).mean(dim=1))


def make_batch(n: int, generator: torch.Generator):
    return (torch.randn(n, TOKENS, FEATURES, generator=generator),), torch.randint(0, 10, (n,), generator=generator)


def build() -> Workload:
    torch.manual_seed(0)
    return Workload(model=TokenMLP(), example_args=(torch.randn(4, TOKENS, FEATURES),), loss_fn=F.cross_entropy,
                    make_batch=make_batch)


def _reference_peaks(batches) -> dict[int, int]:
    """Peak bytes of a plain PyTorch training step (AdamW at learning rate 0, as the profile runs
    it, after a first step made its state) at each batch, measured by the runtime's meter."""
    workload = build()
    model = workload.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    meter = MemoryMeter(torch.device("cpu"), enabled=True)
    peaks = {}
    for batch in [1, *batches]:
        (x,), y = make_batch(batch, torch.Generator().manual_seed(batch))
        optimizer.zero_grad(set_to_none=True)
        with meter.step([model], optimizer):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        peaks[batch] = meter.peak_bytes
    return peaks


# -- the spawn: the CLI twice on two ranks ----------------------------------------------------------
LATENCY_US, GBPS = 5000.0, 0.05
EDGES = {"emu-a-0": 6, "emu-b-0": 3}           # the largest batch each device is given
SPEEDS = {"emu-a-0": 1.0, "emu-b-0": 0.5}
# emu-b also has an efficiency curve of its own and a memory bandwidth for its non-matmul bytes
REALISM = {"emu-a-0": {}, "emu-b-0": {"emulated_half_efficiency_batch": 4, "emulated_memory_gbps": 0.02}}


def _cluster_file(tmp_path: Path, edges: dict = EDGES, file: str = "cluster.yaml") -> Path:
    peaks = _reference_peaks(range(1, max(EDGES.values()) + 2))
    devices = []
    for name, kind in (("emu-a-0", "emu-a"), ("emu-b-0", "emu-b")):
        edge = edges[name]
        # between the peak that fits and the next (edge 0: less than one sample's step)
        capacity = (peaks[edge] + peaks[edge + 1]) // 2 if edge else peaks[1] // 2
        devices.append({"name": f"host-{kind}", "devices": [
            {"kind": kind, "peak_tflops": SPEEDS[name] * 0.1 / 1000 / 0.4, "memory_gib": capacity / 2**30,
             "emulated_speed": SPEEDS[name], **REALISM[name]}]})
    spec = {"name": "profile-test", "network": {"intra_host_gbps": GBPS, "inter_host_gbps": GBPS,
                                                "latency_us": LATENCY_US},
            "emulation": {"base_gflops": 0.1, "half_efficiency_batch": 2, "enforce_memory": True},
            "hosts": devices}
    path = tmp_path / file
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _profile_runs(rank, world_size, runs):
    """``whalelike profile`` with each argument list in turn on this rank: exit codes and stderr."""
    import contextlib
    import io

    from whalelike.cli import main

    out = []
    for argv in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        out.append((code, err.getvalue()))
    return out


def _adamw_ns_per_byte(model, repeats: int = 5) -> float:
    """AdamW's step over ``model``'s parameters (gradients of ones), the median, ns per parameter byte."""
    import copy
    import statistics
    import time

    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(params)
    opt.step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) / sum(p.numel() * p.element_size() for p in params) * 1e9


def test_profile_recovers_what_the_emulation_was_given(tmp_path):
    cluster_path = _cluster_file(tmp_path)
    cluster = Cluster.from_yaml(cluster_path)
    common = ["profile", f"{HERE}:build", "--cluster", str(cluster_path), "--cache-dir", str(tmp_path / "cache"),
              "--max-batch", "64"]
    first = [*common, "-o", str(tmp_path / "profile.yaml"), "--plot", str(tmp_path / "curves.png")]
    second = [*common, "-o", str(tmp_path / "again.yaml")]
    # then a cluster whose emu-b cannot hold one sample's step: both ranks stop with rank 1's error
    small = _cluster_file(tmp_path, {**EDGES, "emu-b-0": 0}, file="small.yaml")
    third = ["profile", f"{HERE}:build", "--cluster", str(small), "--cache-dir", str(tmp_path / "other-cache"),
             "-o", str(tmp_path / "never.yaml"), "--timeout", "60"]
    results = run_ranks(_profile_runs, 2, args=([first, second, third],), init_process_group=False, timeout_s=240)
    for rank, runs in enumerate(results):
        assert [code for code, _ in runs] == [0, 0, 2], runs
        assert "rank 1: device emu-b-0 (emu-b) cannot run a training step of one sample" in runs[2][1]
    assert "profiled 2 devices (2 measured, 0 from the cache)" in results[0][0][1]      # rank 0's total time
    assert "profiled 2 devices (0 measured, 2 from the cache)" in results[0][1][1]
    assert not (tmp_path / "never.yaml").exists()

    workload = build()
    graphs = wl.capture(workload.model, workload.example_args)
    profile = Profile.from_yaml(tmp_path / "profile.yaml", graphs=graphs, cluster=cluster, precision="fp32")
    assert [d.name for d in profile.devices] == list(EDGES)
    for rank, device in enumerate(profile.devices):
        assert not device.cached
        assert (device.max_batch, device.edge) == (EDGES[device.name], "memory")
        assert device.batches == timed_batches(EDGES[device.name])
        emulator = Emulator.for_device(cluster, device.name, rank)
        try:
            for unit, tg in enumerate(graphs.graphs):
                layers = [graphs.layers[i] for i in tg.layers]
                moved = (sum(l.forward_memory_bytes for l in layers), sum(l.backward_memory_bytes for l in layers))
                for batch, (forward, backward) in device.times[unit].items():
                    modeled = (emulator.modeled_seconds(tg.forward_flops * batch, batch, memory_bytes=moved[0] * batch)
                               + emulator.modeled_seconds(tg.backward_flops * batch, batch,
                                                          memory_bytes=moved[1] * batch))
                    # the runtime records a padded segment at its modeled time unless real compute overran
                    # it (steps that overran are run again): within 5%
                    assert_close((forward + backward) / batch, modeled / batch, rtol=0.05, atol=0.0,
                                 msg=f"{device.name}, unit {unit}, batch {batch}")
        finally:
            emulator.network.close()
        assert set(device.memory_bytes) == set(device.batches)
        assert max(device.memory_bytes.values()) <= device.capacity_bytes
        # the optimizer's update is timed at the machine's own speed (the runtime does not pad it): the
        # same AdamW step timed here, within the noise of ranks sharing the cores
        assert 0.1 * _adamw_ns_per_byte(workload.model) < device.update_ns_per_byte < 10 * _adamw_ns_per_byte(
            workload.model), device.update_ns_per_byte
        # and the step's time outside its units' compute segments, per forward or backward: some, far below a step
        assert 0 < device.action_overhead_s < device.step_seconds(1), device.action_overhead_s
    ring = profile.link("collective")   # a ring all-reduce over both devices, fitted per ring step
    assert (ring.src, ring.dst) == ("emu-a-0", "emu-b-0") and len(ring.points) == 4
    assert ring.latency_s >= 0 and ring.seconds_per_byte > 0
    assert "ring all-reduce over the 2 devices" in profile.summary()
    measured = measured_network(cluster.network, profile)
    assert measured.collective_latency_us == pytest.approx(ring.latency_us)
    link = profile.link("inter-host")
    assert profile.link("intra-host") is None          # one device per host: no pair within a host
    assert (link.src, link.dst) == ("emu-a-0", "emu-b-0")
    assert_close(link.latency_us, LATENCY_US, rtol=0.10, atol=0.0)
    assert_close(link.gbps, GBPS, rtol=0.10, atol=0.0)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = Profile.from_yaml(tmp_path / "again.yaml", graphs=graphs, cluster=cluster)
    assert all(d.cached for d in again.devices)       # the second run measured nothing but the links
    for before, after in zip(profile.devices, again.devices):
        assert dataclasses.replace(after, cached=False) == before
    assert len(os.listdir(tmp_path / "cache")) == 2   # one entry per (model, kind, precision)


def test_profile_outside_torchrun_says_how_to_launch_it(tmp_path, capsys, monkeypatch):
    from whalelike.cli import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    code = main(["profile", f"{HERE}:build", "--cluster", "emulated-4", "-o", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "torchrun --nproc-per-node 4 -m whalelike.cli profile" in err
    assert not (tmp_path / "p.yaml").exists()
    code = main(["profile", f"{HERE}:build", "--cluster", "emulated-4", "-o", str(tmp_path / "p.txt")])
    assert code == 2 and "expected a YAML file" in capsys.readouterr().err
    # under torchrun: every check that needs no peer fails alike on every rank, before the rendezvous
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    bad = {("--cluster", "emulated-4"): "has 4 devices but this run has 2 ranks; launch one rank per device",
           ("--max-batch", "0"): "profile: cap must be >= 1",
           ("--timeout", "0"): "timeout_s (--timeout) must be a positive, finite number of seconds",
           ("--precision", "bf16"): "emu-half cannot run bf16"}
    for (option, value), message in bad.items():
        argv = {"--cluster": "emulated-2", **{option: value}}
        flags = [x for kv in argv.items() for x in kv]
        code = main(["profile", f"{HERE}:build", "-o", str(tmp_path / "p.yaml"), *flags])
        assert code == 2 and message in capsys.readouterr().err, (option, value)


# -- the search: Poplar's Algorithm 1 ----------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(edge=st.integers(1, 5000), estimate=st.one_of(st.none(), st.integers(1, 10_000)), cap=st.integers(1, 4096))
def test_the_search_finds_the_largest_batch_that_fits_exactly(edge, estimate, cap):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= edge

    found = find_max_batch(fits, estimate, cap)
    assert found.max_batch == min(edge, cap)
    assert found.edge == ("cap" if edge >= cap else "memory")
    assert len(tried) == len(set(tried)) and [b for b, _ in found.trials] == tried
    assert all(b <= cap for b in tried)
    if found.edge == "memory":
        assert found.max_batch + 1 in tried           # the edge is proven by one more sample failing
    assert len(tried) <= 2 * math.log2(max(found.max_batch, 1) + 1) + 2 * math.log2(max(estimate or 1, cap)) + 4


def test_the_search_grows_by_powers_of_two_then_bisects():
    found = find_max_batch(lambda b: b <= 21, estimate=100, cap=1024)
    assert [b for b, _ in found.trials] == [1, 2, 4, 8, 16, 32, 24, 20, 22, 21]
    low = find_max_batch(lambda b: b <= 40, estimate=5, cap=1024)     # an estimate too low is not trusted
    assert [b for b, _ in low.trials] == [1, 2, 4, 5, 10, 20, 40, 80, 60, 50, 45, 42, 41]
    assert low.max_batch == 40
    with pytest.raises(NothingFitsError):
        find_max_batch(lambda b: False, estimate=None, cap=8)
    assert timed_batches(21) == [1, 2, 4, 8, 16, 21] and timed_batches(16) == [1, 2, 4, 8, 16]


# -- links: the alpha-beta fit and the pairs ---------------------------------------------------------
def test_alpha_beta_fit_recovers_the_line_and_stays_non_negative():
    sizes = [4096 * 8**k for k in range(4)]
    alpha, beta = fit_alpha_beta({s: 2e-3 + s * 4e-8 for s in sizes})
    assert_close((alpha, beta), (2e-3, 4e-8), rtol=1e-6, atol=0.0)
    noisy = {s: (2e-3 + s * 4e-8) * f for s, f in zip(sizes, (1.03, 0.98, 1.02, 0.99))}
    alpha, beta = fit_alpha_beta(noisy)
    assert_close((alpha, beta), (2e-3, 4e-8), rtol=0.05, atol=0.0)
    alpha, beta = fit_alpha_beta({4096: 1e-6, 32768: 2e-6})      # a link faster than its latency says
    assert alpha >= 0 and beta > 0


def _exchanges(fastest: Fastest, times) -> int:
    """Run a ping-pong's stopping rule over ``times`` (one per exchange, the untimed first included)
    as the sender does: asked before each exchange; how many exchanges were made."""
    times = iter(times)
    while True:
        another = fastest.more()
        fastest.add(next(times))
        if not another:
            return fastest.exchanges


def test_a_ping_pong_times_more_exchanges_while_the_fastest_still_moves():
    """Quiet: ``repeats`` plus two timed exchanges; a loaded machine whose clean exchange comes late
    is timed until it lands and the fastest holds; a machine that never settles stops at the cap."""
    quiet = Fastest(5)
    assert _exchanges(quiet, [9.0] + [1.0] * 50) == 1 + 5 + 2 and quiet.seconds == 1.0
    loaded = [2.0, 1.8, 1.9, 1.6, 1.7, 1.5, 1.55, 1.4, 1.45, 1.3]    # delays that vary, until a clean one
    assert min(loaded[:5]) == 1.6                                     # what the fastest of five would say
    late = Fastest(5)
    assert _exchanges(late, [9.0] + loaded + [1.0] * 50) == 1 + len(loaded) + 1 + 5 + 1
    assert late.seconds == 1.0
    falling = Fastest(5)     # every exchange faster than the last by 2%: capped
    assert _exchanges(falling, [9.0] + [0.98 ** k for k in range(100)]) == MAX_ROUNDS_FACTOR * 5 + 1
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        Fastest(0)


def test_link_pairs_pick_one_pair_per_kind_of_link():
    cluster = Cluster.from_dict({"name": "two-by-two", "network": {"intra_host_gbps": 1, "inter_host_gbps": 1,
                                                                   "latency_us": 1},
                                 "hosts": [{"name": "x", "devices": [{"kind": "k", "count": 2, "peak_tflops": 1,
                                                                      "memory_gib": 1}]},
                                           {"name": "y", "devices": [{"kind": "k", "count": 2, "peak_tflops": 1,
                                                                      "memory_gib": 1}]}]})
    assert link_pairs(cluster) == [("intra-host", 0, 1), ("inter-host", 0, 2)]
    assert link_pairs(Cluster.preset("emulated-4")) == [("intra-host", 0, 1)]


# -- speed curves ----------------------------------------------------------------------------------
def _powers(count: int) -> list[int]:
    return [2**k for k in range(count)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=11), st.booleans())
def test_curves_through_monotone_points_are_monotone_and_positive(values, rising):
    points = dict(zip(_powers(len(values)), sorted(values, reverse=not rising)))
    curve = SpeedCurve(points)
    dense = np.exp2(np.linspace(0, math.log2(max(points)) + 1, 400))
    y = curve(dense)
    assert np.all(y > 0)
    steps = np.diff(y)
    assert np.all(steps >= -1e-15) if rising else np.all(steps <= 1e-15)
    assert_close(curve(np.array(list(points), dtype=float)), np.array(list(points.values())))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=11))
def test_curves_never_leave_the_values_of_adjacent_points(values):
    batches = _powers(len(values))
    curve = SpeedCurve(dict(zip(batches, values)))
    for (b0, y0), (b1, y1) in zip(zip(batches, values), zip(batches[1:], values[1:])):
        y = curve(np.linspace(b0, b1, 50))
        assert np.all(y >= min(y0, y1) - 1e-15) and np.all(y <= max(y0, y1) + 1e-15)
    assert curve(0.5 * batches[0] + 0.5) == values[0] and curve(4 * batches[-1]) == values[-1]   # flat outside


def test_a_cubic_spline_overshoots_a_falling_curve_where_pchip_does_not():
    """Why PCHIP (planner.devices.speed_curves): a device's time per sample falls steeply, then
    flattens; a cubic spline through such points rises between them and dips below zero."""
    points = {1: 1.0, 2: 0.05, 4: 0.04, 8: 0.04, 16: 0.04}
    x = np.log2(list(points))
    dense = np.linspace(0, 4, 400)
    spline = CubicSpline(x, list(points.values()))(dense)
    assert spline.min() < 0 and np.any(np.diff(spline) > 0)
    pchip = SpeedCurve(points)(np.exp2(dense))
    assert pchip.min() >= 0.04 and np.all(np.diff(pchip) <= 1e-15)


def test_a_curve_refuses_what_is_not_a_measurement():
    for bad in ({}, {0: 1.0}, {1: -1.0}, {1: float("nan")}, {1.5: 1.0}):
        with pytest.raises(ValueError):
            SpeedCurve(bad)
    with pytest.raises(ValueError, match="batch sizes are >= 1"):
        SpeedCurve({1: 1.0})(0)


# -- the profile file and its errors -----------------------------------------------------------------
@pytest.fixture(scope="module")
def measured():
    """A profile of ``build``'s model on the two-host test cluster, made in this process as the
    spawn writes one (figures from the emulator's model), and the graphs it belongs to."""
    workload = build()
    graphs = wl.capture(workload.model, workload.example_args)
    cluster = Cluster.preset("emulated-2")
    devices = []
    for d in cluster.devices:
        times = {u: {b: (1e-3 * b * (u + 1), 2e-3 * b * (u + 1)) for b in timed_batches(5)} for u in range(len(graphs))}
        devices.append(DeviceProfile(name=d.name, kind=d.kind, host=d.host, max_batch=5, edge="memory", times=times,
                                     memory_bytes={b: 1000 * b for b in timed_batches(5)}, capacity_bytes=10_000))
    link = LinkProfile(kind="intra-host", src=devices[0].name, dst=devices[1].name, latency_s=5e-5,
                       seconds_per_byte=5e-10, points={4096: 5.2e-5, 32768: 6.6e-5, 262144: 1.8e-4})
    profile = Profile(model_fingerprint=graphs.fingerprint, cluster=cluster.name, precision="fp32", optimizer="adamw",
                      unit="taskgraph", warmup=1, repeats=3, seconds=1.5, devices=tuple(devices), links=(link,))
    return profile, graphs, cluster


def test_a_profile_round_trips_through_its_file(tmp_path, measured):
    profile, graphs, cluster = measured
    profile.to_yaml(tmp_path / "p.yaml")
    assert Profile.from_yaml(tmp_path / "p.yaml", graphs=graphs, cluster=cluster, precision="fp32") == profile
    assert "emu-full-0" in profile.summary() and "intra-host link" in profile.summary()
    curve = profile.devices[0].curve()
    assert_close(curve(4), profile.devices[0].step_seconds(4) / 4)


def test_a_profile_of_another_model_cluster_or_precision_is_refused(tmp_path, measured):
    profile, graphs, cluster = measured
    path = tmp_path / "p.yaml"
    profile.to_yaml(path)
    other = wl.capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    with pytest.raises(ProfileError,
                       match=r"p\.yaml: the profile was measured for another model.*whalelike.cli profile"):
        Profile.from_yaml(path, graphs=other)
    with pytest.raises(ProfileError, match="measured on cluster 'emulated-2', not 'emulated-4'"):
        Profile.from_yaml(path, cluster=Cluster.preset("emulated-4"))
    renamed = dataclasses.replace(cluster, devices=(cluster.devices[1], cluster.devices[0]))
    with pytest.raises(ProfileError, match="differ from cluster 'emulated-2'.* at rank 0"):
        profile.validate(cluster=renamed)
    with pytest.raises(ProfileError, match="measured at precision fp32, not bf16.*--precision bf16"):
        Profile.from_yaml(path, precision="bf16")


@pytest.mark.parametrize("edit, message", [
    (lambda text: text.replace("max_batch: 5", "max_batch: 4", 1), "batch 5, outside 1..max_batch"),
    (lambda text: text.replace("0.001, 0.002", "-0.001, 0.002", 1), "must be >= 0"),
    (lambda text: text.replace("edge: memory", "edge: guessed", 1), "edge must be one of"),
    (lambda text: text.replace("    1:\n      1:", "    1:\n      3:", 1), "timed at batches"),
    (lambda text: text.replace("cluster: emulated-2\n", "", 1), "missing required key 'cluster'"),
    (lambda text: text + "  - [", "malformed YAML"),
    (lambda text: "", "must be a mapping"),
])
def test_a_corrupt_profile_file_is_a_clear_error(tmp_path, measured, edit, message):
    profile = measured[0]
    path = tmp_path / "p.yaml"
    profile.to_yaml(path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(ProfileError, match=rf"^{re.escape(str(path))}.*{message}"):
        Profile.from_yaml(path)


# -- the cache ---------------------------------------------------------------------------------------
def test_the_cache_keeps_a_kind_and_refuses_a_broken_entry(tmp_path, measured):
    profile = measured[0]
    device = profile.devices[0]
    settings_ = cache.Settings(optimizer="adamw", unit="taskgraph", cap=64, warmup=1, repeats=3)
    entry = cache.Entry(model_fingerprint=profile.model_fingerprint, kind=device.kind, precision="fp32",
                        cluster=profile.cluster, settings=settings_, device=device)
    path = cache.store(str(tmp_path), entry)
    loaded = cache.load(str(tmp_path), profile.model_fingerprint, device.kind, "fp32")
    assert loaded == entry and loaded.answers(settings_) is None
    assert cache.load(str(tmp_path), profile.model_fingerprint, device.kind, "bf16") is None
    other = loaded.for_device("emu-full-7", "elsewhere")
    assert (other.name, other.host, other.cached, other.times) == ("emu-full-7", "elsewhere", True, device.times)
    # found by running out of memory below the cap: answers any cap above it, not other settings
    assert loaded.answers(dataclasses.replace(settings_, cap=1024)) is None
    assert "repeats" in loaded.answers(dataclasses.replace(settings_, repeats=5))
    capped = dataclasses.replace(entry, device=dataclasses.replace(device, edge="cap"),
                                 settings=dataclasses.replace(settings_, cap=5))
    assert "cap" in capped.answers(dataclasses.replace(settings_, cap=1024))
    text = Path(path).read_text()
    Path(path).write_text(text.replace(f"kind: {device.kind}", "kind: emu-other", 1))
    with pytest.raises(cache.CacheError, match="not the key its name says.*--refresh"):
        cache.load(str(tmp_path), profile.model_fingerprint, device.kind, "fp32")
    Path(path).write_text(text.replace("max_batch: 5", "max_batch: -1", 1))
    with pytest.raises(cache.CacheError, match=r"profile cache: .*max_batch must be >= 1.*rm "):
        cache.load(str(tmp_path), profile.model_fingerprint, device.kind, "fp32")


# -- a unit-cut step computes what the model computes ---------------------------------------------------
def test_a_unit_cut_step_computes_the_plain_models_gradients_and_leaves_it_unchanged():
    workload = build()
    reference = build().model.double()
    model = workload.model.double()
    (x,), y = make_batch(5, torch.Generator().manual_seed(5))
    x = x.double()
    graphs = wl.capture(model, (x,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for unit in ("taskgraph", "layer"):
        step = UnitStep(graphs, unit, F.cross_entropy, Emulator.disabled(), torch.device("cpu"), Precision("fp32"))
        assert step.units == (len(graphs.graphs) if unit == "taskgraph" else len(graphs.layers))
        reference.zero_grad(set_to_none=True)
        F.cross_entropy(reference(x), y).backward()
        assert step.prepare((x,), y) and step.fits((x,), y)[0]
        times = step.timed((x,), y, 5)
        assert len(times) == step.units and all(f >= 0 and b >= 0 for f, b in times)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad, q.grad, msg=name)
        assert_close(model.state_dict(), before)     # the optimizer runs at learning rate 0


def test_a_kind_s_costs_outside_compute_are_one_figure(measured):
    """``runtime.profiling.run.kind_figures``: the devices of a kind measured in this run share the median
    of their update and per-action figures (identical devices measured apart must not get unequal shares
    for noise); a cached device keeps its entry's; compute times stay each device's."""
    from runtime.profiling.run import kind_figures

    profile, _, _ = measured
    first = profile.devices[0]
    same = [dataclasses.replace(first, name=f"emu-same-{i}", update_ns_per_byte=rate, action_overhead_s=rate * 1e-4)
            for i, rate in enumerate((4.0, 6.0, 5.5))]
    cached = dataclasses.replace(first, name="emu-same-cached", update_ns_per_byte=9.0, cached=True)
    other = dataclasses.replace(profile.devices[1], kind="another-kind", update_ns_per_byte=1.0)
    out = kind_figures([*same, cached, other])
    assert [d.update_ns_per_byte for d in out] == [5.5, 5.5, 5.5, 9.0, 1.0]
    assert [d.action_overhead_s for d in out[:3]] == [pytest.approx(5.5e-4)] * 3
    assert all(d.times == first.times for d in out[:3]) and [d.name for d in out] == [d.name for d in
                                                                                      [*same, cached, other]]
