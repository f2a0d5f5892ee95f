"""planner.shares.layout.SampleLayout: the one owner of which rank processes which samples.

In process: the layout of hand-made plans (uneven shares with per-rank accumulation, replicas
listed out of rank order, a straddling pipeline, tensor-parallel slots, a hybrid) and of
planner-made plans, written out; short batches split in proportion to the shares; and, on random
plans (hypothesis), the invariant: every stage's slots tile the global batch exactly once, every
stage of a replica sees the same samples per micro-batch, tensor-parallel members share their
ranges, the data-parallel groups are runtime.groups' ``"dp"`` groups, and the sampler reads what
the executor slices.

One 2-rank gloo spawn: a data-parallel Engine (float64, SGD with momentum and AdamW) whose shares
change from [6, 2] to [2, 6] after step 2 through ``DataParallelExecutor.set_plan`` (micro-batch
counts change too), on whole global batches and through ``UnevenLoader.set_plan`` mid-epoch (its
last batch short), trains exactly like the single-process reference; plans of other workers are
refused with the differing field named.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import planner
import planner.candidates
import plans
from dist_utils import run_ranks
from planner.shares.layout import SampleLayout, proportional_split
from planner.plan import Plan, PlanError, StagePlan
from reference import OPTIMIZERS, train_reference
from runtime.data import UnevenSampler
from runtime.groups import group_ranks
from runtime.parallel.pipeline import sample_ranges
from synthetic import synthetic_cluster, synthetic_model
from whalelike import Config, replicate, split
from whalelike.strategy import Strategy


def make_plan(workers: list[tuple[int, int, int, int, int, list[int]]], num_stages: int = 1) -> Plan:
    """Workers as ``(replica, stage, dp_index, tp_index, tp_size, micro_batch_sizes)``, rank = position."""
    ws = [plans.worker(rank, s, i, t, n, sizes=m, replica=r, device=f"dev-{rank}", host="host")
          for rank, (r, s, i, t, n, m) in enumerate(workers)]
    plan = plans.make_plan([StagePlan(s, [0], [s], "replicate") for s in range(num_stages)], ws)
    plan.validate()
    return plan


# -- today's layouts, written out ------------------------------------------------------------------
def test_single_stage_uneven_shares_with_accumulation():
    plan = make_plan([(0, 0, r, 0, 1, m) for r, m in enumerate([[4, 4, 3], [5, 4], [3], [1, 1]])])
    layout = SampleLayout.of(plan)
    assert layout.all_ranges() == {0: [(0, 4), (4, 8), (8, 11)], 1: [(11, 16), (16, 20)], 2: [(20, 23)],
                                   3: [(23, 24), (24, 25)]}
    assert [layout.offset(r) for r in range(4)] == [0, 11, 20, 23]
    assert [layout.share(r) for r in range(4)] == [11, 9, 3, 2]
    assert layout.dp_shares(2) == ([11, 9, 3, 2], 2)
    assert [layout.split(25, r) for r in range(4)] == [(0, 11), (11, 20), (20, 23), (23, 25)]
    # a short batch: in proportion to the shares, then micro-batches of at most the plan's largest
    assert layout.sizes(10, 0) == proportional_split(10, [11, 9, 3, 2]) == [4, 4, 1, 1]
    assert [layout.split(10, r) for r in range(4)] == [(0, 4), (4, 8), (8, 9), (9, 10)]
    assert layout.micro_batches(0, 11) == [4, 4, 3]
    assert layout.micro_batches(0, 7) == [4, 3] and layout.micro_batches(3, 0) == [0]
    assert layout.micro_batches(0, 7, keep_count=True) == [3, 2, 2]


def test_replicas_are_laid_out_replica_major_whatever_the_rank_order():
    # rank 0 is replica 1; replica 0 is ranks 2 (dp_index 0) and 1 (dp_index 1)
    plan = make_plan([(1, 0, 0, 0, 1, [2]), (0, 0, 1, 0, 1, [3, 1]), (0, 0, 0, 0, 1, [5])])
    layout = SampleLayout.of(plan)
    assert layout.all_ranges() == {2: [(0, 5)], 1: [(5, 8), (8, 9)], 0: [(9, 11)]}
    assert layout.dp_group(0) == (2, 1, 0) and layout.dp_shares(0) == ([5, 4, 2], 2)


def test_pipeline_straddling_slots():
    """Stage 0 cut 1+3 then 3+1, stage 1 cut 2+2 twice: micro-batch blocks of 4, pieces inside."""
    plan = make_plan([(0, 0, 0, 0, 1, [1, 3]), (0, 0, 1, 0, 1, [3, 1]),
                      (0, 1, 0, 0, 1, [2, 2]), (0, 1, 1, 0, 1, [2, 2])], num_stages=2)
    layout = SampleLayout.of(plan)
    assert layout.all_ranges() == {0: [(0, 1), (4, 7)], 1: [(1, 4), (7, 8)], 2: [(0, 2), (4, 6)], 3: [(2, 4), (6, 8)]}
    assert layout.all_ranges() == sample_ranges(plan)
    assert layout.dp_shares(3) == ([4, 4], 1) and not layout.contiguous
    with pytest.raises(ValueError, match="single-stage plan; this plan has 2 stages"):
        layout.offset(0)
    with pytest.raises(ValueError, match="single-stage plan"):
        layout.split(5, 0)
    with pytest.raises(ValueError, match="rank 4 is not in the plan: ranks are 0..3"):
        layout.ranges(4)


def test_pipeline_replicas_and_tensor_parallel_slots():
    """Two replicas of a hybrid: stage 0 two slots, stage 1 one tensor-parallel slot of 2 workers."""
    spec = []
    for r, (a, b) in enumerate([([2, 1], [1, 2]), ([1, 1], [1, 1])]):
        spec += [(r, 0, 0, 0, 1, a), (r, 0, 1, 0, 1, b)]
        spec += [(r, 1, 0, t, 2, [x + y for x, y in zip(a, b)]) for t in range(2)]
    layout = SampleLayout.of(make_plan(spec, num_stages=2))
    assert layout.all_ranges() == {
        0: [(0, 2), (3, 4)], 1: [(2, 3), (4, 6)], 2: [(0, 3), (3, 6)], 3: [(0, 3), (3, 6)],
        4: [(6, 7), (8, 9)], 5: [(7, 8), (9, 10)], 6: [(6, 8), (8, 10)], 7: [(6, 8), (8, 10)]}
    assert layout.dp_group(3) == (3, 7) and layout.dp_shares(6) == ([6, 4], 1)
    # micro-batch 1's rows without gaps: replica 0's block [3, 6) then replica 1's [8, 10)
    assert layout.micro_batch_rows(1) == (5, {0: (0, 1), 1: (1, 3), 2: (0, 3), 3: (0, 3),
                                              4: (3, 4), 5: (4, 5), 6: (3, 5), 7: (3, 5)})
    # micro-batch 0 has other shares in replica 0 (2 + 1 against 1 + 2), the same block sizes
    assert layout.micro_batch_rows(0)[0] == 5 and layout.micro_batch_rows(0)[1][0] == (0, 2)


def test_single_stage_tensor_parallel_slots_share_their_samples():
    plan = make_plan([(0, 0, 0, 0, 2, [5]), (0, 0, 0, 1, 2, [5]), (0, 0, 1, 0, 2, [3]), (0, 0, 1, 1, 2, [3])])
    layout = SampleLayout.of(plan)
    assert layout.all_ranges() == {0: [(0, 5)], 1: [(0, 5)], 2: [(5, 8)], 3: [(5, 8)]}
    assert layout.dp_groups == ((0, 2), (1, 3))
    assert [layout.split(4, r) for r in range(4)] == [(0, 3), (0, 3), (3, 4), (3, 4)]


PLANNED = {
    "data-parallel": (synthetic_model(4, [replicate()], hidden=256, seq=32), [(2, 30.0, 16), (2, 10.0, 16)],
                      Config(global_batch_size=80, num_micro_batch=2)),
    "pipeline-replicas": (synthetic_model(8, [replicate(2), replicate(2)], hidden=256, seq=32),
                          [(4, 20.0, 16), (4, 10.0, 16)], Config(global_batch_size=32, num_micro_batch=4)),
    "split-in-replicate": (synthetic_model(4, [Strategy("replicate", 2, Strategy("split", 2))], hidden=256, seq=32),
                           [(2, 20.0, 16), (2, 10.0, 16)], Config(global_batch_size=24, num_micro_batch=2)),
    "pipeline-split-head": (synthetic_model(7, [replicate(), replicate(), split(1)], layers_per_graph=[3, 3, 1],
                                            hidden=256, seq=32),
                            [(2, 20.0, 16), (2, 10.0, 16)], Config(global_batch_size=16, num_micro_batch=2)),
}
EXPECTED = {
    "data-parallel": {0: [(0, 15), (15, 30)], 1: [(30, 45), (45, 60)], 2: [(60, 65), (65, 70)], 3: [(70, 75), (75, 80)]},
    "pipeline-replicas": {0: [(0, 2), (4, 6), (8, 10), (12, 14)], 3: [(18, 20), (22, 24), (26, 28), (30, 32)],
                          5: [(2, 4), (6, 8), (10, 12), (14, 16)], 6: [(16, 18), (20, 22), (24, 26), (28, 30)]},
    "split-in-replicate": {0: [(0, 8), (8, 16)], 1: [(0, 8), (8, 16)], 2: [(16, 20), (20, 24)], 3: [(16, 20), (20, 24)]},
    "pipeline-split-head": {0: [(0, 4), (8, 12)], 1: [(4, 8), (12, 16)], 2: [(0, 8), (8, 16)], 3: [(0, 8), (8, 16)]},
}


@pytest.mark.parametrize("name", PLANNED)
def test_planner_made_plans(name, monkeypatch):
    graphs, kinds, config = PLANNED[name]
    # the layouts below are the planner's with the devices per stage split by work (not searched)
    monkeypatch.setattr(planner.candidates, "count_search", lambda graphs, cluster, config, aware, counts=None: aware)
    plan = planner.plan(graphs, synthetic_cluster(kinds, per_host=4), config)
    layout = SampleLayout.of(plan)
    ranges = layout.all_ranges()
    for rank, expected in EXPECTED[name].items():
        assert ranges[rank] == expected, (name, rank)
    _check_invariant(plan, layout)


# -- the invariant on random plans -----------------------------------------------------------------
@st.composite
def random_plans(draw) -> Plan:
    replicas, num_stages = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    slots = [draw(st.integers(1, 3)) for _ in range(num_stages)]
    tp = [draw(st.integers(1, 2)) for _ in range(num_stages)]
    sizes: dict[tuple[int, int, int], list[int]] = {}
    if num_stages == 1:   # per slot its own micro-batch count (Poplar)
        for r in range(replicas):
            for i in range(slots[0]):
                sizes[r, 0, i] = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    else:                 # per replica and micro-batch one block, cut differently in every stage
        micro = draw(st.integers(1, 3))
        for r in range(replicas):
            for _ in range(micro):
                block = draw(st.integers(max(slots), 12))
                for s in range(num_stages):
                    cuts = sorted(draw(st.sets(st.integers(1, block - 1), min_size=slots[s] - 1,
                                               max_size=slots[s] - 1))) if slots[s] > 1 else []
                    for i, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, block])):
                        sizes.setdefault((r, s, i), []).append(hi - lo)
    keys = draw(st.permutations([(r, s, i, t) for r in range(replicas) for s in range(num_stages)
                                 for i in range(slots[s]) for t in range(tp[s])]))
    return make_plan([(r, s, i, t, tp[s], sizes[r, s, i]) for r, s, i, t in keys], num_stages)


def _check_invariant(plan: Plan, layout: SampleLayout) -> None:
    ranges = layout.all_ranges()
    batch = plan.global_batch_size
    for w in plan.workers:
        assert [hi - lo for lo, hi in ranges[w.rank]] == w.micro_batch_sizes
        mates = [v for v in plan.workers if (v.replica, v.stage, v.dp_index) == (w.replica, w.stage, w.dp_index)]
        assert all(ranges[v.rank] == ranges[w.rank] for v in mates), "tensor-parallel members share their samples"
    for s in range(len(plan.stages)):
        pieces = sorted(rg for w in plan.stage_workers(s) if w.tp_index == 0 for rg in ranges[w.rank])
        assert [lo for lo, _ in pieces] == [0] + [hi for _, hi in pieces[:-1]] and pieces[-1][1] == batch, \
            f"stage {s}: every sample exactly once"
        if s > 0:
            for r in range(plan.num_replicas):
                for m in range(plan.num_micro_batch):
                    def span(stage):
                        own = [ranges[w.rank][m] for w in plan.stage_workers(stage, r)]
                        return min(lo for lo, _ in own), max(hi for _, hi in own)
                    assert span(s) == span(0), f"replica {r} micro-batch {m}: stage {s} sees other samples"
    assert layout.dp_groups == tuple(group_ranks(plan, "dp").values())
    if layout.contiguous:
        for w in plan.workers:
            shares, index = layout.dp_shares(w.rank)
            assert layout.offset(w.rank) == sum(shares[:index]) == ranges[w.rank][0][0]
            assert layout.split(batch, w.rank) == (layout.offset(w.rank), layout.offset(w.rank) + w.batch_share)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=random_plans(), n=st.integers(0, 40))
def test_every_sample_is_processed_by_exactly_one_slot(plan, n):
    layout = SampleLayout.of(plan)
    assert layout == SampleLayout.of(copy.deepcopy(plan)) and layout.all_ranges() == sample_ranges(plan)
    _check_invariant(plan, layout)
    if not layout.contiguous:
        return
    # a short batch of n samples: each data-parallel group tiles [0, n), as the sampler reads it
    for group in layout.dp_groups:
        slices = [layout.split(n, r) for r in group]
        assert [lo for lo, _ in slices] == [0] + [hi for _, hi in slices[:-1]] and slices[-1][1] == n
        for r, (lo, hi) in zip(group, slices):
            assert sum(layout.micro_batches(r, hi - lo)) == hi - lo
            if 0 < n <= plan.global_batch_size:   # one (short) batch: the sampler reads the same slice
                assert list(UnevenSampler(n, *layout.dp_shares(r), shuffle=False)) == [list(range(lo, hi))]


def test_sampler_follows_new_shares_from_the_next_step():
    sampler = UnevenSampler(20, [6, 2], 1, shuffle=False)
    steps = sampler.steps()
    assert next(steps) == ([6, 7], 8)
    sampler.set_shares([2, 6])
    assert next(steps) == ([10, 11, 12, 13, 14, 15], 8)
    assert next(steps) == ([17, 18, 19], 4)   # the short batch split 1/3 by the new shares
    with pytest.raises(StopIteration):
        next(steps)
    with pytest.raises(ValueError, match="the group has 2 ranks, got 3 shares"):
        sampler.set_shares([1, 1, 1])
    with pytest.raises(ValueError, match="non-negative with a positive sum"):
        sampler.set_shares([0, 0])


# -- exactness of a run-time re-balance (one 2-rank spawn) -----------------------------------------
DIN, HIDDEN, CLASSES = 5, 12, 4
BEFORE, AFTER = [[3, 3], [2]], [[2], [3, 3]]   # shares [6, 2] -> [2, 6], micro-batch counts swap


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.head = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.l0(x)))


def _dp_plan(model: nn.Module, micro_batch_sizes: list[list[int]]) -> Plan:
    from whalelike.graphs.capture import capture

    graphs = capture(model, (torch.randn(2, DIN, dtype=torch.float64),))
    return plans.make_plan([StagePlan(0, [0], list(range(len(graphs.layers))), "replicate(2)")],
                           [plans.worker(r, 0, r, sizes=m) for r, m in enumerate(micro_batch_sizes)],
                           model_fingerprint=graphs.fingerprint, cluster="layout-2", global_batch_size=8)


def _cluster():
    from whalelike.cluster import Cluster, Device, Network

    return Cluster("layout-2", tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4)
                                     for i in range(2)), Network(2.0, 2.0, 50.0), None)


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (n,), generator=g)


def _rebalanced_run(rank: int, world_size: int) -> dict:
    from runtime import Engine, UnevenLoader

    torch.manual_seed(0)
    model = Net().double()
    before, after = _dp_plan(model, BEFORE), _dp_plan(model, AFTER)
    results = {}
    for opt_name, make_opt in OPTIMIZERS.items():
        # whole global batches, re-planned after step 2, then a batch of another size evaluated
        x, y = _data(32, seed=1)
        batches = [((x[i:i + 8],), y[i:i + 8]) for i in range(0, 32, 8)]
        losses, final = train_reference(model, batches, make_opt, F.cross_entropy)
        engine = Engine(copy.deepcopy(model), before, optimizer=make_opt, loss_fn=F.cross_entropy,
                        cluster=_cluster(), timeout_s=60)
        for step, batch in enumerate(batches):
            if step == 2:
                ddp = engine.executor.sync
                engine.executor.set_plan(after)
                assert engine.executor.sync is ddp and engine.executor.shares == [2, 6]
                assert engine.executor.micro_batch_sizes == AFTER[rank]
            assert_close(engine.train_step(batch), losses[step], msg=lambda m: f"{opt_name}: loss {step}: {m}")
        state = engine.state_dict()
        for key, value in final.items():
            assert_close(state[key], value, msg=lambda m: f"{opt_name}: final {key}: {m}")
        trained = Net().double()
        trained.load_state_dict(final)
        ex, ey = _data(5, seed=2)   # split 1/4 by the new shares
        assert_close(engine.eval_step(((ex,), ey)), F.cross_entropy(trained(ex), ey))

        # an epoch of 30 samples through UnevenLoader (8, 8 | 8, 6): the loader and the executor
        # re-planned together before step 2, the short last batch split by the new shares
        x, y = _data(30, seed=3)
        dataset = [(x[i], y[i]) for i in range(30)]
        loader = UnevenLoader(dataset, before, rank, seed=4)
        order = torch.randperm(30, generator=torch.Generator().manual_seed(4)).tolist()
        batches = [((x[order[i:i + 8]],), y[order[i:i + 8]]) for i in range(0, 30, 8)]
        losses, final = train_reference(model, batches, make_opt, F.cross_entropy)
        engine = Engine(copy.deepcopy(model), before, optimizer=make_opt, loss_fn=F.cross_entropy,
                        cluster=_cluster(), timeout_s=60)
        sizes = []
        shares = iter(loader)
        for step in range(len(batches)):
            if step == 2:
                loader.set_plan(after)
                engine.executor.set_plan(after)
            share = next(shares)
            sizes.append(share.targets.shape[0])
            assert_close(engine.train_step(share), losses[step], msg=lambda m: f"loader {opt_name}: loss {step}: {m}")
        with pytest.raises(StopIteration):
            next(shares)
        for key, value in engine.state_dict().items():
            assert_close(value, final[key], msg=lambda m: f"loader {opt_name}: final {key}: {m}")
        results[opt_name] = sizes

    # plans of other workers are refused, naming what differs
    swapped = _dp_plan(model, AFTER)
    swapped.workers = [dataclasses.replace(w, dp_index=1 - w.dp_index) for w in swapped.workers]
    with pytest.raises(PlanError, match=r"plan.workers\[0\].dp_index is 1 in the new plan, 0 in the running one"):
        engine.executor.set_plan(swapped)
    moved = _dp_plan(model, AFTER)
    moved.workers[1].device = "emu-9"
    with pytest.raises(PlanError, match=r"plan.workers\[1\].device is 'emu-9'"):
        engine.executor.set_plan(moved)
    with pytest.raises(ValueError, match=r"data-parallel group is ranks \[1, 0\] in the new plan, \[0, 1\]"):
        loader.set_plan(swapped)
    return results


def test_dp_shares_change_at_run_time_exactly():
    results = run_ranks(_rebalanced_run, 2, init_process_group=False)
    # shares [6, 2] for two steps, then [2, 6]; the last 6 samples split 2/4 by the new shares
    assert [r["sgd"] for r in results] == [[6, 6, 2, 2], [2, 2, 6, 4]]
    assert results[0]["sgd"] == results[0]["adamw"]
