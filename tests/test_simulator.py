"""The step simulator against closed-form timings of small hand-built plans."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plans
from planner.schedule.gradient_buckets import fill_buckets, gradient_buckets
from planner.plan import BoundaryPlan, Plan, Prediction, Worker
from planner.schedule.actions import SCHEDULES, SPLIT_SCHEDULES
from planner.schedule.simulator import GradientBucket, simulate
from planner.schedule.deadlock import ScheduleError


def worker(rank, stage, fwd, bwd, *, replica=0, dp=0, tp=0, tp_size=1, allreduce=0.0) -> Worker:
    """A worker whose per-micro-batch forward/backward times are ``fwd``/``bwd`` (lists)."""
    return Worker(rank=rank, device=f"dev{rank}", host="h0", replica=replica, stage=stage, dp_index=dp,
                  tp_index=tp, tp_size=tp_size, micro_batch_sizes=[1] * len(fwd),
                  forward_ms=list(fwd), backward_ms=list(bwd), allreduce_ms=allreduce)


def make_plan(workers, num_micro_batch, schedule="gpipe", transfer_ms=0.0, global_batch_size=None) -> Plan:
    num_stages = 1 + max(w.stage for w in workers)
    return plans.make_plan(
        plans.chain_stages(num_stages, "replicate(1)"), workers, num_micro_batch=num_micro_batch, schedule=schedule,
        boundaries=[BoundaryPlan(s, s + 1, ["x"], 4.0, [transfer_ms] * num_micro_batch) for s in range(num_stages - 1)],
        global_batch_size=global_batch_size or None)


def chain_plan(stage_times, num_micro_batch, schedule="gpipe", transfer_ms=0.0) -> Plan:
    """One worker per stage; ``stage_times[s] = (forward_ms, backward_ms)`` for every micro-batch."""
    workers = [worker(s, s, [f] * num_micro_batch, [b] * num_micro_batch) for s, (f, b) in enumerate(stage_times)]
    return make_plan(workers, num_micro_batch, schedule, transfer_ms)


def compute_events(result, rank):
    return [e for e in result.events if e.rank == rank and e.kind in ("F", "B", "BI", "BW")]


# the schedules that run each backward whole (B); ZB-H1 splits it and has closed forms of its own below
WHOLE = sorted(set(SCHEDULES) - set(SPLIT_SCHEDULES))


def test_single_stage_equal_workers_is_compute_plus_allreduce():
    workers = [worker(r, 0, [1.0] * 4, [2.0] * 4, dp=r, allreduce=5.0) for r in range(3)]
    result = simulate(make_plan(workers, 4))
    assert result.step_time_ms == pytest.approx(4 * 3.0 + 5.0)
    assert result.schedule == "gradient accumulation"
    assert result.bubble_fraction == pytest.approx(0.0)
    for w in result.workers:
        assert (w.compute_ms, w.allreduce_ms, w.idle_ms, w.peak_in_flight) == pytest.approx((12.0, 5.0, 0.0, 1))
    assert [str(e.label) for e in compute_events(result, 0)] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert result.throughput == pytest.approx(12 / 17.0 * 1e3)
    assert result.prediction == Prediction(result.step_time_ms, result.bubble_fraction, result.throughput)


def test_gradient_accumulation_runs_each_workers_own_micro_batches():
    """Poplar: a fast worker takes three micro-batches, a slow one two; the all-reduce waits for both."""
    fast = worker(0, 0, [1.0, 1.0, 0.5], [2.0, 2.0, 1.0], dp=0, allreduce=1.0)
    slow = worker(1, 0, [3.0, 3.0], [4.0, 4.0], dp=1, allreduce=2.0)
    result = simulate(make_plan([fast, slow], 3))
    assert result.step_time_ms == pytest.approx(14.0 + 2.0)
    assert len(compute_events(result, 0)) == 6 and len(compute_events(result, 1)) == 4
    by_rank = {w.rank: w for w in result.workers}
    assert by_rank[0].compute_ms == pytest.approx(7.5)
    assert by_rank[0].idle_ms == pytest.approx(16.0 - 7.5 - 2.0)
    assert by_rank[1].idle_ms == pytest.approx(0.0)
    assert all(e.start_ms == pytest.approx(14.0) for e in result.events if e.kind == "allreduce")


@pytest.mark.parametrize("schedule", WHOLE)
@pytest.mark.parametrize("num_stages,num_micro_batch", [(1, 1), (2, 1), (2, 4), (4, 4), (4, 8), (3, 16)])
def test_equal_stages_without_comm_take_m_plus_s_minus_1_slots(schedule, num_stages, num_micro_batch):
    f, b = 1.0, 2.0
    result = simulate(chain_plan([(f, b)] * num_stages, num_micro_batch, schedule))
    assert result.step_time_ms == pytest.approx((num_micro_batch + num_stages - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx((num_stages - 1) / (num_micro_batch + num_stages - 1))


@pytest.mark.parametrize("num_stages,num_micro_batch", [(2, 2), (2, 4), (3, 3), (4, 4), (4, 8), (3, 16), (6, 12)])
def test_zb_h1_on_equal_stages_leaves_a_forward_per_stage_of_bubble(num_stages, num_micro_batch):
    """ZB-H1 with input and weight halves of b/2 each (Qi et al.: bubble (S - 1)(F + B - W)): the step is
    m (f + b) + (S - 1) f where 1F1B's is (m + S - 1)(f + b), so the bubble is at most half of 1F1B's
    (a third as m grows), with every stage holding S micro-batches, 1F1B's first stage's count."""
    f, b = 1.0, 2.0
    zb = simulate(chain_plan([(f, b)] * num_stages, num_micro_batch, "zb-h1"))
    ofob = simulate(chain_plan([(f, b)] * num_stages, num_micro_batch, "1f1b"))
    assert zb.step_time_ms == pytest.approx(num_micro_batch * (f + b) + (num_stages - 1) * f)
    assert zb.bubble_fraction == pytest.approx((num_stages - 1) * f / zb.step_time_ms)
    assert zb.bubble_fraction <= ofob.bubble_fraction / 2
    assert [w.peak_in_flight for w in zb.workers] == [num_stages] * num_stages
    kinds = sorted((e.kind, e.micro_batch) for e in compute_events(zb, 1))
    assert kinds == sorted((k, m) for k in ("F", "BI", "BW") for m in range(num_micro_batch))


def test_zb_h1_on_an_unequal_pipeline_cuts_the_schedules_bubble_to_a_third():
    """Four stages 0.9x-1.2x apart, as whole layers leave a balanced split on unequal devices: the
    slowest stage's work (m times its forward and backward) bounds every schedule; past it, 1F1B
    loses 7.8 ms to fill and drain, 1F1B with delayed weight gradients 3.7, ZB-H1 2.6 (a third)."""
    times, m = [(1.0, 2.0), (1.2, 2.4), (0.9, 1.8), (1.1, 2.2)], 8
    slowest = m * max(f + b for f, b in times)
    ofob = simulate(chain_plan(times, m, "1f1b"))
    delayed = simulate(dataclasses.replace(chain_plan(times, m, "1f1b"), delay_weight_gradients=True))
    eager = simulate(chain_plan(times, m, "eager-1f1b"))
    zb = simulate(chain_plan(times, m, "zb-h1"))
    assert ofob.step_time_ms - slowest == pytest.approx(7.8)
    assert delayed.step_time_ms - slowest == pytest.approx(3.7)
    assert eager.step_time_ms - slowest == pytest.approx(ofob.step_time_ms - slowest - 0.9)
    assert zb.step_time_ms - slowest == pytest.approx(2.6)
    assert zb.bubble_fraction < delayed.bubble_fraction < ofob.bubble_fraction
    assert zb.bubble_fraction == pytest.approx(1 - sum(m * (f + b) for f, b in times) / (4 * zb.step_time_ms))
    # the same memory bound as 1F1B's largest in-flight count, on every stage
    assert max(w.peak_in_flight for w in zb.workers) == max(w.peak_in_flight for w in ofob.workers) == 4


def test_1f1b_holds_fewer_micro_batches_than_gpipe_at_the_same_step_time():
    stages, m = 4, 8
    gpipe = simulate(chain_plan([(1.0, 2.0)] * stages, m, "gpipe"))
    ofob = simulate(chain_plan([(1.0, 2.0)] * stages, m, "1f1b"))
    assert ofob.step_time_ms == pytest.approx(gpipe.step_time_ms)
    assert [w.peak_in_flight for w in gpipe.workers] == [m] * stages
    assert [w.peak_in_flight for w in ofob.workers] == [stages - s for s in range(stages)]


def test_eager_1f1b_hides_transfers_that_1f1b_exposes():
    stages, m, c = 4, 8, 0.5
    ofob = simulate(chain_plan([(1.0, 2.0)] * stages, m, "1f1b", transfer_ms=c))
    eager = simulate(chain_plan([(1.0, 2.0)] * stages, m, "eager-1f1b", transfer_ms=c))
    # eager: only the fill and the drain pay the transfers, once per boundary and direction
    assert eager.step_time_ms == pytest.approx((m + stages - 1) * 3.0 + 2 * (stages - 1) * c)
    assert ofob.step_time_ms > eager.step_time_ms
    assert [w.peak_in_flight for w in eager.workers] == [min(2 * (stages - s) - 1, m) for s in range(stages)]


@pytest.mark.parametrize("schedule", WHOLE)
def test_the_slowest_stage_bounds_the_step(schedule):
    """Stage 1 is three times slower. Once fed it computes back to back, idle only while stage 0
    fills (one forward) and drains (one backward) the pipeline; GPipe also idles it between its
    last forward and first backward, while stage 2 turns the last micro-batch around."""
    times = [(1.0, 2.0), (3.0, 6.0), (1.0, 2.0)]
    m = 6
    result = simulate(chain_plan(times, m, schedule))
    slowest = 3.0 + 6.0
    idle = sum(times[0]) + (sum(times[2]) if schedule == "gpipe" else 0.0)
    assert result.step_time_ms == pytest.approx(m * slowest + idle)
    assert {w.stage: w.idle_ms for w in result.workers}[1] == pytest.approx(idle)


def test_one_micro_batch_pays_each_transfer_once_per_direction():
    c = 0.25
    result = simulate(chain_plan([(1.0, 2.0), (3.0, 4.0)], 1, "1f1b", transfer_ms=c))
    assert result.step_time_ms == pytest.approx(1.0 + c + 3.0 + 4.0 + c + 2.0)
    sends = [e for e in result.events if e.kind == "send"]
    assert [(e.rank, e.peer_stage, e.start_ms, e.end_ms) for e in sends] == [
        (0, 1, 1.0, 1.0 + c), (1, 0, 1.0 + c + 7.0, 1.0 + 2 * c + 7.0)]


def test_sends_of_one_worker_share_its_link():
    """Transfers slower than the forward queue up: stage 1 is fed every ``c`` ms, not every ``f``."""
    f, c, m = 1.0, 3.0, 3
    result = simulate(chain_plan([(f, 1.0), (f, 1.0)], m, "gpipe", transfer_ms=c))
    starts = [e.start_ms for e in compute_events(result, 1) if e.kind == "F"]
    assert starts == pytest.approx([f + c, f + 2 * c, f + 3 * c])


def test_tensor_parallel_group_moves_in_lockstep():
    fast = worker(0, 0, [1.0, 1.0], [1.0, 1.0], tp=0, tp_size=2)
    slow = worker(1, 0, [3.0, 3.0], [3.0, 3.0], tp=1, tp_size=2)
    result = simulate(make_plan([fast, slow], 2))
    assert result.step_time_ms == pytest.approx(12.0)
    assert [e.start_ms for e in compute_events(result, 0)] == pytest.approx([0.0, 3.0, 6.0, 9.0])
    by_rank = {w.rank: w for w in result.workers}
    assert (by_rank[0].compute_ms, by_rank[0].idle_ms) == pytest.approx((4.0, 8.0))
    assert by_rank[1].idle_ms == pytest.approx(0.0)


def test_next_stage_waits_for_every_group_of_the_previous_stage():
    """Stage 0 has two data-parallel workers, one slow: stage 1's forward waits for the slow one."""
    m = 2
    workers = [
        worker(0, 0, [1.0] * m, [1.0] * m, dp=0),
        worker(1, 0, [2.0] * m, [2.0] * m, dp=1),
        worker(2, 1, [1.0] * m, [1.0] * m),
    ]
    result = simulate(make_plan(workers, m, "gpipe"))
    assert [e.start_ms for e in compute_events(result, 2) if e.kind == "F"] == pytest.approx([2.0, 4.0])
    # backward of stage 0 waits for stage 1's gradients: 1F1B-free GPipe, stage 1 ends B1 at 8
    assert result.step_time_ms == pytest.approx(8.0 + 2.0)


