"""Uneven tensor parallelism against a single-process reference (3 gloo ranks, one spawn).

Every check trains the unsharded reference and its tensor-parallel copy from the same initial
weights on the same data for 3 steps, with SGD (momentum) and with AdamW, and compares losses,
gradients (each rank's slice) and the gathered final parameters. Each check runs once with the
emulated-device path (custom autograd matmul padded to modeled time) and once without. The graph
transform runs the Engine's path: ``wl.capture`` of a scoped model, ``split_stages``, then
``shard_module`` on the split stage.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_utils import run_ranks
from torch.testing import assert_close

import whalelike as wl
from runtime.emulation.compute import Emulator
from runtime.parallel.stage_split import split_stages
from runtime.tensor.shard_pass import (full_state_dict, load_full_state_dict, original_module_paths,
                                     pad_plain_linears, shard_module, split_taskgraphs)
from runtime.tensor.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear, all_gather_uneven
from whalelike.cluster import Emulation
from whalelike.errors import WhaleError

WORLD = 3
HIDDEN_SHARDS = [20, 8, 4]     # hidden 32
OUT_SHARDS = [6, 4, 2]         # lone Linear with 12 outputs
CLASS_SHARDS = [6, 3, 2]       # 11 classes
BATCH, DIN = 6, 16
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _grad_slice(tp: nn.Module, name: str, ref_grad: torch.Tensor) -> torch.Tensor:
    path, _, leaf = name.rpartition(".")
    owner = tp.get_submodule(path)
    return owner.shard_of(leaf, ref_grad) if isinstance(owner, ParallelLinear) else ref_grad


def _train_and_compare(ref, tp, ref_loss, tp_loss, batches, make_opt, check_output=None, ref_name=lambda n: n):
    """``ref_name`` maps a parameter or state-dict key of ``tp`` to the reference's."""
    ref_opt, tp_opt = make_opt(ref.parameters()), make_opt(tp.parameters())
    for x, y in batches:
        ref_opt.zero_grad()
        tp_opt.zero_grad()
        loss_ref = ref_loss(ref(x), y)
        out = tp(x)
        if check_output is not None:
            check_output(out)
        loss_tp = tp_loss(out, y)
        loss_ref.backward()
        loss_tp.backward()
        assert_close(loss_tp, loss_ref)
        for name, p in tp.named_parameters():
            assert_close(p.grad, _grad_slice(tp, name, ref.get_parameter(ref_name(name)).grad), msg=name)
        ref_opt.step()
        tp_opt.step()
    final = {ref_name(k): v for k, v in full_state_dict(tp).items()}
    expected = ref.state_dict()
    assert final.keys() == expected.keys()
    for key in expected:
        assert_close(final[key], expected[key], msg=key)


def _batches(seed, targets):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, DIN, generator=g), targets(g)) for _ in range(3)]


def _check_pair(rank, group, emulator, make_opt):
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(DIN, 32), nn.GELU(), nn.Linear(32, DIN))
    tp = nn.Sequential(
        ColumnParallelLinear(ref[0], HIDDEN_SHARDS, rank, group, gather_output=False, emulator=emulator),
        nn.GELU(),
        RowParallelLinear(ref[2], HIDDEN_SHARDS, rank, group, emulator=emulator),
    )
    assert tp[0].weight.shape == (HIDDEN_SHARDS[rank], DIN) and tp[2].weight.shape == (DIN, HIDDEN_SHARDS[rank])
    batches = _batches(2, lambda g: torch.randn(BATCH, DIN, generator=g))
    _train_and_compare(ref, tp, F.mse_loss, F.mse_loss, batches, make_opt)


def _check_lone(rank, group, emulator, make_opt):
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(DIN, 12), nn.Tanh())
    tp = nn.Sequential(ColumnParallelLinear(ref[0], OUT_SHARDS, rank, group, emulator=emulator), nn.Tanh())
    batches = _batches(4, lambda g: torch.randn(BATCH, 12, generator=g))
    _train_and_compare(ref, tp, F.mse_loss, F.mse_loss, batches, make_opt,
                       check_output=lambda out: out.shape == (BATCH, 12) or pytest.fail(f"gathered {out.shape}"))


def _check_classifier(rank, group, emulator, make_opt):
    from runtime.tensor.shard_pass import ShardedLoss

    torch.manual_seed(5)
    ref = nn.Sequential(nn.Linear(DIN, 16), nn.ReLU(), nn.Linear(16, 11))
    tp = copy.deepcopy(ref)
    tp[2] = ColumnParallelLinear(ref[2], CLASS_SHARDS, rank, group, gather_output=False, emulator=emulator)
    loss = ShardedLoss(tuple(CLASS_SHARDS), rank, group)

    def targets(g):
        t = torch.randint(0, 11, (BATCH,), generator=g)
        t[1] = -100  # ignored, as F.cross_entropy does
        return t

    def local_only(out):
        assert out.shape == (BATCH, CLASS_SHARDS[rank]), f"rank {rank} holds logits of shape {tuple(out.shape)}"

    _train_and_compare(ref, tp, F.cross_entropy, loss, _batches(6, targets), make_opt, check_output=local_only)


class _Net(nn.Module):
    """embed (replicated TaskGraph 0, pipeline stage 0) then a split TaskGraph 1 (stage 1) with a
    GELU pair, a SwiGLU triple, a lone Linear feeding a residual, and a classifier producing the
    model output. Nested paths (``mlp.fc1``) get renamed when the graph is cut into stages."""

    shard_sizes = {p: HIDDEN_SHARDS for p in ("mlp.fc1", "gate", "up", "proj")} | {"head": CLASS_SHARDS}

    def __init__(self):
        super().__init__()
        with wl.replicate(WORLD):
            self.embed = nn.Linear(DIN, 32)
        with wl.split(WORLD):
            self.mlp = nn.Module()
            self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)
            self.gate, self.up, self.down = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.proj = nn.Linear(32, 32)
            self.head = nn.Linear(32, 11)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = h + self.mlp.fc2(self.mlp.act(self.mlp.fc1(h)))
        h = h + self.down(F.silu(self.gate(h)) * self.up(h))
        h = h + self.proj(h)
        return self.head(h)


