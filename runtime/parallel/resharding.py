"""Execute a cross-mesh resharding plan (:class:`planner.resharding.reshard.ReshardPlan`) on process-group ranks.

Why: the planner decides, per unit task, who sends which slice to whom, by which strategy, in
which order (seed paper 001, sections 3-4). This module carries that out on real tensors, exactly
as planned: ``local`` copies, ``send_recv`` direct sends, ``allgather`` (the slice cut by
:func:`planner.resharding.cost.allgather_parts` into one part per receiver of the host, then a ring
all-gather inside the host) and ``broadcast`` (a ring through ``receivers`` in ``chunks`` pieces,
pipelined: each member forwards chunk ``k`` as soon as it has it).

Why not torch's DTensor ``redistribute``: its placements are even tiles (``Shard(d)`` splits a
dimension evenly), while our stage groups hold uneven batch shares and uneven feature shards; it
picks its own collectives per placement pair, blind to hosts, so it cannot run the planner's
chosen strategy (one slice crossing each host once, sender hosts load-balanced, tasks ordered);
and its source and destination must be one device mesh, not two stage groups.

How: :func:`compile_resharding` turns the plan into *messages* (source device, destination device,
a ``[lo, hi)`` range of the slice flattened row-major), numbered in one global order that every
rank derives from the same plan; it checks each message against the plan's hops (devices, bytes)
and that a device forwards only ranges it received earlier in the order. :meth:`ReshardProgram.run`
executes this rank's share: transfers in the plan's start order, each finished on this rank
before its next one starts (every transfer a rank takes part in shares its device, and the plan
runs those one after another); within a transfer, ops are posted in the global order with
non-blocking ``isend``/``irecv`` (tag: ``tag_base`` + the message's number), and a forwarder waits
only for the receive of the range it forwards. Local offsets are the box minus the holder's box.
Plan devices map to global ranks by a given mapping (:func:`device_ranks` for a Plan's workers); a
rank plays at most one device of each spec, and a message between two devices of one rank (the
source and the destination device it plays) is a local copy.

No deadlock (gloo and NCCL): every rank posts its ops in increasing global number and blocks only
on its own ops already posted, all numbered below its next op (the receive it forwards from, or at
the end of a transfer). Take the lowest-numbered op that never completes. Each end has posted it:
an end that has not is blocked on a lower-numbered op that never completes, which contradicts the
choice. Gloo matches the two ends by (peer, unique tag); NCCL ignores tags and matches the k-th
send from A to B with B's k-th receive from A, the same message since both post in global order,
and runs a rank's point-to-point ops in posting order per stream, where every op before it is
lower-numbered, so complete. So it completes: a contradiction. The compile-time check (forward only what arrived
earlier) is the premise. Interfaces shared by transfers of *different* ranks are not serialized
here by signalling (real NICs serialize by themselves; the emulated network pads per interface).

On an emulated network (``run(..., network=)``, :mod:`runtime.emulation.network`), each send is
stamped with its modeled arrival (a stamp message right after it, tag + ``STAMP_TAG``, so the
order argument above holds for the pair) and a receive sleeps until that arrival before its range
is forwarded and at the end of its transfer, as :mod:`runtime.parallel.pipeline` does; a sender posts each
transfer no earlier than its planned start after ``run`` began, since the emulated NICs are
reserved first come, first served and posting early would reorder the plan. A rank on an emulated
network sends from one device (the emulator's). With ``network=None`` none of this runs.

Tensors travel on their own device (NCCL needs CUDA tensors on both ends); only gloo is tested
here (CPU; no machine with several GPUs). A gloo receive is waited once (a second wait blocks for
another message), so a forwarded range's receive leaves the list of works when it is waited.

Invariant: after :meth:`ReshardProgram.run` on every rank, each destination device's tensor equals
the full tensor's entries of its box (every entry written once, from a device that held it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import prod
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from planner.resharding.reshard import ReshardPlan, ShardingSpec
from planner.resharding.cost import allgather_parts
from planner.resharding.spec import Box, box_size, box_text
from runtime.emulation.network import STAMP_TAG, NetworkEmulator
from whalelike.errors import WhaleError

__all__ = ["ReshardingRuntimeError", "Message", "ReshardProgram", "Posted", "ReshardStats", "compile_resharding",
           "device_ranks", "byte_rows"]

MAX_TAG = 2**31 - 1


class ReshardingRuntimeError(WhaleError):
    """A resharding plan, device-to-rank mapping or local tensor does not fit the execution."""


@dataclass(frozen=True)
class Message:
    """Message ``number`` (global order, tag offset): entries ``[lo, hi)`` of transfer
    ``transfer``'s slice, flattened row-major, from device ``src`` to device ``dst``."""

    number: int
    transfer: int
    src: str
    dst: str
    lo: int
    hi: int


