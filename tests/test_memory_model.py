"""The planner's one memory model (planner.devices.memory): each term scales with its own fraction,
and on real plans it gives the bytes the partitioner, Whale's Algorithm 1, the shard caps and the
plan checks computed before it existed (the old formulas are written out here, independently)."""
from __future__ import annotations

import copy
import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import planner
import whalelike as wl
from planner.devices.cost_model import GIB, StageCost
from planner.devices.memory import (
    DDP_JOIN_BYTES, FIT_TOLERANCE, TERMS, UNBOUNDED_SAMPLES, MemoryTerms, ZeroShards, fits, max_shard, recompute_unit,
    runs_foreach, stage_memory, update_bytes, worker_fractions,
)
from planner.partition.pricing import Pricing
from planner.partition.solve import (
    DeviceMemory, LayerCost, PartitionProblem, StageLink, StageSlot, layer_costs, partition,
)
from planner.schedule.actions import build_schedule, gradient_accumulation, max_in_flight
from planner.shares.shard_sizes import layout_of_sizes
from runtime.training.memory_meter import LiveBytes
from whalelike import Cluster, Config, replicate
from whalelike.graphs.capture import with_autocast

from synthetic import bert_large, synthetic_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_llama  # noqa: E402
import hybrid_classifier  # noqa: E402

FRACTIONS = {"weight": 0.5, "gradient": 0.25, "optimizer": 0.125, "activation": 0.75}


def terms(**fractions) -> MemoryTerms:
    f = {**FRACTIONS, **fractions}
    return MemoryTerms(3.0 * GIB, 5.0 * GIB, 7.0 * GIB, 11.0 * 2**20, in_flight=2,
                       **{f"{t}_fraction": f[t] for t in TERMS})


# -- the model alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("term", TERMS)
def test_each_term_scales_with_its_own_fraction_only(term):
    base, doubled = terms(), terms(**{term: 2 * FRACTIONS[term]})
    before, after = base.term_bytes(samples=8), doubled.term_bytes(samples=8)
    for other in TERMS:
        assert after[other] == (2 * before[other] if other == term else before[other]), other
    assert doubled.total(8) - base.total(8) == pytest.approx(before[term], rel=1e-15)
    assert base.total(8) == pytest.approx(sum(before.values()), rel=1e-15)


def test_only_activations_scale_with_samples_and_in_flight():
    m = terms()
    static = m.static()
    assert static == 0.5 * 3 * GIB + 0.25 * 5 * GIB + 0.125 * 7 * GIB
    assert m.total(8) - static == pytest.approx(0.75 * 8 * 2 * 11 * 2**20, rel=1e-15)
    assert m.activations(8) == 2 * m.activations(4) == 0.75 * 8 * 2 * 11 * 2**20
    alive = MemoryTerms(3.0 * GIB, 5.0 * GIB, 7.0 * GIB, 11.0 * 2**20, in_flight=4,
                        **{f"{t}_fraction": FRACTIONS[t] for t in TERMS})
    assert alive.static() == static and alive.activations(8) == 2 * m.activations(8)


def test_equal_fractions_price_a_shard_as_before_bit_for_bit():
    """One shard fraction for every term gives ``f * (static + n * per-sample bytes)``, the formula
    StageCost used, to the last bit (terms that share a fraction are added before scaling), while the
    micro-batches run (the optimizer update's temporaries, after them: :func:`test_the_update_temporaries_come_after_the_backward`)."""
    graphs = bert_large([replicate()])
    cost = dataclasses.replace(StageCost.of_layers(graphs, range(5)), optimizer="")
    for f in (1.0, 0.5, 0.37, 1 / 3):
        for n, in_flight in ((0, 1), (1, 1), (7, 3), (104, 1)):
            old = f * (cost.static_bytes + n * ((cost.activation_bytes + cost.boundary_bytes) * in_flight))
            assert stage_memory(cost, in_flight, f).total(n) == old


def test_the_worker_rule_and_the_batch_share():
    assert worker_fractions(0.4) == {f"{t}_fraction": 0.4 for t in TERMS}
    cost = StageCost(1.0, 2.0, 4.0, 12.0, 1.0, 0.5, ())
    assert cost.optimizer_bytes == 4.0   # a hand-made cost: static less parameters and gradients
    whole, share = stage_memory(cost, 2, 0.5), stage_memory(cost, 2, 0.5, batch_share=0.25)
    assert share.static() == whole.static() == 6.0
    assert share.activations(8) == 0.25 * whole.activations(8) == 0.5 * 0.25 * 8 * 2 * 1.5


