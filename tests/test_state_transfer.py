"""Moving training state between the executors of two plans (``planner.balance.state_moves``,
``runtime.state.transfer``).

Pure: :func:`plan_moves` keeps what a rank holds local, moves exactly the missing pieces (uneven
and fused q/k/v shards), spreads the sending over holders, and names the tensor and piece that no
rank holds. Slabs of tensor-parallel layers come from the layers' own slicing.

Distributed (one 2-rank gloo spawn, float64 models, SGD with momentum and AdamW): each scenario
trains 2 steps under one plan with ``runtime.Engine``, switches the engine's executor to another
plan of the same ranks with :func:`switch_executor`, trains 2 more steps, and compares every
step's loss and the final full state with the single-process reference:

* ``pipeline``: a 2-stage MLP stack; layer 1 (a Linear and a persistent buffer) moves from stage 0
  to stage 1;
* ``reshard``: one tensor-parallel stage (attention by heads, SwiGLU MLP) resharded from 3:1 to
  1:3 units;
* ``tied``: one tensor-parallel stage holding a tied matrix twice, whole as the embedding and
  sliced as the (row-parallel) output projection, resharded 3:1 -> 1:3;
* ``shares``: data parallel, shares 6:2 -> 2:6; nothing moves, and the old executor's hooks are gone.

Before each switch every model tensor the old executor does not hold is filled with NaN on its
rank, so a value the new plan needs and the transfer did not bring shows up in the losses. The
reports must count exactly the tensors that change rank (parameters, buffers, optimizer state).
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import planner
import whalelike as wl
from blocks import FxBlock
from dist_utils import run_ranks
from planner.plan import Plan, StagePlan
from planner.balance.state_moves import Move, Slab, StateMoveError, plan_moves
from plans import make_plan, worker
from reference import OPTIMIZERS, train_reference
from whalelike.cluster import Cluster

DIN, HIDDEN, CLASSES, SEQ, VOCAB = 6, 16, 4, 6, 24
BATCH, STEPS, SWITCH_AT = 8, 4, 2


# -- pure: the move planner ------------------------------------------------------------------------
def _moves(old, new) -> list[tuple]:
    return [(m.name, m.src, m.dst, m.dim, m.lo, m.hi) for m in plan_moves(old, new)]


def test_a_layer_moving_to_the_next_stage_is_one_move_and_the_rest_stays_local():
    whole_a, whole_b = Slab((4, 3)), Slab((5,))
    old = {0: {"a": whole_a}, 1: {"b": whole_b}}
    new = {0: {}, 1: {"a": whole_a, "b": whole_b}}
    moves = plan_moves(old, new)
    assert [(m.name, m.src, m.dst, m.dim, m.lo, m.hi, m.elements) for m in moves] == [
        ("a", 0, 1, 0, 0, 4, 12), ("b", 1, 1, 0, 0, 5, 5)]
    assert [m.local for m in moves] == [False, True]


def test_an_uneven_reshard_moves_only_the_units_that_change_rank():
    shape = (8, 2)
    old = {0: {"w": Slab(shape, 0, [(0, 6)])}, 1: {"w": Slab(shape, 0, [(6, 8)])}}
    new = {0: {"w": Slab(shape, 0, [(0, 2)])}, 1: {"w": Slab(shape, 0, [(2, 8)])}}
    assert _moves(old, new) == [("w", 0, 0, 0, 0, 2), ("w", 0, 1, 0, 2, 6), ("w", 1, 1, 0, 6, 8)]
    # a row projection is sharded along its input features (dim 1)
    old = {0: {"o": Slab((2, 8), 1, [(0, 6)])}, 1: {"o": Slab((2, 8), 1, [(6, 8)])}}
    new = {0: {"o": Slab((2, 8), 1, [(0, 2)])}, 1: {"o": Slab((2, 8), 1, [(2, 8)])}}
    assert _moves(old, new) == [("o", 0, 0, 1, 0, 2), ("o", 0, 1, 1, 2, 6), ("o", 1, 1, 1, 6, 8)]


def test_a_fused_projection_moves_its_piece_of_each_part():
    # q, k, v of 4 features each; shards 3:1 of every part -> 1:3
    def slab(ranges):
        return Slab((12, 5), 0, ranges)
    old = {0: {"qkv": slab([(0, 3), (4, 7), (8, 11)])}, 1: {"qkv": slab([(3, 4), (7, 8), (11, 12)])}}
    new = {0: {"qkv": slab([(0, 1), (4, 5), (8, 9)])}, 1: {"qkv": slab([(1, 4), (5, 8), (9, 12)])}}
    assert [(s, d, lo, hi) for _, s, d, _, lo, hi in _moves(old, new) if d == 1] == [
        (0, 1, 1, 3), (1, 1, 3, 4), (0, 1, 5, 7), (1, 1, 7, 8), (0, 1, 9, 11), (1, 1, 11, 12)]
    assert Slab((12, 5), 0, [(1, 4), (5, 8), (9, 12)]).local_offset(0, 9) == 6
    assert Slab((12, 5), 0, [(1, 4), (5, 8), (9, 12)]).local_shape == (9, 5)


def test_sources_are_spread_over_holders_and_gathering_takes_every_shard():
    old = {0: {"x": Slab((6,))}, 1: {"x": Slab((6,))}}
    new = {2: {"x": Slab((6,))}, 3: {"x": Slab((6,))}}
    assert [(m.src, m.dst) for m in plan_moves(old, new)] == [(0, 2), (1, 3)]
    # a whole tensor needed from two shards: one move from each
    old = {0: {"x": Slab((6,), 0, [(0, 4)])}, 1: {"x": Slab((6,), 0, [(4, 6)])}}
    assert _moves(old, {2: {"x": Slab((6,))}}) == [("x", 0, 2, 0, 0, 4), ("x", 1, 2, 0, 4, 6)]
    # a scalar (Adam's step) comes whole from a holder; the same input always gives the same moves
    old, new = {0: {"s": Slab(())}, 1: {"s": Slab(())}}, {0: {"s": Slab(())}, 2: {"s": Slab(())}}
    assert _moves(old, new) == [("s", 0, 0, None, 0, 1), ("s", 0, 2, None, 0, 1)] == _moves(old, new)
    assert plan_moves(old, new)[0] == Move("s", 0, 0, None, 0, 1, 1)


def test_plan_errors_name_the_tensor_the_piece_and_the_fix():
    old = {0: {"w": Slab((8,), 0, [(0, 6)])}}
    with pytest.raises(StateMoveError, match=r"tensor 'w': rank 1 needs \[6, 8\) along dim 0 .* no rank holds it"):
        plan_moves(old, {1: {"w": Slab((8,))}})
    with pytest.raises(StateMoveError, match=r"tensor 'v' is needed by rank\(s\) \[0\] .* no rank holds it"):
        plan_moves(old, {0: {"v": Slab((8,))}})
    with pytest.raises(StateMoveError, match=r"'w' has different full shapes"):
        plan_moves(old, {0: {"w": Slab((9,))}})
    with pytest.raises(StateMoveError, match=r"sharded along different dimensions \[0, 1\]"):
        plan_moves({0: {"w": Slab((2, 2), 0, [(0, 2)])}}, {0: {"w": Slab((2, 2), 1, [(0, 2)])}})
    with pytest.raises(StateMoveError, match=r"ranges \(\(0, 3\), \(2, 4\)\) along dim 0 overlap"):
        Slab((4,), 0, [(0, 3), (2, 4)])
    with pytest.raises(StateMoveError, match=r"dim 2 is not a dimension"):
        Slab((4,), 2, [(0, 1)])


def test_slabs_of_parallel_layers_come_from_their_own_slicing():
    from runtime.replicas.held_state import parallel_slab
    from runtime.tensor.layers import ColumnParallelLinear, RowParallelLinear

    fused = ColumnParallelLinear(nn.Linear(5, 12), [9, 3], 0, gather_output=False, pieces=3)
    assert parallel_slab(fused, "weight") == Slab((12, 5), 0, [(0, 3), (4, 7), (8, 11)])
    assert parallel_slab(fused, "bias") == Slab((12,), 0, [(0, 3), (4, 7), (8, 11)])
    row = RowParallelLinear(nn.Linear(8, 2), [6, 2], 1)
    assert parallel_slab(row, "weight") == Slab((2, 8), 1, [(6, 8)])
    assert parallel_slab(row, "bias") == Slab((2,))


# -- distributed: switching an Engine's executor --------------------------------------------------
class Scaled(nn.Module):
    """A Linear and a persistent buffer: a layer whose move carries a buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x):
        return self.fc(x) * self.scale


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate(1):
            self.l0, self.l1 = nn.Linear(DIN, HIDDEN), Scaled()
        with wl.replicate(1):
            self.l2, self.l3 = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))))


class BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = (nn.Linear(DIN, HIDDEN * 2), FxBlock(HIDDEN * 2, 4, SEQ),
                                              nn.Linear(HIDDEN * 2, CLASSES))

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(1))


class TiedHead(nn.Module):
    """The output projection is the embedding (GPT-2's tie); the hidden Linear and the head pair up
    as an MLP group of 16 units."""

    def __init__(self):
        super().__init__()
        with wl.split(2):
            self.wte, self.h0 = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.h0(self.wte(tokens))))


def _cluster() -> Cluster:
    return Cluster.preset("emulated-2").without_emulation()


def _plan(graphs, stages: list[StagePlan], micro_batches: list[list[int]], stage_of: list[int]) -> Plan:
    devices = _cluster().devices
    return make_plan(stages, [worker(r, stage_of[r], 0 if len(stages) > 1 else r, sizes=mbs, device=d.name,
                                     host=d.host) for r, (d, mbs) in enumerate(zip(devices, micro_batches))],
                     model_fingerprint=graphs.fingerprint, cluster="emulated-2", global_batch_size=BATCH)


def _data(model: nn.Module) -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if isinstance(model, TiedHead):
        return [((torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
                for _ in range(STEPS)]
    shape = (BATCH, SEQ, DIN) if isinstance(model, BlockNet) else (BATCH, DIN)
    return [((torch.randn(*shape, generator=g, dtype=torch.float64),), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _scenario(name: str):
    """The model (float64), the plan trained first, the plan switched to, and the tensors expected
    to change rank, by model name: a "buffer", a "param" (all its optimizer state moves with it) or
    a "shard" (part of a parameter: its state shaped like it moves, Adam's step is already there)."""
    torch.manual_seed(0)
    if name == "tied":
        model = TiedHead().double()
        graphs = wl.capture(model, _data(model)[0][0])
        before = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=BATCH))
        after = copy.deepcopy(before)
        (stage,), (stage_after,) = before.stages, after.stages
        assert stage.shard_sizes == {"h0": [8, 8], "lm_head": [8, 8]}
        stage.shard_sizes = {"h0": [12, 4], "lm_head": [12, 4]}
        stage_after.shard_sizes = {"h0": [4, 12], "lm_head": [4, 12]}
        before.validate(graphs=graphs, cluster=_cluster())
        # the head's slice of the tied matrix travels as a tensor of its own ("wte.weight@<key>")
        moved = {"h0.weight": "shard", "h0.bias": "shard", "wte.weight@lm_head.weight": "shard"}
        return model, before, after, moved, wl.token_cross_entropy
    if name == "pipeline":
        model = Stack().double()
        graphs = wl.capture(model, _data(model)[0][0])
        before = _plan(graphs, [StagePlan(0, [0], [0, 1], "replicate"), StagePlan(1, [1], [2, 3], "replicate")],
                       [[3, 5], [3, 5]], [0, 1])
        after = copy.deepcopy(before)
        after.stages[0].layers, after.stages[1].layers, after.stages[1].taskgraphs = [0], [1, 2, 3], [0, 1]
        moved = {"l1.fc.weight": "param", "l1.fc.bias": "param", "l1.scale": "buffer"}
    elif name == "reshard":
        model = BlockNet().double()
        wl.annotate(model, {"block": wl.split(2)})
        graphs = wl.capture(model, _data(model)[0][0])
        before = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=BATCH))
        after = copy.deepcopy(before)
        (stage,) = after.stages
        assert stage.shard_sizes["block.q"] == [24, 8] and stage.shard_sizes["block.up"] == [48, 16]
        stage.shard_sizes = {path: sizes[::-1] for path, sizes in stage.shard_sizes.items()}
        # half of every sharded tensor changes rank: units 1 and 2 of 4 (rows of columns, inputs of rows)
        moved = {f"block.{p}.{t}": "shard" for p in ("q", "k", "v", "gate", "up") for t in ("weight", "bias")}
        moved |= {"block.o.weight": "shard", "block.down.weight": "shard"}
    else:
        model = nn.Sequential(nn.Linear(DIN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()
        graphs = wl.capture(model, _data(model)[0][0])
        stage = StagePlan(0, [0], [layer.index for layer in graphs.layers], "replicate(2)")
        before = _plan(graphs, [stage], [[6], [2]], [0, 0])
        after = _plan(graphs, [copy.deepcopy(stage)], [[2], [6]], [0, 0])
        moved = {}
    after.validate(graphs=graphs, cluster=_cluster())
    return model, before, after, moved, F.cross_entropy


def _poison_what_is_not_held(model: nn.Module, executor) -> None:
    """NaN in every floating tensor of the model this rank's executor does not hold."""
    held = {id(t) for t, _ in executor.named_state().values()}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) not in held and t.is_floating_point():
                t.fill_(float("nan"))


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _switch(rank: int, name: str, opt: str) -> dict:
    from runtime import Engine, register_executor
    from runtime.state.transfer import switch_executor
    from runtime.tensor.layers import ParallelLinear

    model, before, after, moved, loss_fn = _scenario(name)
    data = _data(model)
    losses, final = train_reference(model, data, OPTIMIZERS[opt], loss_fn)
    kind, contexts = before.kind, []
    builder = register_executor(kind, lambda ctx: contexts.append(ctx) or builder(ctx))   # keeps the context
    try:
        engine = Engine(copy.deepcopy(model), before, optimizer=OPTIMIZERS[opt], loss_fn=loss_fn,
                        cluster=_cluster(), timeout_s=60)
        got = [engine.train_step(batch) for batch in data[:SWITCH_AT]]
        _poison_what_is_not_held(engine.model, engine.executor)
        hooks, old, optimizer = _hooks(engine.model), engine.executor, engine.optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)   # holds the optimizer
        context = dataclasses.replace(contexts[-1], plan=after, worker=after.worker(rank))
        new, report = switch_executor(old, lambda: builder(context), optimizer, engine.slot.make_optimizer)
        engine.slot.executor, engine.runtime = new, engine.runtime.with_plan(after)
        assert engine.optimizer is optimizer and scheduler.optimizer is optimizer
        # building an executor twice from one capture: sharding and the tied attach leave the capture alone
        assert not any(isinstance(m, ParallelLinear) for m in context.graphs.graph_module.modules())
        got += [engine.train_step(batch) for batch in data[SWITCH_AT:]]
        scheduler.step()
    finally:
        register_executor(kind, builder)
    for step, (loss, expected) in enumerate(zip(got, losses)):
        assert_close(loss, expected, msg=lambda m: f"{name}/{opt}: loss of step {step}: {m}")
    state = engine.state_dict()
    assert state.keys() == final.keys(), f"{name}: {sorted(set(state) ^ set(final))}"
    for key, value in final.items():
        assert_close(state[key], value, msg=lambda m: f"{name}/{opt}: final {key}: {m}")
    held = new.named_state()
    for copy_name, (tensor, slab) in held.items():   # a second copy of a tied matrix equals the first
        if "@" in copy_name:
            whole, _ = held[copy_name.split("@")[0]]
            index = torch.cat([torch.arange(lo, hi) for lo, hi in slab.ranges])
            assert torch.equal(whole.index_select(slab.dim, index), tensor), f"{name}/{opt}: {copy_name}"
    riding = {"buffer": 0, "param": {"sgd": 1, "adamw": 3}[opt], "shard": {"sgd": 1, "adamw": 2}[opt]}
    expected_tensors = sum(1 + riding[what] for what in moved.values())
    assert report.moved_tensors == expected_tensors, (name, opt, report)
    return {"report": report, "hooks": (hooks, _hooks(engine.model)),
            "shapes": {n: tuple(t.shape) for n, (t, _) in new.named_state().items()}}