@dataclass(frozen=True)
class ReshardStats:
    """What this rank did: messages posted, bytes sent and received, entries copied locally."""

    messages: int
    sent_bytes: int
    received_bytes: int
    copied_entries: int


def _box_of(spec: ShardingSpec) -> dict[str, Box]:
    return {h.device: h.box for h in spec.holdings}


@dataclass(frozen=True)
class ReshardProgram:
    """A compiled plan: per transfer, its messages in global order; device boxes and ranks."""

    plan: ReshardPlan
    messages: tuple[tuple[Message, ...], ...]
    src_boxes: Mapping[str, Box]
    dst_boxes: Mapping[str, Box]
    ranks: Mapping[str, int]
    # derived once (a program runs every step): Tags used, each rank's devices, devices sending off-rank
    message_count: int = field(init=False, compare=False)
    _roles: Mapping[int, tuple] = field(init=False, compare=False, repr=False)
    _senders: frozenset = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # message_count: tags tag_base .. tag_base + message_count - 1 are used (concurrent reshardings
        # need disjoint ranges)
        object.__setattr__(self, "message_count", sum(len(m) for m in self.messages))
        roles: dict[int, list] = {}
        for which, boxes in enumerate((self.src_boxes, self.dst_boxes)):
            for device in boxes:
                roles.setdefault(self.ranks[device], [None, None])[which] = device
        object.__setattr__(self, "_roles", {rank: tuple(pair) for rank, pair in roles.items()})
        object.__setattr__(self, "_senders", frozenset(
            m.src for messages in self.messages for m in messages if self.ranks[m.src] != self.ranks[m.dst]))

    def roles(self, rank: int) -> tuple[Optional[str], Optional[str]]:
        """The source device and the destination device that ``rank`` plays (None: none)."""
        return self._roles.get(rank, (None, None))

    @torch.no_grad()
    def run(self, source: Optional[torch.Tensor], destination: Optional[torch.Tensor],
            group: Optional[dist.ProcessGroup] = None, tag_base: int = 0, rank: Optional[int] = None,
            network: Optional[NetworkEmulator] = None) -> ReshardStats:
        """Carry out this rank's share. ``source``: this rank's tensor of its source device's box
        (None if it plays no source device); ``destination``: an allocated tensor of its
        destination device's box, written in place. Ranks are global (``group``: default world).
        ``network``: this rank's emulator on an emulated network (its device must be every device
        this rank sends from): each send is stamped with its modeled arrival and each receive
        sleeps until it, before it is forwarded and at the end of its transfer (as
        :mod:`runtime.parallel.pipeline` does), and a sender posts each transfer no earlier than its planned
        start after this call began (the emulated NICs are reserved first come, first served, so
        posting ahead of the plan would reorder it); tags must then stay below ``STAMP_TAG``."""
        posted = Posted()
        stats = self._execute(source, destination, group, tag_base, rank, network, posted, paced=True)
        posted.wait()
        return stats

    @torch.no_grad()
    def post_sends(self, source: Optional[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                   tag_base: int = 0, rank: Optional[int] = None, network: Optional[NetworkEmulator] = None
                   ) -> "Posted":
        """The source side alone, without blocking: post every send this rank's source device
        makes (in the global order) and return them pending; :meth:`Posted.wait` them later. For a
        caller whose two sides run at different times (:mod:`runtime.parallel.boundaries`: the producing
        stage sends after its forward, the consuming stage receives before its own). Sends are
        posted at once, not paced (no common start time)."""
        posted = Posted()
        self._execute(source, None, group, tag_base, rank, network, posted, paced=False, side="source")
        return posted

    @torch.no_grad()
    def receive(self, destination: Optional[torch.Tensor], group: Optional[dist.ProcessGroup] = None,
                tag_base: int = 0, rank: Optional[int] = None, network: Optional[NetworkEmulator] = None
                ) -> "Posted":
        """The destination side alone: returns once this rank's destination box is complete (and,
        emulated, its modeled arrival has passed); the ranges it forwards to other receivers
        (broadcast ring, all-gather) are posted as soon as they arrive and returned pending."""
        posted = Posted()
        self._execute(None, destination, group, tag_base, rank, network, posted, paced=False, side="destination")
        return posted

    def _execute(self, source, destination, group, tag_base: int, rank: Optional[int], network, posted: "Posted",
                 paced: bool, side: Optional[str] = None) -> ReshardStats:
        rank = dist.get_rank() if rank is None else rank
        src_device, dst_device = self.roles(rank)
        if side is not None and src_device is not None and dst_device is not None:
            raise ReshardingRuntimeError(f"resharding: rank {rank} plays source device {src_device!r} and destination "
                                         f"device {dst_device!r}; run both sides at once with run()")
        src_device = None if side == "destination" else src_device
        dst_device = None if side == "source" else dst_device
        if network is not None:
            _check_network(self, network, rank, src_device, dst_device)
        _check_local(source, src_device, self.src_boxes, "source", rank)
        _check_local(destination, dst_device, self.dst_boxes, "destination", rank)
        top = MAX_TAG if network is None else STAMP_TAG - 1   # stamps take tag + STAMP_TAG
        if tag_base < 0 or tag_base + self.message_count > top:
            raise ReshardingRuntimeError(f"resharding: tag_base {tag_base} with {self.message_count} messages leaves "
                                         f"the tag range 0..{top}; use a smaller tag_base")
        counts = [0, 0, 0, 0]   # messages, sent bytes, received bytes, copied entries
        origin = time.monotonic()
        for index, transfer in enumerate(self.plan.transfers):
            mine_src = src_device is not None and transfer.sender == src_device
            mine_dst = dst_device is not None and dst_device in transfer.receivers
            if not (mine_src or mine_dst):
                continue
            if paced and network is not None and mine_src and transfer.strategy != "local":
                _sleep_until(origin + transfer.start_ms * 1e-3)   # the plan's slot: NICs are not shared first-come
            if transfer.strategy == "local":
                if mine_dst:   # the same device name on both meshes: one rank, copy in place
                    _region(destination, self.dst_boxes[dst_device], transfer.box).copy_(
                        _region(source, self.src_boxes[transfer.sender], transfer.box))
                    counts[3] += box_size(transfer.box)
                continue
            src_flat = None
            if mine_src:   # the sender's slice, contiguous and flat (a copy when the region is strided)
                src_flat = _region(source, self.src_boxes[src_device], transfer.box).contiguous().view(-1)
            landing, dst_flat, direct = None, None, False
            if mine_dst:   # receive straight into the destination when its region is contiguous
                landing = _region(destination, self.dst_boxes[dst_device], transfer.box)
                direct = landing.is_contiguous()
                dst_flat = landing.view(-1) if direct else landing.new_empty(landing.numel())
            self._run_transfer(index, rank, src_device, dst_device, src_flat, dst_flat, group, tag_base, counts,
                               network, posted)
            if mine_dst and not direct:
                landing.copy_(dst_flat.view(landing.shape))
        return ReshardStats(*counts)

    def _run_transfer(self, index: int, rank: int, src_device, dst_device, src_flat, dst_flat, group,
                      tag_base: int, counts: list[int], network: Optional[NetworkEmulator], posted: "Posted") -> None:
        """This rank's messages of one transfer (those of the devices it plays here: ``None`` is a
        side not played); its receives are waited before returning, its sends go to ``posted``."""
        sender = self.plan.transfers[index].sender
        # range of dst_flat -> (its receive works, its modeled arrival or None); None: copied or waited
        arrived: dict[tuple[int, int], object] = {}
        works = []
        for message in self.messages[index]:
            from_rank, to_rank = self.ranks[message.src], self.ranks[message.dst]
            sends = from_rank == rank and message.src in (src_device, dst_device)
            takes = to_rank == rank and message.dst == dst_device
            if not (sends or takes):
                continue
            span = (message.lo, message.hi)
            payload = None
            if sends:
                if message.src == sender and message.src == src_device:
                    payload = src_flat[message.lo:message.hi]
                else:   # forwarding: wait for the receive that brought this range here (and its modeled arrival)
                    if arrived[span] is not None:   # a gloo receive must be waited once: drop it from the list
                        _finish(arrived[span], works)
                        arrived[span] = None
                    payload = dst_flat[message.lo:message.hi]
            tag = tag_base + message.number
            if sends and takes:
                dst_flat[message.lo:message.hi].copy_(payload)
                arrived[span] = None
                counts[3] += message.hi - message.lo
            elif sends:
                ops = [dist.P2POp(dist.isend, payload, to_rank, group, tag)]
                if network is not None:   # priced and stamped by the sender, as runtime.parallel.pipeline's _send
                    ops = network.stamp_sends(ops, [message.dst])
                posted.works.extend(_post(ops))
                posted.keep_alive.extend(op.tensor for op in ops)
                counts[0] += 1
                counts[1] += payload.numel() * payload.element_size()
            else:
                into = dst_flat[message.lo:message.hi]
                ops, arrival = [dist.P2POp(dist.irecv, into, from_rank, group, tag)], None
                if network is not None:   # the sender's modeled arrival too, as runtime.parallel.pipeline's _receive
                    ops, arrival = network.stamp_receives(ops)
                received = _post(ops)
                arrived[span] = (received, arrival)
                works.extend(received)
                counts[0] += 1
                counts[2] += into.numel() * into.element_size()
        for work in works:
            work.wait()
        for pending in arrived.values():   # sleep until the modeled arrival of what was not forwarded
            if pending is not None and pending[1] is not None:
                pending[1].wait()


class Posted:
    """Sends posted and not yet waited (with the tensors they read, kept alive until then)."""

    def __init__(self):
        self.works: list = []
        self.keep_alive: list[torch.Tensor] = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        self.keep_alive.clear()


def _sleep_until(moment: float) -> None:
    left = moment - time.monotonic()
    if left > 0:
        time.sleep(left)


def _post(ops: list) -> list:
    """Post point-to-point ops one by one, in order (each with its own tag): their works."""
    return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]


