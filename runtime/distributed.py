"""Process-group set-up and the failure messages of a distributed step.

Under ``torchrun`` every rank finds ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in its
environment; :func:`init` turns them into the default process group (gloo on CPU, nccl with CUDA)
with a timeout, so a rank that never arrives fails the others within that bound instead of hanging.

A failed collective says little by itself ("Connection closed by peer", "Timed out waiting 5000ms
for recv"). :class:`Progress` records in the default group's key-value store where each rank is,
so when a collective fails the survivors can name the culprit:

* the step each rank has begun and how many Engine-level collectives of it it has entered (a
  small ``set`` written by the heartbeat's thread: the first of a step at once, later ones at most
  every 50 ms, the latest then; none in a world of one rank, which has no peer to read them): a
  rank that never reached the step, or that began it but never entered the collective the others
  wait in, is named;
* a heartbeat: a daemon thread per rank writes a timestamp, the PID and the seconds spent inside
  the current compute segment (:meth:`runtime.emulation.compute.Emulator.busy_for`) every
  ``timeout_s / 12`` seconds (0.1 to 5): no collective, a few hundred bytes. A rank whose
  heartbeat is older than ``min(timeout_s / 2, 6 beats)`` is stopped (SIGSTOP), dead, or hung in
  native code; a rank with a fresh heartbeat that has been inside one compute segment that long
  is alive but stuck in its compute (an endless loop). Peers on the same machine (host and PID
  namespace) are also looked up by PID, which tells stopped from dead.

Why not torch's ``monitored_barrier``: it names the ranks that miss a barrier, but it is a
collective of its own (a per-step cost, gloo only) and cannot tell a stopped rank from one stuck in
its compute; NCCL's watchdog watches its own process only.

Invariant: only the failure path reads the store, so a healthy step costs one ``set`` when it
begins and at most one more per 50 ms, plus the heartbeat, all written by the heartbeat's thread
(the step only posts its record there: no store round trip on the training thread); a record is
in the store within 50 ms of its collective's entry; a ``set`` that finds the store gone is dropped (rank 0
may exit after the run's last collective while its peers still record the step's last hooks). Heartbeat ages compare wall clocks across hosts, which
assumes clocks synchronised to well under ``timeout_s / 2`` (NTP gives milliseconds). The store
lives on rank 0; if rank 0 is gone, the message says so.

Work every rank would do alike, done by rank 0 and sent to the others (:class:`MeasuredOnce`,
:func:`from_rank0`). Why: at start every rank captures the same model and, without a plan file,
plans it; measuring a capture's costs on fake tensors and planning are pure functions of inputs
every rank has, so repeating them on each rank is only CPU (seconds a rank for a ``transformers``
model, on a machine whose cores the ranks share). Rank 0 does them and broadcasts the result over
the default group; the others wait in that broadcast, within the job's collective timeout.
:class:`MeasuredOnce` is capture's measuring step (``capture(share=...)``): each rank still traces
its own model, since a trace is bound to its process's tensors, and takes rank 0's figures only
under an equal :func:`whalelike.graphs.capture.measure_key`, else measures itself.
:func:`from_rank0` gives rank 0's value (the plan made at start), or its error, to every rank.
Invariant: every rank enters the same collectives once each (:class:`MeasuredOnce`: an all-gather
of the keys, then the broadcast; :func:`from_rank0`: the broadcast), whatever happens in the work
it wraps (an error, a cache hit that skips the work), so no rank waits for one that never comes;
the result is what each rank would have computed itself. Why not torch's ``broadcast_object_list``
alone: it is the transport; what is added is the agreement on when the result applies (the key)
and that errors travel too.
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from planner.plan import Plan, PlanError

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedStepError(RuntimeError):
    """A collective of a training step failed or timed out; names the rank, the step and the peers
    that never reached it."""


# gloo reports timeouts and dead peers as plain RuntimeErrors ("Timed out waiting 3000ms for recv
# operation", "Connection closed by peer", "Application timeout caused pair closure" when a peer hangs inside
# a DDP all-reduce); newer torch raises DistError subclasses for some.
_TRANSPORT_FAILURE = re.compile(r"gloo|nccl|timed out|timeout caused|pair closure|connection (closed|reset|refused)|"
                                r"by peer|broken pipe",
                                re.IGNORECASE)

_PEER_CLOSED = re.compile(r"connection (closed|reset)|by peer|broken pipe", re.IGNORECASE)


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` comes from a failed or timed-out collective rather than from the model."""
    return isinstance(error, dist.DistError) or bool(_TRANSPORT_FAILURE.search(str(error)))


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def torchrun_missing() -> list[str]:
    """The variables of torchrun's environment this process lacks (none once the default group is
    initialised: a process that set up torch.distributed itself runs without them)."""
    return [] if dist.is_initialized() else [v for v in _TORCHRUN_VARS if v not in os.environ]


