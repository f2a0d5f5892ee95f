"""The simulator on a network (``simulate(plan, network=...)``): boundary transfers are the resharding
the runtime runs, queued on host network interfaces; DDP's buckets overlap the backward; delayed
weight gradients; and the planner's predictions and timing fields agree with it."""
from __future__ import annotations

import pytest

import planner
from planner.assemble import predict
from planner.schedule.boundary_traffic import BACKWARD, FORWARD, plan_traffic
from planner.devices.cost_model import CommModel
from planner.schedule.gradient_buckets import MIB, gradient_buckets, plan_buckets
from planner.devices.network import NetworkModel
from planner.plan import BoundaryPlan, Plan, Worker
from planner.resharding.reshard import boundary_resharding, plan_resharding, unbatched_resharding
from planner.shares.layout import SampleLayout
from planner.resharding.spec import stage_output_spec
from planner.schedule.simulator import STEP_LOSS_BYTES, simulate
from plans import make_plan
from synthetic import synthetic_cluster, synthetic_model
from whalelike import Config, replicate
from whalelike.cluster import Device, Network

MB = 1e6            # bytes: 1 ms on a 1 GB/s link
GBPS = 1.0


def worker(rank, device, host, stage, sizes, *, fwd=1.0, bwd=1.0, dp=0, tp=0, tp_size=1) -> Worker:
    m = len(sizes)
    return Worker(rank=rank, device=device, host=host, replica=0, stage=stage, dp_index=dp, tp_index=tp,
                  tp_size=tp_size, micro_batch_sizes=list(sizes), forward_ms=[fwd] * m, backward_ms=[bwd] * m)


def two_stage_plan(workers, bytes_per_sample=MB, resharding="auto", num_micro_batch=1, **fields) -> Plan:
    return make_plan(2, workers, num_micro_batch=num_micro_batch,
                     boundaries=[BoundaryPlan(0, 1, ["x"], bytes_per_sample, [])], resharding=resharding, **fields)


def network_of(plan: Plan, latency_us=0.0) -> NetworkModel:
    return NetworkModel(100.0, GBPS, latency_us, {w.device: w.host for w in plan.workers})


def starts(result, kind, stage):
    return sorted(e.start_ms for e in result.events if e.kind == kind and e.stage == stage)


def _loss_allreduce(plan, network) -> float:
    """The pipeline step's closing all-reduce of the loss over every rank (planner.schedule.simulator)."""
    ranks = sorted(plan.workers, key=lambda w: w.rank)
    return network.ring_allreduce_ms(STEP_LOSS_BYTES * len(ranks), [w.device for w in ranks])


def test_a_pipeline_step_ends_with_the_losss_all_reduce_over_every_rank():
    plan = two_stage_plan([worker(0, "a0", "A", 0, [2]), worker(1, "b0", "B", 1, [1], dp=0),
                           worker(2, "b1", "B", 1, [1], dp=1)], resharding="send_recv")
    network = network_of(plan)
    closing = _loss_allreduce(plan, network)
    assert closing > 0
    priced = simulate(plan, network=network)
    assert priced.step_time_ms == pytest.approx(max(e.end_ms for e in priced.events) + closing)
    alone = simulate(plan)   # without a network: the plan's timing fields alone, no collective priced
    assert alone.step_time_ms == pytest.approx(max(e.end_ms for e in alone.events))


