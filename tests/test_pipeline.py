"""Pipeline execution against a single-process reference (one 4-rank gloo spawn), plus in-process
tests of the stage split and the sample layout.

Every distributed check trains the whole model in one process and the pipelined copy from the same
initial weights on the same data for 3 steps, with SGD (momentum) and with AdamW, and compares the
loss of every step and the gathered final parameters. Scenarios: 2 stages under GPipe and 1F1B with
uneven micro-batch sizes; stage 0 on 2 ranks with shares [3, 1] feeding stage 1 on 1 rank; stage
groups of 2 and 2 whose sample ranges straddle each other; a skip connection from stage 0 to
stage 2; 2 pipeline replicas with uneven shares. Plans smaller than the world run on a subgroup.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

from dist_utils import run_ranks
from planner.shares.layout import SampleLayout
from planner.plan import Plan
from planner.resharding.reshard import plan_resharding
from planner.resharding.spec import stage_output_spec
from plans import make_plan, worker
from runtime.parallel.boundaries import default_network
from runtime.emulation.compute import Emulator
from runtime.groups import group_ranks
from runtime.parallel.pipeline import PipelineExecutor, sample_ranges
from runtime.parallel.stage_split import ModelInput, StageSplitError, ValueSpec, split_stages
from runtime.parallel.tied_weights import find_ties
from whalelike.cluster import Emulation

DIN, HIDDEN, CLASSES = 8, 16, 4
STEPS = 3
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


class SkipNet(nn.Module):
    """h0 skips over l1 and l2; the second input ``z`` is used only by the head."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1 = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.l2, self.head = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, z):
        h0 = torch.tanh(self.l0(x))
        h1 = torch.tanh(self.l1(h0))
        h2 = torch.tanh(self.l2(h1)) + h0
        return self.head(h2) + z


def _cut(gm: fx.GraphModule, first_nodes: tuple[str, ...]) -> dict[str, int]:
    """Node -> stage: a new stage starts at each node named in ``first_nodes``."""
    stage, out = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        stage += node.name in first_nodes
        out[node.name] = stage
    return out


def _plan(schedule: str, workers: list[tuple[int, int, int, list[int]]]) -> Plan:
    """``workers``: (replica, stage, dp_index, micro_batch_sizes) in rank order."""
    num_stages = 1 + max(w[1] for w in workers)
    return make_plan(num_stages, [worker(rank, s, dp, sizes=mbs, replica=r, device=f"cpu{rank}", host="host")
                                  for rank, (r, s, dp, mbs) in enumerate(workers)], schedule=schedule)


TWO_STAGES = ("l2",)
THREE_STAGES = ("l1", "l2")
SCENARIOS = {
    "gpipe-2stages": ("gpipe", TWO_STAGES, [(0, 0, 0, [3, 1, 2, 2]), (0, 1, 0, [3, 1, 2, 2])], False),
    "1f1b-2stages": ("1f1b", TWO_STAGES, [(0, 0, 0, [3, 1, 2, 2]), (0, 1, 0, [3, 1, 2, 2])], False),
    "stage0-on-2-ranks": ("1f1b", TWO_STAGES, [(0, 0, 0, [3] * 4), (0, 0, 1, [1] * 4), (0, 1, 0, [4] * 4)], True),
    "straddling-2x2": ("gpipe", TWO_STAGES,
                       [(0, 0, 0, [1, 3]), (0, 0, 1, [3, 1]), (0, 1, 0, [2, 2]), (0, 1, 1, [2, 2])], True),
    "skip-3stages-gpipe": ("gpipe", THREE_STAGES, [(0, s, 0, [2] * 4) for s in range(3)], False),
    "skip-3stages-1f1b": ("1f1b", THREE_STAGES, [(0, s, 0, [2] * 4) for s in range(3)], False),
    "2-replicas": ("1f1b", TWO_STAGES,
                   [(0, 0, 0, [3] * 4), (0, 1, 0, [3] * 4), (1, 0, 0, [1] * 4), (1, 1, 0, [1] * 4)], True),
}


