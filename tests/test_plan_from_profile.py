"""Planning from a profile (planner.devices.measured_speeds, ``planner.plan(..., profile=)``).

The profiles here are what a perfect measurement of the emulated preset would give: each unit's
seconds are the emulator's own modeled time (runtime.emulation.compute.Emulator.modeled_seconds) on
each device, so the planner is tested on what it does with measurements; measuring them is
tests/test_profile.py's subject. The preset ``emulated-equal-peak`` lies: its two kinds have equal
spec-sheet peaks, but one reaches half its peak at a micro-batch of 2 and the other only at 16.
"""
from __future__ import annotations

import dataclasses

import pytest

import planner
import whalelike as wl
from planner.devices.measured_speeds import best_batch, device_rate, measured_cluster, unit_flops
from planner.devices.profile import DeviceProfile, LinkProfile, Profile, ProfileError
from planner.balance.replan import repriced, repriced_plan
from planner.plan import Plan
from runtime.emulation.compute import Emulator
from synthetic import synthetic_model
from whalelike.cluster import Cluster

BATCHES = (1, 2, 4, 8, 16, 32)
GLOBAL_BATCH = 64


def _graphs():
    return synthetic_model(num_layers=4, strategies=[wl.replicate(4)], hidden=64, seq=8, heads=4)


def _cluster() -> Cluster:
    return Cluster.preset("emulated-equal-peak")


def emulated_profile(graphs, cluster: Cluster, precision: str = "fp32", latency_s: float = 20e-6,
                     gbps: float = 4.0) -> Profile:
    """The profile a perfect measurement of ``cluster``'s emulation would give (per TaskGraph)."""
    devices = []
    for rank, d in enumerate(cluster.devices):
        emulator = Emulator.for_device(cluster, d.name, rank, precision)
        times = {g.index: {b: (emulator.modeled_seconds(g.forward_flops * b, b),
                               emulator.modeled_seconds(g.backward_flops * b, b)) for b in BATCHES}
                 for g in graphs.graphs}
        devices.append(DeviceProfile(d.name, d.kind, d.host, max_batch=BATCHES[-1], edge="cap", times=times,
                                     memory_bytes={b: 1 << 20 for b in BATCHES}))
    points = {n: latency_s + n / (gbps * 1e9) for n in (1 << 10, 1 << 16, 1 << 20)}
    link = LinkProfile("intra-host", cluster.devices[0].name, cluster.devices[1].name, latency_s, 1 / (gbps * 1e9),
                       points)
    return Profile(graphs.fingerprint, cluster.name, precision, "adamw", "taskgraph", warmup=1, repeats=3,
                   seconds=12.0, devices=tuple(devices), links=(link,))


def _samples(plan: Plan, kind: str, cluster: Cluster) -> int:
    kinds = {d.name: d.kind for d in cluster.devices}
    return sum(w.batch_share for w in plan.workers if kinds[w.device] == kind)


def test_a_profile_rates_devices_by_what_they_measured():
    graphs, cluster = _graphs(), _cluster()
    profile = emulated_profile(graphs, cluster)
    flops = unit_flops(graphs, profile)
    hbm, gddr = profile.device("emu-hbm-0"), profile.device("emu-gddr-0")
    # the best-throughput batch is the largest measured (both saturate towards it)
    assert best_batch(hbm, flops, [0]) == best_batch(gddr, flops, [0]) == 32
    # at a micro-batch of 8: b/(b+2) against b/(b+16), 0.8 against 1/3: 2.4x, where the spec says 1x
    assert device_rate(hbm, flops, sizes=[8]) / device_rate(gddr, flops, sizes=[8]) == pytest.approx(2.4)
    measured = measured_cluster(cluster, profile, graphs, "fp32")
    assert measured.network.intra_host_gbps == pytest.approx(4.0) and measured.network.latency_us == pytest.approx(20)
    # the spec sheet's figures are left alone; the measured rate is what the planner reads
    assert [d.peak_tflops for d in measured.devices] == [d.peak_tflops for d in cluster.devices]
    assert all(d.measured("fp32") for d in measured.devices)


