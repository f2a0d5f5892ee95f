"""Network emulation: transfers between emulated hosts take their modeled time on one machine.

docs/ARCHITECTURE.md section 4. Under emulation every rank runs on one machine, so a real transfer
costs whatever the loopback costs. As with compute (:mod:`runtime.emulation.compute`), the real transfer
happens (results stay exact) and its modeled time is padded on top, never fed by waiting: the
modeled times come from :class:`planner.devices.network.NetworkModel`, the same model the planner and the
simulator price transfers with, so predicted and measured times compare.

Point to point (:meth:`NetworkEmulator.stamp_sends` / :meth:`NetworkEmulator.stamp_receives`): the
sender prices each message when it posts it: ``start = max(now, its host's outgoing NIC free-at,
the destination host's incoming NIC free-at)`` for an inter-host transfer (``now`` inside a host),
``end = start + latency + bytes / bandwidth``, and sends ``end`` along with the data (one float64
stamp per message, tag offset by :data:`STAMP_TAG`, posted after the data in the same batch, so
gloo (peer and tag) and NCCL (order) match it alike). The receiver, after the real receive, sleeps
until the latest ``end``. Each NIC is a serial resource per direction, shared by every process of
its emulated host: a ledger file per host and direction holds its free-at time
(``time.monotonic()``, one clock for all processes of a machine) under ``/dev/shm/whalelike-<run
id>/``, read and advanced behind ``fcntl`` locks (both NICs of a transfer at once, in path order,
so two senders never deadlock). Why files and not a collective: a send must not wait on anyone.

Collectives (:meth:`NetworkEmulator.allreduce_launched` / :meth:`NetworkEmulator.wait_allreduces`,
driven by :mod:`runtime.parallel.data_parallel`'s DDP comm hook): each bucket's all-reduce has a modeled
ready time; the members' ready times are combined by a MAX all-reduce of one float64 launched with
the bucket, so every member computes the same ``end_k = max(latest member's ready_k, end_{k-1}) +
ring cost`` (:meth:`planner.devices.network.Ring.allreduce_ms`), and after the backward the rank sleeps
until the last ``end``. A ring is priced in closed form; it does not take NIC ledger slots.

Benchmark bound (``signal_bytes``): an emulator built with ``signal_bytes=1`` prices every
point-to-point message as one byte, the seed paper's "Signal Send/Recv" (section 4): the data
dependencies stay and the real data still moves (results stay exact), but the modeled transfer
time is one latency, so a run with it is the upper bound a schedule's overlap is measured against
(``bench/pipeline_comm.py``). Only point-to-point messages change; collectives keep their price.
Not a model of any network: never set it outside a benchmark.

Tensor-parallel collectives (:func:`price_group` / :func:`pad_collective`, called by
:mod:`runtime.tensor.layers`'s region ops): the real collective blocks until its last member joins,
then each member sleeps the ring time, so all end at the latest arrival plus the modeled cost. An
asynchronous one (:func:`launch_collective`, the column-parallel input-gradient all-reduce that
overlaps the weight gradient) carries the members' launch times in a MAX all-reduce and ends at
the latest launch plus the ring time, however much compute ran meanwhile.

Not emulated: sharing of a NIC between a collective and point-to-point transfers, transfers of the
loss and of the straggler monitor's figures (one scalar each), evaluation, and a sender's own
wait for its sends (the receiver's sleep carries the transfer; the step's loss all-reduce joins
them). Requires every rank on one machine (the ledger and the stamps share its clock): ranks on
several machines are a :class:`NetworkEmulationError`.

Invariant: a receive never returns before the modeled arrival of any message it took, two
inter-host transfers never hold one NIC (per direction) during overlapping modeled intervals, and
with emulation off nothing here runs (no stamps, no files).
"""
from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from planner.devices.network import INTER_HOST, NetworkModel, Ring
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)

STAMP_TAG = 1 << 30          # a stamp's tag: its message's tag plus this (gloo tags are int32 >= 0)
LEDGER_ENV = "WHALELIKE_NETWORK_LEDGER_DIR"   # where the ledger directories go (default /dev/shm)
_FREE_AT = struct.Struct("d")


class NetworkEmulationError(WhaleError):
    """Network emulation cannot run as configured (the message names the value and the fix)."""


