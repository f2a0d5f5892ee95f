"""The replica-sync seam (runtime.replicas.replica_sync): what every implementation must do for the
executors, checked on DDP (the one implementation today) on two real gloo ranks, plus the plan
field that names it."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import run_ranks
from plans import make_plan, worker
from planner import Plan, PlanError
from planner.plan import StagePlan
from runtime.replicas.replica_sync import AloneSync, build_replica_sync
from runtime.replicas import ddp_sync
from runtime.replicas.ddp_sync import DDPSync
from whalelike.errors import WhaleError

SAMPLES = {0: 3, 1: 5}   # uneven shares of an 8-sample batch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64)


def _local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, weight: float) -> list[torch.Tensor]:
    model.zero_grad()
    (nn.functional.mse_loss(model(x), y) * weight).backward()
    return [p.grad.clone() for p in model.parameters()]


def _sync_checks(rank: int, world_size: int) -> dict:
    x, y = _batch()
    lo = 0 if rank == 0 else SAMPLES[0]
    mine = slice(lo, lo + SAMPLES[rank])
    weight = SAMPLES[rank] / 8
    # the reference: the gradient of the global-batch mean, from one process holding the whole batch
    reference = _local_grads(_model(), x, y, 1.0)

    model = _model()
    sync = build_replica_sync("ddp", model, None, devices=["a", "b"])
    out = {"kind": type(sync).__name__, "syncs": sync.syncs}
    # two micro-batches: the first accumulates without a sync, the last syncs and carries a passenger
    first, last = slice(mine.start, mine.start + 1), slice(mine.start + 1, mine.stop)
    with sync.no_sync():
        (nn.functional.mse_loss(sync.module(x[first]), y[first], reduction="sum") / 16).backward()
    passenger = torch.tensor([float(rank + 1), 10.0 * (rank + 1)], dtype=torch.float64)
    sync.carry(passenger)
    (nn.functional.mse_loss(sync.module(x[last]), y[last], reduction="sum") / 16).backward()
    sync.flush()
    out["passenger"] = passenger.tolist()
    out["grads_match"] = all(torch.allclose(p.grad, r) for p, r in zip(model.parameters(), reference))

    # a last bucket above JOIN_BYTES: the passenger is summed in an all-reduce of its own beside it
    joined, ddp_sync.JOIN_BYTES = ddp_sync.JOIN_BYTES, 0
    try:
        model.zero_grad()
        beside = torch.tensor([float(rank + 1)], dtype=torch.float64)
        sync.carry(beside, lambda t: t.mul_(2.0))     # written at send time
        (nn.functional.mse_loss(sync.module(x[mine]), y[mine]) * weight).backward()
        sync.flush()
    finally:
        ddp_sync.JOIN_BYTES = joined
    out["beside"] = beside.tolist()
    out["beside_grads_match"] = all(torch.allclose(p.grad, r) for p, r in zip(model.parameters(), reference))

    # arm: a forward under no_sync, then a backward that syncs all the same (a pipeline's last backward)
    model.zero_grad()
    with sync.no_sync():
        loss = nn.functional.mse_loss(sync.module(x[mine]), y[mine]) * weight
    sync.arm([loss])
    loss.backward()
    out["armed_grads_match"] = all(torch.allclose(p.grad, r) for p, r in zip(model.parameters(), reference))

    # what a rank holds: everything whole under DDP
    out["held"] = {name: slab.shape for name, (_, slab) in sync.named_state().items()}

    # release: no hook is left, so a second sync can own the parameters and sums only once
    assert sync.release() is model
    again = build_replica_sync("ddp", model, None, devices=["a", "b"])
    out["after_release_match"] = all(torch.allclose(g, r) for g, r in zip(
        _local_grads(again.module, x[mine], y[mine], weight), reference))
    again.release()

    # alone: no collective on the gradients, the passenger still summed over the group given
    alone = build_replica_sync("ddp", _model(), dist.group.WORLD, alone=True)
    figures = torch.tensor([1.0], dtype=torch.float64)
    alone.carry(figures, lambda t: t.fill_(2.0 + rank))
    alone.flush()
    out["alone"] = (type(alone).__name__, alone.syncs, figures.item())
    return out


def test_ddp_sync_keeps_uneven_replicas_in_step_on_two_ranks():
    results = run_ranks(_sync_checks, 2, timeout_s=120)
    for out in results:
        assert out["kind"] == "DDPSync" and out["syncs"]
        assert out["passenger"] == [3.0, 30.0]                 # summed in the gradient all-reduce
        assert out["grads_match"] and out["armed_grads_match"] and out["after_release_match"]
        assert out["beside"] == [6.0] and out["beside_grads_match"]     # (1 + 2) * 2, beside a large bucket
        assert out["held"] == {"0.weight": (3, 4), "0.bias": (3,), "2.weight": (2, 3), "2.bias": (2,)}
        assert out["alone"] == ("AloneSync", False, 5.0)       # 2 + 3: filled at send time, summed


def test_an_unknown_replica_sync_is_named_with_the_choices():
    with pytest.raises(WhaleError, match=r"replica_sync is 'zero3'; the replica syncs are \['ddp', 'fsdp', 'partial', 'ragged'\]"):
        build_replica_sync("zero3", _model(), None)


def test_a_module_without_trainable_parameters_is_alone():
    frozen = _model().requires_grad_(False)
    assert isinstance(build_replica_sync("ddp", frozen, None), AloneSync)
    assert DDPSync.name == "ddp"


def test_the_plan_names_each_stage_s_replica_sync_and_refuses_others():
    plan = make_plan([StagePlan(0, [0], [0], "replicate(2)")], [worker(0, 0, 0, sizes=[4]), worker(1, 0, 1, sizes=[4])])
    assert plan.stages[0].replica_sync == "ddp"
    assert Plan.from_dict(plan.to_dict()) == plan
    bad = plan.to_dict()
    bad["stages"][0]["replica_sync"] = "zero3"
    with pytest.raises(PlanError, match="replica_sync"):
        Plan.from_dict(bad)