def launched() -> tuple[int, int]:
    """``(rank, world_size)`` of this run: the default group's if initialised, else torchrun's."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = torchrun_missing()
    if missing:
        raise RuntimeError(f"runtime.Engine must run under torchrun (environment lacks {', '.join(missing)}): "
                           "launch with `torchrun --nproc_per_node N script.py`, or initialise "
                           "torch.distributed yourself before creating the Engine")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def check_world_size(plan: Plan, world_size: int, rank: int) -> None:
    """Raise on every rank (no communication, so no rank can hang) when the plan needs another world."""
    if plan.world_size != world_size:
        raise PlanError(
            f"rank {rank}: the plan has {plan.world_size} workers (cluster {plan.cluster!r}) but this run has "
            f"{world_size} ranks; launch `torchrun --nproc_per_node {plan.world_size} ...`, or make a plan for "
            f"{world_size} devices with `whalelike plan`"
        )


def init(timeout_s: float) -> int:
    """Initialise the default process group from the torchrun environment unless it exists; returns
    this rank. A rank that never arrives makes the others fail after ``timeout_s`` seconds."""
    if dist.is_initialized():
        return dist.get_rank()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        dist.init_process_group(backend(), store=_attempt_store(store, rank, world, timeout_s), rank=rank,
                                world_size=world, timeout=timeout)
    except (dist.DistError, RuntimeError) as e:
        raise DistributedStepError(
            f"rank {rank}: process-group initialisation failed within timeout_s={timeout_s:g} s: not all {world} "
            f"ranks arrived at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (a rank died before "
            f"starting, or WORLD_SIZE is wrong). Cause: {e}"
        ) from e
    log.info("rank %d of %d: %s process group initialised (timeout %g s)", rank, world, backend(), timeout_s)
    return rank


def _attempt_store(store: "dist.Store", rank: int, world: int, timeout_s: float) -> "dist.Store":
    """A store no earlier start of the workers has written to, for this start's process group.

    Why: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``, the static rendezvous of
    ``--master-port`` and the c10d one of ``--rdzv-backend c10d`` alike) outlives the workers it
    restarts, so restarted workers would read the previous start's gloo addresses and time out
    connecting to ranks that no longer exist. A prefix of the restart attempt is not enough: under
    the elastic agent each node counts its own restarts (a node that joins starts at 0, a survivor
    does not count a membership change), so ranks of one rendezvous may disagree on it. So rank 0
    hosts a fresh store of its own for this start (on its node, ``MASTER_ADDR``) and advertises its
    port under :data:`_FRESH_KEY` in the agent store; the other ranks connect to the port advertised
    and check its nonce. A port left there by an earlier start belonged to a worker the agent has
    stopped (every worker of a rendezvous round is stopped before the next round), so connecting
    fails and they read the key again. Outside torchrun's agent store the store is already fresh."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return store
    timeout = datetime.timedelta(seconds=timeout_s)
    host = os.environ["MASTER_ADDR"]
    if rank == 0:
        nonce = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        fresh = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        fresh.set(_FRESH_NONCE, nonce)
        store.set(_FRESH_KEY, f"{fresh.port} {nonce}")
        return fresh
    deadline = time.monotonic() + timeout_s
    while True:
        store.wait([_FRESH_KEY], timeout)
        port, nonce = store.get(_FRESH_KEY).decode().split()
        try:   # a plain connection first: torch's client logs every failed try at length
            socket.create_connection((host, int(port)), timeout=_FRESH_PROBE_S).close()
            fresh = dist.TCPStore(host, int(port), world, is_master=False,
                                  timeout=datetime.timedelta(seconds=_FRESH_PROBE_S))
            if fresh.get(_FRESH_NONCE).decode() == nonce:
                fresh.set_timeout(timeout)
                return fresh
        except (OSError, dist.DistError, RuntimeError):
            pass       # an earlier start's rank 0, stopped: this start's rank 0 has not advertised yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank 0 advertised no store of this start within {timeout_s:g} s")
        time.sleep(0.05)


