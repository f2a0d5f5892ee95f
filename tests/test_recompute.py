"""Activation checkpointing end to end: asked per region, chosen by the planner, priced by the one
memory model and the cost model, run by ``runtime.training.recompute`` (torch's non-reentrant
checkpoint), exact against the single-process reference.

In process: the ``recompute`` option of ``replicate``/``split``/``annotate`` and its checks, the
TaskGraph round trip and the recompute-blind fingerprint; the wrapper (names kept, gradients bit
for bit, dropout exact thanks to the preserved RNG, undo); the memory model's transient term; the
planner asking and choosing recompute, predicting the memory drop and pricing the extra forward;
plan YAML round trip and bad plans; and the measured activation memory of a stage with two
micro-batches in flight, with and without recompute, against the predicted drop (within 15%).

Distributed (one 2-rank spawn): data parallel with uneven shares, a 2-stage 1F1B pipeline (with
``delay_weight_gradients``, which a recomputing stage declines) and an uneven tensor-parallel stage
(whose recompute re-runs its forward collectives on every rank of the group), each against the
plain single-process reference: checkpointing changes what is kept, not what is computed.
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
import plans
import whalelike as wl
from dist_utils import run_ranks
from planner.devices.cost_model import StageCost, backward_flops
from planner.devices.memory import MemoryTerms, stage_memory
from planner.plan import Plan, PlanError, StagePlan
from reference import OPTIMIZERS, assert_engine_trains_like_reference
from runtime.training import recompute
from synthetic import bert_large, synthetic_cluster
from whalelike.cluster import Cluster, Device, Network
from whalelike.errors import AnnotationError
from whalelike.graphs.capture import capture
from whalelike.graphs.taskgraph import TaskGraphs

DIN, HIDDEN, CLASSES = 6, 32, 10
STEPS = 3


# -- the request ------------------------------------------------------------------------------------
def test_strategy_records_recompute():
    asked = wl.replicate(2, recompute=True)
    assert asked.recompute and str(asked) == "replicate(2,recompute)" and asked.structure == "replicate(2)"
    assert str(wl.split(recompute=True)) == "split(auto,recompute)"
    assert asked != wl.replicate(2) and asked == wl.replicate(2, recompute=True)
    assert not wl.replicate(2).recompute and str(wl.replicate(2)) == "replicate(2)"
    with wl.replicate(2, recompute=True), wl.split(2) as inner:   # nested in a recomputing region: recomputes
        assert inner.recompute and str(inner) == "replicate(2,recompute)+split(2)"
    with wl.replicate(2), wl.split(2, recompute=True) as inner:
        assert inner.asks_recompute and inner.structure == "replicate(2)+split(2)"


@pytest.mark.parametrize("bad", ["yes", 1, None, 1.0])
def test_recompute_must_be_a_bool(bad):
    with pytest.raises(AnnotationError, match=r"replicate\(recompute=...\): recompute must be True or False, got"):
        wl.replicate(2, recompute=bad)
    with pytest.raises(AnnotationError, match="split"):
        wl.split(recompute=bad)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(DIN if i == 0 else HIDDEN, HIDDEN), nn.Tanh())
                                      for i in range(3)])
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.layers(x))


def test_annotate_and_capture_carry_recompute_and_the_fingerprint_ignores_it():
    x = torch.randn(4, DIN)
    plain, asked = Blocks(), Blocks()
    wl.annotate(plain, {"layers": wl.replicate(), "head": wl.replicate()})
    wl.annotate(asked, {"layers": wl.replicate(recompute=True), "head": wl.replicate()})
    g_plain, g_asked = capture(plain, (x,)), capture(asked, (x,))
    assert [g.strategy.recompute for g in g_asked] == [True, False]
    assert "replicate(auto,recompute)" in g_asked.table()
    assert g_plain.fingerprint == g_asked.fingerprint   # recompute is no structure: the plan says it
    back = TaskGraphs.from_dict(g_asked.to_dict())
    assert [g.strategy.recompute for g in back] == [True, False]
    wl.set_default_strategy(wl.replicate(recompute=True))
    try:
        assert wl.strategy.default_strategy().recompute
    finally:
        wl.set_default_strategy(None)


# -- the wrapper ------------------------------------------------------------------------------------
class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(DIN, HIDDEN), nn.Dropout(0.5), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _grads(module: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, dict]:
    module.zero_grad()
    torch.manual_seed(seed)
    out = module(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def test_wrap_keeps_names_and_is_exact_with_dropout():
    torch.manual_seed(0)
    plain = Dropped()
    wrapped = recompute.wrap(copy.deepcopy(plain))
    assert recompute.is_wrapped(wrapped) and [n for n, _ in wrapped.named_parameters()] == \
        [n for n, _ in plain.named_parameters()]
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(8, DIN)
    out, grads = _grads(plain, x, seed=3)
    out_w, grads_w = _grads(wrapped, x, seed=3)
    # the recompute redraws the dropout mask from the preserved RNG state: bit for bit
    assert torch.equal(out, out_w)
    for name in grads:
        assert torch.equal(grads[name], grads_w[name]), name
    # the wrapped forward really recomputes: it saves its input, not its activations
    def saved_by(module):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            module(x)
        return saved
    assert saved_by(wrapped) == [(8, DIN)] and len(saved_by(plain)) > 3
    with torch.no_grad():   # evaluation runs plainly
        torch.manual_seed(4)
        a = wrapped(x)
        torch.manual_seed(4)
        assert torch.equal(a, plain(x))
    with pytest.raises(ValueError, match="already recomputes"):
        recompute.wrap(wrapped)
    recompute.unwrap(wrapped)
    assert not recompute.is_wrapped(wrapped) and "forward" not in wrapped.__dict__
    copied = copy.deepcopy(recompute.wrap(wrapped))   # a copy recomputes its own forward
    assert copied.forward.__self__ is copied


# -- the memory model -------------------------------------------------------------------------------
def test_transient_term_is_held_once_and_max_samples_stays_the_inverse():
    terms = MemoryTerms(3e9, 3e9, 6e9, 1e6, in_flight=4, weight_fraction=0.5, gradient_fraction=0.5,
                        optimizer_fraction=0.5, activation_fraction=0.25, transient_bytes_per_sample=5e6)
    assert terms.total(10) == 0.5 * 12e9 + 0.25 * 10 * (4 * 1e6 + 5e6)
    assert terms.max_samples(5e9) == -1   # not even the static terms fit
    for capacity in (6.01e9, 7e9, 1e12):
        n = terms.max_samples(capacity)
        assert terms.total(n) <= capacity < terms.total(n + 1)
    cost = StageCost(1e9, 2e9, 1e8, 4e8, activation_bytes=3e6, boundary_bytes=2e5, layer_output_bytes=(1e5,))
    plain, again = stage_memory(cost, 3, 0.5), stage_memory(cost, 3, 0.5, recompute=True)
    assert plain.total(8) == stage_memory(cost, 3, 0.5, recompute=False).total(8)
    assert again.total(8) == plain.static() + 0.5 * 8 * (3 * 2e5 + 3e6)
    assert plain.total(8) - again.total(8) == pytest.approx(0.5 * 8 * 2 * 3e6)   # (in_flight - 1) activations
    assert backward_flops(cost, True) == 3e9 and backward_flops(cost) == 2e9


# -- the planner ------------------------------------------------------------------------------------
def _bert_plan(strategies, gbs: int):
    graphs = bert_large(strategies)
    return graphs, planner.plan(graphs, synthetic_cluster([(4, 10.0, 4)]),
                                wl.Config(global_batch_size=gbs, num_micro_batch=2, schedule="gpipe"))


def test_planner_turns_recompute_on_when_a_stage_does_not_fit_and_predicts_the_drop():
    graphs, plan = _bert_plan([wl.replicate(2), wl.replicate(2)], 4096)
    assert [(st.recompute, st.recompute_reason) for st in plan.stages] == [(True, "fit"), (True, "fit")]
    assert "recomputes activations (chosen to fit)" in plan.summary()
    for w in plan.workers:
        assert w.memory_gib <= w.capacity_gib
    # the same decisions without recompute would not fit: the predicted drop is the activations of
    # all but one micro-batch in flight
    st = plan.stages[0]
    cost = StageCost.of_layers(graphs, st.layers)
    in_flight, n = plan.num_micro_batch, max(plan.workers[0].micro_batch_sizes)
    without = stage_memory(cost, in_flight).total(n) / 2**30
    assert without > plan.workers[0].capacity_gib
    assert without - plan.workers[0].memory_gib == pytest.approx(
        n * (in_flight - 1) * cost.activation_bytes / 2**30, rel=1e-9)
    # the backward is priced with the forward run again
    w = plan.workers[0]
    assert w.backward_ms[0] > w.forward_ms[0] + 0.99 * w.forward_ms[0] * cost.backward_flops / cost.forward_flops


def test_planner_keeps_recompute_off_when_it_fits_and_honours_an_asked_region():
    _, plan = _bert_plan([wl.replicate(2), wl.replicate(2)], 8)
    assert [st.recompute_reason for st in plan.stages] == ["none", "none"]
    _, asked = _bert_plan([wl.replicate(2, recompute=True), wl.replicate(2)], 8)
    assert [(st.recompute, st.recompute_reason) for st in asked.stages] == [(True, "asked"), (False, "none")]
    assert "recomputes activations (asked)" in asked.summary()
    assert asked.workers[0].memory_gib < plan.workers[0].memory_gib


def test_recompute_in_plan_files(tmp_path):
    graphs, plan = _bert_plan([wl.replicate(2, recompute=True), wl.replicate(2)], 8)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path, graphs=graphs) == plan
    old = plan.to_dict()
    for stage in old["stages"]:   # a plan file from before recompute existed
        del stage["recompute"], stage["recompute_reason"]
    loaded = Plan.from_dict(old)
    assert [st.recompute for st in loaded.stages] == [False, False]
    with pytest.raises(PlanError, match=r"TaskGraph\(s\) \[0\] of this stage ask for recompute=True"):
        loaded.validate(graphs=graphs)
    bad = plan.to_dict()
    bad["stages"][1]["recompute"] = "yes"
    with pytest.raises(PlanError, match=r"plan.stages\[1\].recompute must be true or false"):
        Plan.from_dict(bad)
    bad = plan.to_dict()
    bad["stages"][1]["recompute_reason"] = "fit"
    with pytest.raises(PlanError, match=r"recompute_reason is 'fit' with recompute False"):
        Plan.from_dict(bad).validate()
    bad = plan.to_dict()
    bad["stages"][0]["batchnorm"] = ["bn"]
    with pytest.raises(PlanError, match="running statistics twice"):
        Plan.from_dict(bad).validate()


# -- measured memory --------------------------------------------------------------------------------
class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.hidden = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.fc3(h)


def _peak_bytes(module: nn.Module, micro_batches: list[torch.Tensor]) -> int:
    """Peak live bytes of a GPipe-like stage: every forward, then every backward (all in flight),
    measured by the project's CPU meter (runtime.training.memory_meter.LiveBytes, what
    Engine(measure_memory=True) runs), counted from the module's state."""
    from runtime.training.memory_meter import LiveBytes, state_tensors

    counter = LiveBytes(state_tensors([module], None))
    try:
        with counter:
            outs = [module(x) for x in micro_batches]
            for out in outs:
                out.backward(torch.ones_like(out))
            del outs
    finally:
        counter.close()
    return counter.peak