def test_skip_connection_transfer_is_waited_for():
    """A U-shaped model: stage 2 also needs stage 0's output over a slow skip boundary (5 ms)."""
    plan = chain_plan([(1.0, 1.0)] * 3, 1, "1f1b", transfer_ms=0.0)
    plan.boundaries.append(BoundaryPlan(0, 2, ["skip"], 4.0, [5.0]))
    result = simulate(plan)
    f2 = next(e for e in compute_events(result, 2) if e.kind == "F")
    assert f2.start_ms == pytest.approx(1.0 + 5.0)
    # the gradient goes back over the skip boundary too: stage 0's backward waits for it. Stage 2
    # sends its gradients in ascending peer order, as the runtime posts them (the skip's to stage 0
    # first), on its one link, so stage 1's leaves after the skip's: 6 + 2 + 5, then stage 1's backward
    b0 = next(e for e in compute_events(result, 0) if e.kind == "B")
    assert b0.start_ms == pytest.approx(6.0 + 2.0 + 5.0 + 1.0)
    sends = sorted((e.start_ms, e.peer_stage) for e in result.events if e.kind == "send" and e.rank == 2)
    assert sends == [(pytest.approx(8.0), 0), (pytest.approx(13.0), 1)]


def test_data_parallel_allreduce_spans_replicas_and_waits_for_the_slowest():
    m = 2
    workers = [
        worker(0, 0, [1.0] * m, [1.0] * m, replica=0, allreduce=1.0),
        worker(1, 1, [1.0] * m, [1.0] * m, replica=0, allreduce=1.5),
        worker(2, 0, [2.0] * m, [2.0] * m, replica=1, allreduce=1.0),
        worker(3, 1, [2.0] * m, [2.0] * m, replica=1, allreduce=3.0),
    ]
    result = simulate(make_plan(workers, m, "1f1b"))
    # replica 1 runs (M + S - 1) * (f + b) = 12 ms; stage 1 finishes one backward earlier (at 10)
    reduces = {e.rank: (e.start_ms, e.end_ms) for e in result.events if e.kind == "allreduce"}
    assert reduces[0] == reduces[2] == pytest.approx((12.0, 13.0))
    assert reduces[1] == reduces[3] == pytest.approx((10.0, 13.0))
    assert result.step_time_ms == pytest.approx(13.0)