def test_one_sender_nic_feeding_two_receivers_takes_twice_as_long():
    """Stage 0 on host A sends one 1 MB row to each of two stage-1 devices on host B: the two
    transfers queue on A's outgoing interface, so the second arrives 2 ms after the forward ends.
    Backward: the gradients leave B at 4 and 5, when each backward ends (the runtime posts a
    boundary's sends unpaced, not at the plan's start offsets, which assume every sender ready at
    once), and queue on B's outgoing interface: the second arrives at 6. The plan of the boundary
    predicts the same 2 ms."""
    plan = two_stage_plan([worker(0, "a0", "A", 0, [2]), worker(1, "b0", "B", 1, [1], dp=0),
                           worker(2, "b1", "B", 1, [1], dp=1)], resharding="send_recv")
    network = network_of(plan)
    result = simulate(plan, network=network)
    assert starts(result, "F", 1) == pytest.approx([2.0, 3.0])
    assert starts(result, "B", 1) == pytest.approx([3.0, 4.0])
    assert sorted(s.offset_ms for s in plan_traffic(plan, network)[0, BACKWARD][0].sends) == pytest.approx([0, 1])
    assert starts(result, "B", 0) == pytest.approx([6.0])
    assert result.step_time_ms == pytest.approx(7.0 + _loss_allreduce(plan, network))
    sends = [e for e in result.events if e.kind == "send"]
    assert len(sends) == 4 and all("send_recv" in e.detail for e in sends)
    assert {e.nics for e in sends if e.stage == 0} == {("A out", "B in")}
    (reshard,) = boundary_resharding(plan, network)
    assert reshard.strategy == "send_recv" and reshard.predicted_ms == pytest.approx(2.0)
    assert plan_traffic(plan, network)[0, FORWARD][0].predicted_ms == pytest.approx(reshard.predicted_ms)


@pytest.mark.parametrize("strategy", ["send_recv", "broadcast"])
def test_the_boundary_takes_the_time_of_the_plans_resharding(strategy):
    """A replicated destination on two other hosts (a tensor-parallel group of two): send/recv
    sends the row twice out of host A, a broadcast once (chunked through B to C). The receiving
    stage starts when the resharding's predicted time has passed after the forward."""
    plan = two_stage_plan([worker(0, "a0", "A", 0, [1]), worker(1, "b0", "B", 1, [1], tp=0, tp_size=2),
                           worker(2, "c0", "C", 1, [1], tp=1, tp_size=2)], resharding=strategy)
    network = network_of(plan, latency_us=1.0)
    (reshard,) = boundary_resharding(plan, network)
    result = simulate(plan, network=network)
    assert reshard.strategy == strategy
    assert starts(result, "F", 1) == pytest.approx([1.0 + reshard.predicted_ms] * 2)
    if strategy == "send_recv":
        assert reshard.predicted_ms == pytest.approx(2 * (1.0 + 1e-3))
    else:
        assert 1.0 < reshard.predicted_ms < 1.1
    assert {t.describe() for t in result.reshardings} >= {plan_traffic(plan, network)[0, FORWARD][0].describe()}


def test_a_value_without_a_batch_dimension_crosses_whole_from_the_owner_slot():
    """Stage 0 on two devices of host A, stage 1 on two of host B; the boundary carries only a 1 MB
    statistic of the micro-batch (``BoundaryPlan.unbatched_bytes``, issue 30 item 2). Forward, the
    owner slot (dp 0) sends it whole to both receivers, queued on A's outgoing interface (arrivals
    at 2 and 3 ms); backward, each receiver's 1 MB gradient goes to the owner alone (leaving B when
    each backward ends, at 4 and 5, arriving at 5 and 6), so the owner's backward starts at 6 while
    the other stage-0 worker, which neither sends nor receives it, is not held back."""
    plan = make_plan(2, [worker(0, "a0", "A", 0, [1]), worker(1, "a1", "A", 0, [1], dp=1),
                         worker(2, "b0", "B", 1, [1]), worker(3, "b1", "B", 1, [1], dp=1)],
                     num_micro_batch=1, resharding="send_recv",
                     boundaries=[BoundaryPlan(0, 1, ["statistic"], 0.0, [], unbatched_bytes=MB)])
    network = network_of(plan)
    traffic = plan_traffic(plan, network)
    assert sorted((s.sender, s.receivers, s.nbytes) for s in traffic[0, FORWARD][0].sends) == \
        [("a0", ("b0",), MB), ("a0", ("b1",), MB)]
    assert sorted((s.sender, s.receivers, s.nbytes) for s in traffic[0, BACKWARD][0].sends) == \
        [("b0", ("a0",), MB), ("b1", ("a0",), MB)]
    (whole,) = unbatched_resharding(plan, network)
    assert whole.predicted_ms == pytest.approx(2.0) == traffic[0, FORWARD][0].predicted_ms
    assert boundary_resharding(plan, network) == [None]   # no batched rows
    result = simulate(plan, network=network)
    assert starts(result, "F", 1) == pytest.approx([2.0, 3.0])
    b0 = sorted((e.rank, e.start_ms) for e in result.events if e.kind == "B" and e.stage == 0)
    assert b0 == [(0, pytest.approx(6.0)), (1, pytest.approx(1.0))], b0
    assert result.step_time_ms == pytest.approx(7.0 + _loss_allreduce(plan, network))


