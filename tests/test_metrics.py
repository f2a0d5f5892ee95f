"""runtime.control.metrics: each step's figures from rank 0 as JSON lines, TensorBoard scalars and W&B.

In one process (the pure parts): the FLOPs each rank of a plan runs and the MFU per device kind
against a hand computation from the matmul shapes (a two-stage plan on two kinds at bf16, on an
emulated cluster; a tensor-parallel stage cut 3:1); the controller driven through the board's calls
writes whole JSON lines, the other ranks' peaks of the step before, and an event line for a plan
change, and its TensorBoard event file reads back with TensorBoard's own ``EventAccumulator``; a
missing tensorboard or wandb is one clear line, and wandb is used when present and asked.

One 2-rank spawn: a tiny model trains 3 steps with the controller on two device kinds; rank 0 wrote
3 lines whose losses are the returned ones and whose per-rank peaks are the ones each rank measured,
and rank 1 wrote nothing.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import plans
import whalelike as wl
from dist_utils import run_ranks
from planner.plan import StagePlan
from runtime.control.metrics import Metrics, kind_figures, rank_flops, tokens_per_sample_of
from runtime.control.protocol import PlanChange, StepView
from runtime.step_stats import StepStats
from whalelike.cluster import Cluster, Device, Emulation, Network
from whalelike.errors import WhaleError
from whalelike.graphs.capture import capture

POSITIONS = 3


class Net(nn.Module):
    """Two bias-free projections: per position, forward 2*8*16 + 2*16*4 FLOPs; backward the weight
    gradients of both and the input gradient of the second only (the input needs none)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# by hand, per sample of POSITIONS positions: layer a forward 256 + backward 256, layer b 128 + 256
A_FLOPS, B_FLOPS = (256 + 256) * POSITIONS, (128 + 256) * POSITIONS


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.split(2):
            self.up, self.down = nn.Linear(8, 32, bias=False), nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _loss(out, targets):
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


def _cluster(emulation=None) -> Cluster:
    def device(name, kind, fp32, bf16, speed, bf16_speed):
        return Device(name, kind, "localhost", peak_tflops=fp32, memory_gib=4, dtype_tflops={"bf16": bf16},
                      emulated_speed=speed if emulation else None,
                      emulated_dtype_speed={"bf16": bf16_speed} if emulation else None)

    return Cluster("metrics-test", (device("big-0", "Big", 2.0, 8.0, 1.0, 4.0), device("small-0", "Small", 1.0, 2.0, 0.5, 1.0),
                                    device("big-1", "Big", 2.0, 8.0, 1.0, 4.0)), Network(2.0, 2.0, 50.0), emulation)


@functools.lru_cache(maxsize=None)
def _pipeline():
    graphs = capture(Net(), (torch.randn(2, POSITIONS, 8),))
    plan = plans.make_plan([StagePlan(0, [0], [0], "replicate(2)"), StagePlan(1, [0], [1], "replicate(1)")],
                           [plans.worker(0, 0, 0, sizes=[3, 3], device="big-0"),
                            plans.worker(1, 0, 1, sizes=[1, 1], device="small-0"),
                            plans.worker(2, 1, 0, sizes=[4, 4], device="big-1")], precision="bf16")
    return graphs, plan


def test_flops_and_mfu_per_kind_match_a_hand_computation():
    graphs, plan = _pipeline()
    assert rank_flops(graphs, plan) == [A_FLOPS * 6, A_FLOPS * 2, B_FLOPS * 8]
    figures = kind_figures(graphs, plan, _cluster(Emulation(base_gflops=0.5)), "bf16")
    assert list(figures) == ["Big", "Small"]
    big, small = figures["Big"].line(0.5), figures["Small"].line(0.5)
    assert big["ranks"] == [0, 2] and small["ranks"] == [1]
    assert big["flops"] == A_FLOPS * 6 + B_FLOPS * 8 and small["flops"] == A_FLOPS * 2
    # bf16 peaks from the spec: 8 + 8 TFLOPS for the two Big devices, 2 for the Small one
    assert big["peak_tflops"] == 16.0 and small["peak_tflops"] == 2.0
    assert big["mfu"] == pytest.approx((A_FLOPS * 6 + B_FLOPS * 8) / 0.5 / 16e12, rel=1e-12)
    assert small["mfu"] == pytest.approx(A_FLOPS * 2 / 0.5 / 2e12, rel=1e-12)
    # the emulated peaks: bf16 speed x base_gflops, 4 x 0.5 GFLOP/s per Big device, 1 x 0.5 for the Small one
    assert big["emulated_mfu"] == pytest.approx((A_FLOPS * 6 + B_FLOPS * 8) / 0.5 / 4e9, rel=1e-12)
    assert small["emulated_mfu"] == pytest.approx(A_FLOPS * 2 / 0.5 / 0.5e9, rel=1e-12)
    assert "emulated_mfu" not in kind_figures(graphs, plan, _cluster(), "bf16")["Big"].line(0.5)
    # a tensor-parallel stage cut 24:8 (its one shard group holds all its FLOPs): 3/4 and 1/4 of the work
    split = capture(Split(), (torch.randn(2, 8),))
    tp = plans.make_plan([StagePlan(0, [0], [0, 1], "split(2)", shard_sizes={"up": [24, 8], "down": [24, 8]})],
                         [plans.worker(0, tp_index=0, tp_size=2, sizes=[4]),
                          plans.worker(1, tp_index=1, tp_size=2, sizes=[4])])
    whole = 2 * 8 * 32 * 2 + (2 * 8 * 32 * 2 + 2 * 8 * 32)    # forward of both, backward (no input gradient for up)
    assert rank_flops(split, tp) == [whole * 4 * 0.75, whole * 4 * 0.25]