def _check_transform(rank, group, emulator, make_opt):
    """The path the Engine takes: capture, cut into stages, shard the split stage, train."""
    torch.manual_seed(7)
    ref = _Net()
    graphs = wl.capture(copy.deepcopy(ref), (torch.randn(BATCH, DIN),))  # shares the copy's parameters
    gm, node_taskgraph = graphs.graph_module, graphs.node_taskgraph
    assert split_taskgraphs(graphs) == {1} and set(_Net.shard_sizes) <= set(graphs[1].shardable)
    pipeline = split_stages(gm, node_taskgraph)  # one stage per TaskGraph
    stage = pipeline.stages[1].module
    paths = original_module_paths(gm, stage)
    assert paths["mlp_fc1"] == "mlp.fc1"
    sharded = shard_module(stage, node_taskgraph, {1}, _Net.shard_sizes, rank, group, loss_fn=nn.CrossEntropyLoss(),
                           emulator=emulator, module_paths=paths)
    assert sharded.roles == {"mlp.fc1": "column", "mlp.fc2": "row", "gate": "column", "up": "column",
                             "down": "row", "proj": "column+gather", "head": "classifier"}
    assert isinstance(ref.mlp.fc1, nn.Linear) and ref.mlp.fc1.weight.shape == (32, 32), "the user's model was modified"
    if emulator is not None:
        assert pad_plain_linears(pipeline.root, emulator) == ["submod_0.embed"]

    def ref_name(name):  # "submod_1.mlp_fc1.weight" -> "mlp.fc1.weight"
        module, _, leaf = name.split(".", 1)[1].rpartition(".")
        return f"{paths.get(module, module)}.{leaf}"

    def local_only(out):
        assert out.shape == (BATCH, CLASS_SHARDS[rank]), f"rank {rank} holds logits of shape {tuple(out.shape)}"

    batches = _batches(8, lambda g: torch.randint(0, 11, (BATCH,), generator=g))
    _train_and_compare(ref, pipeline.root, F.cross_entropy, sharded.sharded_loss, batches, make_opt,
                       check_output=local_only, ref_name=ref_name)

    # A full state dict loads back into the sharded module (each rank takes its slice).
    full = full_state_dict(stage)
    for p in stage.parameters():
        p.data.zero_()
    load_full_state_dict(stage, full)
    for key, value in full_state_dict(stage).items():
        assert_close(value, full[key], msg=key)


def _check_errors(rank, group):
    with pytest.raises(WhaleError, match="sum to 32"):
        ColumnParallelLinear(nn.Linear(DIN, 32), [20, 8, 5], rank, group)
    with pytest.raises(WhaleError, match="tp_index is"):
        ColumnParallelLinear(nn.Linear(DIN, 32), HIDDEN_SHARDS, (rank + 1) % WORLD, group)
    gathered = all_gather_uneven(torch.full((2, HIDDEN_SHARDS[rank]), float(rank)), HIDDEN_SHARDS, 1, group)
    assert_close(gathered, torch.cat([torch.full((2, n), float(r)) for r, n in enumerate(HIDDEN_SHARDS)], 1))


def _all_checks(rank, world_size):
    group = dist.group.WORLD
    _check_errors(rank, group)
    for emulated in (False, True):
        # A fast emulated device: modeled times are tiny, but every matmul runs as a segment.
        emulator = Emulator(1.0, Emulation(base_gflops=1e6), rank) if emulated else None
        for make_opt in OPTIMIZERS.values():
            for check in (_check_pair, _check_lone, _check_classifier, _check_transform):
                check(rank, group, emulator, make_opt)
        if emulated:
            # 2 optimizers x 3 steps x forward + backward of the 2+1+1+(7 sharded + embed) matmuls, plus a
            # second backward segment for each of the 6 column-parallel layers (dX, then dW while dX is all-reduced)
            assert emulator.stats.segments == 2 * 3 * (2 * (2 + 1 + 1 + 8) + 6), emulator.stats


def test_uneven_tensor_parallel_matches_single_process():
    run_ranks(_all_checks, WORLD, env={"OMP_NUM_THREADS": "1"})


def test_roles_follow_the_loss_and_missing_shard_sizes_are_named():
    """Single process, no collectives: only the analysis and the validation run."""
    graphs = wl.capture(_Net(), (torch.randn(BATCH, DIN),))
    gm, node_taskgraph = graphs.graph_module, graphs.node_taskgraph
    sizes = _Net.shard_sizes
    # Without a plain cross-entropy the head's logits must be gathered for the user's loss.
    sharded = shard_module(copy.deepcopy(gm), node_taskgraph, {1}, sizes, 0, loss_fn=F.mse_loss)
    assert sharded.roles["head"] == "column+gather" and sharded.sharded_loss is None
    # A weighted cross-entropy is not the plain one the sharded loss computes.
    weighted = nn.CrossEntropyLoss(weight=torch.ones(11))
    assert shard_module(copy.deepcopy(gm), node_taskgraph, {1}, sizes, 0, loss_fn=weighted).sharded_loss is None
    with pytest.raises(WhaleError, match="'gate' has no entry in the plan's shard_sizes"):
        shard_module(copy.deepcopy(gm), node_taskgraph, {1}, {k: v for k, v in sizes.items() if k != "gate"}, 0)