def test_delayed_weight_gradients_send_after_the_input_half():
    """Backward 4 ms on stage 1: with delayed weight gradients its gradient leaves after 2 ms, so
    stage 0's backward starts 2 ms sooner; stage 1 stays busy for the whole 4 ms."""
    def plan(delay):
        return two_stage_plan([worker(0, "a0", "A", 0, [1], bwd=4.0), worker(1, "b0", "A", 1, [1], bwd=4.0)],
                              bytes_per_sample=0.0, delay_weight_gradients=delay)
    plain, delayed = simulate(plan(False)), simulate(plan(True))
    # delayed, each backward is two actions (planner.schedule.program): stage 0's input half computes
    # nothing (it receives no gradient-carrying value), so its whole backward is its weight half
    assert starts(plain, "B", 0) == pytest.approx([6.0]) and starts(delayed, "BI", 0) == pytest.approx([4.0])
    assert starts(delayed, "BW", 0) == pytest.approx([4.0]) and not starts(delayed, "B", 0)
    assert plain.step_time_ms == pytest.approx(10.0) and delayed.step_time_ms == pytest.approx(8.0)
    stage1 = [e for e in delayed.events if e.kind in ("B", "BI", "BW") and e.stage == 1]
    assert [(e.kind, e.start_ms, e.end_ms) for e in stage1] == [("BI", 2.0, 4.0), ("BW", 4.0, 6.0)]


def test_ddp_buckets_are_ready_at_their_byte_share_as_the_runtime_models_them():
    """51 MiB of gradients: DDP's buckets of 1, 25 and 25 MiB, ready after 1/51, 26/51 and all of
    the backward (runtime.replicas.ddp_sync._emulate_overlap), each a ring all-reduce."""
    workers = [worker(r, f"a{r}", "AB"[r], 0, [1], dp=r) for r in range(2)]
    for w in workers:
        w.gradient_bytes = 51 * MIB
    plan = make_plan(1, workers)
    network = network_of(plan)
    buckets = plan_buckets(plan, network)[0, 0]
    assert [b.nbytes for b in buckets] == [MIB, 25 * MIB, 25 * MIB]
    assert [b.ready_fraction for b in buckets] == pytest.approx([1 / 51, 26 / 51, 1.0])
    ring = network.ring(["a0", "a1"])
    assert [b.allreduce_ms for b in buckets] == pytest.approx([ring.allreduce_ms(b.nbytes) for b in buckets])
    overlapped = simulate(plan, network=network)
    assert overlapped.step_time_ms == pytest.approx(simulate(plan, buckets={(0, 0): buckets}).step_time_ms)
    assert overlapped.workers[0].hidden_allreduce_ms > 0


def planned_model():
    """Two movable replicate stages over two hosts of unequal devices: uneven batch shares, cut
    differently in the two stages (slices that straddle workers)."""
    cluster = synthetic_cluster([(2, 10.0, 32.0), (1, 5.0, 32.0), (1, 10.0, 32.0), (2, 5.0, 32.0)], per_host=3)
    graphs = synthetic_model(num_layers=6, strategies=[replicate(3), replicate(3)], hidden=256, seq=32)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=30, num_micro_batch=3))
    return plan, graphs, cluster


def straddling_plan() -> Plan:
    """Shares cut differently in the two stages and in the two micro-batches, over three hosts."""
    return two_stage_plan([worker(0, "a0", "A", 0, [3, 2], dp=0), worker(1, "a1", "A", 0, [1, 2], dp=1),
                           worker(2, "b0", "B", 1, [2, 1], dp=0), worker(3, "b1", "B", 1, [1, 2], dp=1),
                           worker(4, "c0", "C", 1, [1, 1], dp=2)], bytes_per_sample=0.5 * MB, num_micro_batch=2)