_FRESH_KEY = "whalelike/worker-store"        # in the agent store: "PORT NONCE" of this start's store
_FRESH_NONCE = "whalelike/worker-store-nonce"
_FRESH_PROBE_S = 2.0                         # how long a connection to an advertised port is tried


class Progress:
    """Where each rank is, kept in the default group's store (see the module docstring): the step
    and the count of Engine-level collectives it has entered (written when it enters one), and a
    heartbeat written by a daemon thread."""

    def __init__(self, rank: int, world_size: int, timeout_s: float = 300.0,
                 computing: Optional[Callable[[], Optional[float]]] = None, store: Optional[dist.Store] = None):
        self.rank, self.world_size = rank, world_size
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.step, self.entered = -1, 0
        self._entered_at = time.monotonic()
        interval = min(5.0, max(0.1, timeout_s / 12))
        self.silent_after = min(timeout_s / 2, 6 * interval)   # a heartbeat older than this has stopped
        self._beat = _Heartbeat.attach(self.store, rank, interval, computing)

    def enter(self, step: int) -> None:
        """This rank enters an Engine-level collective of ``step``: the record is posted to the
        heartbeat thread, which writes it to the store at once (no round trip on this thread). A
        store found gone (rank 0 may exit after the run's last collective while its peers still
        record that step's hooks) stops the records: they are a diagnostic, and were it a failure the
        next collective fails and :meth:`failure` says the store is unreachable."""
        began = step != self.step
        if began:
            self.step, self.entered = step, 0
        self.entered += 1
        self._entered_at = time.monotonic()
        # a world of one rank has no peer to read its records; the first record of a step is written
        # at once (a rank stopped or stuck right after beginning a step must be seen to have begun it)
        if self.world_size > 1 and not self._beat.lost:
            self._beat.post(_progress_key(self.rank), f"{step} {self.entered}", now=began)

    def failure(self, step: int, timeout_s: float, cause: BaseException) -> DistributedStepError:
        """The error to raise when a collective of ``step`` failed on this rank."""
        return DistributedStepError(
            f"rank {self.rank}, step {step}: a collective failed or timed out (timeout_s={timeout_s:g} s); "
            f"{self._suspects(step, cause)}. Cause: {cause}"
        )

    def _suspects(self, step: int, cause: BaseException) -> str:
        entered = self.entered if step == self.step else 0
        waited = time.monotonic() - self._entered_at
        try:   # read the store at once: its host, rank 0, may be a survivor about to exit
            records = {}
            for r in range(self.world_size):
                if r != self.rank:
                    reached, beat = self._read(_progress_key(r)), self._read(heartbeat_key(r))
                    records[r] = (tuple(map(int, reached.split())) if reached is not None else None,
                                  json.loads(beat) if beat is not None else None)
        except Exception as e:  # the store itself is gone: its host, rank 0, is the likely casualty
            return (f"the progress store on rank 0 is unreachable ({type(e).__name__}), so rank 0 has likely died "
                    "or is stopped")
        if _PEER_CLOSED.search(str(cause)):
            time.sleep(0.1)   # a peer's sockets close a moment before its process is gone: let it finish dying
        now = time.time()
        found = [_diagnose(r, where, liveness(beat, now, self.silent_after), step, entered, waited)
                 for r, (where, beat) in records.items()]
        found = [line for line in found if line]
        if not found:
            return f"every rank began step {step}, so a rank failed or died during it"
        return "; ".join(found)

    def _read(self, key: str) -> Optional[str]:
        return self.store.get(key).decode() if self.store.check([key]) else None