def _finish(pending, works: list) -> None:
    """Wait for a receive's works (dropping them from ``works``), then for its modeled arrival."""
    posted, arrival = pending
    for work in posted:
        work.wait()
        works.remove(work)
    if arrival is not None:
        arrival.wait()


def _check_network(program: "ReshardProgram", network: NetworkEmulator, rank: int, src_device, dst_device) -> None:
    """The emulator prices sends from its own device: it must be every device this rank sends from."""
    sending = {d for d in (src_device, dst_device) if d in program._senders}
    wrong = sorted(sending - {network.device})
    if wrong:
        raise ReshardingRuntimeError(f"resharding: rank {rank} sends from device(s) {wrong} but its network emulator "
                                     f"is for device {network.device!r}; give each rank the emulator of the device it "
                                     "sends from (one device per rank on an emulated network)")


def _region(tensor: torch.Tensor, own: Box, box: Box) -> torch.Tensor:
    """The view of ``tensor`` (holding ``own``) covering ``box``: local offsets = box - own box."""
    index = tuple(slice(lo - own_lo, hi - own_lo) for (lo, hi), (own_lo, _) in zip(box, own))
    return tensor[index]


def _check_local(tensor, device, boxes, which: str, rank: int) -> None:
    if device is None:
        return
    shape = tuple(hi - lo for lo, hi in boxes[device])
    if prod(shape) and tensor is None:
        raise ReshardingRuntimeError(f"resharding: rank {rank} plays {which} device {device!r} holding "
                                     f"{box_text(boxes[device])} but was given no {which} tensor; pass a tensor "
                                     f"of shape {shape}")
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ReshardingRuntimeError(f"resharding: rank {rank}'s {which} tensor has shape {tuple(tensor.shape)} but "
                                     f"its device {device!r} holds {box_text(boxes[device])}, shape {shape}; pass "
                                     "the local tensor of that box")