@pytest.mark.parametrize("make", ["planned", "straddling"])
def test_traffic_plans_are_boundary_reshardings_for_every_micro_batch(make):
    """The canonical-shape cache gives, for every micro-batch and direction, the plan
    boundary_resharding makes (same strategy, tasks, time and transfers, names restored)."""
    if make == "planned":
        plan, _, cluster = planned_model()
        network = NetworkModel.of_cluster(cluster)
    else:
        plan = straddling_plan()
        network = cluster = network_of(plan, latency_us=5.0)
    traffic = plan_traffic(plan, network)
    for m in range(plan.num_micro_batch):
        (forward,) = boundary_resharding(plan, cluster, micro_batch=m)
        got = traffic[0, FORWARD][m]
        assert (got.strategy, got.unit_tasks) == (forward.strategy, len(forward.tasks))
        assert got.predicted_ms == pytest.approx(forward.predicted_ms)
        planned = [t for t in forward.transfers if t.hops]
        assert [(s.sender, s.receivers, s.strategy) for s in got.sends] == [
            (t.sender, t.receivers, t.strategy) for t in planned]
        assert [(s.offset_ms, s.duration_ms) for s in got.sends] == [
            pytest.approx((t.start_ms, t.end_ms - t.start_ms)) for t in planned]
        # the backward reverses the boundary: the receiving stage's rows go back to the senders
        layout = SampleLayout.of(plan)
        src, dst = (stage_output_spec(plan, layout, s, m, (int(plan.boundaries[0].bytes_per_sample),)) for s in (0, 1))
        backward = plan_resharding(dst, src, network, itemsize=1, max_nodes=2000)
        assert traffic[0, BACKWARD][m].predicted_ms == pytest.approx(backward.predicted_ms)


def test_predictions_and_timing_fields_use_the_network():
    """The plan's prediction is the network simulation; each boundary's transfer_ms is its
    resharding's predicted time; the buckets from Worker.gradient_bytes are those of the model."""
    plan, graphs, cluster = planned_model()
    network = NetworkModel.of_cluster(cluster)
    assert plan.prediction.step_time_ms == pytest.approx(simulate(plan, network=cluster).step_time_ms)
    assert predict(plan, cluster) == plan.prediction
    assert plan.boundaries[0].transfer_ms == pytest.approx(
        [t.predicted_ms for t in plan_traffic(plan, network)[0, FORWARD]])
    ours, theirs = plan_buckets(plan, network), gradient_buckets(plan, graphs, cluster)
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert [tuple(b) for b in ours[key]] == [pytest.approx(tuple(b)) for b in theirs[key]]


def test_comm_model_prices_with_the_network_model():
    """CommModel is NetworkModel on Device records: a ring over devices interleaved across two
    hosts shares each NIC between two hops, so it is slower than the host-contiguous ring."""
    devices = [Device(f"d{i}", "k", f"h{i % 2}", 10.0, 16.0) for i in range(4)]
    comm = CommModel(Network(intra_host_gbps=100.0, inter_host_gbps=10.0, latency_us=5.0))
    network = NetworkModel(100.0, 10.0, 5.0, {d.name: d.host for d in devices})
    contiguous = [devices[0], devices[2], devices[1], devices[3]]
    for order in (devices, contiguous):
        names = [d.name for d in order]
        assert comm.allreduce_ms(8 * MB, order) == pytest.approx(network.ring_allreduce_ms(8 * MB, names))
        assert comm.allgather_ms(8 * MB, order) == pytest.approx(network.ring_allgather_ms(8 * MB, names))
        assert comm.allreduce_each_ms([MB, 2 * MB], 3.0, order) == pytest.approx(
            network.ring_allreduce_ms(3 * MB, names) + network.ring_allreduce_ms(6 * MB, names))
    assert comm.allreduce_ms(8 * MB, devices) > comm.allreduce_ms(8 * MB, contiguous)
    assert comm.p2p_ms(MB, devices[0], devices[1]) == pytest.approx(network.transfer_ms(MB, "d0", "d1"))