def test_every_action_appears_once_per_worker():
    m = 5
    plan = chain_plan([(1.0, 2.0)] * 3, m, "1f1b", transfer_ms=0.1)
    result = simulate(plan)
    for w in plan.workers:
        kinds = sorted((e.kind, e.micro_batch) for e in compute_events(result, w.rank))
        assert kinds == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
    assert sum(e.kind == "send" for e in result.events) == 2 * 2 * m
    assert all(e.end_ms >= e.start_ms >= 0 for e in result.events)


def test_summary_is_an_aligned_table():
    text = simulate(chain_plan([(1.0, 2.0)] * 2, 4, "1f1b")).summary()
    lines = text.splitlines()
    assert "15.00 ms" in lines[0] and "bubble 20.0%" in lines[0]
    assert lines[1].split()[:4] == ["rank", "device", "replica", "stage"]
    assert len(lines) == 3 + 2
    assert len({len(line) for line in lines[2:]}) == 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: setattr(p, "schedule", "zigzag"), "plan.schedule: unknown schedule 'zigzag'"),
        (lambda p: p.boundaries.clear(), "plan.boundaries: stage 0 feeds no stage; add a boundary with src_stage=0"),
        (lambda p: setattr(p.workers[1], "forward_ms", [1.0]), "plan.workers[1]: forward_ms and backward_ms"),
        (lambda p: setattr(p.boundaries[0], "transfer_ms", [0.0]), "plan.boundaries[0].transfer_ms has 1 entries"),
        (lambda p: p.boundaries.append(p.boundaries[0]), "plan.boundaries[1]: a second boundary 0 -> 1"),
        (lambda p: setattr(p.workers[1], "stage", 2), "plan.workers[1].stage is 2, the plan has stages 0..1"),
        (lambda p: setattr(p.workers[1], "replica", 1), "plan.workers: no worker runs stage 1 in replica 0"),
    ],
)
def test_inconsistent_plans_are_rejected_by_name(edit, message):
    plan = chain_plan([(1.0, 2.0)] * 2, 3, "1f1b")
    edit(plan)
    with pytest.raises(ScheduleError, match=message.replace("[", r"\[").replace("]", r"\]")):
        simulate(plan)