def _diagnose(rank: int, where: Optional[tuple[int, int]], liveness: tuple[str, str], step: int, entered: int,
              waited: float) -> Optional[str]:
    """One peer's line of the failure message, or None when it is where this rank is and alive."""
    kind, detail = liveness
    reached, reached_entered = where if where is not None else (None, 0)
    if reached is None or reached < step:
        head = f"rank {rank} never reached step {step} (last began: {'none' if reached is None else f'step {reached}'})"
        return f"{head}; {detail}" if detail else head
    if reached == step and reached_entered < entered:
        head = (f"rank {rank} began step {step} but has not entered its collective {entered} of the step for "
                f"{waited:.1f} s (it entered {reached_entered})")
        return f"{head}; {detail}" if detail else head
    if kind in ("alive", "unknown"):
        return None
    return f"rank {rank} began step {step} but {detail}"


def liveness(beat: Optional[dict], now: float, silent_after: float) -> tuple[str, str]:
    """``(kind, text)`` about a peer from its heartbeat: dead, stopped, silent, computing, alive or
    unknown. A peer on this machine (same host and PID namespace) is also looked up by its PID."""
    if beat is None:
        return "unknown", ""
    age, pid = now - beat["time"], beat["pid"]
    if beat["machine"] == _MACHINE:
        state = _process_state(pid)
        if state is None or state in "ZX":
            return "dead", f"it has died (its process, PID {pid} on this machine, is gone)"
        if state in "Tt":
            return "stopped", (f"it is stopped (PID {pid} on this machine, state {state}: SIGSTOP, ctrl-Z or a "
                               f"debugger; `kill -CONT {pid}` resumes it)")
    if age > silent_after:
        return "silent", (f"its heartbeat stopped {age:.1f} s ago: it is hung in native code that holds the "
                          f"interpreter lock, stopped, or dead (PID {pid} on {beat['machine'].split()[0]})")
    if beat["computing_s"] is not None and beat["computing_s"] + age > silent_after:
        return "computing", (f"it has been inside one compute segment for {beat['computing_s'] + age:.1f} s "
                             f"although alive (heartbeat {age:.1f} s ago): its computation is stuck (an endless "
                             f"loop or a deadlock in the model) or far slower than its plan")
    return "alive", f"it is alive (heartbeat {age:.1f} s ago)"


