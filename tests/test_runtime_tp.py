"""``split`` through ``runtime.Engine``: uneven tensor parallelism alone, inside ``replicate`` and
inside pipeline stages, against a single-process reference (one 4-rank spawn).

Each scenario trains the whole model in one process and under the Engine from the same initial
weights on the same data for 3 steps, with SGD (momentum) and with AdamW, and compares the loss of
every step, the gathered (unsharded) final parameters, an evaluation, and loading a full state
dict back. Shard sizes and batch shares are deliberately uneven:

* ``split-in-replicate``: one stage, two data-parallel slots (samples 5+3 and 2+2 per step) of two
  tensor-parallel ranks each; a column/row pair (24/8 of 32 features), a lone Linear
  (column + gather, 20/12) and a class-sharded classifier (7/3 classes) whose logits only ever
  meet the sharded cross-entropy; once more with per-slot gradient accumulation (3 micro-batches
  of 4+4+2 samples on one slot, 1 of 3 on the other).
* ``hybrid`` (Whale's flagship shape): a ``replicate`` feature extractor on two ranks with uneven
  shares feeding a ``split`` classifier on two ranks, under GPipe and 1F1B, and once more with
  emulated devices (segments padded matmul by matmul on the tensor-parallel stage).
* ``split-first``: a tensor-parallel stage that *produces* boundary values: every member of the
  group needs the gradients coming back, which only the consumers' ``tp_index`` 0 sends.
* ``lm-head``: a language model's vocabulary-sharded head, ``[batch, positions, vocab]`` logits
  fed to the sharded cross-entropy through ``wl.token_cross_entropy``.

A warm-up (``_warm``) captures each scenario's model once before the ranks fork, so that their
captures are capture-cache hits.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import plans
import whalelike as wl
from dist_utils import run_ranks
from planner.plan import Plan, StagePlan
from reference import OPTIMIZERS, assert_engine_trains_like_reference
from whalelike.graphs.capture import capture
from whalelike.cluster import Cluster, Device, Emulation, Network

WORLD = 4
DIN, HIDDEN, CLASSES = 6, 32, 10
VOCAB, POSITIONS = 24, 5
STEPS = 3


class SplitInReplicate(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate(2), wl.split(2):
            self.fc1, self.fc2 = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.proj, self.head = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(x)))                       # column/row pair
        h = F.layer_norm(self.proj(h), (HIDDEN,))               # lone Linear: its output is needed whole
        return self.head(h)                                     # class-sharded classifier


class Hybrid(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate(2):
            self.features = nn.Sequential(nn.Linear(DIN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        with wl.split(2):
            self.classifier = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.classifier(self.features(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate(2):
            self.embed, self.mix = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        with wl.split(2):
            self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class SplitFirst(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.split(2):
            self.fc1, self.fc2 = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        with wl.replicate(2):
            self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(F.relu(self.fc1(x)))))


# Per scenario: model, schedule, stages (TaskGraphs, strategy, shard sizes), workers in rank order
# (stage, dp_index, tp_index, tp_size, micro-batch sizes), emulated speeds or None.
TP_IN_DP_STAGE = ([0], "replicate(2)+split(2)", {"fc1": [24, 8], "fc2": [24, 8], "proj": [20, 12], "head": [7, 3]})
# stage 0 data parallel on ranks 0-1 (shares 3+2 and 1+2), stage 1 tensor parallel on ranks 2-3
DP_THEN_TP_WORKERS = [(0, 0, 0, 1, [3, 2]), (0, 1, 0, 1, [1, 2]), (1, 0, 0, 2, [4, 4]), (1, 0, 1, 2, [4, 4])]
HYBRID_STAGES = [([0], "replicate(2)", {}), ([1], "split(2)", {"classifier": [6, 4]})]
SCENARIOS = {
    "split-in-replicate": (SplitInReplicate, "1f1b", [TP_IN_DP_STAGE],
                           [(0, 0, 0, 2, [5, 3]), (0, 0, 1, 2, [5, 3]), (0, 1, 0, 2, [2, 2]), (0, 1, 1, 2, [2, 2])],
                           None),
    "split-in-replicate-accumulation": (SplitInReplicate, "1f1b", [TP_IN_DP_STAGE],
                                        [(0, 0, 0, 2, [4, 4, 2]), (0, 0, 1, 2, [4, 4, 2]), (0, 1, 0, 2, [3]),
                                         (0, 1, 1, 2, [3])],
                                        None),
    "hybrid-gpipe": (Hybrid, "gpipe", HYBRID_STAGES, DP_THEN_TP_WORKERS, None),
    "hybrid-1f1b": (Hybrid, "1f1b", HYBRID_STAGES, DP_THEN_TP_WORKERS, None),
    "split-first": (SplitFirst, "1f1b",
                    [([0], "split(2)", {"fc1": [8, 24], "fc2": [8, 24]}), ([1], "replicate(2)", {})],
                    [(0, 0, 0, 2, [4, 4]), (0, 0, 1, 2, [4, 4]), (1, 0, 0, 1, [3, 1]), (1, 1, 0, 1, [1, 3])],
                    None),
    "lm-head": (TinyLM, "1f1b", [([0], "replicate(2)", {}), ([1], "split(2)", {"head": [16, 8]})],
                DP_THEN_TP_WORKERS, None),
    "hybrid-emulated": (Hybrid, "1f1b", HYBRID_STAGES, DP_THEN_TP_WORKERS, (1.0, 0.5, 1.0, 0.5)),
}


def make_cluster(speeds) -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4,
                           emulated_speed=None if speeds is None else speeds[i]) for i in range(WORLD))
    return Cluster("test-4", devices, Network(2.0, 2.0, 50.0), None if speeds is None else Emulation(base_gflops=0.05))


def make_plan(model: nn.Module, schedule: str, stages, workers) -> Plan:
    (example,), _ = batches(model, 2, seed=0)[0]
    graphs = capture(model, (example,))
    stage_plans = [StagePlan(s, tgs, [layer.index for layer in graphs.layers if layer.taskgraph in tgs], strategy,
                             {path: list(sizes) for path, sizes in shards.items()})
                   for s, (tgs, strategy, shards) in enumerate(stages)]
    return plans.make_plan(stage_plans, [plans.worker(r, stage, dp, tp, tp_size, sizes=mbs)
                                         for r, (stage, dp, tp, tp_size, mbs) in enumerate(workers)],
                           model_fingerprint=graphs.fingerprint, cluster="test-4", schedule=schedule)


def batches(model: nn.Module, n: int, seed: int) -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, TinyLM):
        return [((torch.randint(0, VOCAB, (n, POSITIONS), generator=g),),
                 torch.randint(0, VOCAB, (n, POSITIONS), generator=g)) for _ in range(STEPS)]
    return [((torch.randn(n, DIN, generator=g),), torch.randint(0, CLASSES, (n,), generator=g)) for _ in range(STEPS)]


def loss_of(model: nn.Module):
    return wl.token_cross_entropy if isinstance(model, TinyLM) else F.cross_entropy


def _check(name: str, opt: str) -> dict:
    make_model, schedule, stages, workers, speeds = SCENARIOS[name]
    torch.manual_seed(0)
    model = make_model()
    plan = make_plan(model, schedule, stages, workers)
    data, loss_fn = batches(model, plan.global_batch_size, seed=1), loss_of(model)
    engine, _, final = assert_engine_trains_like_reference(model, plan, data, OPTIMIZERS[opt], loss_fn,
                                                           make_cluster(speeds), f"{name}/{opt}", timeout_s=60)
    trained = copy.deepcopy(model)
    trained.load_state_dict(final)
    (inputs, targets), = batches(model, plan.global_batch_size, seed=2)[:1]
    with torch.no_grad():
        assert_close(engine.eval_step((inputs, targets)), loss_fn(trained(*inputs), targets),
                     msg=f"{name}/{opt}: eval")
    engine.load_state_dict(model.state_dict())
    for key, value in engine.state_dict().items():
        assert_close(value, model.state_dict()[key], msg=f"{name}/{opt}: loaded {key}")
    sharded = {n: tuple(p.shape) for n, p in engine.executor.stage.module.named_parameters()}
    return {"sharded": sharded, "segments": sum(s.segments for s in engine.stats),
            "sharded_loss": engine.executor.stage_worker.loss_fn is not loss_fn}


def _warm() -> None:
    """Each scenario's model captured as a rank's ``_check`` captures it (its plan's example of 2,
    its Engine's first global batch), once, before the ranks fork (dist_utils' ``warm``)."""
    for make_model, schedule, stages, workers, _ in SCENARIOS.values():
        torch.manual_seed(0)
        model = make_model()
        plan = make_plan(model, schedule, stages, workers)
        capture(model, batches(model, plan.global_batch_size, seed=1)[0][0])


def _ranks(rank: int, world_size: int) -> dict:
    results = {}
    for name in SCENARIOS:
        for opt in OPTIMIZERS if not name.endswith("emulated") else ("sgd",):
            results[name, opt] = _check(name, opt)
    return results


def test_split_through_the_engine_matches_single_process():
    results = run_ranks(_ranks, WORLD, init_process_group=False, timeout_s=300, warm=_warm)
    # the layouts really are uneven: each rank holds its own shard sizes, never the full matrix
    assert results[0]["split-in-replicate", "sgd"]["sharded"]["fc1.weight"] == (24, DIN)
    assert results[1]["split-in-replicate", "sgd"]["sharded"]["fc2.weight"] == (HIDDEN, 8)
    assert results[3]["split-in-replicate", "sgd"]["sharded"]["head.weight"] == (3, HIDDEN)
    assert results[2]["hybrid-1f1b", "adamw"]["sharded"]["classifier.weight"] == (6, HIDDEN)
    assert results[1]["split-first", "sgd"]["sharded"]["fc1.weight"] == (24, DIN)
    assert results[3]["lm-head", "sgd"]["sharded"]["head.weight"] == (8, HIDDEN)
    # the classifiers' logits stay class-sharded: the last stage computes the sharded cross-entropy
    assert all(results[r][name, "sgd"]["sharded_loss"] for r in (2, 3) for name in ("hybrid-1f1b", "lm-head"))
    # emulation pads every matmul of the tensor-parallel stage on both of its ranks
    assert all(results[r]["hybrid-emulated", "sgd"]["segments"] > 0 for r in range(WORLD))


def test_tensor_parallel_slots_share_their_samples():
    """Every member of a tensor-parallel group covers the same samples; the slots of a stage cover
    each micro-batch exactly once, in the same order for every stage."""
    from runtime.parallel.pipeline import sample_ranges

    for name in ("split-in-replicate", "hybrid-1f1b", "split-first"):
        make_model, schedule, stages, workers, _ = SCENARIOS[name]
        torch.manual_seed(0)
        plan = make_plan(make_model(), schedule, stages, workers)
        ranges = sample_ranges(plan)
        for w in plan.workers:
            group = [v for v in plan.workers if (v.stage, v.dp_index) == (w.stage, w.dp_index)]
            assert all(ranges[v.rank] == ranges[w.rank] for v in group), name
        for s in range(len(plan.stages)):
            slots = [w for w in plan.stage_workers(s) if w.tp_index == 0]
            covered = sorted(r for w in slots for r in ranges[w.rank])
            assert [lo for lo, _ in covered] == [0] + [hi for _, hi in covered[:-1]], (name, covered)
            assert covered[-1][1] == plan.global_batch_size
