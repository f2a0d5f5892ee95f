"""runtime.Engine on single-stage (data-parallel) plans against a single-process reference.

One 4-rank spawn, the Engine initialising the process group from the torchrun-style environment.
Every check trains the whole model in one process and the Engine copy from the same initial
weights on the same data for 3 steps, with SGD (momentum) and with AdamW, and compares the loss
and every gradient of each step and the final parameters: uneven shares (8/8/4/2); uneven
gradient accumulation (different micro-batch counts, sizes and last batch sizes per rank); the
same under emulation (segments counted, each padded to at least its modeled time); evaluation of
a batch of another size; loading a full state dict; one epoch
through ``UnevenLoader`` (a short last batch leaves two ranks empty); and that a two-stage plan is
dispatched to the pipeline executor and trains exactly as well; and that the ranks' captures are
measured once (rank 0 measures, the others take its figures, equal to a fresh capture's; a rank
whose inputs differ measures itself). The sampler's properties are checked in-process.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import plans
from dist_utils import run_ranks
from planner.plan import Plan, StagePlan
from runtime import Engine, UnevenLoader, UnevenSampler
from runtime.data import proportional_split
from whalelike.graphs.capture import capture
from whalelike.cluster import Cluster, Device, Emulation, Network

WORLD = 4
DIN, HIDDEN, CLASSES = 6, 16, 5
STEPS = 3
SPEEDS = (1.0, 1.0, 0.5, 0.25)
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}
PLANS = {
    "uneven": [[8], [8], [4], [2]],
    "accumulation": [[4, 4, 3], [5, 4], [3], [1, 1]],
}


class Net(nn.Module):
    """Two inputs (the second only added at the end) to exercise tuple inputs."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.head = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, z):
        return self.head(torch.tanh(self.l1(torch.tanh(self.l0(x))))) + z


def make_cluster(emulation: Emulation | None) -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=s, memory_gib=4,
                           emulated_speed=s if emulation else None) for i, s in enumerate(SPEEDS))
    return Cluster("test-4", devices, Network(2.0, 2.0, 50.0), emulation)


def make_plan(model: nn.Module, micro_batch_sizes: list[list[int]]) -> Plan:
    graphs = capture(model, (torch.randn(2, DIN), torch.randn(2, CLASSES)))
    return plans.make_plan([StagePlan(0, [0], list(range(len(graphs.layers))), f"replicate({WORLD})")],
                           [plans.worker(r, 0, r, sizes=m) for r, m in enumerate(micro_batch_sizes)],
                           model_fingerprint=graphs.fingerprint, cluster="test-4")


def batches(n: int, seed: int) -> list[tuple[tuple, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, DIN, generator=g), torch.randn(n, CLASSES, generator=g)),
             torch.randint(0, CLASSES, (n,), generator=g)) for _ in range(STEPS)]