def test_a_stage_fed_by_no_boundary_is_rejected():
    plan = chain_plan([(1.0, 1.0)] * 3, 2)
    plan.boundaries[0] = BoundaryPlan(0, 2, ["skip"], 4.0, [0.0, 0.0])
    with pytest.raises(ScheduleError, match="stage 1 receives from no stage; add a boundary with dst_stage=1"):
        simulate(plan)


def test_tensor_parallel_peers_with_different_micro_batch_counts_are_rejected():
    plan = make_plan([worker(0, 0, [1.0] * 3, [1.0] * 3, tp=0, tp_size=2),
                      worker(1, 0, [1.0] * 2, [1.0] * 2, tp=1, tp_size=2)], 3)
    with pytest.raises(ScheduleError, match=r"plan.workers \[0, 1\] \(replica 0, stage 0, dp_index 0\) form a "
                                            r"tensor-parallel group but have \[3, 2\] micro-batches"):
        simulate(plan)


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(sorted(SCHEDULES)),
    num_micro_batch=st.integers(1, 8),
    times=st.lists(st.tuples(st.floats(0.1, 5.0), st.floats(0.1, 5.0)), min_size=1, max_size=5),
    transfer=st.floats(0.0, 2.0),
)
def test_time_accounting_adds_up(schedule, num_micro_batch, times, transfer):
    result = simulate(chain_plan(times, num_micro_batch, schedule, transfer_ms=transfer))
    slowest = max(f + b for f, b in times)
    assert result.step_time_ms >= num_micro_batch * slowest - 1e-9
    if schedule in SPLIT_SCHEDULES:   # micro-batch 0's forwards, input halves (none on stage 0), stage 0's weights
        assert result.step_time_ms >= sum(f + b / 2 for f, b in times[1:]) + sum(times[0]) - 1e-9
    else:
        assert result.step_time_ms >= sum(f + b for f, b in times) - 1e-9
    for w in result.workers:
        assert w.busy_ms + w.idle_ms == pytest.approx(result.step_time_ms)
    assert 0.0 <= result.bubble_fraction < 1.0