def _view(step, plan, graphs, cluster, loss, peak, rank=0, wall=0.5, grad_norm=None):
    stats = StepStats(step=step, wall_s=wall, compute_s=0.1, modeled_s=0.0, padded_s=0.1, wait_s=0.4, segments=2,
                      overruns=0, lr=0.01, grad_norm=grad_norm, peak_memory_bytes=peak)
    runtime = SimpleNamespace(rank=rank, world_size=plan.world_size, plan=plan, cluster=cluster, precision="bf16")
    return StepView(step=step, loss=loss, stats=stats, history=[], runtime=runtime, compute_plan=None, module=None,
                    evaluate=None, graphs=graphs)


def _drive(metrics, plan, graphs, cluster, steps, peaks):
    """The board's calls on rank 0 for ``steps`` steps, ``peaks[step][rank]`` each rank's measured peak
    (the exchange summed as the executor would)."""
    for step in range(steps):
        metrics.on_batch((torch.zeros(plan.global_batch_size, POSITIONS, 8),),
                         torch.zeros(plan.global_batch_size, POSITIONS, dtype=torch.long))
        part = metrics.exchange(step, SimpleNamespace(rank=0, world_size=plan.world_size), None)
        summed = part.fill().clone()
        for r in range(1, plan.world_size):      # what the other ranks add: their peak of the step before
            if step > 0:
                summed[r] = peaks[step - 1][r]
        part.arrived(summed)
        view = _view(step, plan, graphs, cluster, loss=1.0 / (step + 1), peak=peaks[step][0],
                     grad_norm=2.0 if step else None)
        assert metrics.react(view) is None
        if step == 1:
            metrics.changed(view, PlanChange("apply", plan, reason="shares for the measured speeds"))


def test_json_lines_tensorboard_and_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    graphs, plan = _pipeline()
    cluster = _cluster(Emulation(base_gflops=0.5))
    metrics = Metrics(str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb"))
    peaks = [[100, 200, 300], [110, 210, 310], [120, 220, 320]]
    _drive(metrics, plan, graphs, cluster, 3, peaks)
    metrics.close()
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "event" not in line]
    assert [line["step"] for line in steps] == [0, 1, 2] and metrics.lines == 3
    assert [line["loss"] for line in steps] == [1.0, 0.5, 1.0 / 3]
    assert "grad_norm" not in steps[0] and steps[1]["grad_norm"] == 2.0      # none computed: no key
    first = steps[0]
    assert first["lr"] == 0.01 and first["step_time_s"] == 0.5 and first["samples_per_s"] == 8 / 0.5
    assert first["tokens_per_sample"] == POSITIONS and first["tokens_per_s"] == 8 * POSITIONS / 0.5
    assert first["mfu"]["Small"]["mfu"] == pytest.approx(A_FLOPS * 2 / 0.5 / 2e12, rel=1e-12)
    assert first["peak_memory_bytes"] == 100 and "peak_memory_bytes_by_rank" not in first
    assert steps[2]["peak_memory_bytes_by_rank"] == {"step": 1, "ranks": {"0": 110, "1": 210, "2": 310}}
    event, = [line for line in lines if "event" in line]
    assert event == {"step": 1, "event": "replan", "change": "apply", "reason": "shares for the measured speeds",
                     "exact": True, "world_size": 3}
    assert lines.index(event) == 2                   # written when it happened, after step 1's line
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("train/loss")] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [e.value for e in tb.Scalars("mfu/Big")] == pytest.approx([steps[0]["mfu"]["Big"]["mfu"]] * 3, rel=1e-6)
    assert [(e.step, e.value) for e in tb.Scalars("memory/peak_bytes/rank2")] == [(0, 300.0), (1, 310.0)]
    assert [(e.step, e.value) for e in tb.Scalars("events/replans")] == [(1, 1.0)]
    # rank 1 takes part in the exchange and writes nothing
    quiet = Metrics(str(tmp_path / "quiet.jsonl"))
    quiet.react(_view(0, plan, graphs, cluster, loss=1.0, peak=None, rank=1))
    assert quiet.lines == 0 and not (tmp_path / "quiet.jsonl").exists()


