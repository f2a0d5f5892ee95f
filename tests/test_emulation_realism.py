"""Emulated devices behave like real ones (issue 20, item 4): each device's efficiency curve, a
memory-bandwidth-bound cost for the non-matmul work, per-dtype rates that may be slower than the
spec sheet claims, the presets whose spec sheets lie, and the errors for bad figures; then the
bytes wired through: capture gives every Layer its non-matmul bytes (against MemoryTrafficMode on
the real model), the stages sum them, and one short 2-rank spawn runs the Engine on a
data-parallel and a pipeline plan whose steps are modeled with them.

Every time checked is the emulator's *modeled* time against the formula worked out by hand from
the spec (no wall time, no timing thresholds); every byte count against the tensors' sizes.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import assert_close

import plans
from dist_utils import run_ranks
from planner.plan import StagePlan
from runtime import Engine
from runtime.emulation.compute import Emulator
from runtime.parallel.builders import stage_memory_bytes
from runtime.parallel.executor import ExecutorContext
from runtime.parallel.stage_split import stage_flops_from_plan, stage_memory_bytes_from_plan
from whalelike import Cluster, Device, Network, SpecError
from whalelike.cluster import Emulation
from whalelike.graphs.capture import capture, with_autocast
from whalelike.graphs.memory_traffic import MemoryTrafficMode, forward_backward_bytes, operator_bytes
from whalelike.graphs.taskgraph import TaskGraphs

GIGA = 1e9


def expected_seconds(speed, base_gflops, half_batch, gbps, flops, samples, memory_bytes):
    """The device model written out: matmul FLOPs at the efficiency of the micro-batch, plus the
    non-matmul bytes at the memory bandwidth."""
    efficiency = samples / (samples + half_batch) if half_batch else 1.0
    seconds = flops / (speed * base_gflops * GIGA * efficiency)
    return seconds + (memory_bytes / (gbps * GIGA) if gbps else 0.0)


# -- the device model, per device, per precision ----------------------------------------------------
@pytest.mark.parametrize("preset", ["emulated-equal-peak", "emulated-slow-bf16", "emulated-4"])
def test_modeled_time_is_each_devices_formula_at_every_batch_and_precision(preset):
    cluster = Cluster.preset(preset)
    raw = {d["kind"]: d for host in cluster.to_dict()["hosts"] for d in host["devices"]}   # the spec as written
    base = cluster.emulation.base_gflops
    flops, memory_bytes = 3.2e9, 0.4e9
    for rank, device in enumerate(cluster.devices):
        entry = raw[device.kind]
        speeds = entry["emulated_speed"] if isinstance(entry["emulated_speed"], dict) else {"fp32": entry["emulated_speed"]}
        for precision in device.precisions:
            emulator = Emulator.for_device(cluster, device.name, rank, precision)
            for samples in (1, 2, 8, 32):
                want = expected_seconds(speeds[precision], base,
                                        entry.get("emulated_half_efficiency_batch", cluster.emulation.half_efficiency_batch),
                                        entry.get("emulated_memory_gbps"), flops, samples, memory_bytes)
                assert_close(emulator.modeled_seconds(flops, samples, memory_bytes=memory_bytes), want)


def test_equal_peaks_run_unequally_where_memory_bandwidth_and_small_batches_differ():
    """emulated-equal-peak: the spec sheet rates both kinds alike at every precision; the emulator
    does not. Hand-worked at a micro-batch of 8, 1.6 GFLOP and 0.5 GB of non-matmul traffic:
    emu-hbm 1.6e9 / (2e9 * 8/10) + 0.5e9 / 1e9 = 1.5 s; emu-gddr 1.6e9 / (2e9 * 8/24) + 0.5e9 / 0.25e9 = 4.4 s."""
    cluster = Cluster.preset("emulated-equal-peak")
    hbm, gddr = cluster.device("emu-hbm-0"), cluster.device("emu-gddr-0")
    assert hbm.rates == gddr.rates and hbm.emulated_rates == gddr.emulated_rates
    assert hbm.memory_gib == 2 * gddr.memory_gib
    fast = Emulator.for_device(cluster, hbm.name, 0)
    slow = Emulator.for_device(cluster, gddr.name, 2)
    assert_close(fast.modeled_seconds(1.6e9, 8, memory_bytes=0.5e9), 1.5)
    assert_close(slow.modeled_seconds(1.6e9, 8, memory_bytes=0.5e9), 4.4)
    # each device saturates at its own batch: half of peak at 2 and at 16 samples
    assert_close((fast.efficiency(2), slow.efficiency(16)), (0.5, 0.5))
    assert slow.efficiency(1024) < fast.efficiency(1024) < 1.0
    # in bf16 both matmul rates double; the bandwidth term stays (bytes, not FLOPs)
    fast16 = Emulator.for_device(cluster, hbm.name, 0, "bf16")
    assert_close(fast16.modeled_seconds(1.6e9, 8, memory_bytes=0.5e9), 0.5 + 0.5)


def test_a_kind_without_fast_low_precision_runs_bf16_no_faster_though_its_spec_sheet_claims_it():
    cluster = Cluster.preset("emulated-slow-bf16")
    honest, liar = cluster.device("emu-full-0"), cluster.device("emu-claims-bf16-0")
    assert liar.tflops("bf16") == 4 * liar.tflops("fp32") and honest.tflops("bf16") == 2 * honest.tflops("fp32")
    flops = 1e9
    seconds = {(d.name, p): Emulator.for_device(cluster, d.name, r, p).modeled_seconds(flops, 16)
               for r, d in ((0, honest), (2, liar)) for p in ("fp32", "bf16", "fp16")}
    assert_close(seconds[liar.name, "fp32"], flops / 2e9)
    assert_close(seconds[liar.name, "fp16"], flops / 2e9)            # fp16 at its FP32 rate
    assert_close(seconds[liar.name, "bf16"], flops / (0.9 * 2e9))    # bf16 slower still
    assert_close(seconds[honest.name, "bf16"], flops / 4e9)
    # what the spec sheet says against what the emulator gives: 2x the wrong way round
    claimed = liar.tflops("bf16") / honest.tflops("bf16")
    delivered = seconds[honest.name, "bf16"] / seconds[liar.name, "bf16"]
    assert claimed == 2.0
    assert_close(delivered, 0.45)


def test_a_devices_curve_overrides_the_blocks_and_new_fields_default_to_off():
    em = Emulation(base_gflops=1.0, half_efficiency_batch=4)
    default = Emulator(1.0, em)
    own = Emulator(1.0, em, half_efficiency_batch=12)
    assert_close(default.modeled_seconds(1e9, 4), 2.0)            # 4 / (4 + 4): the block's curve
    assert_close(own.modeled_seconds(1e9, 4), 4.0)                # 4 / (4 + 12): the device's own
    # without a bandwidth, the bytes cost nothing: existing clusters model what they always did
    assert default.modeled_seconds(1e9, 4, memory_bytes=1e12) == default.modeled_seconds(1e9, 4)
    for rank, device in enumerate(Cluster.preset("emulated-4").devices):
        emulator = Emulator.for_device(Cluster.preset("emulated-4"), device.name, rank)
        assert emulator.memory_gbps is None and emulator.half_efficiency_batch is None
        assert_close(emulator.modeled_seconds(1e9, 3, memory_bytes=5e8), 1e9 / (device.emulated_speed * 2e9))
    # a segment of bytes alone (a FLOP-free stage of element-wise work) is modeled where bytes are priced
    priced = Emulator(1.0, em, memory_gbps=2.0)
    assert_close(priced.modeled_seconds(0.0, 4, memory_bytes=1e9), 0.5)
    assert priced.modeled_seconds(0.0, 0, memory_bytes=1e9) == 0.0
    with pytest.raises(ValueError, match=r"memory_bytes must be >= 0 .*got -1"):
        priced.modeled_seconds(1e9, 4, memory_bytes=-1)


# -- the non-matmul bytes and the segments that carry them ------------------------------------------
def test_operator_bytes_read_inputs_once_write_outputs_and_price_matmuls_by_flops():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    n = 4 * 8 * 4   # bytes of one float32 4x8 tensor
    counts = {}
    for name, fn in {"relu": lambda: torch.relu(x), "add": lambda: x + y, "square": lambda: x * x,
                     "in_place": lambda: x.clone().add_(y), "view": lambda: x.reshape(32).unsqueeze(0).expand(3, 32),
                     "cast": lambda: x.to(torch.bfloat16), "matmul": lambda: x @ y.t(),
                     "zero": lambda: torch.empty(4, 8).zero_()}.items():
        with MemoryTrafficMode() as mode:
            fn()
        counts[name] = mode.total
    assert counts == {"relu": 2 * n, "add": 3 * n, "square": 2 * n, "in_place": 2 * n + 3 * n, "view": 0,
                      "cast": n + n // 2, "matmul": 0, "zero": n}
    # a norm reads its input and affine parameters, writes its output and saved statistics
    norm = nn.LayerNorm(8)
    with MemoryTrafficMode() as mode:
        out = norm(x)
    written = sum(t.numel() * t.element_size() for t in torch.ops.aten.native_layer_norm.default(
        x, [8], norm.weight, norm.bias, 1e-5))
    assert mode.total == n + 2 * 8 * 4 + written and out.shape == x.shape
    # a gather reads what it gathers and its indices, not the table
    table = nn.Embedding(10_000, 8)
    ids = torch.tensor([[1, 2, 3]])
    with MemoryTrafficMode() as mode:
        table(ids)
    assert mode.total == ids.numel() * 8 + 2 * 3 * 8 * 4
    assert operator_bytes(torch.ops.aten.mm.default, (x, y.t()), {}, x @ y.t()) == 0


def test_forward_and_backward_bytes_count_the_same_on_fake_tensors_and_zero_for_pure_matmuls():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    x = torch.randn(6, 16)
    forward, backward = forward_backward_bytes(model, (x,))
    assert forward > 0 and backward > forward          # the backward reads the saved inputs and the gradients
    # a second backward accumulates into the gradients the first left: that traffic counts too
    accumulating = forward_backward_bytes(model, (x,))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert accumulating == (forward, backward + 3 * params)    # add_: read grad and new grad, write grad
    model.zero_grad(set_to_none=True)
    with FakeTensorMode(allow_non_fake_inputs=True):   # the same count without allocating (as costs.py runs)
        fake = forward_backward_bytes(model, (torch.randn(6, 16),))
    assert fake == (forward, backward)
    # doubling the batch doubles the per-sample work (the parameters' reads are the only fixed part)
    model.zero_grad(set_to_none=True)
    forward2, _ = forward_backward_bytes(model, (torch.randn(12, 16),))
    fixed = 4 * (2 * 32)   # the LayerNorm's weight and bias, read once per call
    assert forward2 - fixed == 2 * (forward - fixed)
    only_matmuls = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 4, bias=False))
    assert forward_backward_bytes(only_matmuls, (x,)) == (0, 0)
    with pytest.raises(ValueError, match="no tensor that requires grad"):
        forward_backward_bytes(nn.Identity(), (x,))


def test_a_padded_module_is_modeled_with_its_counted_bytes():
    """The bytes counted for one module, passed per sample beside its FLOPs, are what its segments
    are modeled with (pad_forward here; begin/segment take memory_bytes the same way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32))
    x = torch.randn(4, 16)
    with MemoryTrafficMode() as mode:
        model(x)
    bytes_per_sample = mode.total / 4
    flops_per_sample = 2 * 16 * 32
    emulator = Emulator(0.5, Emulation(base_gflops=1e-3), half_efficiency_batch=4, memory_gbps=2e-4)
    unpad = emulator.pad_forward(model, flops_per_sample, memory_bytes_per_sample=bytes_per_sample)
    out = model(x)
    unpad()
    assert_close(out, nn.functional.layer_norm(nn.functional.gelu(x @ model[0].weight.t() + model[0].bias), (32,),
                                               model[2].weight, model[2].bias))
    want = expected_seconds(0.5, 1e-3, 4, 2e-4, flops_per_sample * 4, 4, mode.total)
    assert_close(emulator.stats.modeled_s, want)
    assert emulator.stats.flops == flops_per_sample * 4