# -- overlap of the gradient all-reduce with backward (DDP buckets) ------------------------------------
def overlap_plan(backward=(4.0,), slow_backward=None, allreduce=3.0):
    """Data parallel on two workers: forward 1 ms, backward ``backward`` per micro-batch; the second
    worker's backward is ``slow_backward`` when given."""
    fast = worker(0, 0, [1.0] * len(backward), list(backward), dp=0, allreduce=allreduce)
    slow = worker(1, 0, [1.0] * len(backward), list(slow_backward or backward), dp=1, allreduce=allreduce)
    return make_plan([fast, slow], len(backward))


def allreduce_spans(result, rank):
    return [(e.start_ms, e.end_ms) for e in result.events if e.kind == "allreduce" and e.rank == rank]


def test_bucket_allreduces_overlap_the_backward_and_the_step_ends_with_the_last():
    """Backward [1, 5]: buckets ready at 2, 3 and 5 run back to back as they become ready."""
    buckets = {(0, 0): [GradientBucket(0.25, 1.0), GradientBucket(0.5, 1.0), GradientBucket(1.0, 1.0)]}
    plain, overlapped = simulate(overlap_plan()), simulate(overlap_plan(), buckets=buckets)
    assert plain.step_time_ms == pytest.approx(1.0 + 4.0 + 3.0)
    assert overlapped.step_time_ms == pytest.approx(6.0)
    assert allreduce_spans(overlapped, 0) == [(2.0, 3.0), (3.0, 4.0), (5.0, 6.0)]   # exact in binary
    for w in overlapped.workers:
        assert (w.allreduce_ms, w.hidden_allreduce_ms, w.idle_ms) == pytest.approx((1.0, 2.0, 0.0))
        assert w.busy_ms + w.idle_ms == pytest.approx(overlapped.step_time_ms)


