"""The optimizer's update priced without a profile: from the spec sheet's memory bandwidth (a known
GPU's data sheet, or the spec's ``memory_gbps``), or timed on this machine at plan time for the
emulated devices (``whalelike plan --calibrate``); a measured rate wins over both.

:func:`planner.devices.cost_model.update_ns_per_byte`, :data:`~planner.devices.cost_model.UPDATE_PASSES`,
:func:`whalelike.hardware.memory_gbps`, :func:`runtime.profiling.update_rate.calibrate_update`.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import yaml

import planner
import whalelike as wl
from planner.devices.cost_model import UPDATE_BANDWIDTH_EFFICIENCY, UPDATE_PASSES, update_ns_per_byte
from runtime.profiling.update_rate import calibrate_update
from whalelike.cluster import Cluster, Device, Network
from whalelike.errors import SpecError, WhaleError
from whalelike.hardware import memory_gbps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import wide_mlp  # noqa: E402


def test_known_gpus_memory_bandwidth_and_its_variants():
    assert memory_gbps("A100-40GB") == 1555.0 and memory_gbps("NVIDIA-A100-SXM4-80GB") == 2039.0
    assert memory_gbps("A100-PCIe-80GB") == 1935.0 and memory_gbps("A100", memory_gib=80) == 2039.0
    assert memory_gbps("H100-SXM5") == 3350.0 and memory_gbps("H100-PCIe") == 2000.0
    assert memory_gbps("NVIDIA-H200") == 4800.0   # torch.cuda.get_device_name's "NVIDIA H200", dashed
    assert memory_gbps("Tesla-P100-12GB") == 549.0 and memory_gbps("V100-16GB") == 900.0
    assert memory_gbps("T4") == 320.0 and memory_gbps("RTX-3090") == 936.0
    assert memory_gbps("A10") == 600.0   # not an A100
    assert memory_gbps("emu-full") is None and memory_gbps("MI250X") is None


def test_a_devices_bandwidth_the_spec_then_the_data_sheet_never_an_emulated_ones():
    a100 = Device("a", "A100-40GB", "h", peak_tflops=19.5, memory_gib=40)
    assert a100.bandwidth_gbps == 1555.0
    assert dataclasses.replace(a100, memory_gbps=1000.0).bandwidth_gbps == 1000.0
    assert Device("m", "MI250X", "h", peak_tflops=47.9, memory_gib=64).bandwidth_gbps is None
    assert Device("m", "MI250X", "h", peak_tflops=47.9, memory_gib=64, memory_gbps=1600).bandwidth_gbps == 1600.0
    # an emulated device updates on the host's memory, which no spec sheet describes
    emulated = Device("e", "A100-40GB", "h", peak_tflops=0.005, memory_gib=4, emulated_speed=1.0)
    assert emulated.bandwidth_gbps is None and update_ns_per_byte(emulated, "adamw") == 0.0
    assert dataclasses.replace(emulated, memory_gbps=10.0).bandwidth_gbps == 10.0   # a figure given is the spec's
    # the rate: the passes torch's kernels make over the parameters, at 80% of the bandwidth; measured wins
    assert update_ns_per_byte(a100, "adamw") == pytest.approx(20 / (1555.0 * UPDATE_BANDWIDTH_EFFICIENCY))
    assert update_ns_per_byte(a100, "sgd") == pytest.approx(3 / (1555.0 * UPDATE_BANDWIDTH_EFFICIENCY))
    assert update_ns_per_byte(dataclasses.replace(a100, measured_update_ns_per_byte=0.5), "adamw") == 0.5
    assert update_ns_per_byte(a100, "") == 0.0   # the optimizer not known: not priced


def test_memory_gbps_in_a_cluster_file_is_checked(tmp_path):
    spec = {"name": "c", "network": {"intra_host_gbps": 10, "inter_host_gbps": 1, "latency_us": 10},
            "hosts": [{"name": "h", "devices": [{"kind": "MI250X", "memory_gib": 64, "peak_tflops": 47.9,
                                                 "memory_gbps": 1600}]}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert Cluster.load(str(path)).devices[0].bandwidth_gbps == 1600.0
    spec["hosts"][0]["devices"][0]["memory_gbps"] = 0
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match="memory_gbps"):
        Cluster.load(str(path))


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_spec_plan_prices_each_workers_update_from_its_memory_bandwidth_and_shares_by_it():
    w = wide_mlp.build(width=64, blocks=4)
    graphs = wl.capture(w.model, w.example_args)
    devices = (Device("a100-0", "A100-40GB", "h", peak_tflops=19.5, memory_gib=40),
               Device("t4-0", "T4", "h", peak_tflops=8.1, memory_gib=16))
    cluster = Cluster("a100+t4", devices, Network(10.0, 10.0, 10.0))
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=64, zero_stage=0))
    nbytes = _param_bytes(w.model)
    for worker, gbps in zip(plan.workers, (1555.0, 320.0)):   # each a full replica
        assert worker.update_ms == pytest.approx(nbytes * UPDATE_PASSES["adamw"] / (gbps * UPDATE_BANDWIDTH_EFFICIENCY)
                                                 * 1e-6)
    # the T4's longer update counts with its work: fewer samples than its speed alone would give it
    unpriced = Cluster("a100+t4", tuple(dataclasses.replace(d, measured_update_ns_per_byte=0.0) for d in devices),
                       Network(10.0, 10.0, 10.0))
    speed_only = planner.plan(graphs, unpriced, wl.Config(global_batch_size=64, zero_stage=0))
    assert all(x.update_ms == 0 for x in speed_only.workers)
    assert plan.workers[1].batch_share < speed_only.workers[1].batch_share


def test_calibrate_times_the_update_here_for_the_emulated_devices_only():
    w = wide_mlp.build(width=32, blocks=2)
    cluster = Cluster.preset("emulated-2")
    calibrated, result = calibrate_update(w.model, cluster, optimizer="adamw", repeats=2, cores=1)
    assert result.contention == 2.0 and result.ns_per_byte == pytest.approx(2.0 * result.alone_ns_per_byte)
    assert result.nbytes == _param_bytes(w.model) and result.alone_ns_per_byte > 0
    assert [d.measured_update_ns_per_byte for d in calibrated.devices] == [result.ns_per_byte] * 2
    assert [dataclasses.replace(d, measured_update_ns_per_byte=None) for d in calibrated.devices] == list(cluster.devices)
    assert "2 emulated rank(s) on 1 core(s)" in result.line() and "emu-" in result.line()
    # the model's parameters are copied, never stepped
    before = [p.detach().clone() for p in w.model.parameters()]
    calibrate_update(w.model, cluster, optimizer="sgd_momentum", repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(before, w.model.parameters()))
    with pytest.raises(WhaleError, match="no emulated device.*memory bandwidth"):
        calibrate_update(w.model, Cluster.preset("whale-v100-p100"))
    with pytest.raises(WhaleError, match="no trainable"):
        calibrate_update(torch.nn.ReLU(), cluster)


def test_plan_calibrate_on_the_command_line(tmp_path, capsys):
    from whalelike.cli import main

    out = tmp_path / "plan.yaml"
    code = main(["plan", str(ROOT / "examples" / "wide_mlp.py:build"), "--cluster", "emulated-2", "--global-batch", "8",
                 "--calibrate", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "calibrated the adamw update on this machine" in printed and "update ms" in printed
    assert all(w["update_ms"] > 0 for w in yaml.safe_load(out.read_text())["workers"])
    code = main(["plan", str(ROOT / "examples" / "wide_mlp.py:build"), "--cluster", "emulated-2", "--global-batch", "8",
                 "--calibrate", "--profile", str(tmp_path / "p.yaml"), "-o", str(tmp_path / "other.yaml")])
    assert code == 2 and "give one of --calibrate and --profile" in capsys.readouterr().err