def test_the_plan_from_a_profile_gives_the_faster_kind_more_and_is_faster_where_the_spec_lies():
    graphs, cluster = _graphs(), _cluster()
    profile = emulated_profile(graphs, cluster)
    config = wl.Config(global_batch_size=GLOBAL_BATCH)
    spec = planner.plan(graphs, cluster, config)
    measured = planner.plan(graphs, cluster, config, profile=profile)
    assert spec.speeds == "spec" and measured.speeds == "profile"
    # equal peaks: the spec sheet splits evenly; the profile gives the kind that measured faster more
    assert _samples(spec, "emu-hbm", cluster) == _samples(spec, "emu-gddr", cluster)
    assert _samples(measured, "emu-hbm", cluster) > _samples(measured, "emu-gddr", cluster)
    # both priced at the speeds each runs at (its own micro-batch sizes): the profiled plan is faster
    spec_at_measured = repriced(spec, graphs, measured_cluster(cluster, profile, graphs, "fp32", plan=spec))
    assert measured.prediction.step_time_ms < spec_at_measured.step_time_ms
    # and its prediction is its own sizes' (re-rating it changes nothing)
    again = repriced(measured, graphs, measured_cluster(cluster, profile, graphs, "fp32", plan=measured))
    assert again.step_time_ms == pytest.approx(measured.prediction.step_time_ms)
    # and so are its workers' timing fields (what the summary shows)
    rebuilt = repriced_plan(measured, graphs, measured_cluster(cluster, profile, graphs, "fp32", plan=measured))
    assert [w.compute_ms for w in measured.workers] == pytest.approx([w.compute_ms for w in rebuilt.workers])


def test_the_naive_baseline_from_a_profile_is_priced_as_the_plans_own_naive_candidate():
    """``train.py --compare-naive --profile``: the naive run's prediction from the same measurements."""
    graphs, cluster = _graphs(), _cluster()
    profile = emulated_profile(graphs, cluster)
    config = wl.Config(global_batch_size=GLOBAL_BATCH)
    naive = planner.naive_plan(graphs, cluster, config, profile=profile)
    assert naive.speeds == "profile" and planner.naive_plan(graphs, cluster, config).speeds == "spec"
    measured = planner.plan(graphs, cluster, config, profile=profile)
    assert naive.prediction.step_time_ms == pytest.approx(measured.naive_prediction.step_time_ms)
    assert naive.naive_prediction == naive.prediction
    # the same layout as from the spec sheet, only priced differently (equal peaks, unequal measured speeds)
    spec = planner.naive_plan(graphs, cluster, config)
    assert [w.batch_share for w in naive.workers] == [w.batch_share for w in spec.workers]
    assert naive.prediction.step_time_ms != pytest.approx(spec.prediction.step_time_ms)


def test_plan_files_say_where_the_speeds_came_from(tmp_path):
    graphs, cluster = _graphs(), _cluster()
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=GLOBAL_BATCH),
                        profile=emulated_profile(graphs, cluster))
    plan.to_yaml(tmp_path / "p.yaml")
    assert Plan.from_yaml(tmp_path / "p.yaml").speeds == "profile"
    data = plan.to_dict()
    del data["speeds"]          # a plan file written before profiles: spec-sheet speeds
    assert Plan.from_dict(data).speeds == "spec"
    data["speeds"] = "guessed"
    with pytest.raises(wl.SpecError, match=r"plan.speeds must be one of .*'spec'.*'profile'.*got 'guessed'"):
        Plan.from_dict(data)