def test_buckets_ready_at_once_run_one_after_another():
    """One process group all-reduces the buckets in order: three 2 ms buckets ready when the
    backward starts (at 1) end at 7, 2 ms after the backward."""
    buckets = {(0, 0): [GradientBucket(0.0, 2.0)] * 3}
    result = simulate(overlap_plan(), buckets=buckets)
    assert [s for s, _ in allreduce_spans(result, 1)] == pytest.approx([1.0, 3.0, 5.0])
    assert result.step_time_ms == pytest.approx(7.0)
    assert [w.allreduce_ms for w in result.workers] == pytest.approx([2.0, 2.0])


def test_a_bucket_waits_for_the_slowest_peer_to_reach_its_layers():
    """Worker 1's backward runs [1, 9]: the bucket ready at half the backward waits for it (5), not
    for worker 0 (3). Worker 0's compute ended at 5, so both of its all-reduces are exposed and it
    idles 3 ms; worker 1 hides the first under its backward."""
    buckets = {(0, 0): [GradientBucket(0.5, 1.0), GradientBucket(1.0, 1.0)]}
    result = simulate(overlap_plan(slow_backward=(8.0,)), buckets=buckets)
    assert allreduce_spans(result, 0) == [(5.0, 6.0), (9.0, 10.0)]
    fast, slow = result.workers
    assert (fast.allreduce_ms, fast.hidden_allreduce_ms, fast.idle_ms) == pytest.approx((2.0, 0.0, 3.0))
    assert (slow.allreduce_ms, slow.hidden_allreduce_ms, slow.idle_ms) == pytest.approx((1.0, 1.0, 0.0))


def test_under_gradient_accumulation_only_the_last_backward_is_overlapped():
    buckets = {(0, 0): [GradientBucket(0.0, 1.0)]}
    result = simulate(overlap_plan(backward=(4.0, 4.0)), buckets=buckets)
    # F0 B0 F1 B1: the last backward starts at 1 + 4 + 1 = 6
    assert allreduce_spans(result, 0) == [(6.0, 7.0)]
    assert result.step_time_ms == pytest.approx(10.0)


def test_one_bucket_after_the_backward_is_the_plain_allreduce():
    m = 2
    workers = [worker(0, 0, [1.0] * m, [1.0] * m, replica=0, allreduce=1.0),
               worker(1, 1, [1.0] * m, [1.0] * m, replica=0, allreduce=1.5),
               worker(2, 0, [2.0] * m, [2.0] * m, replica=1, allreduce=1.0),
               worker(3, 1, [2.0] * m, [2.0] * m, replica=1, allreduce=3.0)]
    plan = make_plan(workers, m, "1f1b")
    one = {(0, 0): [GradientBucket(1.0, 1.0)], (1, 0): [GradientBucket(1.0, 3.0)]}
    plain, bucketed = simulate(plan), simulate(plan, buckets=one)
    assert bucketed.step_time_ms == pytest.approx(plain.step_time_ms)
    assert bucketed.workers == plain.workers
    assert sorted(bucketed.events) == sorted(plain.events)