def compile_resharding(plan: ReshardPlan, src: ShardingSpec, dst: ShardingSpec,
                       ranks: Mapping[str, int]) -> ReshardProgram:
    """The messages of ``plan`` (made from ``src`` -> ``dst``), plan devices mapped to global ranks
    by ``ranks`` (device name -> rank; a rank plays at most one device of each spec). Pure: the
    same on every rank."""
    if tuple(src.shape) != tuple(plan.shape) or tuple(dst.shape) != tuple(plan.shape):
        raise ReshardingRuntimeError(f"resharding: the plan is for shape {plan.shape} but the specs have "
                                     f"{src.shape} and {dst.shape}; pass the specs the plan was made from")
    ranks = dict(ranks)
    for spec, which in ((src, "source"), (dst, "destination")):
        owner: dict[int, str] = {}
        for device in spec.devices:
            if device not in ranks:
                raise ReshardingRuntimeError(f"resharding: {which} device {device!r} has no rank in the mapping "
                                             f"{dict(list(ranks.items())[:6])}...; map every device to a global rank")
            rank = ranks[device]
            if rank in owner:
                raise ReshardingRuntimeError(f"resharding: rank {rank} is mapped to {which} devices {owner[rank]!r} "
                                             f"and {device!r}; a rank holds one box of each spec, map them apart")
            owner[rank] = device
    src_boxes, dst_boxes = _box_of(src), _box_of(dst)
    number = 0
    per_transfer = []
    for index, transfer in enumerate(plan.transfers):
        if transfer.sender not in src_boxes or any(d not in dst_boxes for d in transfer.receivers):
            raise ReshardingRuntimeError(f"resharding: transfer {index} ({transfer.sender} -> "
                                         f"{', '.join(transfer.receivers)}) names devices outside the specs; "
                                         "pass the specs the plan was made from")
        messages = []
        for src_device, dst_device, lo, hi in _layout(index, transfer, plan.itemsize):
            if hi > lo:
                messages.append(Message(number, index, src_device, dst_device, lo, hi))
                number += 1
        _check_forwarding(index, transfer, messages)
        per_transfer.append(tuple(messages))
    return ReshardProgram(plan, tuple(per_transfer), src_boxes, dst_boxes, ranks)


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _layout(index: int, transfer, itemsize: int) -> list[tuple[str, str, int, int]]:
    """``(src, dst, lo, hi)`` per message of one transfer, in order, checked against its hops."""
    elements = box_size(transfer.box)
    receivers, sender, hops = list(transfer.receivers), transfer.sender, transfer.hops
    if transfer.strategy == "local":
        expected, out = [], []
    elif transfer.strategy == "broadcast" and len(receivers) > 1:
        ring = [sender] + receivers
        expected = [(a, b, elements) for a, b in zip(ring, ring[1:])]
        chunks = _ranges(allgather_parts(elements, max(1, transfer.chunks)))
        # wavefront order: chunk k on hop j comes after chunk k on hop j-1 and after chunk k+1 on hop j-1
        steps = sorted(((k, j) for k in range(len(chunks)) for j in range(len(expected))),
                       key=lambda kj: (kj[0] + kj[1], kj[1]))
        out = [(ring[j], ring[j + 1], *chunks[k]) for k, j in steps]
    elif transfer.strategy == "allgather" and len(receivers) > 1:
        count = len(receivers)
        parts = _ranges(allgather_parts(elements, count))
        expected = [(sender, d, hi - lo) for d, (lo, hi) in zip(receivers, parts)]
        expected += [(receivers[i], receivers[(i + 1) % count], elements - (parts[(i + 1) % count][1]
                                                                          - parts[(i + 1) % count][0]))
                     for i in range(count)]
        out = [(sender, d, lo, hi) for d, (lo, hi) in zip(receivers, parts)]
        out += [(receivers[i], receivers[(i + 1) % count], *parts[(i - step) % count])
                for step in range(count - 1) for i in range(count)]
    else:   # send_recv, or a broadcast / all-gather to one receiver: a full copy to each receiver
        expected = [(sender, d, elements) for d in receivers]
        out = [(sender, d, 0, elements) for d in receivers]
    planned = [(hop.src, hop.dst, hop.nbytes) for hop in hops]
    if planned != [(a, b, float(n * itemsize)) for a, b, n in expected]:
        raise ReshardingRuntimeError(
            f"resharding: transfer {index} ({transfer.strategy}, {transfer.sender} -> {', '.join(receivers)}, "
            f"{box_text(transfer.box)}) has hops {planned} but the runtime lays it out as "
            f"{[(a, b, n * itemsize) for a, b, n in expected]}; the planner's hop layout "
            "(planner/resharding/cost.py) and runtime/parallel/resharding.py disagree: bring them in line")
    return out