@pytest.mark.parametrize("fractions", [{}, {t: 0.5 for t in TERMS}, {"weight": 1.0, "gradient": 0.75}])
def test_max_samples_is_the_inverse_of_total(fractions):
    m = terms(**fractions)
    for capacity in np.linspace(m.static() + 2**20, m.static() + 3 * GIB, 37):
        n = m.max_samples(capacity)
        assert m.total(n) <= capacity < m.total(n + 1), (capacity, n)
    assert m.max_samples(m.static() * (1 - 1e-9)) == -1
    assert m.max_samples(math.inf) == m.max_samples(1e300 * GIB) == UNBOUNDED_SAMPLES
    free = terms(activation=0.0)
    assert free.max_samples(free.static()) == UNBOUNDED_SAMPLES and free.max_samples(free.static() / 2) == -1


def test_max_samples_matches_the_old_cap_bit_for_bit():
    graphs = bert_large([replicate()])
    cost = dataclasses.replace(StageCost.of_layers(graphs, range(25)), optimizer="")   # no update temporaries
    for f in (1.0, 0.5, 0.3):
        for in_flight in (1, 4):
            per_sample = (cost.activation_bytes + cost.boundary_bytes) * in_flight
            for capacity in [16 * GIB, 32 * GIB, 5.3 * GIB] + [f * (cost.static_bytes + k * per_sample)
                                                               for k in (0, 1, 17)]:
                free = capacity / f - cost.static_bytes
                old = -1 if free < 0 else math.floor(free / per_sample)
                assert stage_memory(cost, in_flight, f).max_samples(capacity) == old


def test_boundary_values_without_a_batch_dimension_are_held_whole_per_micro_batch_in_flight():
    """A statistic crossing a stage boundary (``Layer.cut_bytes_unbatched``, received and sent:
    ``StageCost.unbatched_boundary_bytes``) is held whole by every worker of the stage, once per
    micro-batch in flight, whatever its shard or samples (issue 30 item 2); reported with the
    activations; the largest micro-batch leaves room for it."""
    graphs = bert_large([replicate()])
    graphs.layers[0] = dataclasses.replace(graphs.layers[0], cut_bytes_unbatched=100.0)
    graphs.layers[4] = dataclasses.replace(graphs.layers[4], cut_bytes_unbatched=28.0)
    cost = dataclasses.replace(StageCost.of_layers(graphs, range(1, 5)), optimizer="")   # the terms while it runs
    assert cost.unbatched_boundary_bytes == 128.0   # received after layer 0, sent after layer 4
    assert StageCost.of_layers(graphs, range(5, 10)).unbatched_boundary_bytes == 28.0   # received
    assert StageCost.of_layers(graphs, range(6, 10)).unbatched_boundary_bytes == 0.0
    whole = 2**20
    cost = dataclasses.replace(cost, unbatched_boundary_bytes=whole)
    without = dataclasses.replace(cost, unbatched_boundary_bytes=0.0)
    for f in (1.0, 0.37):
        for n, in_flight in ((0, 1), (7, 3)):
            m, bare = stage_memory(cost, in_flight, f), stage_memory(without, in_flight, f)
            assert m.total(n) == pytest.approx(bare.total(n) + in_flight * whole, rel=1e-15)
            assert sum(m.term_bytes(n).values()) == pytest.approx(m.total(n), rel=1e-15)
            assert m.activations(n) == bare.activations(n)   # per sample: unchanged
    m = stage_memory(cost, 2, 0.5)
    for capacity in np.linspace(m.static() + 2**20, m.static() + 3 * GIB, 11):
        n = m.max_samples(capacity)
        assert m.total(n) <= capacity < m.total(n + 1), (capacity, n)
    assert m.max_samples(m.static() * (1 - 1e-9)) == -1


def test_numbers_arrays_and_fit_rule():
    arrays = MemoryTerms(np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([0.0, 8.0]), np.array([0.5, 0.25]),
                         in_flight=3, weight_fraction=0.5, activation_fraction=0.25)
    singles = [MemoryTerms(w, g, o, a, 3, 0.5, 1.0, 1.0, 0.25) for w, g, o, a in [(1.0, 3.0, 0.0, 0.5), (2.0, 4.0, 8.0, 0.25)]]
    assert list(arrays.total(4)) == [s.total(4) for s in singles]
    assert fits(1.0 + FIT_TOLERANCE / 2, 1.0) and not fits(1.0 + 2 * FIT_TOLERANCE, 1.0)
    with pytest.raises(ValueError, match="in_flight"):
        MemoryTerms(1.0, 1.0, 1.0, 1.0, in_flight=0)
    with pytest.raises(ValueError, match="gradient_fraction"):
        MemoryTerms(1.0, 1.0, 1.0, 1.0, gradient_fraction=-0.5)


# -- real plans: the totals equal what the planner computed before ---------------------------------
@pytest.fixture(scope="module")
def hybrid():
    workload = hybrid_classifier.build()
    return wl.capture(workload.model, workload.example_args)


