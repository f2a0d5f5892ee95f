"""Eager-1F1B, delayed weight gradients and ZB-H1 in the pipeline runtime, against the single-process
reference (one 4-rank gloo spawn, float64).

Cases: schedules ``eager-1f1b`` and ``1f1b``, each with and without ``Plan.delay_weight_gradients``,
and ``zb-h1`` (every backward split: input halves sent upstream at once, weight halves deferred),
on (a) 3 stages whose middle stage runs on 2 data-parallel workers with shares [3, 1] (so DDP's
all-reduce must fire in the weight half of the split backward, and the stage both receives a
gradient-carrying value and has parameters), with emulation on, and (b) 2 stages with uneven
micro-batch sizes on a 2-rank subgroup. Each trains ``tests/test_pipeline.SkipNet`` for 3 AdamW
steps and compares every step's loss and the final parameters with
:func:`reference.train_reference`; the two workers of the data-parallel stage must also hold equal
parameters. Under delay and ZB-H1, every backward is two emulated compute segments (three per
micro-batch) whose FLOPs add up to the undelayed backward's; under ZB-H1 each rank runs exactly the
program :mod:`planner.schedule.program` lowers (what the simulator runs and the deadlock proof proves).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.testing import assert_close

from dist_utils import run_ranks
from planner.schedule.actions import build_schedule
from planner.schedule.program import lower
from reference import OPTIMIZERS, train_reference
from runtime.emulation.compute import Emulator
from runtime.groups import group_ranks
from runtime.parallel.pipeline import PipelineExecutor
from test_pipeline import CLASSES, DIN, THREE_STAGES, TWO_STAGES, SkipNet, _cut, _plan
from whalelike.cluster import Emulation

STEPS = 3
PLANS = {
    "3-stages-middle-on-2-workers": (THREE_STAGES, [(0, 0, 0, [4] * 4), (0, 1, 0, [3] * 4), (0, 1, 1, [1] * 4),
                                                    (0, 2, 0, [4] * 4)]),
    "2-stages-uneven": (TWO_STAGES, [(0, 0, 0, [3, 1, 2, 2]), (0, 1, 0, [3, 1, 2, 2])]),
}
CASES = [(plan, schedule, delay) for plan in PLANS for schedule in ("eager-1f1b", "1f1b") for delay in (False, True)]
# ZB-H1 (issue 31): every backward split, input halves sent at once, weight halves deferred (delay is moot)
CASES += [(plan, "zb-h1", False) for plan in PLANS]


def _run_case(rank: int, groups: dict[int, dist.ProcessGroup], plan_name: str, schedule: str, delay: bool):
    cut, workers = PLANS[plan_name]
    plan = dataclasses.replace(_plan(schedule, workers), delay_weight_gradients=delay)
    torch.manual_seed(0)
    model = SkipNet()
    g = torch.Generator().manual_seed(1)
    batches = [((torch.randn(plan.global_batch_size, DIN, generator=g),
                 torch.randn(plan.global_batch_size, CLASSES, generator=g)),
                torch.randint(0, CLASSES, (plan.global_batch_size,), generator=g)) for _ in range(STEPS)]
    ref_losses, ref_state = train_reference(model, batches, OPTIMIZERS["adamw"], F.cross_entropy)
    dp_group = None
    for ranks in group_ranks(plan, "dp").values():   # new_group is a collective over the whole world
        created = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        dp_group = created if rank in ranks else dp_group
    if rank >= plan.world_size:
        return None
    label = f"{plan_name}/{schedule}/delay={delay}"
    emulate = dp_group is not None
    emulator = Emulator(1.0 if rank % 2 else 0.5, Emulation(base_gflops=10.0), rank) if emulate else None
    gm = fx.symbolic_trace(model)
    pipe = PipelineExecutor(gm, _cut(gm, cut), plan, F.cross_entropy, emulator=emulator,
                            stage_flops=[(2e3, 4e3)] * (len(cut) + 1), group=groups[plan.world_size], dp_group=dp_group)
    opt = OPTIMIZERS["adamw"](pipe.parameters())
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        losses.append(pipe.train_step(inputs, targets))
        opt.step()
    assert_close(torch.stack(losses), torch.stack(ref_losses), msg=lambda m: f"{label}: losses: {m}")
    final = pipe.full_state_dict()
    assert final.keys() == ref_state.keys(), f"{label}: {sorted(final)} != {sorted(ref_state)}"
    for key, value in ref_state.items():
        assert_close(final[key], value, msg=lambda m: f"{label}: {key}: {m}")
    if emulator is not None:
        segments_per_micro_batch = 3 if delay or schedule == "zb-h1" else 2
        assert emulator.stats.segments == segments_per_micro_batch * plan.num_micro_batch * STEPS, label
    return {"losses": torch.stack(losses), "stage": pipe.worker.stage, "program": [str(a) for a in pipe.schedule],
            "emulated_flops": emulator.stats.flops if emulator is not None else None,
            "state": {k: v.detach().clone() for k, v in pipe.stage.module.state_dict().items()}}


def _all_cases(rank: int, world_size: int) -> dict:
    torch.set_default_dtype(torch.float64)
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    out = {}
    for case in CASES:
        out[case] = _run_case(rank, groups, *case)
        dist.barrier()
    return out


def test_eager_1f1b_and_delayed_weight_gradients_match_single_process_reference():
    results = run_ranks(_all_cases, 4, env={"OMP_NUM_THREADS": "1"}, timeout_s=300)
    for case in CASES:
        ran = [r[case] for r in results if r[case] is not None]
        assert len(ran) == len(PLANS[case[0]][1]), case
        for other in ran[1:]:   # every rank returns the same global-mean loss
            assert_close(other["losses"], ran[0]["losses"], rtol=0, atol=0)
        by_stage: dict[int, list[dict]] = {}
        for r in ran:
            by_stage.setdefault(r["stage"], []).append(r["state"])
        for states in by_stage.values():   # the data-parallel workers of a stage stay identical
            for state in states[1:]:
                assert_close(state, states[0], rtol=0, atol=0, msg=lambda m: f"{case}: {m}")
    # delayed or not, the same plan and schedule train the same model, and the two emulated halves
    # of each backward add up to the one-segment backward's FLOPs
    for plan in PLANS:
        for schedule in ("eager-1f1b", "1f1b"):
            assert_close(results[0][(plan, schedule, True)]["losses"], results[0][(plan, schedule, False)]["losses"])
            for r in results:
                if r[(plan, schedule, True)] is not None:
                    assert r[(plan, schedule, True)]["emulated_flops"] == r[(plan, schedule, False)]["emulated_flops"]
        # ZB-H1 trains the same model as 1F1B, its split backwards emulate the same FLOPs, and each rank ran
        # the program the planner proves and simulates (the schedule lowered onto the stages' crossings)
        assert_close(results[0][(plan, "zb-h1", False)]["losses"], results[0][(plan, "1f1b", False)]["losses"])
        cut, workers = PLANS[plan]
        edges = [(s, s + 1) for s in range(len(cut))] + ([(0, 2)] if len(cut) == 2 else [])   # SkipNet's skip
        expected = lower(build_schedule("zb-h1", len(cut) + 1, 4), edges, [True] * (len(cut) + 1))
        for r in results:
            if r[(plan, "zb-h1", False)] is not None:
                assert r[(plan, "zb-h1", False)]["emulated_flops"] == r[(plan, "1f1b", False)]["emulated_flops"]
                assert r[(plan, "zb-h1", False)]["program"] == [str(a) for a in expected[r[(plan, "zb-h1", False)]["stage"]]]