def test_missing_packages_and_bad_arguments_are_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(WhaleError, match=r"needs the tensorboard package: pip install tensorboard") as e:
        Metrics(str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb"))
    assert "\n" not in str(e.value)
    Metrics(str(tmp_path / "m.jsonl"))              # not asked: not needed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(WhaleError, match=r"needs the wandb package: pip install wandb"):
        Metrics(str(tmp_path / "m.jsonl"), wandb=True)
    with pytest.raises(WhaleError, match="writes nowhere"):
        Metrics()
    with pytest.raises(WhaleError, match="tokens_per_sample"):
        Metrics(str(tmp_path / "m.jsonl"), tokens_per_sample=0)
    # tokens by default: integer targets with positions; class labels and regression targets are not tokens
    assert tokens_per_sample_of(torch.zeros(4, 5, dtype=torch.long)) == 5
    assert tokens_per_sample_of(torch.zeros(4, dtype=torch.long)) is None
    assert tokens_per_sample_of(torch.zeros(4, 5)) is None


def test_wandb_when_installed_and_asked(monkeypatch, tmp_path):
    calls = []
    run = SimpleNamespace(log=lambda values, step: calls.append(("log", step, values)),
                          finish=lambda: calls.append(("finish",)))
    fake = ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    graphs, plan = _pipeline()
    metrics = Metrics(None, wandb=True, wandb_init={"project": "p"}, tokens_per_sample=7)
    _drive(metrics, plan, graphs, _cluster(), 2, [[1, 2, 3], [4, 5, 6]])
    metrics.close()
    assert calls[0] == ("init", {"project": "p"}) and calls[-1] == ("finish",)
    logged = [c for c in calls if c[0] == "log" and "train/loss" in c[2]]
    assert [c[1] for c in logged] == [0, 1] and logged[0][2]["throughput/tokens_per_s"] == 8 * 7 / 0.5
    assert "mfu/Small" in logged[0][2] and "emulated_mfu/Small" not in logged[0][2]


def _ranks(rank: int, world_size: int, directory: str, fingerprint: str) -> dict:
    from runtime import Engine

    torch.manual_seed(0)
    model = Net()
    whole = _cluster()
    cluster = Cluster(whole.name, whole.devices[:2], whole.network, None)
    plan = plans.make_plan([StagePlan(0, [0], [0, 1], "replicate(2)")],
                           [plans.worker(0, 0, 0, sizes=[5], device="big-0"),
                            plans.worker(1, 0, 1, sizes=[3], device="small-0")],
                           model_fingerprint=fingerprint, cluster=cluster.name)
    engine = Engine(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=_loss, cluster=cluster,
                    timeout_s=60, balance="off", measure_memory=True, clip_grad_norm=1.0)
    metrics = engine.add_controller(Metrics(os.path.join(directory, "metrics.jsonl")))
    g = torch.Generator().manual_seed(1)
    losses = [float(engine.train_step((torch.randn(8, POSITIONS, 8, generator=g),
                                       torch.randint(0, 4, (8, POSITIONS), generator=g)))) for _ in range(3)]
    metrics.close()
    return {"losses": losses, "lines": metrics.lines, "peaks": [s.peak_memory_bytes for s in engine.stats]}


def test_two_ranks_train_and_rank_0_writes_every_rank_s_figures(tmp_path):
    fingerprint = _pipeline()[0].fingerprint
    results = run_ranks(_ranks, 2, args=(str(tmp_path), fingerprint), init_process_group=False, timeout_s=240)
    assert results[0]["lines"] == 3 and results[1]["lines"] == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["loss"] for line in lines] == results[0]["losses"] == results[1]["losses"]
    for step, line in enumerate(lines):
        assert line["peak_memory_bytes"] == results[0]["peaks"][step] > 0
        assert line["lr"] == 0.1 and line["grad_norm"] > 0 and line["tokens_per_sample"] == POSITIONS
        assert line["tokens_per_s"] == pytest.approx(line["samples_per_s"] * POSITIONS)
        big, small = line["mfu"]["Big"], line["mfu"]["Small"]
        assert (big["flops"], small["flops"]) == ((A_FLOPS + B_FLOPS) * 5, (A_FLOPS + B_FLOPS) * 3)
        assert big["mfu"] == pytest.approx(big["flops"] / line["step_time_s"] / 2e12)
    assert "peak_memory_bytes_by_rank" not in lines[0]
    for step in (1, 2):
        assert lines[step]["peak_memory_bytes_by_rank"] == {
            "step": step - 1, "ranks": {str(r): results[r]["peaks"][step - 1] for r in (0, 1)}}