def test_measured_activation_memory_drops_by_the_predicted_amount():
    torch.manual_seed(0)
    # activations dominate (1024 samples of 256 features, 0.3 MiB of parameters), as in training
    model, n, in_flight = Wide(), 1024, 3
    graphs = capture(model, (torch.randn(n, 64),))
    cost = StageCost.of_layers(graphs, list(range(len(graphs.layers))))
    predicted = stage_memory(cost, in_flight).total(n) - stage_memory(cost, in_flight, recompute=True).total(n)
    assert predicted == (in_flight - 1) * n * cost.activation_bytes
    # capture leaves out the stage's input its first layer saves (Layer.input_activation_bytes_per_sample):
    # the caller holds it (in a pipeline: the received boundary buffer) whether or not the stage recomputes
    assert graphs.layers[0].input_activation_bytes_per_sample == 64 * 4
    # a first stage's inputs (they need no gradient), held by the caller either way
    xs = [torch.randn(n, 64) for _ in range(in_flight)]
    plain = _peak_bytes(copy.deepcopy(model), xs)
    again = _peak_bytes(recompute.wrap(copy.deepcopy(model)), xs)
    measured = plain - again
    print(f"\nmeasured drop {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB")
    assert measured == pytest.approx(predicted, rel=0.15)


# -- distributed, against the reference -------------------------------------------------------------
class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate(1):
            self.body = nn.Sequential(nn.Linear(DIN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        with wl.replicate(1):
            self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.body(x))


class SplitStage(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.split(2, recompute=True):
            self.fc1, self.fc2, self.head = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.fc2(F.gelu(self.fc1(x))))


def _cluster() -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4) for i in range(2))
    return Cluster("test-2", devices, Network(2.0, 2.0, 50.0))


