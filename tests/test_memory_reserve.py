"""The memory reserve (``Config.memory_reserve``, ``planner.devices.memory.with_reserve``): a plan fits
every worker's prediction into its device's memory less the reserve, so a plan at the edge trains on
devices that enforce their memory, and one byte less is refused with the shortfall named.

The model is one ``nn.Linear`` under ``replicate(2)``: a single layer, so recomputing its activations
would keep no less (the planner cannot fit it that way), and one sample per device (global batch 2,
one micro-batch, ZeRO 0 asked), so no share can move and no accumulation can shrink it: at one byte
less than the edge the only answer is a refusal.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import planner
import whalelike as wl
from dist_utils import run_ranks
from planner.balance.replan import config_of, rebalance
from planner.devices.cost_model import GIB
from planner.devices.memory import with_reserve
from runtime import Engine
from whalelike.cluster import Cluster, Device, Emulation, Network
from whalelike.config import DEFAULT_MEMORY_RESERVE

WIDTH, CLASSES, BATCH = 256, 16, 2


class OneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        with wl.replicate(2):
            return self.fc(x)


def model() -> OneLayer:
    torch.manual_seed(0)
    return OneLayer()


def cluster(memory_gib: float) -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=memory_gib,
                           emulated_speed=1.0) for i in range(2))
    return Cluster("reserve", devices, Network(10.0, 10.0, 50.0),
                   Emulation(base_gflops=50.0, enforce_memory=True))


def config(reserve: float = DEFAULT_MEMORY_RESERVE) -> wl.Config:
    return wl.Config(global_batch_size=BATCH, num_micro_batch=1, zero_stage=0, memory_reserve=reserve)


@pytest.fixture(scope="module")
def graphs():
    return wl.capture(model(), (torch.randn(2, WIDTH),))


def _need_gib(graphs) -> float:
    """The largest worker's predicted peak, planned where anything fits."""
    roomy = planner.plan(graphs, cluster(1.0), config())
    return max(w.memory_gib for w in roomy.workers)


def test_the_reserve_is_left_free_and_recorded(graphs):
    reserve = DEFAULT_MEMORY_RESERVE
    assert reserve == 0.10
    plan = planner.plan(graphs, cluster(1.0), config())
    assert plan.memory_reserve == reserve
    assert all(w.capacity_gib == pytest.approx(1.0 * (1 - reserve)) for w in plan.workers)
    assert "the 10% reserve it keeps free" in plan.summary()
    whole = planner.plan(graphs, cluster(1.0), config(0.0))
    assert whole.memory_reserve == 0.0 and all(w.capacity_gib == 1.0 for w in whole.workers)
    # the view is idempotent and re-scales from the devices' whole memory
    spec = cluster(1.0)
    view = with_reserve(spec, 0.25)
    assert with_reserve(view, 0.25) is view and view.devices[0].memory_gib == 0.75
    assert with_reserve(view, 0.5).devices[0].memory_gib == pytest.approx(0.5)
    assert with_reserve(view, 0.0).devices[0].memory_gib == pytest.approx(1.0)
    # a re-plan keeps the plan's reserve: its config, and what it fits into
    assert config_of(plan).memory_reserve == reserve
    again = rebalance(plan, graphs, spec, [2.0, 1.0])
    assert again.memory_reserve == reserve and all(w.capacity_gib == pytest.approx(0.9) for w in again.workers)


def test_a_plan_at_the_edge_fits_and_one_byte_less_is_refused_with_the_shortfall(graphs):
    need = _need_gib(graphs)
    reserve = DEFAULT_MEMORY_RESERVE
    edge = need / (1 - reserve)                       # what a plan may fill is exactly the prediction
    plan = planner.plan(graphs, cluster(edge), config())
    assert [w.micro_batch_sizes for w in plan.workers] == [[1], [1]]
    assert max(w.memory_gib for w in plan.workers) == pytest.approx(need)
    short = edge - 1 / GIB / (1 - reserve)            # one byte less of what a plan may fill, on every device
    with pytest.raises(planner.PlanError) as refused:
        planner.plan(graphs, cluster(short), config())
    text = str(refused.value)
    assert "short by 1 B (1 bytes)" in text, text
    assert "less the 10% reserve a plan keeps free" in text and "--memory-reserve" in text, text
    # with no reserve, the same devices hold the plan to their last byte
    assert planner.plan(graphs, cluster(short), config(0.0)).memory_reserve == 0.0


def _train(rank: int, world_size: int, plan, spec: Cluster) -> list[int]:
    engine = Engine(model(), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=F.cross_entropy,
                    cluster=spec, example_args=(torch.randn(2, WIDTH),), timeout_s=60, balance="off")
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.train_step(((torch.randn(BATCH, WIDTH, generator=generator),),
                           torch.randint(0, CLASSES, (BATCH,), generator=generator)))
    return [s.peak_memory_bytes for s in engine.stats]


def test_the_plan_at_the_edge_trains_on_devices_that_enforce_their_memory(graphs):
    edge = _need_gib(graphs) / (1 - DEFAULT_MEMORY_RESERVE)
    spec = cluster(edge)
    plan = planner.plan(graphs, spec, config())
    peaks = run_ranks(_train, 2, args=(plan, spec), init_process_group=False, timeout_s=120)
    capacity = int(edge * GIB)
    for rank, steps in enumerate(peaks):
        assert steps and all(0 < p <= capacity for p in steps), (rank, steps, capacity)
