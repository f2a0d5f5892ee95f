"""Planner time (issue 21, item 8): the work ``planner.plan`` and a re-plan do, counted, and what it
may not change.

Counted, not timed (the same on every machine): the simulations one ``planner.plan`` runs (two
placement rules that deal the same devices are planned once; a naive plan that equals the aware one
in everything the simulator reads takes the aware plan's prediction), and a plan's validation
checking lists of numbers in one pass while still naming the first bad entry. Predictions: a
pipeline boundary's sends leave when the action ends, as the runtime posts them, so re-planning a
two-stage pipeline from measured speeds predicts what planning from scratch predicts (the mapping
it keeps puts the slowed device's rows elsewhere in the micro-batch, which no longer costs a planned
slot). Each against the figure computed the plain way: one simulation of the naive plan, one of the
re-planned plan on the measured cluster.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import planner
import planner.assemble
from planner import PlanError
from planner.balance.replan import measured_cluster, replan
from planner.devices.cost_model import device_tflops
from planner.plan import BoundaryPlan, Worker
from planner.schedule.simulator import simulate
from plans import make_plan
from synthetic import synthetic_cluster, synthetic_model
from whalelike import Config, replicate


@pytest.fixture
def simulations(monkeypatch):
    """Counts the simulations that ``planner.assemble.predict`` runs."""
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return simulate(*args, **kwargs)

    monkeypatch.setattr(planner.assemble, "simulate", counted)
    return count


def test_one_device_kind_is_simulated_once(simulations):
    """One kind: both placement rules deal the same devices and the naive plan is the aware plan,
    so one simulation prices all three; the naive prediction is what simulating it gives."""
    cluster = synthetic_cluster([(8, 100.0, 80)], per_host=4, name="one-kind")
    graphs = synthetic_model(8, (replicate(), replicate()), hidden=256, seq=64, heads=4)
    config = Config(32, 4)
    plan = planner.plan(graphs, cluster, config)
    assert simulations[0] == 1
    naive = planner.naive_plan(graphs, cluster, config)
    assert plan.naive_prediction == naive.prediction
    assert plan.prediction == simulate(plan, record_events=False, network=cluster).prediction


def test_two_device_kinds_simulate_each_plan(simulations, monkeypatch):
    """Two kinds under a pipeline whose first stage holds the embedding: the speed-first rule deals
    other devices than the memory-first one and the naive shares differ from the aware ones, so
    each candidate and the naive plan are simulated (three), as before; the search of the devices per
    stage (planner.candidates.count_search) simulates each layout it tries on top, one per placement
    that deals other devices."""
    import planner.candidates

    cluster = synthetic_cluster([(4, 125.0, 80), (4, 65.0, 40)], per_host=4, name="two-kinds")
    graphs = synthetic_model(8, (replicate(), replicate()), hidden=256, seq=64, heads=4, vocab=5000)
    tried = []
    searched = planner.candidates.best_aware_plan

    def counting_moves(*args, counts=None, **kwargs):
        before = simulations[0]
        out = searched(*args, counts=counts, **kwargs)
        if counts is not None:
            tried.append(simulations[0] - before)
        return out

    monkeypatch.setattr(planner.candidates, "best_aware_plan", counting_moves)
    plan = planner.plan(graphs, cluster, Config(32, 4))
    assert tried and simulations[0] == 3 + sum(tried)
    naive = planner.naive_plan(graphs, cluster, Config(32, 4)).prediction
    assert plan.naive_prediction == naive and naive.step_time_ms > plan.prediction.step_time_ms


@pytest.mark.parametrize("layers, hidden, heads", [(12, 768, 12), (24, 1024, 16)])
def test_a_pipeline_re_plan_predicts_what_planning_from_scratch_predicts(layers, hidden, heads, monkeypatch):
    """bench/replan_speed.py's two-stage pipeline: rank 1 measures half its speed. The re-plan keeps
    rank 1 at data-parallel index 1 (scratch puts it last), so the boundary's slices leave the
    stage in another order; unpaced, as the runtime sends them, both predict the same step."""
    import planner.candidates

    cluster = synthetic_cluster([(4, 125.0, 80), (4, 65.0, 40)], per_host=4, name="mixed-8")
    graphs = synthetic_model(layers + 1, (replicate(), replicate()), hidden=hidden, seq=1024, heads=heads, vocab=50257)
    # the re-plan keeps each stage's devices: the plans compared keep the split by work (no count search)
    monkeypatch.setattr(planner.candidates, "count_search", lambda graphs, cluster, config, aware, counts=None: aware)
    plan = planner.plan(graphs, cluster, Config(128, 16))
    speeds = [device_tflops(cluster.device(w.device)) * 1e12 for w in plan.workers]
    speeds[1] /= 2
    new = replan(plan, graphs, cluster, speeds).plan
    measured = measured_cluster(plan, cluster, speeds)
    scratch = planner.plan(graphs, measured, Config(128, 16))
    assert [w.dp_index for w in new.workers if w.stage == 0] != [w.dp_index for w in scratch.workers if w.stage == 0]
    assert new.prediction.step_time_ms == pytest.approx(scratch.prediction.step_time_ms, rel=1e-9)
    assert new.prediction == simulate(new, record_events=False, network=measured).prediction


def test_boundary_sends_leave_when_the_action_ends():
    """Stage 1's two workers on host B end their backwards at 4 and 5 ms and send 1 MB each to
    stage 0 on host A (1 GB/s): B's outgoing interface carries them in turn, at 4-5 and 5-6, as
    the runtime posts them (no planned slot delays the second), so stage 0's backward starts at 6."""
    def worker(rank, device, host, stage, sizes, dp=0):
        return Worker(rank=rank, device=device, host=host, replica=0, stage=stage, dp_index=dp, tp_index=0,
                      tp_size=1, micro_batch_sizes=list(sizes), forward_ms=[1.0], backward_ms=[1.0])

    plan = make_plan(2, [worker(0, "a0", "A", 0, [2]), worker(1, "b0", "B", 1, [1], dp=0),
                         worker(2, "b1", "B", 1, [1], dp=1)],
                     boundaries=[BoundaryPlan(0, 1, ["x"], 1e6, [])], resharding="send_recv")
    from planner.devices.network import NetworkModel
    network = NetworkModel(100.0, 1.0, 0.0, {w.device: w.host for w in plan.workers})
    result = simulate(plan, network=network)
    sends = sorted((e.start_ms, e.end_ms) for e in result.events if e.kind == "send" and e.stage == 1)
    assert [t for span in sends for t in span] == pytest.approx([4.0, 5.0, 5.0, 6.0])
    assert [e.start_ms for e in result.events if e.kind == "B" and e.stage == 0] == pytest.approx([6.0])
    # the last backward ends at 7; then the step's closing all-reduce of the loss over the three ranks
    from planner.schedule.simulator import STEP_LOSS_BYTES
    closing = network.ring_allreduce_ms(3 * STEP_LOSS_BYTES, [w.device for w in plan.workers])
    assert result.step_time_ms == pytest.approx(7.0 + closing)


def test_validation_checks_lists_in_one_pass_and_still_names_the_bad_entry():
    """A plan's rules accept what they accepted (ints in float lists, numpy floats) and refuse what
    they refused (NaN, a negative time, a bool as a count), naming the entry."""
    cluster = synthetic_cluster([(4, 125.0, 80)], per_host=4, name="four")
    graphs = synthetic_model(4, (replicate(),), hidden=128, seq=16, heads=2)
    plan = planner.plan(graphs, cluster, Config(16, 2))
    worker = plan.workers[2]
    worker.forward_ms[1] = 3                      # an int where a float goes: accepted
    worker.backward_ms[0] = np.float64(worker.backward_ms[0])   # a float subclass: accepted
    plan.validate()
    for field, index, bad, says in (("forward_ms", 1, math.nan, "must be a number"),
                                    ("backward_ms", 0, -1.0, "must be >= 0"),
                                    ("micro_batch_sizes", 1, True, "must be an integer")):
        kept = getattr(worker, field)[index]
        getattr(worker, field)[index] = bad
        with pytest.raises(PlanError, match=rf"plan\.workers\[2\]\.{field}\[{index}\] {says}"):
            plan.validate()
        getattr(worker, field)[index] = kept
    plan.validate()