def test_a_profile_of_another_model_cluster_or_precision_is_refused():
    graphs, cluster = _graphs(), _cluster()
    profile = emulated_profile(graphs, cluster)
    config = wl.Config(global_batch_size=GLOBAL_BATCH)
    other = synthetic_model(num_layers=5, strategies=[wl.replicate(4)], hidden=64, seq=8, heads=4)
    with pytest.raises(ProfileError, match="fingerprint|another model|model"):
        planner.plan(other, cluster, config, profile=profile)
    with pytest.raises(ProfileError, match="cluster"):
        planner.plan(graphs, Cluster.preset("emulated-4"), config, profile=profile)
    with pytest.raises(ProfileError, match="precision|fp32|bf16"):
        planner.plan(graphs, cluster, dataclasses.replace(config, precision="bf16"), profile=profile)


def test_whalelike_plan_with_a_profile(tmp_path, capsys):
    from whalelike.cli import load_workload, main
    from whalelike.graphs.capture import capture

    workload = load_workload("examples/wide_mlp.py:build")
    graphs = capture(workload.model, workload.example_args, workload.example_kwargs, optimizer="adamw")
    cluster = _cluster()
    emulated_profile(graphs, cluster).to_yaml(tmp_path / "profile.yaml")
    argv = ["plan", "examples/wide_mlp.py:build", "--cluster", "emulated-equal-peak", "--global-batch", "32"]
    assert main([*argv, "--profile", str(tmp_path / "profile.yaml"), "-o", str(tmp_path / "plan.yaml")]) == 0
    assert "device speeds and links measured by whalelike profile" in capsys.readouterr().out
    assert Plan.from_yaml(tmp_path / "plan.yaml").speeds == "profile"
    # a profile measured at another precision: one line naming the file and how to measure the right one
    assert main([*argv, "--profile", str(tmp_path / "profile.yaml"), "--precision", "bf16",
                 "-o", str(tmp_path / "bf16.yaml")]) != 0
    error = capsys.readouterr().err
    assert "profile.yaml" in error and "bf16" in error and not (tmp_path / "bf16.yaml").exists()


def test_re_plans_for_measured_speeds_start_from_the_profile():
    """runtime.Engine(profile=...): the straggler monitor's speeds re-plan on the profile's rates and
    links (runtime.balance.rebalance), not on the spec sheet's."""
    from runtime.balance.rebalance import BalanceConfig, Rebalancer

    graphs, cluster = _graphs(), _cluster()
    profile = emulated_profile(graphs, cluster, gbps=0.05)    # links far slower than the spec's 2 GB/s
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=GLOBAL_BATCH), profile=profile)

    def view(profile):      # what the Rebalancer reads of a step boundary
        from types import SimpleNamespace
        return SimpleNamespace(runtime=SimpleNamespace(cluster=cluster, plan=plan), plan=plan, graphs=_graphs(),
                               profile=profile, figures={})

    speeds = [3.0, 3.0, 1.0, 1.0]     # as measured: the first two ranks three times faster
    with_profile = Rebalancer(BalanceConfig.of("exact"), 0, 4)._new_plan(view(profile), speeds)[0]
    without = Rebalancer(BalanceConfig.of("exact"), 0, 4)._new_plan(view(None), speeds)[0]
    # the same shares (the measured speeds decide them), priced on the measured links: slower
    assert [w.micro_batch_sizes for w in with_profile.workers] == [w.micro_batch_sizes for w in without.workers]
    assert with_profile.prediction.step_time_ms > without.prediction.step_time_ms