def _run_scenario(rank: int, groups: dict[int, dist.ProcessGroup], name: str, opt: str) -> list[float]:
    schedule, cut, workers, emulate = SCENARIOS[name]
    plan = _plan(schedule, workers)
    torch.manual_seed(0)
    model = SkipNet()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(plan.global_batch_size, DIN, generator=g),
                torch.randn(plan.global_batch_size, CLASSES, generator=g),
                torch.randint(0, CLASSES, (plan.global_batch_size,), generator=g)) for _ in range(STEPS)]
    # single-process reference: the whole batch at once
    ref = copy.deepcopy(model)
    ref_opt = OPTIMIZERS[opt](ref.parameters())
    ref_losses = []
    for x, z, y in batches:
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x, z), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())
    dp_group = None
    for ranks in group_ranks(plan, "dp").values():   # new_group is a collective over the whole world
        created = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        dp_group = created if rank in ranks else dp_group
    if rank >= plan.world_size:
        return []
    gm = fx.symbolic_trace(model)
    emulator = Emulator(1.0 if rank % 2 else 0.5, Emulation(base_gflops=10.0), rank) if emulate else None
    flops = [(2e3, 4e3)] * len(cut + (None,))
    pipe = PipelineExecutor(gm, _cut(gm, cut), plan, F.cross_entropy, emulator=emulator, stage_flops=flops,
                            group=groups[plan.world_size], dp_group=dp_group)
    pipe_opt = OPTIMIZERS[opt](pipe.parameters())
    losses = []
    for x, z, y in batches:
        pipe_opt.zero_grad()
        losses.append(pipe.train_step((x, z), y))
        pipe_opt.step()
    assert_close(torch.stack(losses), torch.stack(ref_losses), msg=f"{name}/{opt}: losses")
    final, expected = pipe.full_state_dict(), ref.state_dict()
    assert final.keys() == expected.keys(), f"{name}: {sorted(final)} != {sorted(expected)}"
    for key in expected:
        assert_close(final[key], expected[key], msg=f"{name}/{opt}: {key}")
    if emulator is not None:
        assert emulator.stats.segments == 2 * plan.num_micro_batch * STEPS
    x, z, y = batches[0]
    with torch.no_grad():
        assert_close(pipe.eval_step((x, z), y), F.cross_entropy(ref(x, z), y), msg=f"{name}/{opt}: eval_step")
    pipe.load_full_state_dict(_initial_state())
    assert_close(pipe.full_state_dict(), _initial_state(), msg=f"{name}/{opt}: load_full_state_dict")
    return [float(v) for v in losses]


def _initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return SkipNet().state_dict()


def _all_scenarios(rank: int, world_size: int) -> dict:
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    out = {}
    for name in SCENARIOS:
        for opt in OPTIMIZERS:
            out[(name, opt)] = _run_scenario(rank, groups, name, opt)
            dist.barrier()
    return out


def test_pipeline_matches_single_process_reference():
    results = run_ranks(_all_scenarios, 4, env={"OMP_NUM_THREADS": "1"}, timeout_s=300)
    for (name, opt), losses in results[0].items():
        assert len(losses) == STEPS, (name, opt)
        # every rank of the plan returns the same global-mean loss
        for r in range(1, len(SCENARIOS[name][2])):
            assert results[r][(name, opt)] == losses, (name, opt, r)


# -- in-process: the split and the layout ----------------------------------------------------
def test_split_records_skip_edges_and_runs_exactly():
    torch.manual_seed(0)
    model = SkipNet()
    gm = fx.symbolic_trace(model)
    split = split_stages(gm, _cut(gm, THREE_STAGES))
    s0, s1, s2 = split.stages
    assert s0.inputs == (ModelInput(0, "x"),)
    h0 = s0.outputs[[v.name for v in s0.outputs].index("tanh")]
    assert split.consumers(h0) == [1, 2]        # sent straight from stage 0 to stage 2
    assert ModelInput(1, "z") in s2.inputs
    x, z = torch.randn(5, DIN), torch.randn(5, CLASSES)
    assert_close(split.root(x, z), model(x, z))
    specs = split.value_specs((x, z))
    assert specs[h0].shape == (HIDDEN,) and specs[h0].requires_grad
    owned = [{n for n, _ in s.module.named_parameters()} for s in split.stages]
    assert owned == [{"l0.weight", "l0.bias"}, {"l1.weight", "l1.bias"},
                     {"l2.weight", "l2.bias", "head.weight", "head.bias"}]


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return torch.tanh(x @ self.w * self.scale) @ self.w.t() * self.scale