def _check_forwarding(index: int, transfer, messages: list[Message]) -> None:
    """A device sends only ranges it holds: the sender's slice, or a range it received earlier in
    the order (the premise of the no-deadlock argument in the module docstring)."""
    received: dict[str, set] = {}
    for message in messages:
        if message.src != transfer.sender and (message.lo, message.hi) not in received.get(message.src, set()):
            raise ReshardingRuntimeError(f"resharding: transfer {index} message {message.number} forwards "
                                         f"[{message.lo}:{message.hi}] from {message.src!r} before it arrived there; "
                                         "the message order is broken (runtime/parallel/resharding.py _layout)")
        received.setdefault(message.dst, set()).add((message.lo, message.hi))


def device_ranks(plan, group: Optional[dist.ProcessGroup] = None) -> dict[str, int]:
    """Device name -> global rank from a :class:`planner.plan.Plan`'s workers (the mapping that
    specs built by :func:`planner.resharding.spec.stage_output_spec` need). With ``group``, plan
    rank ``r`` is rank ``r`` of ``group`` (as in :mod:`runtime.parallel.pipeline`); else the global rank."""
    if group is None:
        return {worker.device: worker.rank for worker in plan.workers}
    return {worker.device: dist.get_global_rank(group, worker.rank) for worker in plan.workers}


def byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's rows as bytes, ``(rows, row_bytes)`` uint8, a view (writes land in
    ``tensor``): what a byte-row plan (``itemsize`` 1, rows = samples, as
    :func:`planner.resharding.reshard.boundary_resharding` makes) moves."""
    if not tensor.is_contiguous() or tensor.dim() < 1:
        raise ReshardingRuntimeError(f"resharding: byte_rows needs a contiguous tensor with a batch dimension, got "
                                     f"shape {tuple(tensor.shape)} strides {tensor.stride()}; call .contiguous() "
                                     "first (a destination must be the tensor written, so allocate it contiguous)")
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)