def _ranks(rank: int, world_size: int) -> dict:
    return {(name, opt): _switch(rank, name, opt) for name in ("pipeline", "reshard", "tied", "shares")
            for opt in OPTIMIZERS}


def test_switching_plans_mid_training_matches_single_process_reference():
    results = run_ranks(_ranks, 2, init_process_group=False, timeout_s=300)
    for key in results[0]:
        assert results[0][key]["report"].moved_bytes == results[1][key]["report"].moved_bytes, key
    # pipeline: layer 1 is now on stage 1; its Linear (16x16 + 16) and, with SGD, its momentum moved
    assert "l1.fc.weight" in results[1]["pipeline", "sgd"]["shapes"]
    assert "l1.fc.weight" not in results[0]["pipeline", "sgd"]["shapes"]
    assert results[0]["pipeline", "sgd"]["report"].moved_bytes == (2 * (16 * 16 + 16) + 16) * 8
    # reshard: rank 1 now holds 3 of 4 heads; half of each sharded tensor moved, with its state
    assert results[1]["reshard", "sgd"]["shapes"]["block.q.weight"] == (24, 32)
    assert results[0]["reshard", "adamw"]["shapes"]["block.down.weight"] == (32, 16)
    half = (3 * (32 * 32 + 32) + 32 * 32 + 2 * (64 * 32 + 64) + 32 * 64) // 2
    assert results[0]["reshard", "sgd"]["report"].moved_bytes == 2 * half * 8
    assert results[0]["reshard", "adamw"]["report"].moved_bytes == 3 * half * 8
    # tied: rank 1 now holds 12 of the head's 16 input features of the tied matrix, next to the whole
    assert results[1]["tied", "adamw"]["shapes"]["wte.weight"] == (VOCAB, HIDDEN)
    copies = {n: shape for n, shape in results[1]["tied", "adamw"]["shapes"].items() if "@" in n}
    assert copies == {"wte.weight@lm_head.weight": (VOCAB, 12)}, copies
    # shares: nothing moves, and the old executor's hooks left the model with it
    for rank in (0, 1):
        assert results[rank]["shares", "adamw"]["report"].moved_bytes == 0
        before, after = results[rank]["shares", "adamw"]["hooks"]
        assert before == after > 0