def test_root_attributes_move_into_stages_and_tied_parameters_are_found():
    gm = fx.symbolic_trace(_Tied())
    calls = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    tied = split_stages(gm, {n: int(i >= 3) for i, n in enumerate(calls)})
    assert [(tie.name, tie.stages) for tie, _ in find_ties(tied, names=gm)] == [("w", (0, 1))]
    split = split_stages(gm, dict.fromkeys(calls[:-1], 0) | {calls[-1]: 1})
    assert [n for n, _ in split.stages[0].module.named_parameters()] == ["_w"]
    assert [n for n, _ in split.stages[1].module.named_buffers()] == ["_scale"]   # buffers are copied


class _Unbatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) * h.mean(), h


def test_split_errors_name_the_value_and_the_fix():
    gm = fx.symbolic_trace(_Unbatched())
    calls = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    with pytest.raises(StageSplitError, match=r"model output\(s\) 'a' \(stage 0 output 0\) are computed before"):
        split_stages(gm, {n: int(n != "a") for n in calls})
    with pytest.raises(StageSplitError, match="node 'b' .* has no stage"):
        split_stages(gm, {n: 0 for n in calls if n != "b"})

    class Scalar(nn.Module):
        def forward(self, x):
            return x * x.mean()

    # a value without a batch dimension (a statistic of the micro-batch) crosses whole (issue 30 item 2;
    # it used to be refused with "has no batch dimension 0")
    gm = fx.symbolic_trace(Scalar())
    split = split_stages(gm, {"mean": 0, "mul": 1})
    (mean,) = split.stages[1].received
    assert split.value_specs((torch.randn(3, 4),))[mean] == ValueSpec((), torch.float32, False, batched=False)

    class Transposed(nn.Module):
        def forward(self, x):
            return x * x.t().exp().t()

    # a batch dimension that is not dimension 0 is still refused, naming the value and the fix
    gm = fx.symbolic_trace(Transposed())
    split = split_stages(gm, {"t": 0, "exp": 0, "t_1": 1, "mul": 1})
    with pytest.raises(StageSplitError, match=r"'exp' .* shape \(4, 2\) for a batch of 2 and \(4, 3\) for a batch "
                                              r"of 3: its batch dimension is not dimension 0.*transpose"):
        split.value_specs((torch.randn(3, 4),))


def test_sample_layout_and_boundary_transfers():
    plan = _plan("1f1b", SCENARIOS["straddling-2x2"][2])
    ranges = sample_ranges(plan)
    assert ranges == {0: [(0, 1), (4, 7)], 1: [(1, 4), (7, 8)], 2: [(0, 2), (4, 6)], 3: [(2, 4), (6, 8)]}
    # micro-batch 0 crossing from stage 0 (ranks 0, 1) to stage 1 (ranks 2, 3), as runtime.parallel.boundaries plans it:
    # rank 2 needs [0, 2): [0, 1) from rank 0 and [1, 2) from rank 1; rank 3 needs [2, 4): all from rank 1
    layout = SampleLayout.of(plan)
    src, dst = (stage_output_spec(plan, layout, stage, 0, (4,)) for stage in (0, 1))
    device_rank = {w.device: w.rank for w in plan.workers}
    moves = {(device_rank[t.sender], tuple(device_rank[d] for d in t.receivers), t.box[0])
             for t in plan_resharding(src, dst, default_network(plan)).transfers}
    assert moves == {(0, (2,), (0, 1)), (1, (2,), (1, 2)), (1, (3,), (2, 4))}
    replicated = sample_ranges(_plan("1f1b", SCENARIOS["2-replicas"][2]))
    assert replicated[0][0] == (0, 3) and replicated[2][0] == (12, 13)