# -- the presets and the errors -----------------------------------------------------------------------
def test_the_lying_presets_load_validate_and_round_trip():
    for name in ("emulated-equal-peak", "emulated-slow-bf16"):
        assert name in Cluster.preset_names()
        cluster = Cluster.preset(name)
        assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(cluster.to_dict()))) == cluster
        assert len(cluster.devices) == 4 and cluster.emulation is not None
        plain = cluster.without_emulation()   # for profiling the real hardware: no hidden truth left
        assert all(d.emulated_memory_gbps is None and d.emulated_half_efficiency_batch is None for d in plain.devices)
    summary = Cluster.preset("emulated-equal-peak").summary()
    assert "half-efficiency batch" in summary and "emulated GB/s" in summary
    assert "emulated GB/s" not in Cluster.preset("emulated-4").summary()


def _device(**fields):
    return Device("emu-0", "emu", "localhost", peak_tflops=0.005, memory_gib=4, emulated_speed=1.0, **fields)


@pytest.mark.parametrize("fields,message", [
    ({"emulated_memory_gbps": 0}, r"device 'emu-0': emulated_memory_gbps must be > 0, got 0"),
    ({"emulated_memory_gbps": 1e300}, r"emulated_memory_gbps must be <= 1000000 .*got 1e\+300; a petabyte per second"),
    ({"emulated_half_efficiency_batch": -2.0}, r"emulated_half_efficiency_batch must be > 0, got -2\.0"),
    ({"emulated_half_efficiency_batch": 1e300}, r"emulated_half_efficiency_batch must be <= 1000000 .*sleep forever"),
    ({"emulated_half_efficiency_batch": "8"}, r"emulated_half_efficiency_batch must be a number .*got '8'"),
])
def test_bad_figures_are_errors_naming_the_field_the_value_and_the_fix(fields, message):
    with pytest.raises(SpecError, match=message):
        _device(**fields)


