"""runtime.parallel.resharding: cross-mesh resharding plans executed on gloo ranks, exact.

The paper's microbenchmark cases (seed paper 001) on meshes of 2 emulated hosts x 2 devices: one
sender host feeding a replicated destination on two hosts, both sender hosts usable, sharded to
differently sharded, uneven (and empty) batch shares to replicated, each strategy forced
(``send_recv``, ``allgather``, ``broadcast``) and ``auto``. The hosts are emulated by the specs'
device -> host mapping; all ranks run on this machine. Source and destination meshes are 8 plan
devices on 4 ranks (each rank plays one source and one destination device, mapped with several
rotations so some hops stay on one rank and most cross), plus meshes sharing their devices (the
``local`` strategy), a ``replicate(2)`` stage feeding a ``split(2)`` stage's feature shards and
the reverse (specs from a Plan by ``stage_output_spec``), and a byte-row plan (itemsize 1, the
form ``boundary_resharding`` plans) moving float64 rows through uint8 views. Every destination
tensor must equal its box of the full tensor exactly.
The same spawn runs two cases under the emulated network (``run(..., network=)``: stamped sends,
receives that wait their modeled arrival): exact, and every stamp sent is taken.
One 4-rank spawn runs every case; the compile step (message layout, checks, bad input) is tested
in process.
"""
from __future__ import annotations

import dataclasses
import os
from math import prod

import pytest
import torch

from dist_utils import run_ranks
from planner.shares.layout import SampleLayout
from planner.devices.network import NetworkModel
from planner.plan import StagePlan, Worker
from planner.resharding.reshard import ShardingSpec, plan_resharding
from planner.resharding.spec import padded_sizes, stage_output_spec
from plans import make_plan
from runtime.emulation.network import NetworkEmulator
from runtime.parallel.resharding import ReshardingRuntimeError, byte_rows, compile_resharding, device_ranks

SHAPE = (8, 6, 10)   # 480 float64 entries: small, but cut unevenly into parts and chunks
HOSTS = ("a", "b", "c", "d", "h0", "h1")
# latency low enough that a broadcast pipelines in several chunks at this size
NETWORK = NetworkModel.of_hosts(100.0, 1.25, 0.2, HOSTS)
WORLD = 4


def mesh(*hosts: str, tag: str) -> list[tuple[str, str]]:
    return [(f"{host}-{tag}{i}", host) for host in hosts for i in range(2)]


def _case(name, src, dst, strategy="auto", shift=1, itemsize=8, ranks=None):
    """A case: its plan and the mapping source device i -> rank i, destination i -> rank i + shift
    (or ``ranks``)."""
    if ranks is None:
        ranks = {device: i % WORLD for i, device in enumerate(src.devices)}
        for i, device in enumerate(dst.devices):
            if ranks.setdefault(device, (i + shift) % WORLD) != (i + shift) % WORLD:
                raise ValueError(f"{name}: shared device {device} needs the same rank on both meshes")
    plan = plan_resharding(src, dst, NETWORK, itemsize=itemsize, strategy=strategy, max_nodes=500)
    return name, plan, src, dst, ranks