def _in_flight(plan) -> list[int]:
    if len(plan.stages) == 1:
        return [max_in_flight(gradient_accumulation(plan.num_micro_batch))]
    return [max_in_flight(a) for a in build_schedule(plan.schedule, len(plan.stages), plan.num_micro_batch)]


def _stage(graphs, st):
    """The stage's cost and its shard layout (fractions and unit shares), as the plan priced them."""
    cost = StageCost.of_layers(graphs, st.layers)
    owners = [graphs[t] for t in st.taskgraphs]
    shardable = {p: d for tg in owners for p, d in tg.shardable.items()}
    groups = tuple(g for tg in owners for g in tg.shard_groups)
    tp = len(next(iter(st.shard_sizes.values()))) if st.shard_sizes else 1
    return cost, layout_of_sizes(shardable, st.shard_sizes, tp, groups, cost.flops_per_sample)


def _plans(hybrid):
    yield hybrid, Cluster.preset("emulated-4"), Config(global_batch_size=16, num_micro_batch=2)
    yield hybrid, Cluster.preset("emulated-4"), Config(global_batch_size=64, num_micro_batch=4)
    yield (bert_large([replicate()] * 3), synthetic_cluster([(2, 15.7, 32), (2, 9.3, 16), (2, 30, 16)]),
           Config(global_batch_size=96, num_micro_batch=8))
    yield bert_large([replicate()]), synthetic_cluster([(2, 15.7, 32), (2, 9.3, 16)]), Config(1000, 1)


def test_real_plans_memory_equals_the_formulas_written_out(hybrid):
    """Per worker: the plan's memory_gib (what summary shows and plan checks compare) is
    ``shard * static + a * micro-batch * (per-sample bytes per micro-batch in flight + the loss
    bytes held once)``, where the activation share ``a`` is the shard fraction, or on a ``split``
    stage whose groups divide part of the activations ``1 - divided / whole * (1 - unit share)``
    (what the groups leave whole, every rank holds whole); Algorithm 1's cap on each device is the
    largest sample count that fits; the shard cap is capacity over the whole stage's need; and the
    plan passes the plan checks against its cluster."""
    seen_tp = seen_pipeline = seen_accumulation = seen_loss = False
    for graphs, cluster, config in _plans(hybrid):
        plan = planner.plan(graphs, cluster, config)
        plan.validate(graphs=graphs, cluster=cluster)
        in_flight = _in_flight(plan)
        stages = [_stage(graphs, st) for st in plan.stages]
        capacity = {d.name: d.memory_gib * GIB for d in cluster.devices}
        for w in plan.workers:
            (cost, layout), n = stages[w.stage], max(w.micro_batch_sizes)
            f, alive = layout.fractions[w.tp_index], in_flight[w.stage]
            # one layer's backward temporaries, held once beside the loss
            per_sample = (cost.activation_bytes + cost.boundary_bytes) * alive + max(cost.loss_bytes,
                                                                                     cost.max_layer_backward_bytes)
            divided = alive * cost.sharded_activation_bytes + cost.sharded_loss_bytes
            a = 1 - divided / per_sample * (1 - layout.unit_shares[w.tp_index]) if divided else f
            # after the backward: the update's temporaries (foreach on a GPU: all the parameters' bytes; one by one:
            # twice the largest), or DDP's last bucket joined with the step's exchange, the larger
            device = cluster.device(w.device)
            group = sum(1 for x in plan.workers if (x.stage, x.tp_index) == (w.stage, w.tp_index))
            assert plan.stages[w.stage].zero_stage == 0
            update = cost.param_bytes if runs_foreach(device) else 2 * cost.max_param_bytes
            join = min(f * cost.param_bytes, DDP_JOIN_BYTES) if group > 1 else 0.0
            model = stage_memory(cost, alive, f, unit_share=layout.unit_share(w.tp_index),
                                 zero=ZeroShards(0, group), foreach=runs_foreach(device))
            written = f * cost.static_bytes + max(a * n * per_sample, f * update, join)
            assert model.total(n) / GIB == pytest.approx(written / GIB, rel=1e-12)
            assert model.total(n) / GIB == w.memory_gib, w
            cap = model.max_samples(capacity[w.device])
            assert model.total(cap) <= capacity[w.device] < model.total(cap + 1) and cap >= n, w
            need = max(cost.static_bytes + max(n * per_sample, 2 * cost.max_param_bytes), 1.0)
            assert max_shard(cost, alive, n, capacity[w.device]) == pytest.approx(capacity[w.device] / need, rel=1e-12)
            assert fits(w.memory_gib, w.capacity_gib)
            seen_tp |= w.tp_size > 1 and f < 1
            seen_loss |= cost.loss_bytes > 0
        seen_pipeline |= len(plan.stages) > 2
        seen_accumulation |= len({len(w.micro_batch_sizes) for w in plan.workers}) > 1
    assert seen_tp and seen_pipeline and seen_accumulation and seen_loss