@dataclass
class NetworkStats:
    """Cumulative over an emulator's life. ``sent``/``bytes``: messages this rank posted (stamped),
    ``modeled_s`` their modeled transfer times, ``queued_s`` the time they waited for a busy NIC;
    ``received`` stamped messages taken, ``waited_s`` the time receives slept for their modeled
    arrival, ``unpadded`` batches of receives that returned after it already (the receiver came
    late, or the real transfer was slower than the model);
    ``allreduces``/``allreduce_modeled_s``: bucket all-reduces and their ring costs,
    ``allreduce_waited_s`` the sleep after the backward until their modeled end."""

    sent: int = 0
    bytes: int = 0
    modeled_s: float = 0.0
    queued_s: float = 0.0
    received: int = 0
    waited_s: float = 0.0
    unpadded: int = 0
    allreduces: int = 0
    allreduce_modeled_s: float = 0.0
    allreduce_waited_s: float = 0.0


def default_run_id() -> str:
    """An id shared by the processes of one run and different between runs on one machine:
    torchrun's run id plus the rendezvous address (the port is unique among live runs). Without
    either (ranks started by ``torch.multiprocessing.spawn`` with another init method) the parent
    process's id: the ranks of one launcher share it, where their own ids would give every rank a
    ledger of its own and its interfaces would never be shared."""
    parts = [os.environ.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")]
    if not any(parts):
        return f"ppid{os.getppid()}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(p for p in parts if p))


def _ledger_root() -> str:
    root = os.environ.get(LEDGER_ENV)
    if root:
        return root
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


ONE_MACHINE_WAIT_S = 30.0   # how long a rank waits for the run's other agents' ranks to register on this machine


def _check_one_machine(directory: str) -> None:
    """Raise unless every rank of the run is on this machine (one clock, one NIC ledger). With one
    torchrun agent (``LOCAL_WORLD_SIZE == WORLD_SIZE``) that is so; with several (torchrun agents
    on one machine acting as nodes, ``runtime.elastic``) every rank registers in the ledger
    directory, which is this machine's own (``/dev/shm``), and waits for the others' registrations:
    a rank on another machine never appears. Ranks build their emulators at the same point of the
    Engine's set-up, so the wait is short."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if not local or not world or local == world:
        return
    ranks = os.path.join(directory, "ranks")
    os.makedirs(ranks, exist_ok=True)
    open(os.path.join(ranks, os.environ.get("RANK", "0")), "w").close()
    deadline = time.monotonic() + ONE_MACHINE_WAIT_S
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(ranks, str(r))) for r in range(int(world))):
            return
        time.sleep(0.05)
    raise NetworkEmulationError(
        f"network emulation: WORLD_SIZE={world} ranks but LOCAL_WORLD_SIZE={local}, and the other agents' ranks "
        f"did not appear on this machine within {ONE_MACHINE_WAIT_S:g} s; the emulated network needs every rank "
        "on one machine (one clock, one NIC ledger); run on one machine or remove the cluster spec's emulation block")


class NicLedger:
    """Free-at times of each emulated host's NIC per direction, shared by the processes of one run.

    One 8-byte file per (host, direction) in ``directory``; :meth:`reserve` locks both NICs of a
    transfer, starts it when both are free and the transfer is ready, and advances both. Each
    process registers itself with a marker file; :meth:`close` (also at exit) removes the marker,
    and the last process to leave removes the directory; ledgers whose members all died without
    leaving are removed by the next ledger created under the same root.
    """

    def __init__(self, directory: str, hosts: Sequence[str]):
        self.directory = directory
        self._paths = {}
        for index, host in enumerate(hosts):
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host)
            for direction in ("out", "in"):
                self._paths[host, direction] = os.path.join(directory, f"{index}-{safe}.{direction}")
        self._fds: dict[str, int] = {}
        self._marker = os.path.join(directory, f"member-{os.getpid()}-{id(self)}")
        _remove_stale_ledgers(os.path.dirname(directory) or ".")
        try:
            for attempt in range(3):   # the last process of an earlier use may remove it meanwhile
                os.makedirs(directory, exist_ok=True)
                try:
                    with self._directory_lock():
                        open(self._marker, "w").close()
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        except OSError as e:
            raise NetworkEmulationError(
                f"network emulation: cannot create its NIC ledger directory {directory!r} ({e.strerror or e}); "
                f"set {LEDGER_ENV} to a writable directory on this machine (default /dev/shm)") from e
        self._closed = False
        atexit.register(self.close)

    def _directory_lock(self):
        return _Locked([os.path.join(self.directory, ".lock")])

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def reserve(self, src_host: str, dst_host: str, ready: float, duration: float) -> tuple[float, float]:
        """``(start, end)`` of a transfer out of ``src_host``'s NIC into ``dst_host``'s, ready at
        ``ready`` and lasting ``duration`` (monotonic seconds); both NICs are held until ``end``."""
        paths = [self._paths[src_host, "out"], self._paths[dst_host, "in"]]
        fds = [self._fd(p) for p in paths]
        for path in sorted(paths):   # one order in every process (fd numbers differ between them)
            fcntl.flock(self._fds[path], fcntl.LOCK_EX)
        try:
            free = [_FREE_AT.unpack(data)[0] if len(data) == _FREE_AT.size else 0.0
                    for data in (os.pread(fd, _FREE_AT.size, 0) for fd in fds)]
            start = max(ready, *free)
            end = start + duration
            for fd in fds:
                os.pwrite(fd, _FREE_AT.pack(end), 0)
        finally:
            for fd in fds:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return start, end

    def close(self) -> None:
        """Leave the run's ledger; the last process to leave removes it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        try:
            with _Locked([os.path.join(self.directory, ".lock")]):
                os.remove(self._marker)
                _remove_if_unused(self.directory)
        except OSError as e:   # another process cleaned up first, or the files are gone: nothing to keep
            log.debug("network emulation: ledger cleanup of %s: %s", self.directory, e)


def _remove_if_unused(directory: str) -> bool:
    """Remove ``directory`` (a ledger) if no live process is a member; call it holding its lock.
    A member that died without leaving (killed, ``os._exit``) does not count."""
    members = [name for name in os.listdir(directory) if name.startswith("member-")]
    if any(_alive(name.split("-")[1]) for name in members):
        return False
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    os.rmdir(directory)
    return True


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):   # another user's process, or not a pid: keep it
        return True
    return True