def cases():
    one_host = ShardingSpec.replicated(SHAPE, mesh("a", tag="s"))
    both_hosts = ShardingSpec.replicated(SHAPE, mesh("a", "b", tag="s"))
    replicated = ShardingSpec.replicated(SHAPE, mesh("c", "d", tag="r"))
    rows = ShardingSpec.grid(SHAPE, [mesh("a", tag="s"), mesh("b", tag="s")], row=(0, [4, 4]))
    grid = ShardingSpec.grid(SHAPE, [mesh("a", tag="s"), mesh("b", tag="s")], row=(0, [4, 4]), col=(1, [3, 3]))
    transposed = ShardingSpec.grid(SHAPE, [mesh("c", tag="r"), mesh("d", tag="r")], row=(1, [3, 3]),
                                   col=(0, [4, 4]))
    per_host = ShardingSpec.grid(SHAPE, [mesh("c", tag="r"), mesh("d", tag="r")], row=(0, [4, 4]))
    uneven = ShardingSpec.split(SHAPE, mesh("a", "b", tag="s"), dim=0, sizes=[3, 1, 2, 2])
    empty_share = ShardingSpec.split(SHAPE, mesh("a", "b", tag="s"), dim=0, sizes=[5, 0, 1, 2])
    padded = ShardingSpec.grid(SHAPE, [mesh("c", tag="r"), mesh("d", tag="r")], row=(0, [5, 3]),
                               col=(2, padded_sizes(10, 2)))
    feature_uneven = ShardingSpec.split(SHAPE, mesh("c", "d", tag="r"), dim=2, sizes=[1, 4, 0, 5])
    # meshes sharing their 4 devices (2 hosts x 2 devices): a device keeps what it holds
    shared_split = ShardingSpec.split(SHAPE, mesh("h0", "h1", tag="d"), dim=0, sizes=[3, 1, 2, 2])
    shared_replicated = ShardingSpec.replicated(SHAPE, mesh("h0", "h1", tag="d"))
    shared_one_host = ShardingSpec.replicated(SHAPE, mesh("h0", tag="d"))
    out = [_case(f"one sender host -> replicated, {s}", one_host, replicated, s, shift)
           for s, shift in (("broadcast", 1), ("allgather", 2), ("send_recv", 3), ("auto", 0))]
    out += [_case("both sender hosts -> batch split", both_hosts,
                  ShardingSpec.split(SHAPE, mesh("c", "d", tag="r"), dim=0, sizes=[2, 2, 2, 2]), "auto", 2),
            _case("rows per host -> replicated, auto", rows, replicated, "auto", 0),
            _case("grid -> transposed grid, auto", grid, transposed, "auto", 3),
            _case("grid -> replicated per host, allgather", grid, per_host, "allgather", 1),
            _case("grid -> replicated per host, broadcast", grid, per_host, "broadcast", 2),
            _case("uneven -> padded grid, auto", uneven, padded, "auto", 1),
            _case("uneven -> uneven features, send_recv", empty_share, feature_uneven, "send_recv", 3)]
    out += [_case(f"uneven batch split -> replicated, {s}", source, replicated, s, shift)
            for s, source, shift in (("broadcast", uneven, 1), ("allgather", empty_share, 2),
                                     ("send_recv", uneven, 0), ("auto", empty_share, 3))]
    out += [_case(f"shared devices, split -> replicated, {s}", shared_split, shared_replicated, s, 0)
            for s in ("auto", "broadcast", "allgather", "send_recv")]
    out.append(_case("shared devices, one host -> replicated, broadcast", shared_one_host, shared_replicated,
                     "broadcast", 0))
    # the form planner.resharding.reshard.boundary_resharding plans: rows of bytes (itemsize 1); the
    # runtime moves the float64 tensors through uint8 views of their rows
    row_bytes = prod(SHAPE[1:]) * 8
    out.append(_case("byte rows, uneven -> replicated, auto",
                     ShardingSpec.split((SHAPE[0], row_bytes), mesh("a", "b", tag="s"), dim=0, sizes=[3, 1, 2, 2]),
                     ShardingSpec.replicated((SHAPE[0], row_bytes), mesh("c", "d", tag="r")), "auto", 1, itemsize=1))
    return out + stage_cases()


def stage_cases():
    """A ``replicate(2)`` stage on host h0 (uneven shares) feeding a ``split(2)`` stage on h1 whose
    input arrives as feature shards (stage_output_spec, micro-batch 1 of 2), and the reverse."""
    shares = {0: [3, 2], 1: [1, 2]}
    workers = [Worker(r, f"w{r}", "h0", 0, 0, r, micro_batch_sizes=shares[r]) for r in (0, 1)]
    workers += [Worker(r, f"w{r}", "h1", 0, 1, 0, r - 2, 2, micro_batch_sizes=[4, 4]) for r in (2, 3)]
    plan = make_plan([StagePlan(0, [0], [0], "replicate(2)"), StagePlan(1, [0], [1], "split(2)")], workers)
    plan.validate()
    layout = SampleLayout.of(plan)
    rows = stage_output_spec(plan, layout, 0, 1, SHAPE[1:])
    shards = stage_output_spec(plan, layout, 1, 1, SHAPE[1:], feature_dim=2, feature_sizes=[7, 3])
    return [_case(f"replicate stage -> split stage shards, {s}", rows, shards, s, ranks=device_ranks(plan))
            for s in ("auto", "broadcast")] + [
            _case("split stage shards -> replicate stage, auto", shards, rows, ranks=device_ranks(plan))]


def full_tensor() -> torch.Tensor:
    return torch.arange(prod(SHAPE), dtype=torch.float64).reshape(SHAPE) * 0.5 - 7.0


def box_of(tensor: torch.Tensor, box) -> torch.Tensor:
    return tensor[tuple(slice(lo, hi) for lo, hi in box)]