# -- the partitioner -------------------------------------------------------------------------------
def _old_need(p: PartitionProblem, k: int, d: DeviceMemory, first: int, last: int) -> float:
    """The partitioner's formula before the model: one weight fraction for parameters, gradients
    and optimizer state, one batch fraction for the activations and boundary buffers; then, the
    larger of those and the update's temporaries."""
    chosen = p.layers[first:last + 1]
    per_sample = sum(l.activation_bytes for l in chosen)
    per_sample += p.layers[first - 1].cut_bytes if k > 0 else 0.0
    per_sample += p.layers[last].cut_bytes if k < len(p.slots) - 1 else 0.0
    static = sum(l.param_bytes + l.state_bytes for l in chosen)
    # the optimizer update's temporaries, after the backward: the larger of them and the activations
    update = sum(l.foreach_update_bytes for l in chosen) if d.foreach else max(l.update_bytes for l in chosen)
    return d.weight_fraction * static + max(d.batch_fraction * p.micro_batch * p.in_flight[k] * per_sample,
                                            d.optimizer_fraction * update)


def test_partitioner_prices_real_layers_as_before():
    """bert_large's captured layer costs over a data-parallel, a tensor-parallel (shards 0.6 / 0.4)
    and a single-device slot: every range's need on every device, and the chosen split's memory
    utilisation, equal the old formula (to rounding: the old one summed in another order)."""
    layers = layer_costs(bert_large([replicate()]))
    assert all(0 < l.optimizer_bytes < l.state_bytes for l in layers if l.param_bytes)
    tp = StageSlot("tp2", 25e12, (DeviceMemory.of_worker(16 * GIB, 0.6, 1.0, "t0"),
                                  DeviceMemory.of_worker(12 * GIB, 0.4, 1.0, "t1")))
    slots = [StageSlot.data_parallel("dp2", [15e12, 9e12], [32 * GIB, 16 * GIB]), tp,
             StageSlot.data_parallel("one", [30e12], [24 * GIB])]
    p = PartitionProblem.for_schedule(layers, slots, [StageLink(12.5e9, 5e-6)] * 2, micro_batch=6,
                                      num_micro_batch=8, order="search")
    pricing, L = Pricing(p), len(layers)
    for k in range(3):
        for slot in p.slots:
            for d in slot.devices:
                need = pricing.need(k, d)
                for i in range(k, L):   # every range position k can run (the stages around it need a layer)
                    for j in range(i, L - 2 + k):
                        assert need[i, j] == pytest.approx(_old_need(p, k, d, i, j), rel=1e-13, abs=0)
    for solver in ("greedy", "ilp"):
        result = partition(p, solver=solver)
        for s in result.stages:
            old = max(_old_need(p, s.position, d, s.first, s.last) / d.capacity_bytes for d in p.slots[s.slot].devices)
            assert s.memory_utilization == pytest.approx(old, rel=1e-13)


def test_partitioner_holds_each_term_in_its_own_fraction():
    """A device that holds a quarter of the optimizer state (ZeRO-1 over four) takes more layers,
    in the dynamic program and the ILP alike, and each split fits by the model."""
    layers = [LayerCost(f"l{i}", 1e9, 2e9, 0.25 * GIB, 0.75 * GIB, 0.0, 0.0, optimizer_bytes=0.5 * GIB)
              for i in range(12)]
    assert layers[0].gradient_bytes == 0.25 * GIB
    with pytest.raises(ValueError, match="optimizer_bytes"):
        LayerCost("x", 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, optimizer_bytes=2.0)

    def split(optimizer_fraction):
        small = StageSlot("small", 1000e12, (DeviceMemory(4 * GIB, 1.0, 1.0, "s", optimizer_fraction=optimizer_fraction),))
        big = StageSlot.data_parallel("big", [1e12], [80 * GIB])
        p = PartitionProblem.for_schedule(layers, [small, big], [StageLink(12.5e9, 5e-6)], micro_batch=1,
                                          num_micro_batch=1)
        results = [partition(p, solver=solver) for solver in ("greedy", "ilp")]
        assert results[0].stage_layers() == results[1].stage_layers()
        for s in results[0].stages:
            d = p.slots[s.slot].devices[0]
            assert fits(Pricing(p).need(s.position, d)[s.first, s.last], d.capacity_bytes)
        return [len(s.layers) for s in results[0].stages]

    assert DeviceMemory(GIB, 0.5, 0.25).fractions == (0.5, 0.5, 0.5, 0.25)
    assert split(1.0) == [4, 8]       # 1 GiB per layer
    assert split(0.25) == [6, 6]      # 0.25 + 0.25 + 0.125 GiB per layer: 6 fit