def reference(model: nn.Module, data, make_opt, clip: float | None = None, norms: list | None = None):
    """Losses and gradients of each step, and final parameters, training on whole global batches.
    ``clip``: clip each step's gradient norm to it (``clip_grad_norm_``), the norms appended to ``norms``."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses, grads = [], []
    for inputs, targets in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(*inputs), targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(norm)
        opt.step()
    return losses, grads, model.state_dict()


def check_against_reference(engine: Engine, model: nn.Module, data, make_opt, label: str) -> None:
    losses, grads, final = reference(model, data, make_opt)
    for step, batch in enumerate(data):
        loss = engine.train_step(batch)
        assert_close(loss, losses[step], msg=f"{label}: loss of step {step}")
        for name, p in engine.executor.module.named_parameters():
            assert_close(p.grad, grads[step][name], msg=f"{label}: gradient of {name} in step {step}")
    state = engine.state_dict()
    assert state.keys() == final.keys()
    for key, value in final.items():
        assert_close(state[key], value, msg=f"{label}: final {key}")
    # evaluation of a batch of any size (13: split 5/5/2/1 in proportion to the shares)
    trained = copy.deepcopy(model)
    trained.load_state_dict(final)
    (inputs, targets), = batches(13, seed=9)[:1]
    with torch.no_grad():
        assert_close(engine.eval_step((inputs, targets)), F.cross_entropy(trained(*inputs), targets), msg=f"{label}: eval")
    # a full state dict loads back on every rank
    engine.load_state_dict(model.state_dict())
    for key, value in engine.state_dict().items():
        assert_close(value, model.state_dict()[key], msg=f"{label}: loaded {key}")


def _check_loader(rank: int, model: nn.Module) -> None:
    """One epoch of 24 samples with a plan of 22 per step: a full step, then 2 samples (shares 1/1/0/0:
    two ranks run an empty step so the all-reduce still happens)."""
    plan = make_plan(model, PLANS["uneven"])
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(24, DIN, generator=g), torch.randint(0, CLASSES, (24,), generator=g))
    dataset = [((x, torch.zeros(CLASSES)), y) for x, y in data]
    loader = UnevenLoader(dataset, plan, rank, seed=3)
    loader.set_epoch(1)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    global_batches = [(tuple(torch.stack([dataset[i][0][k] for i in order[s:s + 22]]) for k in range(2)),
                       torch.stack([dataset[i][1] for i in order[s:s + 22]])) for s in (0, 22)]
    make_opt = OPTIMIZERS["adamw"]
    losses, grads, final = reference(model, global_batches, make_opt)
    engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=F.cross_entropy,
                    cluster=make_cluster(None), timeout_s=60)
    shares = list(loader)
    assert [s.targets.shape[0] for s in shares] == [[8, 8, 4, 2][rank], [1, 1, 0, 0][rank]]
    for step, share in enumerate(shares):
        assert_close(engine.train_step(share), losses[step], msg=f"loader: loss of step {step}")
    for key, value in engine.state_dict().items():
        assert_close(value, final[key], msg=f"loader: final {key}")


class Wide(Net):
    """Another architecture than :class:`Net`, which no rank has captured before."""

    def __init__(self):
        super().__init__()
        self.l2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, z):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x))))))) + z


def _examples(batch: int) -> tuple:
    return torch.ones(batch, DIN), torch.zeros(batch, CLASSES)


def _measured_once(rank: int, plan: Plan) -> tuple[list[int], list[dict]]:
    """Two Engines on a model no rank has captured: the first's capture measured by rank 0 alone; the
    second's by rank 1 alone, whose example batch differs (rank 0 reuses its own figures). The
    number of measurements per Engine, and the captured graphs."""
    import whalelike.graphs.capture as capture_module

    calls, real = [0], capture_module.measure

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    counts, graphs = [], []
    capture_module.measure = counted
    try:
        for batch in (2, 3 if rank == 1 else 2):
            calls[0] = 0
            engine = Engine(Wide(), plan, loss_fn=F.cross_entropy, cluster=make_cluster(None),
                            example_args=_examples(batch), timeout_s=60)
            counts.append(calls[0])
            graphs.append(engine.graphs.to_dict())
    finally:
        capture_module.measure = real
    return counts, graphs


def _ranks(rank: int, world_size: int, wide_plan: Plan) -> dict:
    measured = _measured_once(rank, wide_plan)
    torch.manual_seed(0)
    model = Net()
    for plan_name, micro_batch_sizes in PLANS.items():
        plan = make_plan(model, micro_batch_sizes)
        for opt_name, make_opt in OPTIMIZERS.items():
            engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=F.cross_entropy,
                            cluster=make_cluster(None), timeout_s=60)
            check_against_reference(engine, model, batches(plan.global_batch_size, seed=1), make_opt,
                                    f"{plan_name}/{opt_name}")

    # Emulated devices: the same exact results, every micro-batch's forward and backward padded.
    plan = make_plan(model, PLANS["accumulation"])
    engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(Emulation(base_gflops=0.05)), timeout_s=60)
    assert engine.emulator.enabled and engine.emulator.speed == SPEEDS[rank]
    check_against_reference(engine, model, batches(plan.global_batch_size, seed=2), OPTIMIZERS["sgd"], "emulated")
    assert [s.step for s in engine.stats] == list(range(STEPS)) and engine.emulator.step == STEPS - 1
    for s in engine.stats:
        assert s.segments == 2 * len(PLANS["accumulation"][rank]), s
        assert s.padded_s >= s.modeled_s > 0 and s.wall_s >= s.padded_s, s

    _check_loader(rank, model)
    _check_pipeline_dispatch(model)
    return {"stats": engine.stats, "measured": measured}


def _check_pipeline_dispatch(model: nn.Module) -> None:
    """A two-stage plan (2 + 2 ranks) goes to the pipeline executor and trains exactly too."""
    graphs = capture(model, (torch.randn(2, DIN), torch.randn(2, CLASSES)))
    layers = list(range(len(graphs.layers)))
    plan = dataclasses.replace(
        make_plan(model, [[3, 2], [1, 2], [2, 2], [2, 2]]), num_micro_batch=2, global_batch_size=8,
        stages=[StagePlan(0, [0], layers[:2], "replicate(2)"), StagePlan(1, [0], layers[2:], "replicate(2)")],
    )
    plan.workers = [dataclasses.replace(w, stage=w.rank // 2, dp_index=w.rank % 2) for w in plan.workers]
    engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["sgd"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(None), timeout_s=60)
    losses, _, final = reference(model, batches(8, seed=4), OPTIMIZERS["sgd"])
    for step, batch in enumerate(batches(8, seed=4)):
        assert_close(engine.train_step(batch), losses[step], msg=f"pipeline: loss of step {step}")
    assert type(engine.executor).__name__ == "PipelineExecutor"
    for key, value in engine.state_dict().items():
        assert_close(value, final[key], msg=f"pipeline: final {key}")


def test_engine_data_parallel_matches_single_process():
    wide_plan = make_plan(Wide(), PLANS["uneven"])
    results = run_ranks(_ranks, WORLD, (wide_plan,), init_process_group=False)
    # rank 0 measured the first capture for all; rank 1's second, at another batch, itself
    assert [r["measured"][0] for r in results] == [[1, 0], [0, 1], [0, 0], [0, 0]]
    fresh = {batch: capture(Wide(), _examples(batch)).to_dict() for batch in (2, 3)}
    for rank, r in enumerate(results):
        assert r["measured"][1] == [fresh[2], fresh[3 if rank == 1 else 2]], f"rank {rank}'s captures"
    # A faster emulated device models the same FLOPs in less time (per sample): rank 3 is 4x slower.
    modeled = [r["stats"][0].modeled_s / sum(PLANS["accumulation"][i]) for i, r in enumerate(results)]
    assert_close(modeled[3] / modeled[0], 4.0)


# -- sampler properties (in-process) ---------------------------------------------------------------
@pytest.mark.parametrize("num_samples", [1, 3, 22, 27, 100])
@pytest.mark.parametrize("shares", [[8, 8, 4, 2], [1, 1], [5]])
def test_uneven_sampler_covers_each_epoch_exactly_once(num_samples, shares):
    for epoch in (0, 1):
        per_rank = []
        for index in range(len(shares)):
            sampler = UnevenSampler(num_samples, shares, index, seed=7)
            sampler.set_epoch(epoch)
            steps = list(sampler)
            assert len(steps) == len(sampler)
            per_rank.append(steps)
        seen = sorted(i for steps in per_rank for indices in steps for i in indices)
        assert seen == list(range(num_samples)), "every sample exactly once per epoch"
        for step in range(len(per_rank[0])):
            sizes = [len(per_rank[r][step]) for r in range(len(shares))]
            if sum(sizes) == sum(shares):
                assert sizes == shares


def test_uneven_sampler_is_deterministic_and_reshuffles_per_epoch():
    def indices(seed, epoch):
        s = UnevenSampler(50, [3, 1], 0, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert indices(1, 0) == indices(1, 0)
    assert indices(1, 0) != indices(1, 1)
    assert indices(1, 0) != indices(2, 0)


def test_proportional_split():
    assert proportional_split(22, [8, 8, 4, 2]) == [8, 8, 4, 2]
    assert proportional_split(5, [8, 8, 4, 2]) == [2, 1, 1, 1]
    assert proportional_split(2, [8, 8, 4, 2]) == [1, 1, 0, 0]
    assert proportional_split(7, [1, 0, 1]) == [4, 0, 3]
    with pytest.raises(ValueError, match="positive"):
        proportional_split(3, [0, 0])