def emulated_cases():
    """One sender host -> replicated on hosts c, d (send_recv, and a broadcast whose forwarders are
    ranks that send from no other device), priced by a model that knows the devices."""
    src = ShardingSpec.replicated(SHAPE, mesh("a", tag="s"))
    dst = ShardingSpec.replicated(SHAPE, mesh("c", "d", tag="r"))
    model = NetworkModel(100.0, 1.25, 0.2, {**src.device_hosts, **dst.device_hosts})
    ranks = {"a-s0": 0, "a-s1": 1, "c-r0": 1, "c-r1": 2, "d-r0": 3, "d-r1": 0}
    out = []
    for strategy in ("send_recv", "broadcast"):
        plan = plan_resharding(src, dst, model, itemsize=8, strategy=strategy, max_nodes=500)
        assert plan.transfers[0].sender == "a-s0" and plan.transfers[-1].receivers[-1] == "d-r1"
        out.append((f"emulated network, one sender host -> replicated, {strategy}", plan, src, dst, ranks))
    return model, out


def _sending_device(program, rank: int):
    """The one device ``rank`` sends from to another rank (else the device it plays)."""
    sending = {m.src for ms in program.messages for m in ms if program.ranks[m.src] == rank != program.ranks[m.dst]}
    assert len(sending) <= 1, sending
    src_device, dst_device = program.roles(rank)
    return sending.pop() if sending else (dst_device or src_device)


def _run_cases(rank: int, world_size: int, all_cases, emulated=None, run_id="") -> list:
    full = full_tensor()
    out, tag_base = [], 0
    model, emulated = emulated if emulated else (None, [])
    for name, plan, src, dst, ranks in [*all_cases, *emulated]:
        program = compile_resharding(plan, src, dst, ranks)
        network = None
        if name.startswith("emulated"):
            network = NetworkEmulator(model, _sending_device(program, rank), run_id)
        src_device, dst_device = program.roles(rank)
        as_bytes = plan.itemsize == 1   # boxes are (rows, bytes): the tensors' rows seen as bytes
        source = destination = result = None
        if src_device:
            box = program.src_boxes[src_device]
            source = box_of(full, box[:1] if as_bytes else box).clone()
            source = byte_rows(source) if as_bytes else source
        if dst_device:
            box = program.dst_boxes[dst_device]
            rows = (box[0][1] - box[0][0], *SHAPE[1:]) if as_bytes else tuple(hi - lo for lo, hi in box)
            result = torch.full(rows, float("nan"), dtype=torch.float64)
            destination = byte_rows(result) if as_bytes else result
        stats = program.run(source, destination, tag_base=tag_base, network=network)
        tag_base += program.message_count
        if network is not None:
            network.close()
            stats = (stats, network.stats.sent, network.stats.received)
        out.append((name, dst_device, result, stats))
    return out


def test_plans_execute_exactly_on_four_ranks():
    all_cases = cases()
    # the cases exercise every strategy, a pipelined broadcast, a host ring all-gather, local copies
    strategies = {t.strategy for _, plan, *_ in all_cases for t in plan.transfers}
    assert strategies == {"local", "send_recv", "allgather", "broadcast"}
    assert any(t.strategy == "broadcast" and t.chunks > 1 and len(t.receivers) == 4
               for _, plan, *_ in all_cases for t in plan.transfers)
    assert any(t.strategy == "allgather" and len(t.receivers) == 2 for _, plan, *_ in all_cases for t in plan.transfers)
    emulated = emulated_cases()
    results = run_ranks(_run_cases, WORLD, args=(all_cases, emulated, f"reshard-test-{os.getpid()}"), timeout_s=120)
    full = full_tensor()
    for index, (name, plan, src, dst, ranks) in enumerate(all_cases + emulated[1]):
        boxes = {h.device: h.box for h in dst.holdings}
        seen = set()
        for rank in range(WORLD):
            case_name, device, tensor, _ = results[rank][index]
            assert case_name == name
            if device is None:
                continue
            seen.add(device)
            box = boxes[device][:1] if plan.itemsize == 1 else boxes[device]
            assert torch.equal(tensor, box_of(full, box)), (name, device)
        assert seen == set(dst.devices), name
        stats = [results[rank][index][3] for rank in range(WORLD)]
        if name.startswith("emulated"):   # every message stamped by its sender and the stamp taken
            stamps_sent, stamps_taken = sum(s[1] for s in stats), sum(s[2] for s in stats)
            stats = [s[0] for s in stats]
            assert stamps_sent == stamps_taken == sum(s.messages for s in stats) // 2 > 0, name
        assert sum(s.sent_bytes for s in stats) == sum(s.received_bytes for s in stats), name