# -- what runs: the corrections bench/memory.py measured --------------------------------------------
class _Residual(torch.nn.Module):
    """A float32 residual stream around a norm and a projection, an embedding in front, a head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.proj(self.norm(h))
        return self.head(h)


@pytest.fixture(scope="module")
def residual():
    """The captured residual model with its autocast figures (measured on first request)."""
    torch.manual_seed(0)
    graphs = wl.capture(_Residual(), (torch.randint(0, 32, (4, 8)),))
    # capture alone leaves them out (a second run of the graph): a low-precision plan asks for them
    assert all(l.autocast is None for l in graphs.layers)
    measured = with_autocast(graphs)
    assert with_autocast(graphs) is measured and measured.fingerprint == graphs.fingerprint
    return measured


def test_autocast_bytes_are_measured_not_halved(residual):
    """Under autocast the residual stream and the norm stay float32: the activations are more than
    half the float32 bytes; only the projections' weights are cast (2 bytes per parameter of proj
    and head, none of the embedding or the norm)."""
    layers = {l.name: l for l in residual.layers}
    assert all(l.autocast is not None for l in residual.layers)
    fp32 = StageCost.of_layers(residual, range(len(residual.layers)), "fp32")
    bf16 = StageCost.of_layers(residual, range(len(residual.layers)), "bf16")
    assert 0.5 * fp32.activation_bytes < bf16.activation_bytes < fp32.activation_bytes
    assert bf16.param_copy_bytes == 2 * (16 * 16 + 16 + 16 * 32 + 32) == sum(l.autocast["param_copy"] for l in layers.values())
    assert layers["embed"].autocast["param_copy"] == layers["norm"].autocast["param_copy"] == 0
    # the model output (the logits) is the head's: 32 classes x 8 positions, 4 bytes, 2 under autocast
    assert layers["head"].output_bytes_per_sample == 8 * 32 * 4 and layers["head"].autocast["output"] == 8 * 32 * 2
    # a TaskGraph captured without the autocast figures falls back to half the float32 bytes
    old = _without_autocast(residual)
    assert StageCost.of_layers(old, range(len(old.layers)), "bf16").param_copy_bytes == bf16.param_bytes / 2


def _without_autocast(graphs):
    """``graphs`` as a capture made before the autocast figures existed."""
    out = copy.copy(graphs)
    out.layers = [dataclasses.replace(l, autocast=None) for l in graphs.layers]
    return out


def test_a_stage_input_saved_by_its_first_layer_is_not_counted_twice(residual):
    """The received boundary buffer (or the caller's batch) is what the stage's first layer saves:
    counted once, in the boundary bytes."""
    layers = residual.layers
    k = next(i for i, l in enumerate(layers) if l.input_activation_bytes_per_sample > 0 and i > 0)
    cost = StageCost.of_layers(residual, range(k, len(layers)))
    saved = sum(l.activation_bytes_per_sample for l in layers[k:])
    assert cost.activation_bytes == saved - layers[k].input_activation_bytes_per_sample
    assert cost.boundary_bytes == layers[k - 1].cut_bytes_per_sample
    assert layers[k].input_activation_bytes_per_sample <= layers[k - 1].cut_bytes_per_sample


def test_the_loss_is_held_once_on_the_last_stage_only(residual):
    """The model outputs and the loss's temporaries (LOSS_TEMPORARY_BYTES per output element) are
    priced on the stage returning them, once whatever the micro-batches in flight."""
    from planner.devices.cost_model import LOSS_TEMPORARY_BYTES

    n = len(residual.layers)
    first, last = StageCost.of_layers(residual, range(0, 2)), StageCost.of_layers(residual, range(2, n))
    assert first.loss_bytes == 0
    elements = 8 * 32
    assert last.loss_bytes == elements * (4 + LOSS_TEMPORARY_BYTES["fp32"])
    assert StageCost.of_layers(residual, range(2, n), "bf16").loss_bytes == elements * (2 + LOSS_TEMPORARY_BYTES["bf16"])
    one, three = stage_memory(last, 1), stage_memory(last, 3)
    assert three.total(5) - one.total(5) == 5 * 2 * (last.activation_bytes + last.boundary_bytes)
    assert one.total(5) == one.static_terms() + 5 * (last.activation_bytes + last.boundary_bytes
                                                     + max(last.loss_bytes, last.max_layer_backward_bytes))


def test_a_split_stage_holds_what_its_groups_leave_whole_whole():
    """A tensor-parallel worker holds its unit share of the activations the shard groups divide and
    the rest (norms, residual stream, boundary buffers) whole: not its shard of everything."""
    from planner.devices.memory import activation_shard

    cost = StageCost(1.0, 2.0, 400.0, 1600.0, activation_bytes=100.0, boundary_bytes=20.0, layer_output_bytes=(),
                     loss_bytes=30.0, sharded_activation_bytes=60.0, sharded_loss_bytes=30.0)
    whole = 2 * (100.0 + 20.0) + 30.0
    a = activation_shard(cost, 2, unit_share=0.25)
    assert a == pytest.approx(1 - (2 * 60.0 + 30.0) / whole * 0.75)
    m = stage_memory(cost, 2, shard=0.25, unit_share=0.25)
    assert m.weight_fraction == 0.25 and m.activation_fraction == a
    assert m.total(4) == pytest.approx(0.25 * 1600.0 + a * 4 * whole)
    # nothing divided recorded, or no unit share given: the shard fraction, as before
    assert activation_shard(dataclasses.replace(cost, sharded_activation_bytes=0.0, sharded_loss_bytes=0.0), 2, 0.25,
                            shard=0.4) == 0.4
    assert stage_memory(cost, 2, shard=0.25).activation_fraction == 0.25


def test_split_groups_record_the_activations_they_divide():
    """capture records per shard group the saved bytes it divides: less than the TaskGraph's (the
    norms, the residual stream and the column projections' inputs stay whole), more than none."""
    w = hf_llama.build(n_layer=2, hidden_size=32, seq_len=16, batch_size=2)
    graphs = with_autocast(wl.capture(w.model, w.example_args))
    split = next(tg for tg in graphs.graphs if tg.shard_groups)
    blocks = [g for g in split.shard_groups if g.kind != "lone"]
    assert blocks and all(g.activation_bytes_per_sample > 0 for g in blocks)
    assert all(0 < g.autocast_activation_bytes_per_sample < g.activation_bytes_per_sample for g in blocks)
    assert sum(g.activation_bytes_per_sample for g in blocks) < split.activation_bytes_per_sample
    cost = StageCost.of_layers(graphs, list(split.layers))
    assert 0 < cost.sharded_activation_bytes < cost.activation_bytes and cost.sharded_loss_bytes == cost.loss_bytes > 0


def test_recompute_per_layer_keeps_layer_inputs_and_one_layers_activations():
    """Activation checkpointing per layer (runtime.training.recompute): per micro-batch in flight the
    boundary buffers and the layers' inputs, once the largest layer's activations; the whole stage at
    once only where that holds less; ``total`` and ``max_samples`` stay exact inverses."""
    graphs = bert_large([replicate(2), replicate(2)])
    # 12 blocks, the terms while the micro-batches run (the update's temporaries come after them)
    cost = dataclasses.replace(StageCost.of_layers(graphs, list(range(1, 13))), optimizer="")
    cut, block = graphs.layers[1].cut_bytes_per_sample, graphs.layers[1].activation_bytes_per_sample
    assert cost.layer_input_bytes == 11 * cut and cost.max_layer_activation_bytes == block
    for in_flight in (1, 2, 8):
        layer = stage_memory(cost, in_flight, recompute="layer")
        assert layer.activation_bytes_per_sample == cost.boundary_bytes + cost.layer_input_bytes
        assert layer.transient_bytes_per_sample == cost.max_layer_activation_bytes
        # one micro-batch in flight (data parallelism) saves all but one block's activations too
        plain = stage_memory(cost, in_flight)
        assert plain.total(4) - layer.total(4) == pytest.approx(
            4 * (in_flight * (cost.activation_bytes - cost.layer_input_bytes) - block), rel=1e-12)
        for capacity in (layer.static() * 1.01, layer.static() * 3, 1e13):
            n = layer.max_samples(capacity)
            assert layer.total(n) <= capacity < layer.total(n + 1)
    # per layer until the layer inputs of every micro-batch in flight outweigh one micro-batch's activations
    flip = next(k for k in range(1, 1000) if recompute_unit(cost, k) == "stage")
    assert flip == math.floor((cost.activation_bytes - block) / cost.layer_input_bytes) + 1
    assert stage_memory(cost, flip, recompute=True) == stage_memory(cost, flip, recompute="stage")
    assert stage_memory(cost, flip - 1, recompute=True) == stage_memory(cost, flip - 1, recompute="layer")
    # a stage priced by hand, without layer figures, is one layer: both units agree
    hand = StageCost(1e9, 2e9, 1e8, 4e8, activation_bytes=3e6, boundary_bytes=2e5, layer_output_bytes=(1e5,))
    assert recompute_unit(hand, 16) == "layer"
    assert stage_memory(hand, 16, recompute="layer") == stage_memory(hand, 16, recompute="stage")


def test_the_update_temporaries_come_after_the_backward():
    """The optimizer update's temporaries (``UPDATE_COPIES``): with AdamW, parameter by parameter (torch's
    default on CPU) twice the largest parameter, with the foreach kernels (its default on CUDA) all the
    parameters' bytes once; none with SGD. They come after the backward has freed the activations, so the
    peak is the static terms plus the larger of the two, each at the worker's fraction; ``max_samples``
    stays ``total``'s inverse, and a device that cannot hold the update holds no sample."""
    from planner.devices.memory import UPDATE_COPIES

    graphs = bert_large([replicate()])
    cost = StageCost.of_layers(graphs, range(5))
    assert cost.optimizer == "adamw" and UPDATE_COPIES["adamw"] == (2, 1)
    assert update_bytes(cost) == 2 * cost.max_param_bytes and update_bytes(cost, foreach=True) == cost.param_bytes
    assert update_bytes(dataclasses.replace(cost, optimizer="sgd_momentum"), foreach=True) == 0.0
    for f, foreach in ((1.0, False), (0.25, True)):
        m = stage_memory(cost, 1, f, foreach=foreach)
        after = f * update_bytes(cost, foreach)
        assert m.term_bytes(0)["update"] == after
        assert m.total(0) == m.static() == pytest.approx(f * cost.static_bytes + after, rel=1e-12)
        n = next(k for k in range(1, 10**6) if m.activations(k) > after)   # the activations outgrow the update
        assert m.total(n) == pytest.approx(m.static_terms() + m.activations(n), rel=1e-12)
        assert m.total(n - 1) == pytest.approx(m.static_terms() + after, rel=1e-12)
        for capacity in np.linspace(m.static(), m.static() + 2 * m.activations(n), 23):
            k = m.max_samples(capacity)
            assert m.total(k) <= capacity * (1 + FIT_TOLERANCE) and capacity < m.total(k + 1), (capacity, k)
        assert m.max_samples(m.static() * (1 - 1e-6)) == -1
    # the devices that step at once: real GPUs; an emulated device runs on CPU, one parameter at a time
    from whalelike.cluster import Device

    gpu = Device("a0", "A100-SXM4-40GB", "h0", peak_tflops=19.5, memory_gib=40)
    assert runs_foreach(gpu)
    assert not runs_foreach(dataclasses.replace(gpu, emulated_speed=1.0))
    assert not runs_foreach(dataclasses.replace(gpu, kind="emu"))
    assert not any(runs_foreach(d) for d in Cluster.load("examples/clusters/emulated-mixed-bf16.yaml").devices)


def test_the_planner_and_the_runtime_agree_on_the_ddp_join():
    from runtime.replicas.ddp_sync import JOIN_BYTES

    assert DDP_JOIN_BYTES == JOIN_BYTES


class _Blocks(torch.nn.Module):
    """Two blocks ``x + W2 tanh(W1 x)`` of width ``d`` and hidden width ``h``, one region."""

    def __init__(self, d: int = 16, h: int = 64):
        super().__init__()
        with replicate():
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Tanh(),
                                                                  torch.nn.Linear(h, d)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_layer_s_backward_temporaries_are_measured_per_sample_and_priced_once():
    """Capture records what each layer's backward holds above its start (its gradient temporaries)
    per sample: the same at any example batch, growing with the hidden width (what the batch's
    tensors hold), never the weights' gradients (a width-``h`` block's backward holds about two
    hidden-wide gradients, 2 x 4h bytes a sample, however large its weights); the memory model holds
    it once, beside the activations, or the loss's bytes on the stage computing it, the larger."""
    def temporaries(h: int, batch: int) -> list[float]:
        torch.manual_seed(0)
        graphs = wl.capture(_Blocks(h=h), (torch.randn(batch, 16),))
        return [layer.backward_temporary_bytes_per_sample for layer in graphs.layers]

    narrow = temporaries(64, 4)
    assert narrow == temporaries(64, 8) and all(t > 0 for t in narrow)
    wide = temporaries(256, 4)
    assert [w / n for w, n in zip(wide, narrow)] == pytest.approx([256 / 64] * 2, rel=0.15)
    assert max(wide) <= 3 * 4 * 256      # no weight-sized gradient (256 x 16 floats = 16 KiB) among them
    torch.manual_seed(0)
    graphs = wl.capture(_Blocks(h=256), (torch.randn(4, 16),))
    cost = StageCost.of_layers(graphs, range(len(graphs.layers)))
    assert cost.max_layer_backward_bytes == max(wide)
    terms = stage_memory(cost, 2)
    assert terms.transient_bytes_per_sample == max(cost.loss_bytes, cost.max_layer_backward_bytes)
    with_loss = dataclasses.replace(cost, loss_bytes=10 * cost.max_layer_backward_bytes)
    assert stage_memory(with_loss, 2).transient_bytes_per_sample == with_loss.loss_bytes



class _BlockPeaks(LiveBytes):
    """A storage counter that leaves out tensors of a parameter's shape (or its transpose: the weights'
    gradients and their casts, which the memory model prices with the weights, not per sample) and
    records, for the block whose backward runs (``block``, set by a hook), its highest count."""

    def __init__(self, model: torch.nn.Module):
        self.weight_shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
        self.block, self.starts, self.peaks = None, {}, {}
        super().__init__()

    def track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) not in self.weight_shapes:
            super().track(tensor)

    def began(self, index: int):
        """A backward pre-hook: block ``index``'s backward begins."""
        def hook(module, grad_output):
            self.block, self.starts[index], self.peaks[index] = index, self.current, self.current
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.block is not None:
            self.peaks[self.block] = max(self.peaks[self.block], self.current)
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_block_s_backward_temporaries_are_those_of_a_real_backward(precision):
    """What capture records as each Llama block's backward temporaries (per sample, above what the
    block's backward starts with) is what a real backward of the ``transformers`` model holds above
    the moment the block's backward begins (its module's backward pre-hook), counted by a storage
    counter, at float32 and under bf16 autocast. Capture runs on fake tensors at another batch; the
    batch sizes keep every activation's shape apart from the weights'."""
    workload = hf_llama.build(seq_len=32, n_layer=2, batch_size=3)
    graphs = wl.capture(workload.model, workload.example_args)
    if precision == "bf16":
        graphs = with_autocast(graphs)
    captured = [layer.autocast["backward_temporary"] if precision == "bf16" else layer.backward_temporary_bytes_per_sample
                for layer in graphs.layers if layer.name.startswith("model.layers.")]

    model, batch = workload.model, 6
    (ids,), targets = workload.make_batch(batch, torch.Generator().manual_seed(0))
    counter = _BlockPeaks(model)
    hooks = [block.register_full_backward_pre_hook(counter.began(i)) for i, block in enumerate(model.model.layers)]
    try:
        with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            workload.loss_fn(model(ids), targets).backward()
    finally:
        for hook in hooks:
            hook.remove()
    real = [(counter.peaks[i] - counter.starts[i]) / batch for i in range(len(model.model.layers))]
    assert real == pytest.approx(captured, rel=0.02), (real, captured)