def test_the_measured_update_is_priced_on_each_worker_for_the_parameters_it_updates():
    """A profile's update rate (``DeviceProfile.update_ns_per_byte``) prices each worker's optimizer
    update: its parameter bytes at its device's rate, after its last collective; under ZeRO its shard's.
    The step grows by the slowest-finishing worker's update, and a profile without the rate prices none."""
    graphs, cluster = _graphs(), _cluster()
    config = wl.Config(global_batch_size=GLOBAL_BATCH)
    plain = emulated_profile(graphs, cluster)
    rates = {"emu-hbm": 2.0, "emu-gddr": 0.5}   # ns per byte
    profile = dataclasses.replace(plain, devices=tuple(dataclasses.replace(d, update_ns_per_byte=rates[d.kind])
                                                       for d in plain.devices))
    unpriced = planner.plan(graphs, cluster, config, profile=plain)
    priced = planner.plan(graphs, cluster, config, profile=profile)
    assert all(w.update_ms == 0 for w in unpriced.workers)
    param_bytes = sum(l.param_bytes for l in graphs.layers)
    kinds = {d.name: d.kind for d in cluster.devices}
    for w in priced.workers:   # DDP: every worker updates the whole model
        assert w.update_ms == pytest.approx(param_bytes * rates[kinds[w.device]] * 1e-6)
    from planner.schedule.simulator import simulate
    result = simulate(priced, network=cluster)
    updates = {e.rank: e for e in result.events if e.kind == "update"}
    assert sorted(updates) == [w.rank for w in priced.workers]
    # the steady state: each worker's step starts with its update of the step before, then computes
    for w in priced.workers:
        assert (updates[w.rank].start_ms, updates[w.rank].end_ms) == (0.0, pytest.approx(w.update_ms))
        first = min(e.start_ms for e in result.events if e.rank == w.rank and e.kind == "F")
        assert first >= updates[w.rank].end_ms - 1e-9
    assert all(t.update_ms == w.update_ms for t, w in zip(result.workers, priced.workers))
    # the same plan without its updates is that much faster: nothing else moved
    bare = dataclasses.replace(priced, workers=[dataclasses.replace(w, update_ms=0.0) for w in priced.workers])
    assert simulate(bare, network=cluster).step_time_ms < result.step_time_ms
    # ZeRO 1 shards the optimizer's update over the group: each worker steps its own shard
    zero = planner.plan(graphs, cluster, dataclasses.replace(config, zero_stage=1), profile=profile)
    for w in zero.workers:
        assert w.update_ms == pytest.approx(param_bytes * rates[kinds[w.device]] * 1e-6 / len(zero.workers), rel=0.01)


def test_the_measured_cost_outside_compute_is_priced_on_every_forward_and_backward():
    """A profile's time outside the compute segments per unit forward or backward
    (``DeviceProfile.action_overhead_s``) becomes each worker's ``action_overhead_ms``, and the simulator
    adds it to every compute action: each forward and backward event is its compute plus that."""
    graphs, cluster = _graphs(), _cluster()
    config = wl.Config(global_batch_size=GLOBAL_BATCH, num_micro_batch=2)
    plain = emulated_profile(graphs, cluster)
    overhead = {"emu-hbm": 0.004, "emu-gddr": 0.001}   # seconds per action
    profile = dataclasses.replace(plain, devices=tuple(dataclasses.replace(d, action_overhead_s=overhead[d.kind])
                                                       for d in plain.devices))
    plan = planner.plan(graphs, cluster, config, profile=profile)
    kinds = {d.name: d.kind for d in cluster.devices}
    assert [w.action_overhead_ms for w in plan.workers] == pytest.approx([overhead[kinds[w.device]] * 1e3
                                                                          for w in plan.workers])
    from planner.schedule.simulator import simulate
    result = simulate(plan, network=cluster)
    by_rank = {w.rank: w for w in plan.workers}
    computed = [e for e in result.events if e.kind in ("F", "B")]
    assert computed
    for e in computed:
        w = by_rank[e.rank]
        own = (w.forward_ms if e.kind == "F" else w.backward_ms)[e.micro_batch]
        assert e.duration_ms == pytest.approx(own + w.action_overhead_ms)
    bare = dataclasses.replace(plan, workers=[dataclasses.replace(w, action_overhead_ms=0.0) for w in plan.workers])
    assert simulate(bare, network=cluster).step_time_ms < result.step_time_ms