def test_bad_figures_in_a_file_name_the_file_and_the_path(tmp_path):
    spec = Cluster.preset("emulated-equal-peak").to_dict()
    spec["hosts"][0]["devices"][1]["emulated_memory_gbps"] = -0.25
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"lab\.yaml.*hosts\[0\]\.devices\[1\]\.emulated_memory_gbps must be > 0, "
                                        r"got -0\.25"):
        Cluster.from_yaml(path)
    spec["hosts"][0]["devices"][1]["emulated_memory_gbps"] = 0.25
    spec["emulation"]["half_efficiency_batch"] = 0
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError, match=r"emulation\.half_efficiency_batch must be > 0, got 0"):
        Cluster.from_yaml(path)


@pytest.mark.parametrize("field", ["emulated_memory_gbps", "emulated_half_efficiency_batch"])
def test_the_new_figures_need_an_emulation_block(field):
    cluster = Cluster.preset("emulated-equal-peak")
    plain = cluster.without_emulation()
    device = dataclasses.replace(plain.devices[0], **{field: 2.0})
    with pytest.raises(SpecError, match=rf"device 'emu-hbm-0' sets {field} but the cluster has no emulation block; "
                                        rf"add `emulation: \{{base_gflops: 2.0\}}` or remove {field} \(2, "):
        dataclasses.replace(plain, devices=(device, *plain.devices[1:]))