@pytest.mark.parametrize("buckets, message", [
    ({(3, 0): []}, r"buckets: no data-parallel group \(stage, tp_index\) = \(3, 0\) in the plan; groups: \[\(0, 0\)\]"),
    ({(0, 0): [GradientBucket(1.5, 1.0)]}, r"buckets\[\(0, 0\)\]\[0\].ready_fraction must be in \[0, 1\] .* got 1.5"),
    ({(0, 0): [GradientBucket(0.5, 1.0), GradientBucket(1.0, float("nan"))]},
     r"buckets\[\(0, 0\)\]\[1\].allreduce_ms must be a finite number >= 0, got nan"),
])
def test_bad_buckets_are_rejected_by_name(buckets, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(overlap_plan(), buckets=buckets)


def test_fill_buckets_follows_ddp_caps_and_keeps_every_byte():
    mib = 2**20
    layers = [(0.25, 3 * mib), (0.5, 30 * mib), (1.0, 10 * mib)]   # (ready fraction, bytes), in ready order
    buckets = fill_buckets(layers, first_bucket_bytes=mib, bucket_bytes=25 * mib)
    assert buckets == [(mib, 0.25), (25 * mib, 0.5), (17 * mib, 1.0)]
    assert sum(b for b, _ in buckets) == 43 * mib


def test_gradient_buckets_of_a_planned_model_carry_its_gradients_and_shorten_the_step():
    """Data parallel over two hosts of a synthetic cluster: the buckets carry every gradient byte,
    in reverse layer order, each priced as a ring all-reduce by planner.devices.network; overlapping them
    with the backward makes the step shorter than all-reducing after it, and no shorter than the
    compute or the all-reduces alone."""
    from planner import plan as make
    from planner.devices.cost_model import StageCost
    from planner.devices.network import NetworkModel
    from synthetic import synthetic_cluster, synthetic_model
    from whalelike import Config, replicate

    cluster = synthetic_cluster([(2, 10.0, 32.0), (2, 5.0, 32.0)], per_host=2)
    graphs = synthetic_model(num_layers=6, strategies=[replicate(4)], vocab=1000)
    planned = make(graphs, cluster, Config(global_batch_size=16, num_micro_batch=1))
    buckets = gradient_buckets(planned, graphs, cluster)
    assert list(buckets) == [(0, 0)]
    own = buckets[0, 0]
    assert sum(b.nbytes for b in own) == pytest.approx(StageCost.of_layers(graphs, range(6)).param_bytes)
    assert [b.ready_fraction for b in own] == sorted(b.ready_fraction for b in own) and own[-1].ready_fraction == 1.0
    devices = [w.device for w in planned.workers]
    network = NetworkModel.of_cluster(cluster)
    assert [b.allreduce_ms for b in own] == pytest.approx([network.ring_allreduce_ms(b.nbytes, devices) for b in own])
    plain, overlapped = simulate(planned), simulate(planned, buckets=buckets)
    assert overlapped.step_time_ms < plain.step_time_ms
    assert overlapped.step_time_ms >= max(w.compute_ms for w in planned.workers)
    assert overlapped.step_time_ms >= sum(b.allreduce_ms for b in own)


def test_gradient_buckets_of_a_split_stage_carry_each_shard():
    """replicate(2) of split(2): each tensor-parallel index all-reduces its own shard of the gradients
    with its data-parallel peer in the other replica."""
    from planner import plan as make
    from planner.devices.cost_model import StageCost
    from synthetic import synthetic_cluster, synthetic_model
    from whalelike import Config, split

    cluster = synthetic_cluster([(2, 10.0, 32.0), (2, 5.0, 32.0)], per_host=2)
    graphs = synthetic_model(4, [split(2)], hidden=256, seq=32)
    planned = make(graphs, cluster, Config(global_batch_size=8, num_micro_batch=1))
    buckets = gradient_buckets(planned, graphs, cluster)
    assert sorted(buckets) == [(0, 0), (0, 1)]
    shards = [sum(b.nbytes for b in buckets[0, t]) for t in (0, 1)]
    assert sum(shards) == pytest.approx(StageCost.of_layers(graphs, range(4)).param_bytes)
    assert all(b.allreduce_ms > 0 for t in (0, 1) for b in buckets[0, t])
    assert simulate(planned, buckets=buckets).step_time_ms <= simulate(planned).step_time_ms


def _first_fit(busy: dict, resources: tuple, ready: float, duration: float) -> float:
    """First fit over plain interval lists, one interval per send: what ``_Resources.place_on``
    must place alike although it merges touching intervals."""
    if duration <= 0:
        return ready
    start = ready
    while True:
        clash = [e for r in resources for s, e in busy.setdefault(r, []) if s < start + duration and e > start]
        if not clash:
            break
        start = max(clash)
    for r in resources:
        busy[r].append((start, start + duration))
    return start


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(0, 3), min_size=1, max_size=3), st.integers(0, 20),
                          st.integers(0, 6)), max_size=40))
def test_merged_busy_blocks_place_sends_as_plain_first_fit(sends):
    from planner.schedule.simulator import _Resources

    resources, plain = _Resources(), {}
    for used, ready, duration in sends:
        key = tuple(sorted(used))
        got = resources.place_on(resources.slots(key), float(ready), float(duration))
        assert got == _first_fit(plain, key, float(ready), float(duration)), (sends, key, ready, duration)