# -- the compile step, in process ------------------------------------------------------------------
def _simulate(program) -> dict[str, torch.Tensor]:
    """Run the messages sequentially in one process, each device's copy of each slice apart:
    every destination entry must be written exactly once, forwarded only after it arrived."""
    written = {d: torch.zeros(tuple(hi - lo for lo, hi in box), dtype=torch.int64)
               for d, box in program.dst_boxes.items()}
    for index, transfer in enumerate(program.plan.transfers):
        own = program.dst_boxes
        if transfer.strategy == "local":
            box_of(written[transfer.sender], [(lo - o, hi - o) for (lo, hi), (o, _) in
                                              zip(transfer.box, own[transfer.sender])]).add_(1)
            continue
        slice_size = prod(hi - lo for lo, hi in transfer.box)
        counts = {d: torch.zeros(slice_size, dtype=torch.int64) for d in transfer.receivers}
        for message in program.messages[index]:
            counts[message.dst][message.lo:message.hi] += 1
        for device, count in counts.items():
            assert torch.equal(count, torch.ones_like(count)), (index, device)
            local = [(lo - o, hi - o) for (lo, hi), (o, _) in zip(transfer.box, own[device])]
            box_of(written[device], local).add_(1)
    return written


def test_every_destination_entry_is_written_once():
    for name, plan, src, dst, ranks in cases():
        written = _simulate(compile_resharding(plan, src, dst, ranks))
        for device, count in written.items():
            assert torch.equal(count, torch.ones_like(count)), (name, device)


def test_broadcast_messages_pipeline_in_wavefront_order():
    name, plan, src, dst, ranks = cases()[0]
    program = compile_resharding(plan, src, dst, ranks)
    (transfer,) = plan.transfers
    ring = [transfer.sender, *transfer.receivers]
    messages = program.messages[0]
    assert len(messages) == transfer.chunks * len(transfer.receivers)
    hop_of = {(a, b): j for j, (a, b) in enumerate(zip(ring, ring[1:]))}
    chunk_starts = sorted({m.lo for m in messages})
    order = [(chunk_starts.index(m.lo), hop_of[(m.src, m.dst)]) for m in messages]
    # chunk k on hop j is posted after chunk k on hop j-1 and chunk k+1 on hop j-1 (wavefront)
    assert order == sorted(order, key=lambda kj: (kj[0] + kj[1], kj[1]))
    assert [m.number for m in messages] == list(range(len(messages)))


def test_bad_input_is_named():
    name, plan, src, dst, ranks = cases()[0]
    missing = {d: r for d, r in ranks.items() if d != "c-r0"}
    with pytest.raises(ReshardingRuntimeError, match="destination device 'c-r0' has no rank in the mapping"):
        compile_resharding(plan, src, dst, missing)
    doubled = dict(ranks, **{"c-r1": ranks["c-r0"]})
    with pytest.raises(ReshardingRuntimeError, match=r"rank \d is mapped to destination devices 'c-r0' and 'c-r1'"):
        compile_resharding(plan, src, dst, doubled)
    other = ShardingSpec.replicated((4, 4), mesh("c", "d", tag="r"))
    with pytest.raises(ReshardingRuntimeError, match=r"the plan is for shape \(8, 6, 10\)"):
        compile_resharding(plan, src, other, ranks)
    (transfer,) = plan.transfers
    broken = dataclasses.replace(plan, transfers=(dataclasses.replace(transfer, hops=transfer.hops[:-1]),))
    with pytest.raises(ReshardingRuntimeError, match="transfer 0 .broadcast.* has hops .* but the runtime lays it out"):
        compile_resharding(broken, src, dst, ranks)
    program = compile_resharding(plan, src, dst, ranks)
    rank = ranks["a-s0"]
    with pytest.raises(ReshardingRuntimeError, match=rf"rank {rank}'s source tensor has shape \(8, 6\) but its "
                                                     r"device 'a-s0' holds \[0:8, 0:6, 0:10\]"):
        program.run(torch.zeros(8, 6), torch.zeros(SHAPE), rank=rank)
    with pytest.raises(ReshardingRuntimeError, match=f"rank {rank} plays source device 'a-s0' .* no source tensor"):
        program.run(None, torch.zeros(SHAPE), rank=rank)
    with pytest.raises(ReshardingRuntimeError, match="tag_base 2147483640 with 16 messages leaves the tag range"):
        program.run(torch.zeros(SHAPE), torch.zeros(SHAPE), tag_base=2**31 - 8, rank=rank)
    model, ((_, emulated, e_src, e_dst, e_ranks), _) = emulated_cases()
    network = NetworkEmulator(model, "c-r0", f"reshard-test-bad-{os.getpid()}")
    try:
        with pytest.raises(ReshardingRuntimeError, match=r"rank 0 sends from device\(s\) \['a-s0'\] but its network "
                                                         r"emulator is for device 'c-r0'"):
            compile_resharding(emulated, e_src, e_dst, e_ranks).run(torch.zeros(SHAPE), torch.zeros(SHAPE), rank=0,
                                                                     network=network)
    finally:
        network.close()
    with pytest.raises(ReshardingRuntimeError, match=r"byte_rows needs a contiguous tensor .* shape \(6, 8\)"):
        byte_rows(torch.zeros(8, 6).t())