# -- the bytes captured per layer, and the runs that pass them --------------------------------------
class Block(nn.Module):
    """Matmuls with element-wise and norm work between them: every kind of layer the bytes count."""

    def __init__(self):
        super().__init__()
        self.l0, self.act, self.norm = nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16)
        self.l1, self.head = nn.Linear(16, 16, bias=False), nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.l1(self.norm(self.act(self.l0(x))))))


def test_capture_gives_each_layer_the_bytes_its_operators_move_and_pure_matmuls_none():
    """Per layer, the forward and backward non-matmul bytes per sample; summed over the layers, times
    the batch, what MemoryTrafficMode counts on the real model (the single-process reference)."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 6)
    graphs = capture(model, (x,))
    layers = {layer.name: layer for layer in graphs.layers}
    forward, backward = forward_backward_bytes(model, (x,))
    assert_close(sum(l.forward_memory_bytes for l in graphs.layers) * 4, float(forward))
    assert_close(sum(l.backward_memory_bytes for l in graphs.layers) * 4, float(backward))
    # element-wise and norm work moves bytes both ways (GELU joins the norm's layer, tanh the head's);
    # a projection moves none, but for its bias (added inside addmm forward, summed over the batch backward)
    assert list(layers) == ["l0", "norm", "l1", "head"]
    for name in ("norm", "head"):
        assert layers[name].forward_memory_bytes > 0 and layers[name].backward_memory_bytes > 0, name
    assert layers["head"].forward_memory_bytes == 2 * 16 * 4          # tanh reads and writes 16 floats a sample
    assert layers["l0"].forward_memory_bytes == 0 < layers["l0"].backward_memory_bytes
    assert (layers["l1"].forward_memory_bytes, layers["l1"].backward_memory_bytes) == (0.0, 0.0)
    only_matmuls = capture(nn.Sequential(nn.Linear(6, 16, bias=False), nn.Linear(16, 5, bias=False)), (x,))
    assert [(l.forward_memory_bytes, l.backward_memory_bytes) for l in only_matmuls.layers] == [(0.0, 0.0)] * 2
    assert all(l.forward_flops > 0 for l in only_matmuls.layers)


def test_the_bytes_round_trip_old_captures_load_and_the_fingerprint_ignores_them():
    graphs = capture(Block(), (torch.randn(4, 6),))
    data = graphs.to_dict()
    back = TaskGraphs.from_dict(data)
    assert back.layers == graphs.layers and back.fingerprint == graphs.fingerprint
    # a capture file written before the fields existed loads, pricing no bytes
    for layer in data["layers"]:
        del layer["forward_memory_bytes"], layer["backward_memory_bytes"]
    old = TaskGraphs.from_dict(data)
    assert all(l.forward_memory_bytes == l.backward_memory_bytes == 0.0 for l in old.layers)
    # measured costs, like the FLOPs, are not what a fingerprint identifies
    assert old.fingerprint == graphs.fingerprint


def test_stage_bytes_follow_the_plans_layers_and_the_precision_that_runs():
    """Per stage, the layers' bytes summed as their FLOPs are; at bf16 the bytes measured under
    autocast (narrower tensors, plus the casts), which the Engine asks for where bandwidth is priced."""
    graphs = capture(Block(), (torch.randn(4, 6),))
    n = len(graphs.layers)
    plan = plans.make_plan([StagePlan(0, [0], list(range(2)), "replicate(1)"),
                            StagePlan(1, [0], list(range(2, n)), "replicate(1)")],
                           [plans.worker(0, 0, sizes=[2]), plans.worker(1, 1, sizes=[2])])
    fp32 = stage_memory_bytes_from_plan(graphs, plan)
    ls = graphs.layers
    assert fp32 == [(sum(l.forward_memory_bytes for l in ls[:2]), sum(l.backward_memory_bytes for l in ls[:2])),
                    (sum(l.forward_memory_bytes for l in ls[2:]), sum(l.backward_memory_bytes for l in ls[2:]))]
    assert len(stage_flops_from_plan(graphs, plan)) == len(fp32)
    assert stage_memory_bytes_from_plan(graphs, plan, "bf16") == fp32   # not measured under autocast: float32's
    cluster = Cluster.preset("emulated-equal-peak")
    priced = Emulator.for_device(cluster, "emu-gddr-0", 0, "bf16")

    def context(precision, emulator):
        return ExecutorContext(model=None, plan=plan, rank=0, worker=plan.workers[0], graphs=graphs, groups=None,
                               loss_fn=None, emulator=emulator, device=torch.device("cpu"), precision=precision)

    assert stage_memory_bytes(context("fp32", priced)) == fp32
    assert stage_memory_bytes(context("bf16", Emulator.disabled())) == fp32   # nothing priced: nothing measured
    low = stage_memory_bytes(context("bf16", priced))
    measured = [layer.autocast for layer in with_autocast(graphs).layers]
    assert low == [(sum(m["forward_memory"] for m in measured[:2]), sum(m["backward_memory"] for m in measured[:2])),
                   (sum(m["forward_memory"] for m in measured[2:]), sum(m["backward_memory"] for m in measured[2:]))]
    assert low != fp32 and all(b > 0 for pair in low for b in pair)


DEVICES = {"emu-0": dict(emulated_speed=1.0, emulated_memory_gbps=2e-5, emulated_half_efficiency_batch=2.0),
           "emu-1": dict(emulated_speed=0.5, emulated_memory_gbps=5e-5)}
BASE_GFLOPS = 1e-4


def _bytes_cluster() -> Cluster:
    devices = tuple(Device(name, "emu", "localhost", peak_tflops=1.0, memory_gib=4, **fields)
                    for name, fields in DEVICES.items())
    return Cluster("test", devices, Network(2.0, 2.0, 50.0), Emulation(base_gflops=BASE_GFLOPS))


def _modeled(device: str, flops: tuple, memory: tuple, sizes) -> tuple[float, float]:
    """A step's modeled seconds on ``device``, micro-batches of ``sizes``, by the formula; and its bytes term."""
    fields = DEVICES[device]
    total = term = 0.0
    for b in sizes:
        for f, m in zip(flops, memory):
            total += expected_seconds(fields["emulated_speed"], BASE_GFLOPS,
                                      fields.get("emulated_half_efficiency_batch"), fields["emulated_memory_gbps"],
                                      f * b, b, m * b)
            term += m * b / (fields["emulated_memory_gbps"] * GIGA)
    return total, term