def _process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` on this machine (``/proc/PID/stat``): None if it is gone,
    ``"?"`` where there is no ``/proc`` to ask."""
    if not os.path.isdir("/proc/self"):
        return "?"
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _machine() -> str:
    """This machine's identity for PID look-ups: host name, boot id (host names repeat across
    containers and clusters) and PID namespace."""
    parts = [socket.gethostname()]
    for path, read in (("/proc/sys/kernel/random/boot_id", lambda path: Path(path).read_text().strip()),
                       ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(read(path))
        except OSError:
            parts.append("-")
    return " ".join(parts)


_MACHINE = _machine()


# the most often a rank's progress record is written to the store (seconds): a record posted within
# this time of the last write waits, and only the latest posted by then is written
RECORD_EVERY_S = 0.05


class _Heartbeat:
    """One daemon thread per process writing this rank's heartbeat every ``interval`` seconds:
    wall-clock time, PID, machine, and seconds inside the current compute segment; and, as soon as
    it is posted, the latest :class:`Progress` record (:meth:`post`): the training thread hands it
    over and goes on, so a step pays no store round trip for it (one per Engine-level collective
    was ~1 ms each under load, most of the runtime's own per-step cost on one rank). Records are
    written at most once per :data:`RECORD_EVERY_S`, the latest posted by then (a write and the
    thread's wake-up still cost 0.2-0.4 ms of a step's CPU on one rank when made twice a step,
    ``bench/overhead.py``); a failure is diagnosed seconds later (``timeout_s``), by when the last
    record is written. The latest :class:`Progress` (Engine) of the process is the one reported."""

    _current: Optional["_Heartbeat"] = None
    _lock = threading.Lock()

    def __init__(self, store, rank: int, interval: float, computing):
        self.store, self.rank, self.interval, self.computing = store, rank, interval, computing
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pending: Optional[tuple[str, str]] = None
        self._scheduled = False           # a record is posted and the thread will write it
        self._urgent = False              # ... at once
        self.lost = False                 # the store (rank 0) is gone: nothing more is written
        self._thread = threading.Thread(target=self._run, name=f"whalelike-heartbeat-rank{rank}", daemon=True)

    @classmethod
    def attach(cls, store, rank: int, interval: float, computing) -> "_Heartbeat":
        with cls._lock:
            beat = cls._current
            if beat is not None and beat.store is store and beat.rank == rank and beat._thread.is_alive():
                beat.interval, beat.computing = interval, computing
                return beat
            if beat is not None:
                beat._halt()
            cls._current = cls(store, rank, interval, computing)
            cls._current.publish()
            cls._current._thread.start()
            return cls._current

    def post(self, key: str, value: str, now: bool = False) -> None:
        """Have ``key`` set to ``value`` in the store by the thread within :data:`RECORD_EVERY_S`, or
        at once if ``now`` (replacing a record posted before it that the thread has not written
        yet). A post that is not ``now`` wakes the thread only when no write is scheduled: it rides
        the one scheduled."""
        self._pending = (key, value)
        if now:
            self._urgent = True
            self._wake.set()
        elif not self._scheduled:
            self._scheduled = True
            self._wake.set()

    def publish(self) -> None:
        computing = self.computing() if self.computing is not None else None
        self.store.set(heartbeat_key(self.rank), json.dumps(
            {"time": time.time(), "pid": os.getpid(), "machine": _MACHINE, "computing_s": computing}))

    def _halt(self) -> None:
        self._stop.set()
        self._wake.set()

    @classmethod
    def stop_at_exit(cls) -> None:
        """Stop the heartbeat before the interpreter shuts down (``atexit``): a daemon thread still
        inside a store call when finalization begins aborts the process (C++ ``std::terminate``) if
        the store's host, rank 0, exited first; since each start's store lives on rank 0, that is
        the normal end of a run for every other rank."""
        with cls._lock:
            beat, cls._current = cls._current, None
        if beat is not None:
            beat._halt()
            if beat._thread.is_alive():
                beat._thread.join(timeout=max(1.0, 2 * beat.interval))

    def _run(self) -> None:
        due = time.monotonic() + self.interval
        written = float("-inf")     # when the last record was written
        while True:
            self._wake.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            if self._scheduled and not self._urgent:   # at most one record per RECORD_EVERY_S: the latest then
                wait = written + RECORD_EVERY_S - time.monotonic()
                if wait > 0 and self._wake.wait(wait) and self._stop.is_set():
                    return
                self._wake.clear()
            self._scheduled = self._urgent = False
            pending, self._pending = self._pending, None
            try:
                if pending is not None:
                    self.store.set(*pending)
                    written = time.monotonic()
                if time.monotonic() >= due:
                    self.publish()
                    due = time.monotonic() + self.interval
            except Exception as e:  # the store (rank 0) is gone: the collectives will say so
                self.lost = True
                log.debug("rank %d: heartbeat stopped: %s", self.rank, e)
                return


atexit.register(_Heartbeat.stop_at_exit)


def _progress_key(rank: int) -> str:
    return f"whalelike/progress/rank{rank}"


def heartbeat_key(rank: int) -> str:
    return f"whalelike/heartbeat/rank{rank}"


# -- work done once, by rank 0 ------------------------------------------------------------------------
T = TypeVar("T")
Collective = Callable[[Callable[[], Any]], Any]


def _direct(fn: Callable[[], Any]) -> Any:
    return fn()


def _broadcast(payload: Any, enter: Collective) -> Any:
    box = [payload]
    enter(lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def _many() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


class MeasuredOnce:
    """A :data:`whalelike.graphs.capture.MeasureShare` for the ranks of a job capturing the same model
    at once (see the module docstring). The ranks first gather their keys (one small all-gather): a
    rank whose key equals rank 0's waits for rank 0's figures; one whose key differs (another kind of
    GPU, another example batch) measures at once, alongside rank 0, so a mixed cluster starts no
    later than when every rank measured. Then rank 0 broadcasts. Call :meth:`finish` after the
    capture, also when it raised (``with MeasuredOnce(rank) as share: capture(..., share=share)``
    does): it takes part in both collectives if the capture did not (the capture reused this
    process's figures, or failed before measuring). Rank 0's measuring failing
    is sent as such and raised there; the others then measure, and fail alike. ``enter`` runs each
    collective (an Engine's :meth:`runtime.rank.RankRuntime.collective`, which names a failed peer)."""

    def __init__(self, rank: int, enter: Collective = _direct):
        self.rank, self.enter = rank, enter
        self.done = not _many()

    def __call__(self, key: str, measure: Callable[[], Any]) -> Any:
        if self.done:
            return measure()
        self.done = True
        same = self._rank0_key(key) == key
        if self.rank != 0:
            if not same:                       # measured here, alongside rank 0
                figures = measure()
                _broadcast(None, self.enter)
                return figures
            _, figures = _broadcast(None, self.enter)   # rank 0 sends (its key, figures or None)
            return figures if figures is not None else measure()   # None: rank 0 failed, so does this one
        try:
            figures = measure()
        except BaseException:
            _broadcast((key, None), self.enter)
            raise
        _broadcast((key, figures), self.enter)
        return figures

    def __enter__(self) -> "MeasuredOnce":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self._rank0_key(None)
            _broadcast(None, self.enter)

    def _rank0_key(self, key: Optional[str]) -> Optional[str]:
        keys: list = [None] * dist.get_world_size()
        self.enter(lambda: dist.all_gather_object(keys, key))
        return keys[0]


def from_rank0(make: Callable[[], T], rank: int, enter: Collective = _direct) -> T:
    """``make()`` run on rank 0 and its value (or the exception it raised) given to every rank;
    ``make()`` itself where there is one rank. The others wait for it within the collective's
    timeout."""
    if not _many():
        return make()
    if rank == 0:
        try:
            value: Optional[T] = make()
        except Exception as e:  # noqa: BLE001 - sent, then raised here too
            _broadcast(("error", _sendable(e)), enter)
            raise
        _broadcast(("value", value), enter)
        return value
    kind, value = _broadcast(None, enter)
    if kind == "error":
        raise value
    return value


def _sendable(error: Exception) -> Exception:
    """``error`` if it survives pickling (the broadcast pickles it), else a
    :class:`whalelike.errors.WhaleError` with its class name and text."""
    import pickle

    from whalelike.errors import WhaleError

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return WhaleError(f"{type(error).__name__}: {error}")