def _remove_stale_ledgers(root: str) -> None:
    """Remove the ledgers under ``root`` whose members all died without leaving (a crashed run)."""
    try:
        names = [name for name in os.listdir(root) if name.startswith("whalelike-")]
    except OSError:
        return
    for name in names:
        directory = os.path.join(root, name)
        try:
            if not any(n.startswith("member-") for n in os.listdir(directory)):
                continue   # being created right now, or not a ledger
            with _Locked([os.path.join(directory, ".lock")]):
                if _remove_if_unused(directory):
                    log.info("network emulation: removed the stale ledger %s of a run that died", directory)
        except OSError as e:
            log.debug("network emulation: stale ledger %s left alone: %s", directory, e)


class _Locked:
    """An exclusive ``flock`` on each of ``paths`` (created if missing), taken in path order."""

    def __init__(self, paths: Sequence[str]):
        self.paths = sorted(paths)
        self.fds: list[int] = []

    def __enter__(self):
        for path in self.paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            self.fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        for fd in reversed(self.fds):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.fds.clear()


class NetworkEmulator:
    """Pads this rank's transfers to their modeled time on the emulated network (module docstring).

    ``model``: the cluster's :class:`~planner.devices.network.NetworkModel`; ``device``: this rank's device
    name; ``run_id`` names the ledger shared with the other processes of the run. ``signal_bytes``
    (benchmarks only, module docstring): price every point-to-point message as that many bytes
    instead of its size; a public attribute, so a benchmark may set it on an emulator a runtime
    built (``engine.emulator.network.signal_bytes = 1``).
    """

    def __init__(self, model: NetworkModel, device: str, run_id: Optional[str] = None,
                 ledger_root: Optional[str] = None, signal_bytes: Optional[int] = None):
        self.model = model
        self.device = device
        self.host = model.host_of(device)
        self.signal_bytes = signal_bytes
        if signal_bytes is not None:
            self._signal_size()   # a bad value fails here, before any message
        directory = os.path.join(ledger_root or _ledger_root(), f"whalelike-{run_id or default_run_id()}")
        self.ledger = NicLedger(directory, model.hosts)
        _check_one_machine(directory)
        self.stats = NetworkStats()
        self._rings: dict[tuple[str, ...], Ring] = {}
        self._allreduces: list[tuple[torch.Tensor, object, float]] = []   # (ready stamp, its work, ring seconds)
        self.last_allreduce_end: Optional[float] = None   # monotonic modeled end of the last backward's all-reduce

    @classmethod
    def of_cluster(cls, cluster, device: str, run_id: Optional[str] = None) -> Optional["NetworkEmulator"]:
        """The emulator of ``device`` on ``cluster``, or None when the cluster is not emulated."""
        if cluster.emulation is None:
            return None
        return cls(NetworkModel.of_cluster(cluster), device, run_id)

    # -- point to point ------------------------------------------------------------------------------
    def schedule_send(self, nbytes: int, dst_device: str, ready: Optional[float] = None) -> float:
        """Modeled arrival (monotonic seconds) of ``nbytes`` sent now (or at ``ready``) to
        ``dst_device``; an inter-host transfer takes its NICs' next free slot. With
        ``signal_bytes`` set, the message is priced as that many bytes (``stats.bytes`` still
        counts the real ones)."""
        ready = time.monotonic() if ready is None else ready
        link = self.model.link(self.device, dst_device)
        duration = link.time_ms(nbytes if self.signal_bytes is None else self._signal_size()) * 1e-3
        if link.kind == INTER_HOST and duration > 0:
            start, end = self.ledger.reserve(link.src_host, link.dst_host, ready, duration)
        else:
            start, end = ready, ready + duration
        self.stats.sent += 1
        self.stats.bytes += int(nbytes)
        self.stats.modeled_s += duration
        self.stats.queued_s += start - ready
        return end

    def _signal_size(self) -> int:
        size = self.signal_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise NetworkEmulationError(f"network emulation: signal_bytes must be an int >= 0 (the size every "
                                        f"point-to-point message is priced as, e.g. 1), got {size!r}; or None "
                                        f"to price messages by their size")
        return size

    def stamp_sends(self, ops: list, devices: Sequence[str]) -> list:
        """``ops`` (``isend`` P2POps, ``devices[i]`` the device of ``ops[i]``'s peer) followed by one
        stamp per op carrying its modeled arrival."""
        ready = time.monotonic()
        stamps = []
        for op, device in zip(ops, devices, strict=True):
            end = self.schedule_send(op.tensor.numel() * op.tensor.element_size(), device, ready)
            stamp = torch.tensor([end], dtype=torch.float64, device=op.tensor.device)
            stamps.append(dist.P2POp(dist.isend, stamp, op.peer, op.group, _stamp_tag(op.tag)))
        return [*ops, *stamps]

    def stamp_receives(self, ops: list) -> tuple[list, "Arrival"]:
        """``ops`` (``irecv`` P2POps) followed by a receive of each one's stamp; wait for the real
        receives, then call the returned :class:`Arrival`'s ``wait``."""
        stamps = [torch.zeros(1, dtype=torch.float64, device=op.tensor.device) for op in ops]
        extra = [dist.P2POp(dist.irecv, stamp, op.peer, op.group, _stamp_tag(op.tag)) for op, stamp in zip(ops, stamps)]
        return [*ops, *extra], Arrival(self, stamps)

    # -- collectives ---------------------------------------------------------------------------------
    def ring(self, devices: Sequence[str]) -> Ring:
        key = tuple(devices)
        if key not in self._rings:
            self._rings[key] = self.model.ring(key)
        return self._rings[key]

    def allreduce_launched(self, ready: float, nbytes: int, devices: Sequence[str],
                           group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        """Record a bucket all-reduce of ``nbytes`` over ``devices`` (the group's, in rank order)
        that this rank could start at ``ready`` (monotonic seconds): launches the MAX all-reduce
        of the ready times (before the bucket's own all-reduce, which the caller launches next)."""
        stamp = torch.tensor([ready], dtype=torch.float64, device=device)
        work = dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._allreduces.append((stamp, work, self.ring(devices).allreduce_ms(nbytes) * 1e-3))

    def wait_allreduces(self) -> None:
        """After the backward (every bucket's real all-reduce done): sleep until the last bucket's
        modeled end, ``end_k = max(latest member's ready_k, end_{k-1}) + ring cost``."""
        if not self._allreduces:
            return
        end = 0.0
        for stamp, work, seconds in self._allreduces:
            work.wait()
            end = max(float(stamp.item()), end) + seconds
            self.stats.allreduces += 1
            self.stats.allreduce_modeled_s += seconds
        self._allreduces.clear()
        self.last_allreduce_end = end
        left = end - time.monotonic()
        if left > 0:
            time.sleep(left)
            self.stats.allreduce_waited_s += left

    def close(self) -> None:
        self.ledger.close()


# -- tensor-parallel collectives ---------------------------------------------------------------------
# process group -> (its ranks' emulator on this process, the ring of its devices in group rank order)
_PRICED_GROUPS: dict = {}


def price_group(group: dist.ProcessGroup, network: NetworkEmulator, devices: Sequence[str]) -> None:
    """Pad the blocking collectives :mod:`runtime.tensor.layers` runs on ``group`` (a tensor-parallel
    group; ``devices`` in its rank order) to their ring time on the emulated network."""
    if network.device not in devices:
        raise NetworkEmulationError(f"network emulation: this rank's device {network.device!r} is not in the group's "
                                    f"devices {list(devices)}; pass the devices of the group it belongs to")
    _PRICED_GROUPS[group] = (network, network.ring(devices))


def _ring_seconds(ring: Ring, kind: str, nbytes: int) -> float:
    """``"allreduce"`` of ``nbytes`` per member or ``"allgather"`` of ``nbytes`` in all, on ``ring``."""
    if kind not in ("allreduce", "allgather"):
        raise NetworkEmulationError(f"network emulation: collective kind {kind!r}; use 'allreduce' or 'allgather'")
    return (ring.allreduce_ms(nbytes) if kind == "allreduce" else ring.allgather_ms(nbytes)) * 1e-3


def pad_collective(group: Optional[dist.ProcessGroup], kind: str, nbytes: int) -> None:
    """After a blocking collective of ``kind`` (``"allreduce"``: ``nbytes`` per member;
    ``"allgather"``: ``nbytes`` in total) on a :func:`price_group` group: sleep its modeled ring
    time. The real collective returns once its last member has joined, so every member ends at the
    latest member's arrival plus the ring time, as the model says, without exchanging stamps.
    No-op for a group that is not priced (emulation off)."""
    priced = _PRICED_GROUPS.get(group) if group is not None else None
    if priced is None:
        return
    network, ring = priced
    seconds = _ring_seconds(ring, kind, nbytes)
    network.stats.allreduces += 1
    network.stats.allreduce_modeled_s += seconds
    if seconds > 0:
        time.sleep(seconds)
        network.stats.allreduce_waited_s += seconds


def launch_collective(group: Optional[dist.ProcessGroup], kind: str, nbytes: int,
                      device: torch.device) -> Optional["PendingCollective"]:
    """For an asynchronous collective on a :func:`price_group` group, launched just before this
    call: launch the MAX all-reduce of the members' launch times (one float64, same group, same
    order on every member) and return what :meth:`PendingCollective.wait` needs to sleep until
    ``latest launch + ring time`` once both are done. None for a group that is not priced."""
    priced = _PRICED_GROUPS.get(group) if group is not None else None
    if priced is None:
        return None
    network, ring = priced
    seconds = _ring_seconds(ring, kind, nbytes)
    stamp = torch.tensor([time.monotonic()], dtype=torch.float64, device=device)
    work = dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return PendingCollective(network, stamp, work, seconds)


class PendingCollective:
    """An asynchronous tensor-parallel collective's modeled end (see :func:`launch_collective`)."""

    def __init__(self, network: NetworkEmulator, stamp: torch.Tensor, work, seconds: float):
        self.network, self.stamp, self.work, self.seconds = network, stamp, work, seconds

    def wait(self) -> None:
        """After the collective's own wait: sleep until the latest member's launch plus its ring time."""
        self.work.wait()
        end = float(self.stamp.item()) + self.seconds
        stats = self.network.stats
        stats.allreduces += 1
        stats.allreduce_modeled_s += self.seconds
        left = end - time.monotonic()
        if left > 0:
            time.sleep(left)
            stats.allreduce_waited_s += left


class Arrival:
    """The stamps of one batch of receives: :meth:`wait` sleeps until the latest modeled arrival."""

    def __init__(self, network: NetworkEmulator, stamps: list[torch.Tensor]):
        self.network = network
        self.stamps = stamps

    def wait(self) -> None:
        if not self.stamps:
            return
        end = max(float(s.item()) for s in self.stamps)
        stats = self.network.stats
        stats.received += len(self.stamps)
        left = end - time.monotonic()
        if left > 0:
            time.sleep(left)
            stats.waited_s += left
        else:
            stats.unpadded += 1


def _stamp_tag(tag: int) -> int:
    if not 0 <= tag < STAMP_TAG:
        raise NetworkEmulationError(f"network emulation: message tag {tag} is outside [0, {STAMP_TAG}); stamps use "
                                    f"tag + {STAMP_TAG}, so tags must stay below it (fewer micro-batches or values)")
    return tag + STAMP_TAG
