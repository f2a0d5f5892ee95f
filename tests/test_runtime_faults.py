"""Bad input and faults of runtime.Engine, on 3 gloo ranks (two spawns: a dead rank ends its world).

Spawn 1, on every rank: a plan for another world size, a plan for another model, a batch that
does not match the plan's shares (all clear errors raised before any collective, so no rank hangs);
then a rank that never arrives at step 1 while the others wait in its collective: they fail within
``timeout_s`` with an error naming themselves, the step and the missing rank.
Spawn 2: a rank dies during training; the survivors fail with an error naming the step, and exit
non-zero.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time

import pytest
import torch
import torch.nn.functional as F

from dist_utils import spawn_ranks
from planner.plan import PlanError, Worker
from runtime import DistributedStepError, Engine
from test_runtime_dp import Net, batches, make_cluster, make_plan
from whalelike.errors import WhaleError

WORLD = 3
TIMEOUT_S = 3.0
SHARES = [[4], [2], [1]]


def _engine(model, plan, **kwargs) -> Engine:
    cluster = dataclasses.replace(make_cluster(None), devices=make_cluster(None).devices[:WORLD])
    return Engine(copy.deepcopy(model), plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                  loss_fn=F.cross_entropy, cluster=cluster, timeout_s=TIMEOUT_S, **kwargs)


def _bad_input_then_missing_rank(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = Net()
    plan = make_plan(model, SHARES)
    data = batches(plan.global_batch_size, seed=0)

    four = dataclasses.replace(plan, workers=plan.workers + [Worker(3, "emu-3", "localhost", 0, 0, 3, micro_batch_sizes=[1])],
                               global_batch_size=plan.global_batch_size + 1)
    with pytest.raises(PlanError, match=r"the plan has 4 workers .* this run has 3 ranks; launch `torchrun --nproc_per_node 4"):
        _engine(model, four)

    other = dataclasses.replace(plan, model_fingerprint="0123456789abcdef" * 4)
    with pytest.raises(PlanError, match="plan was made for model 0123456789ab"):
        _engine(model, other).train_step(data[0])

    engine = _engine(model, plan)
    (x, z), y = data[0]
    with pytest.raises(WhaleError, match=r"the batch has 5 samples but the plan's shares \[4, 2, 1\] need global_batch_size=7"):
        engine.train_step(((x[:5], z[:5]), y[:5]))

    engine.train_step(data[0])
    if rank == 1:  # never arrives at step 1
        time.sleep(4 * TIMEOUT_S)
        return "absent"
    start = time.monotonic()
    with pytest.raises(DistributedStepError) as info:
        engine.train_step(data[1])
    waited = time.monotonic() - start
    message = str(info.value)
    assert message.startswith(f"rank {rank}, step 1: a collective failed or timed out (timeout_s=3 s)"), message
    assert "rank 1 never reached step 1 (last began: step 0)" in message, message
    assert waited < 4 * TIMEOUT_S, f"failed after {waited:.1f} s"
    return message


def test_bad_input_and_missing_rank():
    outcomes = spawn_ranks(_bad_input_then_missing_rank, WORLD, init_process_group=False, timeout_s=240)
    for o in outcomes:
        assert o.ok, o.error
    assert outcomes[1].value == "absent"


def _rank_dies(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Net()
    plan = make_plan(model, SHARES)
    data = batches(plan.global_batch_size, seed=0)
    engine = _engine(model, plan)
    engine.train_step(data[0])
    if rank == 2:
        os._exit(17)  # dies without a word
    engine.train_step(data[1])


def test_dead_rank_fails_the_others_with_the_step():
    outcomes = spawn_ranks(_rank_dies, WORLD, init_process_group=False, timeout_s=240)
    assert outcomes[2].exitcode == 17
    for o in outcomes[:2]:
        assert o.exitcode == 1 and o.error_type == "DistributedStepError", o
        assert f"rank {o.rank}, step 1: a collective failed or timed out" in o.error, o.error