def test_the_cpu_meter_does_not_count_fake_tensors():
    """Fake tensors (shape propagation while an executor is built inside a step) report a CPU device and
    a storage size but hold no memory: the counter leaves them out, made inside a ``FakeTensorMode``
    or computed from fake inputs, and counts the real tensors beside them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with LiveBytes() as live:
        with FakeTensorMode():
            fake = torch.empty(1000, 1000)
            fake = fake + 1
        doubled = fake * 2   # an operator on fake tensors outside the mode
        real = torch.empty(256)
    assert live.peak == real.untyped_storage().nbytes() == 1024, live.peak
    assert doubled.shape == (1000, 1000)


def test_a_recomputing_stage_holds_the_loss_or_its_recomputed_layer_not_both():
    """Per sample, beside what a stage keeps per micro-batch in flight (its boundary and layer inputs under
    recompute): without recompute every activation is alive when the loss runs, so the loss's bytes (or
    a layer's backward temporaries, the larger) add to them; a recomputing stage holds no layer's
    activations when the loss runs and recomputes a layer only after the loss's tensors are freed, so it
    holds the larger of the loss's and of the recomputed layer with its backward's temporaries. A split
    stage's worker holds its unit share of what the recomputed layer's own groups divide (not of the
    whole stage's divided bytes) and of a class-sharded head's loss, the rest whole. Measured on
    bench/memory.py's tensor-parallel Llama stage: at its peak no logits or loss tensor is alive."""
    cost = StageCost(1.0, 2.0, 4.0, 12.0, activation_bytes=600.0, boundary_bytes=20.0, layer_output_bytes=(),
                     loss_bytes=300.0, layer_input_bytes=40.0, max_layer_activation_bytes=200.0,
                     max_layer_backward_bytes=50.0)
    kept = 20.0 + 40.0
    assert stage_memory(cost, 2).activations(1) == 2 * (600.0 + 20.0) + 300.0            # all alive, then the loss
    assert stage_memory(cost, 2, recompute="layer").activations(1) == 2 * kept + 300.0    # the loss is the larger
    lighter = dataclasses.replace(cost, loss_bytes=100.0)
    assert stage_memory(lighter, 2, recompute="layer").activations(1) == 2 * kept + 200.0 + 50.0
    # split in halves: the stage's groups divide 400 B, the recomputed layer's own groups 120 of its 200, the head
    # its loss
    split = dataclasses.replace(lighter, sharded_activation_bytes=400.0, max_layer_sharded_activation_bytes=120.0,
                                sharded_loss_bytes=100.0)
    mine = stage_memory(split, 2, recompute="layer", unit_share=0.5).activations(1)
    assert mine == pytest.approx(2 * kept + max(100.0 - 50.0, 200.0 - 60.0 + 50.0))
    # a stage priced by hand without its layer's part divides the stage's groups' bytes, at most the layer's
    hand = dataclasses.replace(split, max_layer_sharded_activation_bytes=None)
    assert stage_memory(hand, 2, recompute="layer", unit_share=0.5).activations(1) == \
        pytest.approx(2 * kept + 200.0 - 100.0 + 50.0)