def _stage(graphs, s: int, tgs: list[int], strategy: str, shards=None) -> StagePlan:
    return StagePlan(s, tgs, [l.index for l in graphs.layers if l.taskgraph in tgs], strategy, shards or {},
                     recompute=True, recompute_reason="asked")


def _scenario(name: str):
    torch.manual_seed(0)
    if name == "dp-uneven":
        model = Blocks()
        graphs = capture(model, (torch.randn(2, DIN),))
        plan = plans.make_plan([_stage(graphs, 0, [g.index for g in graphs], "replicate(2)")],
                               [plans.worker(0, 0, 0, sizes=[5, 2]), plans.worker(1, 0, 1, sizes=[1])],
                               model_fingerprint=graphs.fingerprint, cluster="test-2")
    elif name == "pipeline-1f1b":
        model = Pair()
        graphs = capture(model, (torch.randn(2, DIN),))
        plan = plans.make_plan([_stage(graphs, 0, [0], "replicate(1)"), _stage(graphs, 1, [1], "replicate(1)")],
                               [plans.worker(0, 0, 0, sizes=[3, 1, 2]), plans.worker(1, 1, 0, sizes=[3, 1, 2])],
                               model_fingerprint=graphs.fingerprint, cluster="test-2", schedule="1f1b",
                               delay_weight_gradients=True)
    else:   # an uneven tensor-parallel stage
        model = SplitStage()
        graphs = capture(model, (torch.randn(2, DIN),))
        shards = {"fc1": [20, 12], "fc2": [20, 12], "head": [7, 3]}
        plan = plans.make_plan([_stage(graphs, 0, [0], "split(2)", shards)],
                               [plans.worker(0, 0, 0, 0, 2, sizes=[4, 2]), plans.worker(1, 0, 0, 1, 2, sizes=[4, 2])],
                               model_fingerprint=graphs.fingerprint, cluster="test-2")
    plan.validate(graphs=graphs)
    g = torch.Generator().manual_seed(1)
    data = [((torch.randn(plan.global_batch_size, DIN, generator=g),),
             torch.randint(0, CLASSES, (plan.global_batch_size,), generator=g)) for _ in range(STEPS)]
    return model, plan, data


def _ranks(rank: int, world_size: int) -> dict:
    out = {}
    for name in ("dp-uneven", "pipeline-1f1b", "split-uneven"):
        for opt in OPTIMIZERS:
            model, plan, data = _scenario(name)
            engine, _, _ = assert_engine_trains_like_reference(model, plan, data, OPTIMIZERS[opt], F.cross_entropy,
                                                               _cluster(), f"{name}/{opt}", timeout_s=60)
            executor = engine.executor
            worker = getattr(executor, "stage_worker", None)
            module = worker.stage.module if worker is not None else executor.module
            out[name, opt] = {"wrapped": recompute.is_wrapped(module),
                              "splits": worker.splits_backward() if worker is not None else None}
            executor.close()
            out[name, opt]["unwrapped"] = not recompute.is_wrapped(module)
    return out


def test_recomputing_stages_train_exactly_like_the_reference():
    results = run_ranks(_ranks, 2, init_process_group=False, timeout_s=300)
    for rank in range(2):
        for key, seen in results[rank].items():
            assert seen["wrapped"] and seen["unwrapped"], (rank, key, seen)
        # delayed weight gradients are declined by a recomputing stage (it would recompute twice)
        assert results[rank]["pipeline-1f1b", "sgd"]["splits"] is False