def _bytes_ranks(rank: int, world_size: int) -> dict:
    """The Engine on a data-parallel plan, then on a two-stage pipeline: each step's modeled time
    includes the bytes term of the layers the rank runs."""
    torch.manual_seed(0)
    model = Block()
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(5, 6, generator=g),), torch.randint(0, 5, (5,), generator=g)) for _ in range(2)]
    fingerprint = capture(model, data[0][0]).fingerprint
    runs = {
        # both ranks run every layer: rank 0 micro-batches of 3, rank 1 two of 1
        "dp": ([StagePlan(0, [0], [0, 1, 2, 3], "replicate(2)")], [plans.worker(0, 0, 0, sizes=[3]),
                                                                  plans.worker(1, 0, 1, sizes=[1, 1])]),
        # rank 0 the first projection and the element-wise and norm work, rank 1 the rest
        "pipeline": ([StagePlan(0, [0], [0, 1], "replicate(1)"), StagePlan(1, [0], [2, 3], "replicate(1)")],
                     [plans.worker(0, 0, sizes=[3, 2]), plans.worker(1, 1, sizes=[3, 2])]),
    }
    out = {}
    for name, (stages, workers) in runs.items():
        plan = plans.make_plan(stages, workers, model_fingerprint=fingerprint)
        engine = Engine(copy.deepcopy(model), plan, loss_fn=F.cross_entropy, cluster=_bytes_cluster(), balance="off",
                        example_args=data[0][0], timeout_s=60)
        for batch in data:
            engine.train_step(batch)
        stage = plan.worker(rank).stage
        out[name] = {"modeled": [s.modeled_s for s in engine.stats], "sizes": plan.worker(rank).micro_batch_sizes,
                     "flops": stage_flops_from_plan(engine.graphs, plan)[stage],
                     "memory": stage_memory_bytes_from_plan(engine.graphs, plan)[stage]}
    return out


def test_engine_steps_are_modeled_with_their_layers_bytes_on_two_ranks():
    results = run_ranks(_bytes_ranks, 2, init_process_group=False)
    for rank, result in enumerate(results):
        for name, run in result.items():
            want, term = _modeled(f"emu-{rank}", run["flops"], run["memory"], run["sizes"])
            assert term > 0.1 * want, (rank, name, term, want)   # the bandwidth is a real part of the step
            for modeled in run["modeled"]:
                assert_close(modeled, want, msg=f"rank {rank}, {name}")
