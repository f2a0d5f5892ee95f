"""ZeRO stages 1-3 (runtime.replicas.fsdp_sync, torch FSDP2) against the single-process reference.

One 4-rank spawn, float64, every case trained 3 steps next to one process training the whole model
on whole global batches from the same initial weights, with SGD (momentum) and AdamW; losses, every
gradient (gathered) and the final parameters compared:

* ZeRO 1 with Poplar's per-device accumulation (each rank its own micro-batch count and last batch
  size), ZeRO 2 and 3 with the same count on every rank and uneven sizes;
* what each rank holds: its rows of every parameter (``torch.chunk``'s layout over the group), its
  gradient and optimizer-state rows the same, counted in bytes against the layout;
* ZeRO 3 with the model's layers as FSDP units (gathered one at a time), under emulation;
* in a pipeline, ZeRO 1-3 on FSDP2 with each stage cut into its layers, each an FSDP unit
  (runtime.parallel.stage_units);
* ragged (memory-proportional) shards at ZeRO 1, 2 and 3, a rank holding nothing, in pipelines too;
* weights tied across pipeline stages under ZeRO (kept whole, summed over each stage's group);
* activation checkpointing under ZeRO 3 (synchronised BatchNorm under ZeRO: tests/test_batchnorm.py);
* bf16 autocast with global-norm clipping (the norm counted once over the shards, equal to the
  reference's);
* a checkpoint written under ZeRO 3 on 4 ranks, read under ZeRO 0 (DDP) on 2 ranks and on 1 rank
  (two more spawns), continuing exactly.

A warm-up captures each model once for the 4 ranks before they fork (``run_ranks(warm=)``): their
captures are cache hits.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

import plans
from dist_utils import run_ranks, spawn_ranks
from planner.plan import Plan, StagePlan
from runtime import Engine, checkpoint
from runtime.replicas.held_state import local
from runtime.training import recompute
from whalelike.cluster import Cluster, Device, Emulation, Network
from whalelike.graphs.capture import capture
from test_runtime_tp import TP_IN_DP_STAGE, SplitInReplicate, batches as tp_batches, make_plan as make_tp_plan

from test_runtime_dp import CLASSES, DIN, HIDDEN, OPTIMIZERS, SPEEDS, STEPS, WORLD, reference  # their setting

# per rank, its micro-batch sizes: ZeRO 1 may accumulate unevenly, ZeRO 2-3 run equal counts
SIZES = {
    1: [[4, 4, 3], [5, 4], [3], [1, 1]],
    2: [[5, 4], [5, 4], [2, 2], [1, 1]],
    3: [[5, 4], [5, 4], [2, 2], [1, 1]],
}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    """Embedding-free MLP of blocks (each an FSDP unit under ZeRO 3) and a head of 5 rows (fewer rows
    than 4 ranks hold evenly: torch.chunk gives 2, 2, 1, 0)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIN, HIDDEN)
        self.blocks = nn.ModuleList([Block(HIDDEN) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TiedNet(nn.Module):
    """An embedding and a classifier sharing one weight (the language models' tie)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CLASSES, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens).mean(1)))


def make_cluster(emulation: Emulation | None = None, world: int = WORLD) -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=s, memory_gib=4,
                           emulated_speed=s if emulation else None) for i, s in enumerate(SPEEDS[:world]))
    return Cluster(f"test-{world}", devices, Network(2.0, 2.0, 50.0), emulation)


def make_plan(model: nn.Module, sizes: list[list[int]], zero: int) -> Plan:
    graphs = capture(model, (torch.randn(2, DIN),))
    world = len(sizes)
    stage = StagePlan(0, [0], list(range(len(graphs.layers))), f"replicate({world})",
                      replica_sync="fsdp" if zero else "ddp", zero_stage=zero)
    return plans.make_plan([stage], [plans.worker(r, 0, r, sizes=m) for r, m in enumerate(sizes)],
                           model_fingerprint=graphs.fingerprint, cluster=f"test-{world}")


def batches(n: int, seed: int, steps: int = STEPS) -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, DIN, generator=g, dtype=torch.float64),),
             torch.randint(0, CLASSES, (n,), generator=g)) for _ in range(steps)]


def _check_training(engine: Engine, model: nn.Module, data, make_opt, label: str) -> None:
    losses, grads, final = reference(model, data, make_opt)
    for step, batch in enumerate(data):
        loss = engine.train_step(batch)
        assert_close(loss, losses[step], msg=f"{label}: loss of step {step}")
        # each rank's gradient of what it holds (its rows under ZeRO) against the same rows of the reference's
        for name, (tensor, slab) in engine.executor.named_state().items():
            if name not in grads[step]:
                continue              # a buffer
            want = grads[step][name]
            if slab.dim is not None:
                want = torch.cat([want.narrow(slab.dim, a, b - a) for a, b in slab.ranges], slab.dim)
            assert_close(local(tensor.grad), want, msg=f"{label}: gradient of {name} in step {step}")
    state = engine.state_dict()
    for key, value in final.items():
        assert_close(state[key], value, msg=f"{label}: final {key}")


def _held_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards)."""
    params = list(engine.executor.module.parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
    state = [v.to_local() if isinstance(v, DTensor) else v for p in params
             for v in engine.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in
            (("weight", local), ("gradient", grads), ("optimizer", state))}


def _chunk_bytes(model: nn.Module, rank: int, world: int) -> int:
    """Bytes of the rows torch.chunk gives ``rank`` of each parameter of ``model`` (float64)."""
    total = 0
    for p in model.parameters():
        c = math.ceil(p.shape[0] / world)
        rows = max(0, min((rank + 1) * c, p.shape[0]) - min(rank * c, p.shape[0]))
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def _ragged_bytes(model: nn.Module, rank: int, fractions: list[float]) -> int:
    """Bytes of the rows ``fractions`` give ``rank`` of each parameter (largest remainder, float64)."""
    from runtime.replicas.ragged_sync import ragged_rows
    total = 0
    for p in model.parameters():
        a, b = ragged_rows(p.shape[0], fractions)[rank]
        total += (b - a) * (p.numel() // p.shape[0]) * p.element_size()
    return total


def _ranks(rank: int, world_size: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = Net().double()
    out = {}
    for zero, sizes in SIZES.items():
        plan = make_plan(model, sizes, zero)
        for opt_name, make_opt in OPTIMIZERS.items():
            engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=F.cross_entropy,
                            cluster=make_cluster(), timeout_s=60)
            _check_training(engine, model, batches(plan.global_batch_size, seed=zero), make_opt, f"zero{zero}/{opt_name}")
            held = _held_bytes(engine)
            expected = _chunk_bytes(model, rank, WORLD)
            assert held["weight"] == expected, (zero, held, expected)
            assert held["gradient"] == expected, (zero, held, expected)
            if opt_name == "adamw":
                assert held["optimizer"] == 2 * expected, (zero, held, expected)
            else:
                assert held["optimizer"] == expected, (zero, held, expected)
            out[f"zero{zero}"] = held

    # ragged shards (runtime.replicas.ragged_sync): memory-proportional fractions, one rank holding nothing
    for zero, fractions in ((1, [0.4, 0.3, 0.2, 0.1]), (2, [0.5, 0.3, 0.2, 0.0]), (3, [0.4, 0.3, 0.2, 0.1])):
        plan = make_plan(model, SIZES[zero], zero)
        plan.stages[0] = dataclasses.replace(plan.stages[0], replica_sync="ragged", state_fractions=fractions)
        for opt_name, make_opt in OPTIMIZERS.items():
            engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=F.cross_entropy,
                            cluster=make_cluster(), timeout_s=60)
            _check_training(engine, model, batches(plan.global_batch_size, seed=30 + zero), make_opt,
                            f"ragged{zero}/{opt_name}")
            shards = list(engine.executor.parameters())
            held = sum(t.numel() * t.element_size() for t in shards)
            held_optim = sum(v.numel() * v.element_size() for p in shards
                             for v in engine.optimizer.state.get(p, {}).values() if v.dim() > 0)
            expected = _ragged_bytes(model, rank, fractions)
            assert held == expected, (zero, held, expected)
            assert held_optim == (2 if opt_name == "adamw" else 1) * expected, (zero, held_optim, expected)
            out[f"ragged{zero}"] = held
            if zero == 3:     # between steps no whole parameter holds storage (each layer is gathered for use)
                engine.train_step(batches(plan.global_batch_size, seed=39)[0])
                whole = sum(p.untyped_storage().nbytes() for p in engine.executor.module.parameters())
                assert whole == 0, whole

    # re-plans under ZeRO (Engine.apply_plan): other shares in place at ZeRO 1, then other state layouts
    # (ragged fractions, even FSDP2 shards, DDP) moved point to point; training continues exactly
    def with_sync(sizes, zero, sync, fractions=()):
        p = make_plan(model, sizes, zero)
        p.stages[0] = dataclasses.replace(p.stages[0], replica_sync=sync, state_fractions=list(fractions))
        return p
    sequence = [with_sync([[4, 4, 2], [5, 4], [3], [1, 1]], 1, "fsdp"), with_sync([[2, 2, 2], [8], [7], [1, 1, 1]], 1, "fsdp"),
                with_sync(SIZES[2], 2, "ragged", [0.4, 0.3, 0.2, 0.1]), with_sync(SIZES[2], 1, "ragged", [0.1, 0.2, 0.3, 0.4]),
                with_sync(SIZES[3], 3, "fsdp"), with_sync(SIZES[2], 0, "ddp")]
    engine = Engine(copy.deepcopy(model), sequence[0], optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(), timeout_s=60)
    data = batches(24, seed=40, steps=len(sequence))
    losses, _, final = reference(model, data, OPTIMIZERS["adamw"])
    moved = []
    for step, (plan, batch) in enumerate(zip(sequence, data)):
        if step:
            moved.append(engine.apply_plan(plan) is not None)
        assert_close(engine.train_step(batch), losses[step], msg=f"re-plans: loss of step {step}")
    for key, value in engine.state_dict().items():
        assert_close(value, final[key], msg=f"re-plans: final {key}")
    assert moved == [False, True, True, True, True], moved     # only the first re-plan keeps the sync

    # ZeRO 3 under emulation: the layers are units of their own, results unchanged
    plan = make_plan(model, SIZES[3], 3)
    engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(Emulation(base_gflops=0.05)), timeout_s=60)
    _check_training(engine, model, batches(plan.global_batch_size, seed=5), OPTIMIZERS["sgd"], "zero3/emulated")
    units = [m for m in engine.executor.module.modules() if type(m).__name__.startswith("FSDP")]
    assert len(units) == 5, [type(m).__name__ for m in units]     # inp, the two blocks, head and the root

    # activation checkpointing under ZeRO 3 (runtime.training.recompute): each layer recomputed inside
    # its unit, which the recomputing forward finds gathered
    for sync, fractions in (("fsdp", []), ("ragged", [0.4, 0.3, 0.2, 0.1])):
        plan = make_plan(model, SIZES[3], 3)
        plan.stages[0] = dataclasses.replace(plan.stages[0], replica_sync=sync, state_fractions=fractions,
                                             recompute=True, recompute_reason="asked")
        engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                        cluster=make_cluster(), timeout_s=60)
        _check_training(engine, model, batches(plan.global_batch_size, seed=11), OPTIMIZERS["adamw"],
                        f"recompute {sync}3")

    # bf16 autocast and global-norm clipping under ZeRO 2: the norm is the reference's
    plan = make_plan(model, SIZES[2], 2)
    engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(), timeout_s=60, clip_grad_norm=0.05)
    data = batches(plan.global_batch_size, seed=6)
    norms: list = []
    losses, _, final = reference(model, data, OPTIMIZERS["sgd"], clip=0.05, norms=norms)
    for step, batch in enumerate(data):
        assert_close(engine.train_step(batch), losses[step], msg=f"clip: loss of step {step}")
        assert_close(torch.as_tensor(engine.stats[-1].grad_norm, dtype=torch.float64), norms[step].double(),
                     msg=f"clip: norm of step {step}")
    for key, value in engine.state_dict().items():
        assert_close(value, final[key], msg=f"clip: final {key}")

    # inside a pipeline: two stages of two workers each, each stage's pair sharding its state, evenly
    # (FSDP2) or raggedly with fractions of each stage's own
    graphs = capture(model, (torch.randn(2, DIN),))
    layers = list(range(len(graphs.layers)))
    for zero, sync, again in ((1, "fsdp", False), (2, "fsdp", False), (3, "fsdp", False), (3, "fsdp", True),
                              (1, "ragged", False), (2, "ragged", False), (3, "ragged", False)):
        fractions = ([0.7, 0.3], [0.2, 0.8]) if sync == "ragged" else ([], [])
        plan = dataclasses.replace(   # again: recomputing layer by layer, inside each layer's FSDP unit
            make_plan(model, [[3, 2], [1, 2], [2, 2], [2, 2]], zero), num_micro_batch=2, global_batch_size=8,
            stages=[StagePlan(0, [0], layers[:2], "replicate(2)", replica_sync=sync, zero_stage=zero,
                              state_fractions=fractions[0], recompute=again, recompute_reason="asked" if again else "none"),
                    StagePlan(1, [0], layers[2:], "replicate(2)", replica_sync=sync, zero_stage=zero,
                              state_fractions=fractions[1], recompute=again,
                              recompute_reason="asked" if again else "none")])
        plan.workers = [dataclasses.replace(w, stage=w.rank // 2, dp_index=w.rank % 2) for w in plan.workers]
        engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                        cluster=make_cluster(), timeout_s=60)
        data = batches(8, seed=10 + zero)
        losses, _, final = reference(model, data, OPTIMIZERS["adamw"])
        for step, batch in enumerate(data):
            assert_close(engine.train_step(batch), losses[step], msg=f"pipeline {sync}{zero}: loss of step {step}")
        assert type(engine.executor).__name__ == "PipelineExecutor"
        worker = engine.executor.stage_worker
        assert worker.sync.name == sync
        if sync == "fsdp":   # each stage cut into its two layers, each an FSDP unit, then the stage (root)
            assert worker.units == ["units.submod_0", "units.submod_1"], worker.units
            assert len(worker.sync.units) == 3
            assert recompute.recomputed_layers(worker.stage.module) == (worker.units if again else None)
        for key, value in engine.state_dict().items():
            assert_close(value, final[key], msg=f"pipeline {sync}{zero}: final {key}")

    # tensor parallel inside the replicas (HSDP's shape): each tensor-parallel slice sharded by ZeRO
    # over the workers of its tp_index, along the slice's own dimension
    for zero in (2, 3):
        tp_model = SplitInReplicate()
        tp_plan = make_tp_plan(tp_model, "1f1b", [TP_IN_DP_STAGE],
                               [(0, 0, 0, 2, [5, 3]), (0, 0, 1, 2, [5, 3]), (0, 1, 0, 2, [2, 2]), (0, 1, 1, 2, [2, 2])])
        tp_plan.stages[0] = dataclasses.replace(tp_plan.stages[0], replica_sync="fsdp", zero_stage=zero)
        engine = Engine(copy.deepcopy(tp_model), tp_plan, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                        cluster=make_cluster(), timeout_s=60)
        data = tp_batches(tp_model, tp_plan.global_batch_size, seed=20 + zero)
        losses, _, final = reference(tp_model, data, OPTIMIZERS["adamw"])
        for step, batch in enumerate(data):
            assert_close(engine.train_step(batch), losses[step], msg=f"tp zero{zero}: loss of step {step}")
        for key, value in engine.state_dict().items():
            assert_close(value, final[key], msg=f"tp zero{zero}: final {key}")
        # fc1's slice is cut along dim 0 (rows), fc2's along dim 1: ZeRO follows each
        held = engine.executor.named_state()
        out[f"tp{zero}"] = {n: (s.dim, s.ranges) for n, (_, s) in held.items() if n.startswith(("fc1.w", "fc2.w"))}

    # weights tied across pipeline stages under ZeRO (an embedding in stage 0, the classifier sharing
    # it in stage 1): the tied weight stays whole, summed over each stage's pair and then over the stages
    tied = TiedNet().double()
    graphs = capture(tied, (torch.zeros(2, 3, dtype=torch.long),))
    layers = list(range(len(graphs.layers)))
    g = torch.Generator().manual_seed(3)
    data = [((torch.randint(0, CLASSES, (8, 3), generator=g),), torch.randint(0, CLASSES, (8,), generator=g))
            for _ in range(STEPS)]
    losses, _, final = reference(tied, data, OPTIMIZERS["adamw"])
    for zero, sync, fractions in ((1, "fsdp", ([], [])), (3, "fsdp", ([], [])), (2, "ragged", ([0.7, 0.3], [0.25, 0.75])),
                                  (3, "ragged", ([0.7, 0.3], [0.25, 0.75]))):
        plan = dataclasses.replace(
            make_plan(model, [[3, 1], [2, 2], [2, 2], [3, 1]], zero), num_micro_batch=2, global_batch_size=8,
            model_fingerprint=graphs.fingerprint,
            stages=[StagePlan(0, [0], layers[:1], "replicate(2)", replica_sync=sync, zero_stage=zero,
                              state_fractions=fractions[0]),
                    StagePlan(1, [0], layers[1:], "replicate(2)", replica_sync=sync, zero_stage=zero,
                              state_fractions=fractions[1])])
        plan.workers = [dataclasses.replace(w, stage=w.rank // 2, dp_index=w.rank % 2) for w in plan.workers]
        engine = Engine(copy.deepcopy(tied), plan, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                        cluster=make_cluster(), timeout_s=60, example_args=(torch.zeros(4, 3, dtype=torch.long),))
        for step, batch in enumerate(data):
            assert_close(engine.train_step(batch), losses[step], msg=f"tied {sync}{zero}: loss of step {step}")
        for key, value in engine.state_dict().items():
            assert_close(value, final[key], msg=f"tied {sync}{zero}: final {key}")

    # bf16 autocast: ZeRO 3 trains as DDP does at the same precision (both float32 master weights;
    # SGD: Adam's normalised update would turn a rounding of a tiny gradient into a step of lr)
    fp32 = Net()
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    data32 = [((x.float(),), y) for (x,), y in batches(24, seed=9)]
    runs = {}
    for zero in (0, 3):
        engine = Engine(copy.deepcopy(fp32), make_plan(fp32, SIZES[3], zero), optimizer=OPTIMIZERS["sgd"],
                        loss_fn=F.cross_entropy, cluster=make_cluster(), timeout_s=60, precision="bf16",
                        clip_grad_norm=0.5)
        runs[zero] = ([engine.train_step(b) for b in data32], engine.state_dict())
    assert_close(runs[3][0], runs[0][0], rtol=2e-2, atol=2e-2, msg="bf16: ZeRO 3 losses against DDP's")
    for key, value in runs[0][1].items():
        assert_close(runs[3][1][key], value, rtol=2e-2, atol=2e-2, msg=f"bf16: ZeRO 3 {key} against DDP's")

    # the checkpoint written under ZeRO 3 on 4 ranks (read back by 2 ranks and 1 rank, other spawns)
    plan = make_plan(model, SIZES[3], 3)
    engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(), timeout_s=60)
    for batch in batches(plan.global_batch_size, seed=7, steps=2):
        engine.train_step(batch)
    checkpoint.save(engine, directory)
    out["saved"] = engine.state_dict()
    out["after"] = [engine.train_step(b).item() for b in batches(plan.global_batch_size, seed=8, steps=2)]
    out["final"] = engine.state_dict()
    return out


def _resume(rank: int, world_size: int, directory: str) -> dict:
    torch.manual_seed(1)     # other initial weights: everything comes from the checkpoint
    model = Net().double()
    sizes = {2: [[14], [10]], 1: [[24]]}[world_size]
    plan = make_plan(model, sizes, 0)
    engine = Engine(model, plan, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(world=world_size), timeout_s=60,
                    example_args=batches(plan.global_batch_size, seed=7, steps=1)[0][0])
    checkpoint.load(engine, checkpoint.latest(directory))
    loaded = engine.state_dict()
    after = [engine.train_step(b).item() for b in batches(plan.global_batch_size, seed=8, steps=2)]
    return {"loaded": loaded, "after": after, "final": engine.state_dict()}


def _warm() -> None:
    """The captures every rank of ``_ranks`` makes, once before they fork (dist_utils' ``warm``): each
    model at its plans' example (2 samples) and at each global batch its Engines take; theirs are then
    cache hits."""
    torch.manual_seed(0)
    model = Net().double()
    for sizes in SIZES.values():
        capture(model, batches(make_plan(model, sizes, 0).global_batch_size, seed=0, steps=1)[0][0])
    capture(model, batches(8, seed=0, steps=1)[0][0])                 # the pipelines'
    tp_model = SplitInReplicate()
    tp_plan = make_tp_plan(tp_model, "1f1b", [TP_IN_DP_STAGE],
                           [(0, 0, 0, 2, [5, 3]), (0, 0, 1, 2, [5, 3]), (0, 1, 0, 2, [2, 2]), (0, 1, 1, 2, [2, 2])])
    capture(tp_model, tp_batches(tp_model, tp_plan.global_batch_size, seed=0)[0][0])
    tied = TiedNet().double()
    for n in (2, 4):
        capture(tied, (torch.zeros(n, 3, dtype=torch.long),))
    fp32 = Net()
    capture(fp32, (torch.randn(2, DIN),))
    capture(fp32, (torch.randn(24, DIN),))


def test_zero_stages_train_exactly_hold_their_rows_and_checkpoint_across_layouts(tmp_path):
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_ranks, WORLD, args=(directory,), init_process_group=False, warm=_warm)
    # a small device holds less: rank 3 holds no row of the 5-row head
    assert results[3]["zero3"]["weight"] < results[0]["zero3"]["weight"]
    # ragged: the state held follows the fractions (rank 3 holds nothing at 0.0)
    assert results[0]["ragged1"] > results[1]["ragged1"] > results[2]["ragged1"] > results[3]["ragged1"] > 0
    assert results[3]["ragged2"] == 0
    # tensor parallel inside: rank 0 (tp 0 of replica 0) holds rows 0-11 of its 24-row fc1 slice,
    # rank 2 (tp 0 of replica 1) rows 12-23; fc2's 24 input features split along dim 1 the same way
    assert results[0]["tp3"]["fc1.weight"] == (0, ((0, 12),)) and results[2]["tp3"]["fc1.weight"] == (0, ((12, 24),))
    assert results[0]["tp3"]["fc2.weight"] == (1, ((0, 12),)) and results[2]["tp3"]["fc2.weight"] == (1, ((12, 24),))
    saved = results[0]
    for world in (2, 1):
        resumed = run_ranks(_resume, world, args=(directory,), init_process_group=False)
        for key, value in saved["saved"].items():
            assert_close(resumed[0]["loaded"][key], value, msg=f"{world} ranks: loaded {key}")
        assert_close(resumed[0]["after"], saved["after"], msg=f"{world} ranks: losses after resuming")
        for key, value in saved["final"].items():
            assert_close(resumed[0]["final"][key], value, msg=f"{world} ranks: final {key}")


def _out_of_memory(rank: int, world_size: int) -> None:
    """Rank 1's emulated device holds 1 KiB, less than its share of the model: the Engine's set-up
    is measured and fails (capacity is enforced from construction on, not only during steps)."""
    torch.manual_seed(0)
    model = Net()
    emulation = Emulation(base_gflops=1.0, enforce_memory=True)
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4 if i == 0 else 2**-20,
                           emulated_speed=1.0) for i in range(2))
    cluster = Cluster("test-2", devices, Network(2.0, 2.0, 50.0), emulation)
    plan = make_plan(model, [[4], [4]], 0)
    engine = Engine(model, plan, optimizer=OPTIMIZERS["sgd"], loss_fn=F.cross_entropy, cluster=cluster, timeout_s=3)
    engine.train_step(((torch.randn(8, DIN),), torch.randint(0, CLASSES, (8,))))
    engine.train_step(((torch.randn(8, DIN),), torch.randint(0, CLASSES, (8,))))


def test_an_emulated_device_enforces_its_memory():
    outcomes = spawn_ranks(_out_of_memory, 2, init_process_group=False, timeout_s=60)
    error = outcomes[1].error or ""
    assert "EmulatedOutOfMemoryError" in error and "rank 1" in error and "emu-1" in error, error
    assert "1,024 bytes" in error, error           # the capacity, 2**-20 GiB
    assert "during set-up" in error, error
    assert outcomes[0].error is not None          # its peer cannot go on without it (a GPU's OOM does the same)
