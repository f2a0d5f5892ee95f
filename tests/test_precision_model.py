"""The precision-aware hardware model (issue 18, item 2): per-dtype rates in the cluster spec, the
spec-sheet table of known GPUs, the planner pricing and refusing at the plan's precision, and the
memory model's bytes per element under mixed precision."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

import planner
from planner import Plan, PlanError
from planner.devices.cost_model import StageCost, compute_ms, device_tflops
from planner.devices.memory import stage_memory
from planner.partition.problem import layer_costs
from runtime.emulation.compute import Emulator
from whalelike import Cluster, Config, SpecError, replicate
from whalelike.cluster import Device, Network
from whalelike.hardware import KNOWN_GPUS, known_gpu

from synthetic import synthetic_model

LAB = "examples/clusters/lab-mixed.yaml"


def _spec(*devices: dict, emulation: dict | None = None) -> dict:
    out = {"name": "t", "network": {"intra_host_gbps": 10, "inter_host_gbps": 1, "latency_us": 5},
           "hosts": [{"name": "h", "devices": list(devices)}]}
    if emulation is not None:
        out["emulation"] = emulation
    return out


def _load(tmp_path, *devices: dict, **kw) -> Cluster:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_spec(*devices, **kw)))
    return Cluster.from_yaml(path)


def _cluster(*rates: dict[str, float], memory: float = 64.0) -> Cluster:
    """One device per ``rates`` (dtype -> peak TFLOPS, fp32 included), unknown kinds, one host."""
    devices = tuple(Device(f"d{i}", f"gen{i}", "h", peak_tflops=r["fp32"], memory_gib=memory, dtype_tflops=r)
                    for i, r in enumerate(rates))
    return Cluster("mixed", devices, Network(100.0, 10.0, 5.0))


# -- the spec --------------------------------------------------------------------------------------
def test_a_bare_number_of_an_unknown_kind_runs_every_dtype_at_that_rate(tmp_path):
    d = _load(tmp_path, {"kind": "mystery", "peak_tflops": 7, "memory_gib": 8}).devices[0]
    assert d.peak_tflops == 7.0 and d.rates == {"fp32": 7.0, "tf32": 7.0, "bf16": 7.0, "fp16": 7.0}
    assert d.precisions == ("fp32", "bf16", "fp16") and d.tflops("bf16") == 7.0


def test_a_mapping_lists_what_the_device_runs(tmp_path):
    d = _load(tmp_path, {"kind": "mystery", "peak_tflops": {"fp32": 10, "fp16": 40}, "memory_gib": 8}).devices[0]
    assert d.peak_tflops == 10.0 and d.rates == {"fp32": 10.0, "fp16": 40.0}
    assert d.runs("fp16") and not d.runs("bf16") and d.precisions == ("fp32", "fp16")
    with pytest.raises(SpecError, match=r"mystery cannot run bf16 .*device d?[a-z-]*0.*plan with precision fp16 or fp32"):
        d.tflops("bf16")


def test_known_gpus_get_their_spec_sheet_figures():
    assert [known_gpu(k) for k in ("V100-16GB", "Tesla V100", "NVIDIA-A100-SXM4-40GB", "A10", "A100-80GB",
                                   "RTX-3090", "GeForce RTX 4090", "V100S-32GB", "emu-full", "A10G")] == \
        ["v100", "v100", "a100", "a10", "a100", "rtx-3090", "rtx-4090", "v100s", None, None]
    assert "bf16" not in KNOWN_GPUS["v100"] and "bf16" not in KNOWN_GPUS["t4"] and "bf16" not in KNOWN_GPUS["p100"]
    assert KNOWN_GPUS["p100"]["fp16"] == 2 * KNOWN_GPUS["p100"]["fp32"]
    # a bare FP32 figure: the sheet's own figures when it agrees, else the sheet's ratios to FP32
    a100 = Device("a", "A100-40GB", "h", peak_tflops=19.5, memory_gib=40)
    assert a100.rates == {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
    v100 = Device("v", "V100-16GB", "h", peak_tflops=14.0, memory_gib=16)
    assert v100.rates == {"fp32": 14.0, "fp16": pytest.approx(14.0 * 125 / 15.7)} and not v100.runs("bf16")
    # a partial mapping of a known kind: the rest from the sheet
    given = Device("g", "A100-40GB", "h", peak_tflops=19.5, memory_gib=40, dtype_tflops={"bf16": 300.0})
    assert given.rates == {"fp32": 19.5, "tf32": 156.0, "bf16": 300.0, "fp16": 312.0}


@pytest.mark.parametrize("device,message", [
    ({"kind": "x", "peak_tflops": {"fp32": 1, "bf17": 2}, "memory_gib": 8},
     r"c\.yaml: hosts\[0\]\.devices\[0\]\.peak_tflops\.bf17: unknown key; did you mean 'bf16'\?"),
    ({"kind": "x", "peak_tflops": {"fp32": 1, "bf16": 0}, "memory_gib": 8},
     r"c\.yaml: hosts\[0\]\.devices\[0\]\.peak_tflops\.bf16 must be > 0, got 0"),
    ({"kind": "x", "peak_tflops": {"fp32": -1}, "memory_gib": 8},
     r"hosts\[0\]\.devices\[0\]\.peak_tflops\.fp32 must be > 0, got -1"),
    ({"kind": "x", "peak_tflops": {"bf16": 312}, "memory_gib": 8},
     r"hosts\[0\]\.devices\[0\]\.peak_tflops: a mapping of rates needs fp32 .*add fp32"),
    ({"kind": "x", "peak_tflops": {}, "memory_gib": 8},
     r"hosts\[0\]\.devices\[0\]\.peak_tflops is an empty mapping; give a number"),
    ({"kind": "V100-16GB", "peak_tflops": {"fp32": 15.7, "bf16": 100}, "memory_gib": 16},
     r"hosts\[0\]\.devices\[0\]: device 'v100-0': peak_tflops rates bf16, which a V100-16GB cannot run \(no bf16 "
     r"support.*remove bf16"),
    ({"kind": "x", "peak_tflops": {"fp32": 1, "fp16": 2}, "memory_gib": 8, "measured_tflops": {"bf16": 1}},
     r"measured_tflops rates bf16, which the device cannot run .*remove bf16 or add its peak"),
    ({"kind": "x", "peak_tflops": 1, "memory_gib": 8, "measured_tflops": {"fp64": 1}},
     r"measured_tflops\.fp64: unknown key"),
])
def test_bad_rates_name_the_file_the_field_and_the_fix(tmp_path, device, message):
    with pytest.raises(SpecError, match=message):
        _load(tmp_path, device)


def test_emulated_speed_per_dtype_agrees_with_the_spec_sheet(tmp_path):
    emulation = {"base_gflops": 2.0}
    c = _load(tmp_path, {"kind": "e", "peak_tflops": {"fp32": 0.005, "bf16": 0.02}, "memory_gib": 4,
                         "emulated_speed": {"fp32": 1.0, "bf16": 4.0}}, emulation=emulation)
    d = c.devices[0]
    assert d.emulated_speed == 1.0 and d.emulated("bf16") == 4.0 and d.emulated_rates == {"fp32": 1.0, "bf16": 4.0}
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(c.to_dict()))) == c
    with pytest.raises(SpecError, match=r"emulated_speed rates fp32, bf16 but peak_tflops rates fp32, fp16; the "
                                        r"emulated truth and the spec sheet must agree"):
        _load(tmp_path, {"kind": "e", "peak_tflops": {"fp32": 0.005, "fp16": 0.02}, "memory_gib": 4,
                         "emulated_speed": {"fp32": 1.0, "bf16": 4.0}}, emulation=emulation)
    with pytest.raises(SpecError, match=r"emulated_speed: a mapping of rates needs fp32"):
        _load(tmp_path, {"kind": "e", "peak_tflops": 0.005, "memory_gib": 4, "emulated_speed": {"bf16": 4.0}},
              emulation=emulation)
    bare = _load(tmp_path, {"kind": "e", "peak_tflops": {"fp32": 0.005, "fp16": 0.01}, "memory_gib": 4,
                            "emulated_speed": 0.5}, emulation=emulation).devices[0]
    assert bare.emulated_rates == {"fp32": 0.5, "fp16": 0.5}
    assert c.without_emulation().devices[0].emulated_rates == {}


def test_python_records_check_the_same_rules():
    with pytest.raises(SpecError, match=r"device 'a': dtype_tflops\['fp32'\] is 3 but peak_tflops is 2; they are the "
                                        r"same figure"):
        Device("a", "x", "h", peak_tflops=2.0, memory_gib=1, dtype_tflops={"fp32": 3.0})
    with pytest.raises(SpecError, match=r"device 'a': dtype_tflops has unknown data type 'fp8'"):
        Device("a", "x", "h", peak_tflops=2.0, memory_gib=1, dtype_tflops={"fp8": 3.0})
    with pytest.raises(SpecError, match=r"device 'a': dtype_tflops\['bf16'\] must be a number"):
        Device("a", "x", "h", peak_tflops=2.0, memory_gib=1, dtype_tflops={"bf16": float("nan")})
    d = Device("a", "x", "h", peak_tflops=2.0, memory_gib=1, dtype_tflops={"fp32": 2.0, "bf16": 8.0})
    assert d.dtype_tflops == {"bf16": 8.0} and hash(d) == hash(dataclasses.replace(d))
    # a scalar replaced never contradicts a table: fp32 lives in the scalar alone
    assert dataclasses.replace(d, peak_tflops=4.0).rates == {"fp32": 4.0, "bf16": 8.0}


def test_measured_rates_per_dtype_and_their_round_trip():
    lab = Cluster.load(LAB)
    a100 = lab.device("a100-0")
    assert a100.measured("fp32") == 14.2 and a100.measured("bf16") == pytest.approx(14.2 * 312 / 19.5)
    assert device_tflops(a100, "bf16") == pytest.approx(14.2 * 16)
    v100 = lab.device("v100-0")
    assert v100.measured("fp16") is None and device_tflops(v100, "fp16") == pytest.approx(112 * 0.4)
    bf16 = a100.with_measured("bf16", 200.0)
    assert bf16.measured_tflops is None and bf16.measured("bf16") == 200.0
    assert bf16.measured("fp32") == pytest.approx(200.0 * 19.5 / 312)
    edited = dataclasses.replace(lab, devices=(bf16, *lab.devices[1:]))
    assert edited.to_dict()["hosts"][0]["devices"][0]["measured_tflops"] == {"bf16": 200.0}
    assert Cluster.from_dict(edited.to_dict()) == edited
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(lab.to_dict()))) == lab


def test_the_cluster_command_prints_the_per_dtype_rates():
    text = Cluster.load(LAB).summary()
    header = next(line for line in text.splitlines() if line.startswith("rank"))
    assert all(f"peak {t}" in header for t in ("fp32", "tf32", "bf16", "fp16"))
    v100 = next(line for line in text.splitlines() if "v100-0" in line).split()
    assert v100[4:8] == ["14", "-", "-", "112"]
    emulated = Cluster.preset("emulated-4").summary()
    assert "fp32 0.25x, bf16 1x, fp16 1x" in emulated and "fp32 0.5x, fp16 0.5x" in emulated


def test_presets_keep_their_fp32_figures_and_gain_unequally():
    c = Cluster.preset("emulated-4")
    assert [d.emulated_speed for d in c.devices] == [1.0, 1.0, 0.5, 0.25]
    assert [d.peak_tflops for d in c.devices] == [0.005, 0.005, 0.0025, 0.00125]
    assert [d.emulated_rates.get("bf16") for d in c.devices] == [2.0, 2.0, None, 1.0]
    assert [d.emulated_rates["fp16"] for d in c.devices] == [2.0, 2.0, 0.5, 1.0]
    for d in c.devices:   # the planner's figure is the emulator's truth at every dtype
        for p in d.precisions:
            assert device_tflops(d, p) * 1000 == pytest.approx(d.emulated(p) * c.emulation.base_gflops)
    assert Cluster.preset("whale-v100-p100").precisions() == ("fp32", "fp16")
    assert Cluster.preset("poplar-a").precisions() == ("fp32", "bf16", "fp16")


# -- the planner refuses what a device cannot run --------------------------------------------------
@pytest.fixture(scope="module")
def graphs():
    return synthetic_model(4, [replicate()], hidden=128, seq=16, heads=4)


def test_planning_bf16_on_a_v100_names_it_and_suggests_fp16(graphs):
    lab = Cluster.load(LAB)
    for make in (planner.plan, planner.naive_plan):
        with pytest.raises(PlanError, match=r"precision is 'bf16', but in cluster 'lab-mixed': V100-16GB cannot run "
                                            r"bf16 \(no bf16 support\): devices v100-0, v100-1, v100-2, v100-3; plan "
                                            r"with precision fp16 or fp32"):
            make(graphs, lab, Config(global_batch_size=36, precision="bf16"))
    assert planner.plan(graphs, lab, Config(global_batch_size=36, precision="fp16")).precision == "fp16"


def test_a_bf16_plan_file_is_refused_on_a_cluster_that_cannot_run_it(graphs, tmp_path):
    lab = Cluster.load(LAB)
    plan = planner.plan(graphs, lab, Config(global_batch_size=36, precision="fp16"))
    data = plan.to_dict()
    data["precision"] = "bf16"
    path = tmp_path / "bf16.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    Plan.from_yaml(path)   # alone it is consistent
    with pytest.raises(PlanError, match=r"bf16\.yaml: plan\.precision is 'bf16', but in cluster 'lab-mixed': "
                                        r"V100-16GB cannot run bf16 .*plan with precision fp16 or fp32"):
        Plan.from_yaml(path, graphs=graphs, cluster=lab)


def test_config_and_plan_refuse_an_unknown_precision(graphs, tmp_path):
    with pytest.raises(SpecError, match=r"Config\.precision must be one of fp32, bf16, fp16, got 'fp8'"):
        Config(global_batch_size=8, precision="fp8")
    plan = planner.plan(graphs, _cluster({"fp32": 10.0}), Config(global_batch_size=8))
    data = plan.to_dict()
    data["precision"] = "fp8"
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PlanError, match=r"plan\.precision must be one of 'fp32', 'bf16', 'fp16'"):
        Plan.from_yaml(path)


# -- pricing at the plan's precision ---------------------------------------------------------------
def test_low_precision_moves_work_to_the_device_it_speeds_up(graphs):
    """Two devices equal at FP32; one runs fp16 (and bf16) 4x faster, the other fp16 at 1x and no
    bf16: an fp16 plan gives the first four fifths of the batch, the fp32 plan half."""
    cluster = _cluster({"fp32": 10.0, "bf16": 40.0, "fp16": 40.0}, {"fp32": 10.0, "fp16": 10.0})
    shares = {}
    for precision in ("fp32", "fp16"):
        plan = planner.plan(graphs, cluster, Config(global_batch_size=100, precision=precision))
        assert plan.precision == precision
        shares[precision] = [w.batch_share for w in plan.workers]
    assert shares == {"fp32": [50, 50], "fp16": [80, 20]}
    with pytest.raises(PlanError, match=r"gen1 cannot run bf16 .*: device d1; plan with precision fp16 or fp32"):
        planner.plan(graphs, cluster, Config(global_batch_size=100, precision="bf16"))
    # the same with a second device that runs bf16 without a gain
    cluster = _cluster({"fp32": 10.0, "bf16": 40.0}, {"fp32": 10.0, "bf16": 10.0})
    plan = planner.plan(graphs, cluster, Config(global_batch_size=100, precision="bf16"))
    assert [w.batch_share for w in plan.workers] == [80, 20]
    assert "precision bf16" in plan.summary().splitlines()[0]


def test_compute_is_priced_at_the_precisions_rate(graphs):
    cluster = _cluster({"fp32": 10.0, "fp16": 40.0})
    d = cluster.devices[0]
    assert compute_ms(4e9, d, "fp16") == pytest.approx(compute_ms(4e9, d) / 4)
    fp32 = planner.plan(graphs, cluster, Config(global_batch_size=8))
    fp16 = planner.plan(graphs, cluster, Config(global_batch_size=8, precision="fp16"))
    assert fp16.workers[0].compute_ms == pytest.approx(fp32.workers[0].compute_ms / 4)
    assert "precision" not in fp32.summary().splitlines()[0]


# -- memory at the precision's bytes per element ---------------------------------------------------
def test_mixed_precision_bytes(graphs):
    """bf16/fp16 autocast: float32 weights, gradients and optimizer state as at fp32, plus a 2-byte
    copy of every parameter; activations, boundary buffers and layer outputs at 2 bytes, not 4."""
    layers = [1, 2]   # inner layers: a boundary on each side
    fp32 = StageCost.of_layers(graphs, layers)
    assert fp32.param_copy_bytes == 0.0 and fp32.precision == "fp32" and fp32.boundary_bytes > 0
    for precision in ("bf16", "fp16"):
        low = StageCost.of_layers(graphs, layers, precision)
        assert (low.param_bytes, low.static_bytes, low.optimizer_bytes) == \
            (fp32.param_bytes, fp32.static_bytes, fp32.optimizer_bytes)
        assert low.param_copy_bytes == fp32.param_bytes / 2
        assert low.activation_bytes == fp32.activation_bytes / 2 and low.boundary_bytes == fp32.boundary_bytes / 2
        assert low.layer_output_bytes == tuple(b / 2 for b in fp32.layer_output_bytes)
        assert (low.forward_flops, low.backward_flops) == (fp32.forward_flops, fp32.backward_flops)
        terms, whole = stage_memory(low, 1), stage_memory(fp32, 1)
        assert terms.weight_bytes == 1.5 * fp32.param_bytes
        assert terms.gradient_bytes == whole.gradient_bytes and terms.optimizer_bytes == whole.optimizer_bytes
    # the partitioner's layer costs count the same bytes
    (one,) = layer_costs(graphs, [1], "bf16")
    alone = StageCost.of_layers(graphs, [1])
    assert one.param_bytes == 1.5 * alone.param_bytes and one.gradient_bytes == alone.param_bytes
    assert one.cut_bytes == graphs.layers[1].cut_bytes_per_sample / 2


def test_a_bf16_plan_predicts_less_activation_memory(graphs):
    cluster = _cluster({"fp32": 10.0, "bf16": 40.0})
    fp32 = planner.plan(graphs, cluster, Config(global_batch_size=64))
    bf16 = planner.plan(graphs, cluster, Config(global_batch_size=64, precision="bf16"))
    cost32, cost16 = StageCost.of_layers(graphs, range(4)), StageCost.of_layers(graphs, range(4), "bf16")
    gib = float(2**30)
    expected = (stage_memory(cost16, 1).total(64) - stage_memory(cost32, 1).total(64)) / gib
    assert bf16.workers[0].memory_gib - fp32.workers[0].memory_gib == pytest.approx(expected)


# -- the plan file and the emulator ----------------------------------------------------------------
def test_plan_yaml_round_trips_the_precision_and_old_files_load_as_fp32(graphs, tmp_path):
    cluster = _cluster({"fp32": 10.0, "fp16": 20.0}, {"fp32": 5.0, "fp16": 20.0})
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16, precision="fp16"))
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path, graphs=graphs, cluster=cluster)
    assert loaded == plan and loaded.precision == "fp16"
    data = plan.to_dict()
    del data["precision"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data, sort_keys=False))
    assert Plan.from_yaml(old).precision == "fp32"


def test_the_emulator_runs_each_device_at_its_precisions_speed():
    cluster = Cluster.preset("emulated-4")
    assert Emulator.for_device(cluster, "emu-quarter-0", 3).speed == 0.25
    assert Emulator.for_device(cluster, "emu-quarter-0", 3, precision="fp16").speed == 1.0
    assert Emulator.for_device(cluster, "emu-full-0", 0, precision="bf16").speed == 2.0
    with pytest.raises(SpecError, match=r"emu-half cannot run bf16 .*device emu-half-0; plan with precision fp16 or fp32"):
        Emulator.for_device(cluster, "emu-half-0", 2, precision="bf16")
    assert not Emulator.for_device(cluster.without_emulation(), "emu-full-0", 0, precision="fp16").enabled


def test_a_replan_measures_at_the_plans_precision(graphs):
    from planner.balance.replan import measured_cluster

    cluster = _cluster({"fp32": 10.0, "fp16": 40.0}, {"fp32": 10.0, "fp16": 10.0})
    plan = planner.plan(graphs, cluster, Config(global_batch_size=100, precision="fp16"))
    measured = measured_cluster(plan, cluster, [1.0, 1.0])
    rates = [d.measured_dtype_tflops for d in measured.devices]
    assert [d.measured_tflops for d in measured.devices] == [None, None]
    assert rates[0] == rates[1] == {"fp16": pytest.approx((40 + 10) * 0.4 / 2)}
