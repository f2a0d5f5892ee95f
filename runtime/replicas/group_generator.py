"""P-Reduce's group generators (Prague, Luo et al., ASPLOS'20): who averages with whom after each step.

Under Prague's partial all-reduce (:mod:`runtime.replicas.partial_sync`) every worker of a
data-parallel group, after its own optimizer step, asks a *group generator* for a group and averages
its parameters with that group's members only. Behind one interface (:class:`GroupGenerator`:
``group(iteration)`` gives this rank's group for its ``iteration``-th P-Reduce, global ranks in
ascending order, itself included) there are the paper's two generators:

* **static** (:class:`StaticGenerator`, :func:`static_division`): a fixed, conflict-free schedule,
  every worker computing it alone from its own iteration count (no communication at all, the
  paper's "cost of conflict avoidance is cheaper"). Iterations alternate inter-host groups (even
  iterations: consecutive members of the hosts interleaved) and intra-host groups (odd: each host's
  members among themselves), rotating who meets whom (the circle method) so that the groups of a
  period connect every worker. One host: every iteration is a new rotation. A group size of the
  whole data-parallel group gives one group of everyone every iteration: synchronous averaging.
  Its weakness is the paper's: a worker waits for its scheduled partners, slow or not.
* **smart** (:class:`SmartGroups` served by :class:`GeneratorService`, asked by
  :class:`SmartGenerator`): the paper's randomized group division, inter-intra alternation and
  threshold rule, with one departure, the *arrival window* (below). A *division*
  (:func:`random_division`) partitions all workers at once (inter-host and intra-host divisions
  alternate); a request takes the requester's group of the division in force (a new division when
  the requester has none left), keeping only the members that (a) are free (not parked at a
  barrier, not named in or waiting in another open group), (b) pass the threshold rule
  ``c_w > c_i - Δc``, where ``c`` counts each worker's requests and ``i`` is the requester: a worker
  ``Δc`` requests behind (a straggler) is left out of a fast worker's group and catches up on its
  own requests, while a lagging requester still pulls fast workers in (Prague's leeway), and (c)
  are *due*: expected at their own request within the window. The kept members are named in the
  group and join it at their next request (or park, below); the group is answered to all of them
  at once when every member still in it is there, so every member of an answered group is at its
  request and the point-to-point average never waits for a worker that computes.

  The arrival window (the departure, issue 30). In the paper a kept member is bound to the group
  whatever it is doing, and the requester waits for it in the collective; a member in the middle of a
  slow step is only seen as a straggler by the count rule once that step is over, so a fast worker
  waited out the rest of a 5x step (measured on bench/prague.py: waits of 180-310 ms for a 65 ms step,
  smart P-Reduce at 71-80% of its no-wait bound). Here the service clocks every worker: a worker
  computes from its last answer to its next request, its *step time* is the lower quartile of its last
  :data:`DURATIONS` such spans (its usual step: slow ones do not count), and it is expected at its
  last answer plus its step time. It is *due* when that expected arrival lies between
  :data:`WAIT_LATE` of its step time before now and the requester's *patience* after (each at least
  :data:`WAIT_FLOOR_S`, the timing noise of a busy host): :data:`WAIT_AHEAD` of a step for a requester
  ahead of the slowest worker in requests (the slowest sets the run's pace, so a worker ahead of it
  waits at no cost to the run while it stays ahead), only the late share for the slowest, whose every
  wait lengthens the run. A group waits for a member until its *limit*, its expected arrival plus the
  late share, and drops it then (it is in a step slower than its own: a straggler; it asks afresh when
  it comes). A requester whose division leaves its group short takes other due workers, those whose
  own division group has nobody due first; one with nobody due takes the place of a member still
  awaited in a group that waits (that member, the one with the latest limit, asks afresh when it
  comes), so nobody waits more for it. So a requester waits at most for partners due within a quarter
  step (the slowest: a tenth), and for a straggler at most a tenth of its step past its expected
  arrival. Before a worker's first answer its arrival is unknown (every worker's first step): a group
  waits for it without limit, as the paper's would (every worker reaches its first request before any
  barrier). :class:`SmartGroups` without a clock is the paper's generator exactly (groups final when
  formed, members fetching them at their next request), kept for the decisions' unit tests.

  Such a group must never be waited for by a worker that is in a *barrier* (a collective of every
  member: a checkpoint, an evaluation, the straggler monitor's exchange, the caller's own): a
  worker *parks* before the barriers it knows of (:meth:`SmartGroups.park`: it joins at once a
  group it is named in, and is given none until its next request); a barrier it does not announce
  (the Engine's batch check every 100 steps) costs the others at most its limit. A pipeline's loss
  all-reduce and fp16's overflow vote are barriers inside every step before the request, so those
  plans run the static generator (:mod:`planner.plan_checks`), as should runs with global-norm
  clipping (the sync policy refuses it).

Why no process group per subset: groups form at run time, and a group per possible subset is
``2^N`` communicators. P-Reduce runs point-to-point operations on the data-parallel group
(:mod:`runtime.replicas.partial_sync`); the smart generator runs on the rendezvous store every rank
already has (torch's ``TCPStore``), not on a collective: a request is one ``queue_push``, the answer
one blocking ``queue_pop`` on a connection of the rank's own (``Store.clone``; a blocking pop on a
shared connection would stall the Engine's progress records and heartbeats). One request and one
answer a step per worker: the service's clock needs no other message (an earlier unpark message at
each step's first forward doubled the service's load, and at 16 ranks on 2 cores requests queued
for 22 ms at the median). The service is three daemon threads on the group's lowest rank: one pops
requests and pushes answers (it is the only one deciding), one writes a heartbeat every
:data:`BEAT_S` and watches the members' Engine heartbeats (:mod:`runtime.distributed`), one wakes
the first at the groups' next limit (a ``tick`` request). Requests and answers are logged at debug
level.

Failures end every rank with a :class:`GroupGeneratorError`, never a hang: a member whose process
died is reported by the service in every later answer (the threshold rule would otherwise leave it
behind for ever and the others would train on without it); a service that dies (an exception, its
threads stopped) leaves an error key or stops its heartbeat, and every waiting client raises once
the heartbeat is ``silence_s`` old or ``timeout_s`` has passed, naming the generator's rank; an
unreachable store (its host, rank 0, gone) is said so.

Shutdown: the service's threads never outlive the interpreter. A daemon thread still inside a store
call (the serving thread waits in a blocking ``queue_pop`` between requests) when the interpreter
finalizes aborts the whole process: the store call returns, the thread cannot take the interpreter
lock back, and the thread's exit unwinds through torch's C++ frames (``terminate called without an
active exception``, SIGABRT). Finalization is also when rank 0's store closes, which wakes that very
call. So every live service is closed (:meth:`GeneratorService.close`: its threads told to stop, the
blocking pop woken by a ``stop`` request, both joined) at ``atexit``, before finalization, whether the
run ended normally or with an error; a store that closes under a serving thread (its host ended
first) ends the thread quietly, since the ranks still asking for groups are told by their own
connections (an unreachable store, a stopped heartbeat: named errors on every rank).

Invariant: every worker of a group gets that same group (static: one pure function of the
iteration; smart: one service deciding each request in arrival order, answering a group only when
all its members are at their request or park), each worker is named in at most one group at a time,
and a worker named in a group either joins it at its next request or park or is dropped from it at
its limit, so no group waits past its members' limits (after their first step) and none for a
parked worker.
"""
from __future__ import annotations

import atexit
import datetime
import itertools
import json
import logging
import math
import random
import statistics
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from whalelike.errors import WhaleError

log = logging.getLogger(__name__)

BEAT_S = 0.25            # the smart generator's heartbeat period
SILENCE_S = 10.0         # a heartbeat this old (or none this long) means the generator is gone
WAIT_SLICE_S = 1.0       # a client re-checks the generator's health this often while it waits for an answer
CLOSE_JOIN_S = 5.0       # how long closing a service waits for each of its threads to end
WAIT_AHEAD = 0.25        # a group waits for a member expected within this share of its step time ahead...
WAIT_LATE = 0.1          # ...and up to this share of its step time late (later: a straggler in a slow step)
WAIT_FLOOR_S = 0.005     # ...or this many seconds, if more (timing noise: the GIL's 5 ms switch interval)
DURATIONS = 8            # a worker's step time is the median of its latest DURATIONS steps
REQUESTS, BEAT, ERROR = "requests", "beat", "error"


class GroupGeneratorError(WhaleError):
    """P-Reduce's group generator failed, or a member of the group died; the message names which."""


class GroupGenerator(Protocol):
    """This rank's source of P-Reduce groups (see the module docstring)."""

    name: str

    def group(self, iteration: int) -> tuple[int, ...]: ...

    def park(self, iteration: int) -> Optional[tuple[int, ...]]: ...

    def close(self) -> None: ...


def check_settings(members: Sequence[int], group_size: int, delta_c: int = 1) -> None:
    """The settings every generator needs: two or more members (P-Reduce on one device has nothing to
    average), a group size of 2 up to the members' count, a threshold ``Δc >= 1``."""
    if len(members) < 2:
        raise GroupGeneratorError(f"P-Reduce on ranks {list(members)}: a stage on one device has no replica to "
                                  "average with; use replica_sync 'ddp' (or give the region two or more devices)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 2 <= group_size <= len(members):
        raise GroupGeneratorError(f"P-Reduce group size {group_size!r} on {len(members)} workers (ranks "
                                  f"{list(members)}): it must be an integer in 2..{len(members)} "
                                  f"({len(members)}: every worker, every step)")
    if isinstance(delta_c, bool) or not isinstance(delta_c, int) or delta_c < 1:
        raise GroupGeneratorError(f"P-Reduce threshold Δc {delta_c!r}: it must be an integer >= 1 (a worker joins "
                                  "a requester's group only if it lags it by fewer than Δc requests; 2 lets "
                                  "workers in step join each other)")


def _by_host(members: Sequence[int], hosts: Sequence[str]) -> dict[str, list[int]]:
    if len(members) != len(hosts):
        raise GroupGeneratorError(f"P-Reduce: {len(members)} members {list(members)} but {len(hosts)} hosts "
                                  f"{list(hosts)}; give one host per member")
    out: dict[str, list[int]] = defaultdict(list)
    for rank, host in sorted(zip(members, hosts)):
        out[host].append(rank)
    return dict(out)


def _chunks(seq: Sequence[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(sorted(seq[i:i + size])) for i in range(0, len(seq), size)]


def _rotation(ranks: list[int], r: int) -> list[int]:
    """The circle method: the first rank stays, the others turn by ``r`` places, so consecutive
    pairs change every round and the first rank meets everyone within ``len - 1`` rounds."""
    if len(ranks) < 3:
        return list(ranks)
    rest = ranks[1:]
    k = r % len(rest)
    return [ranks[0], *rest[k:], *rest[:k]]


def static_division(members: Sequence[int], hosts: Sequence[str], group_size: int,
                    iteration: int) -> list[tuple[int, ...]]:
    """The static generator's groups at ``iteration``: a partition of ``members`` (every member in
    exactly one group; the last group of a host or of the interleaving may be smaller, a group of one
    skips averaging). Even iterations group across hosts, odd ones within hosts (one host: every
    iteration within it, a new rotation each time); ``iteration // 2`` turns the rotation. A group
    size of every member gives one group of all of them at every iteration."""
    check_settings(members, group_size)
    if not isinstance(iteration, int) or iteration < 0:
        raise GroupGeneratorError(f"P-Reduce iteration {iteration!r}: an integer >= 0")
    by_host = _by_host(members, hosts)
    if group_size >= len(members):   # everyone, every iteration: synchronous averaging
        return [tuple(sorted(members))]
    if len(by_host) == 1:
        return _chunks(_rotation(next(iter(by_host.values())), iteration), group_size)
    r = iteration // 2
    if iteration % 2 == 1:   # intra-host
        return [g for ranks in by_host.values() for g in _chunks(_rotation(ranks, r), group_size)]
    names = list(by_host)
    order = names[r % len(names):] + names[:r % len(names)]
    turned = {h: by_host[h][(i * r) % len(by_host[h]):] + by_host[h][:(i * r) % len(by_host[h])]
              for i, h in enumerate(names)}
    longest = max(len(v) for v in by_host.values())
    seq = [turned[h][j] for j in range(longest) for h in order if j < len(turned[h])]
    return _chunks(seq, group_size)


class StaticGenerator:
    """The static generator on ``rank``: :func:`static_division` at this rank's own iteration count."""

    name = "static"

    def __init__(self, rank: int, members: Sequence[int], hosts: Sequence[str], group_size: int):
        check_settings(members, group_size)
        if rank not in members:
            raise GroupGeneratorError(f"P-Reduce: rank {rank} is not a member of {list(members)}")
        self.rank, self.members, self.hosts, self.group_size = rank, tuple(members), tuple(hosts), group_size

    def group(self, iteration: int) -> tuple[int, ...]:
        group = next(g for g in static_division(self.members, self.hosts, self.group_size, iteration)
                     if self.rank in g)
        log.debug("static group generator: rank %d iteration %d -> %s", self.rank, iteration, group)
        return group

    def park(self, iteration: int) -> Optional[tuple[int, ...]]:
        """Nothing to take at a barrier: a static group's members all average at the same iteration."""
        return None

    def close(self) -> None:
        """Nothing to stop: the schedule is computed locally."""


def random_division(members: Sequence[int], hosts: Sequence[str], group_size: int, rng: random.Random,
                    inter: bool) -> list[tuple[int, ...]]:
    """A randomized group division of every member at once (a partition into groups of
    ``group_size``, the last ones possibly smaller): ``inter`` interleaves the hosts (shuffled, and
    each host's members shuffled) so that a group spans hosts; otherwise each host's members are
    shuffled and grouped among themselves. One host: a shuffle of all members."""
    check_settings(members, group_size)
    by_host = {h: list(v) for h, v in _by_host(members, hosts).items()}
    if group_size >= len(members):
        return [tuple(sorted(members))]
    for ranks in by_host.values():
        rng.shuffle(ranks)
    if len(by_host) == 1:
        return _chunks(next(iter(by_host.values())), group_size)
    if not inter:
        return [g for ranks in by_host.values() for g in _chunks(ranks, group_size)]
    order = list(by_host)
    rng.shuffle(order)
    longest = max(len(v) for v in by_host.values())
    return _chunks([by_host[h][j] for j in range(longest) for h in order if j < len(by_host[h])], group_size)


@dataclass
class _Open:
    """A group formed at a request and not yet answered to every member: ``group`` its members (ascending;
    with a clock, a member dropped at its limit leaves it), ``arrived`` those at their request (without a
    clock: those that fetched it), ``limits`` (with a clock) the latest time each member not yet arrived is
    waited for."""

    group: list
    arrived: set
    limits: dict


class SmartGroups:
    """The smart generator's decisions (pure: no threads, no store), in request order.

    ``members``: the data-parallel group's global ranks; ``hosts``: each member's host (same order);
    ``group_size``, ``delta_c``: the groups' size and the threshold rule's Δc; ``seed``: the
    divisions' random stream (every run of the same requests gives the same groups); ``ahead``,
    ``late`` (shares of a worker's step time) and ``floor_s`` (seconds): the arrival window (module
    docstring).

    Two ways to use it. Without a clock (``now`` None in every call) it is the paper's generator: a
    group is final when formed, the requester gets it at once and the members fetch it at their next
    request or park, whenever they come; a worker parked between steps is given no group until it
    unparks. With a clock (``now``: when the service received the message, ``time.monotonic()``;
    what :class:`GeneratorService` runs) a worker computes from the moment its last group was
    answered until its next request (no unpark), its step time is the median of its latest such
    spans, a group keeps only members *due* (:meth:`due`), the requester's answer waits until every
    member still in the group has arrived, and a member not there by its limit is dropped from it
    (:meth:`expire`); answers decided for other waiting members are taken with :meth:`take_ready`.
    """

    def __init__(self, members: Sequence[int], hosts: Sequence[str], group_size: int, delta_c: int, seed: int = 0,
                 *, ahead: float = WAIT_AHEAD, late: float = WAIT_LATE, floor_s: float = WAIT_FLOOR_S):
        check_settings(members, group_size, delta_c)
        if not (0 <= ahead and 0 <= late and 0 <= floor_s):
            raise GroupGeneratorError(f"P-Reduce arrival window ahead={ahead!r}, late={late!r}, floor_s={floor_s!r}: "
                                      "each >= 0 (shares of a step time, and seconds)")
        order = sorted(zip(members, hosts))
        self.members = tuple(m for m, _ in order)
        self.hosts = tuple(h for _, h in order)
        self.group_size, self.delta_c, self.ahead, self.late, self.floor_s = group_size, delta_c, ahead, late, floor_s
        self.count = {r: 0 for r in self.members}       # c_w: requests so far
        self.parked: set[int] = set()                    # ranks at a barrier: given no group until they ask again
        self.pending: dict[int, int] = {}                # rank -> id of the open group it is named in, not reached yet
        self.open: dict[int, _Open] = {}                 # id -> a group some member has not reached (or fetched)
        self.division: dict[int, tuple[int, ...]] = {}   # the division in force: rank -> its group in it
        self.divisions = 0
        self.started: dict[int, float] = {}             # clock: when each computing rank was last answered
        self.durations = {r: deque(maxlen=DURATIONS) for r in self.members}   # clock: answered to next request, s
        self._step_time: dict[int, float] = {}           # clock: each rank's usual step (step_time)
        self.ready: dict[int, tuple[int, ...]] = {}      # clock: answers decided for ranks waiting at a request
        self._ids = itertools.count()
        self._rng = random.Random(seed)

    def divide(self) -> list[tuple[int, ...]]:
        """The next division: inter-host first, then intra-host, alternating."""
        inter = self.divisions % 2 == 0
        self.divisions += 1
        return random_division(self.members, self.hosts, self.group_size, self._rng, inter)

    def free(self, rank: int) -> bool:
        """Whether ``rank`` may be given a group now: not parked, none pending, and in no open group (one
        it waits in, or one it fetched that some member has not)."""
        return (rank not in self.parked and rank not in self.pending
                and not any(rank in g.group for g in self.open.values()))

    def waiting(self, rank: int) -> bool:
        """Whether ``rank`` is at its request (or park) in a group not yet answered (clock only)."""
        return any(rank in g.arrived and rank in g.group for g in self.open.values())

    # -- the clock --------------------------------------------------------------------------------------
    def step_time(self, rank: int) -> float:
        """``rank``'s usual step time (clock): the lower quartile of its latest spans from an answer to its
        next request, so slow steps (up to three in four) do not count (none yet: the median of every
        rank's; none at all: 0)."""
        if rank in self._step_time:
            return self._step_time[rank]
        known = list(self._step_time.values())
        return statistics.median(known) if known else 0.0

    def expected(self, rank: int) -> Optional[float]:
        """When ``rank``, computing, should reach its request (clock): its last answer plus its step time;
        None for a rank never answered (its first step)."""
        began = self.started.get(rank)
        return None if began is None else began + self.step_time(rank)

    def _slack(self, rank: int, share: float) -> float:
        return max(share * self.step_time(rank), self.floor_s)

    def due(self, rank: int, now: Optional[float], ahead: Optional[float] = None) -> bool:
        """Whether a group may wait for ``rank``: always without a clock, or before its first answer (every
        rank computes its first step then); otherwise when its expected arrival lies within ``ahead`` (the
        requester's share, :meth:`patience`; default :attr:`ahead`) of its step time after ``now`` and
        ``late`` of it before (or ``floor_s``, if more). Further ahead it is mid-step (waiting would cost
        the requester that much); later it is in a step slower than its usual: a straggler, which the
        threshold rule on counts only sees once that step is over."""
        at = None if now is None else self.expected(rank)
        share = self.ahead if ahead is None else ahead
        return at is None or now - self._slack(rank, self.late) <= at <= now + self._slack(rank, share)

    def patience(self, rank: int) -> float:
        """How far ahead (a share of a step time) requester ``rank`` waits for a partner: :attr:`ahead` when
        it is ahead of the slowest worker in requests (the slowest sets the run's pace, so the time it
        waits costs the run nothing while it stays ahead), only :attr:`late` when it is the slowest (its
        every wait would lengthen the run)."""
        return self.ahead if self.count[rank] > min(self.count.values()) else self.late

    def limit(self, rank: int) -> float:
        """The latest time a group waits for ``rank`` (clock): its expected arrival plus ``late`` of its step
        time (or ``floor_s``); no limit before its first answer."""
        at = self.expected(rank)
        return math.inf if at is None else at + self._slack(rank, self.late)

    def _arrived_at(self, rank: int, now: Optional[float]) -> None:
        """``rank`` is at its request or park at ``now`` (clock): the span since its last answer is over."""
        began = None if now is None else self.started.pop(rank, None)
        if began is not None:
            self.durations[rank].append(now - began)
            self._step_time[rank] = sorted(self.durations[rank])[len(self.durations[rank]) // 4]

    def _answered(self, group: Sequence[int], now: Optional[float]) -> None:
        """``group``'s members get their answer at ``now`` (clock): each computes from here (unless parked)."""
        if now is not None:
            for w in group:
                if w not in self.parked:
                    self.started[w] = now

    # -- the decisions ----------------------------------------------------------------------------------
    def _member(self, rank: int) -> None:
        if rank not in self.count:
            raise GroupGeneratorError(f"P-Reduce group generator: rank {rank} asked for a group, but the members "
                                      f"are {list(self.members)}")

    def _arrive(self, rank: int, now: Optional[float]) -> Optional[tuple[int, ...]]:
        """``rank`` reaches the open group it is named in: its group, or None while it waits (clock)."""
        self.count[rank] += 1
        gid = self.pending.pop(rank)
        g = self.open[gid]
        g.arrived.add(rank)
        g.limits.pop(rank, None)
        if now is None:   # the paper's: final since formed, fetched by each member
            if g.arrived >= set(g.group):
                del self.open[gid]
            return tuple(g.group)
        return self._settle(gid, now, rank)

    def _settle(self, gid: int, now: float, rank: Optional[int] = None) -> Optional[tuple[int, ...]]:
        """Answer an open group whose members have all arrived (clock): ``rank``'s group, the others' in
        :attr:`ready`; None while some member is still waited for."""
        g = self.open[gid]
        if not set(g.group) <= g.arrived:
            return None
        del self.open[gid]
        group = tuple(g.group)
        self._answered(group, now)
        for w in group:
            if w != rank:
                self.ready[w] = group
        return group if rank is not None else None

    def park(self, rank: int, now: Optional[float] = None) -> Optional[tuple[int, ...]]:
        """``rank`` reaches a barrier (a collective of every member at one step: a whole-group average,
        the straggler monitor's exchange, the sync policy's decision): it takes the group a lagging
        worker gave it, if any (it averages in it now, so the lagging worker is not left waiting for
        a rank that waits in the barrier), and is given no group until its next :meth:`request`. With a
        clock the group is answered once its other members are there (:meth:`waiting` says it waits)."""
        self._member(rank)
        self.parked.add(rank)
        self._arrived_at(rank, now)
        return self._arrive(rank, now) if rank in self.pending else None

    def unpark(self, rank: int) -> None:
        """``rank`` computes a step again (without a clock: the start of its next step): it may be given a
        group (fetched at its next request)."""
        self._member(rank)
        self.parked.discard(rank)

    def request(self, rank: int, park: bool = False, now: Optional[float] = None) -> Optional[tuple[int, ...]]:
        """``rank``'s group for its next P-Reduce (see the module docstring); ``park``: and park it
        right after (:meth:`park`: the end of its step, without a clock), in the same decision. With a
        clock, None means the rank waits for its group (:meth:`take_ready`)."""
        self._member(rank)
        self.parked.discard(rank)
        self._arrived_at(rank, now)
        group = self._arrive(rank, now) if rank in self.pending else self._form(rank, now)
        if park:
            self.parked.add(rank)
        return group

    def _form(self, rank: int, now: Optional[float]) -> Optional[tuple[int, ...]]:
        self.count[rank] += 1
        if rank not in self.division:
            self.division = {w: g for g in self.divide() for w in g}
        mine, patience = self.count[rank], self.patience(rank)

        def joins(w: int) -> bool:
            return (w != rank and self.free(w) and self.count[w] > mine - self.delta_c
                    and self.due(w, now, patience))

        kept = [w for w in self.division[rank] if joins(w)]
        if now is not None and not kept:
            joined = self._join_waiting(rank, now)
            if joined is not None:
                self.division.pop(rank, None)
                return self._settle(joined, now, rank)
        if now is not None and len(kept) < self.group_size - 1:
            kept += self._fill(rank, kept, joins)
        group = tuple(sorted([rank, *kept]))
        for w in group:
            self.division.pop(w, None)
        if len(group) == 1:
            self._answered(group, now)
            return group
        gid = next(self._ids)
        self.open[gid] = _Open(list(group), {rank}, {} if now is None else {w: self.limit(w) for w in kept})
        for w in kept:
            self.pending[w] = gid
        return group if now is None else None

    def _join_waiting(self, rank: int, now: float) -> Optional[int]:
        """(Clock) The requester has no partner due: it takes the place of a member still awaited in the
        group that has waited longest among those whose arrived members pass the threshold rule against
        it (the awaited member with the latest limit leaves, free to ask afresh); that group's id, or
        None. Nobody waits more for this: the group was waiting anyway."""
        mine = self.count[rank]
        for gid, g in sorted(self.open.items()):
            awaited = [w for w in g.group if w not in g.arrived]
            if awaited and all(self.count[w] > mine - self.delta_c for w in g.arrived):
                leaving = max(awaited, key=lambda w: (g.limits.get(w, math.inf), w))
                g.group.remove(leaving)
                g.limits.pop(leaving, None)
                del self.pending[leaving]
                g.group = sorted([*g.group, rank])
                g.arrived.add(rank)
                return gid
        return None

    def _fill(self, rank: int, kept: list, joins) -> list:
        """(Clock) The requester's division leaves its group short (members not due: stragglers, or
        mid-step): other due workers fill it, first those whose own division group holds no other due
        worker (nobody they would meet), then the soonest expected."""
        def alone(w: int) -> bool:
            return not any(v != w and joins(v) for v in self.division.get(w, ()))

        others = [w for w in self.members if w not in kept and w not in self.division.get(rank, ()) and joins(w)]
        others.sort(key=lambda w: (not alone(w), self.expected(w) or 0.0, w))
        return others[:self.group_size - 1 - len(kept)]

    def expire(self, now: float) -> None:
        """(Clock) Drop from their groups the members not arrived by their limits (each then asks afresh
        at its request), and answer the groups left complete (:attr:`ready`)."""
        for gid, g in list(self.open.items()):
            late = [w for w, limit in g.limits.items() if limit <= now and w not in g.arrived]
            for w in late:
                g.group.remove(w)
                del g.limits[w]
                del self.pending[w]
            if late:
                self._settle(gid, now)

    def next_deadline(self) -> Optional[float]:
        """(Clock) The earliest limit of a member still waited for, or None."""
        limits = [t for g in self.open.values() for w, t in g.limits.items() if w not in g.arrived and t < math.inf]
        return min(limits) if limits else None

    def take_ready(self) -> dict[int, tuple[int, ...]]:
        """(Clock) The answers decided for waiting ranks since the last call."""
        ready, self.ready = self.ready, {}
        return ready


# -- the smart generator on the rendezvous store ----------------------------------------------------------
def _store_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


def _store_closed(e: BaseException) -> bool:
    """Whether a store call failed because the store's connection closed (its host ended or died)."""
    from torch.distributed import DistNetworkError

    return isinstance(e, DistNetworkError)


def _own_connection(store, timeout_s: float):
    """A connection of its own to ``store`` (same keys and prefix), so a blocking pop on it stalls
    no other user of the store; ``timeout_s`` bounds each blocking call."""
    try:
        clone = store.clone()
        clone.set_timeout(datetime.timedelta(seconds=timeout_s))
        clone.queue_len("whalelike/preduce/probe")
    except RuntimeError as e:   # NotImplementedError is one
        if not isinstance(e, NotImplementedError) and "not implemented" not in str(e).lower():
            raise
        raise GroupGeneratorError(
            f"P-Reduce's smart group generator needs a rendezvous store with queues and connections of its own "
            f"(torch's TCPStore: torchrun, or init_process_group with env:// or tcp://); this run's store is "
            f"{type(store).__name__} ({e}); start the run with torchrun / env://, or use the static generator "
            "(StagePlan.partial_generator 'static', Config(partial_generator='static'))") from None
    return clone


class GeneratorService:
    """The smart generator, served on the data-parallel group's lowest rank (see the module docstring).

    ``store``: the rendezvous store (its keys under ``prefix``); ``groups``: the decisions. Threads
    start at once; :meth:`close` stops them. ``heartbeats``: reads a member's Engine heartbeat (JSON
    of :mod:`runtime.distributed`, None when it has none) for the dead-member check.
    """

    def __init__(self, store, prefix: str, groups: SmartGroups, *, host_rank: int,
                 heartbeat_key=None, beat_s: float = BEAT_S, silent_after: float = SILENCE_S):
        from torch.distributed import PrefixStore

        self.prefix, self.groups, self.host_rank, self.beat_s = prefix, groups, host_rank, beat_s
        self.silent_after = silent_after
        self._heartbeat_key = heartbeat_key
        self._raw = _own_connection(store, 3600.0)
        self._serve_store = PrefixStore(prefix, self._raw)
        self._beat_raw = _own_connection(store, 60.0)
        self._beat_store = PrefixStore(prefix, self._beat_raw)
        self._tick_raw = _own_connection(store, 60.0)
        self._tick_store = PrefixStore(prefix, self._tick_raw)
        self.failure: Optional[str] = None
        self.served = 0
        self._stop = threading.Event()
        self._deadline: Optional[float] = None       # the groups' next limit, for the tick thread
        self._deadline_changed = threading.Condition()
        self._beat_store.set(BEAT, repr(time.time()))
        self._threads = [threading.Thread(target=self._serve, name=f"whalelike-preduce-generator-{prefix}",
                                          daemon=True),
                         threading.Thread(target=self._beat, name=f"whalelike-preduce-beat-{prefix}", daemon=True),
                         threading.Thread(target=self._tick, name=f"whalelike-preduce-tick-{prefix}", daemon=True)]
        with _LIVE_LOCK:
            _LIVE.add(self)
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self._serve_store.queue_pop(REQUESTS, block=True).decode()
                except RuntimeError as e:
                    if _store_timeout(e):
                        continue
                    raise
                if item == "stop" or self._stop.is_set():
                    return
                now = time.monotonic()
                if item != "tick":
                    self._decide(item, now)
                self.groups.expire(now)
                for rank, group in self.groups.take_ready().items():
                    self._answer(rank, ",".join(map(str, group)))
                with self._deadline_changed:
                    self._deadline = self.groups.next_deadline()
                    self._deadline_changed.notify()
        except Exception as e:   # noqa: BLE001 (any failure must reach the waiting ranks, not vanish with the thread)
            if self._stop.is_set() or _store_closed(e):
                # closed, or the store's host ended first: a normal end here (ranks still asking are told by
                # their own connections, see the module docstring)
                log.debug("P-Reduce group generator %s: the store closed, serving stops: %s", self.prefix, e)
                return
            self._fail(f"P-Reduce's group generator on rank {self.host_rank} failed: {type(e).__name__}: {e}")

    def _decide(self, item: str, now: float) -> None:
        """One member's message (``RANK COUNT KIND``, kind ``request`` or ``park``), received at ``now``;
        answers what is decided now."""
        rank, count, kind = item.split()
        rank = int(rank)
        if self.failure is not None:
            self._answer(rank, "error " + self.failure)
            return
        if kind == "park":
            group = self.groups.park(rank, now)
        else:
            group = self.groups.request(rank, now=now)
        if group is None and self.groups.waiting(rank):
            log.debug("P-Reduce group generator %s: rank %d %s %s waits for its group", self.prefix, rank, kind, count)
            return
        self._answer(rank, ",".join(map(str, group)) if group is not None else "none")

    def _answer(self, rank: int, answer: str) -> None:
        log.debug("P-Reduce group generator %s: rank %d -> %s", self.prefix, rank, answer)
        self._serve_store.queue_push(f"answers/{rank}", answer)
        self.served += 1

    def _tick(self) -> None:
        """Wake the serving thread (a ``tick`` request) at the groups' next limit, so a rank waiting for a
        member that does not come is answered then, not at the next message."""
        while not self._stop.is_set():
            with self._deadline_changed:
                deadline = self._deadline
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is None or wait > 0:
                    self._deadline_changed.wait(wait)
                    continue
                self._deadline = None   # one tick per limit; the serving thread sets the next one
            try:
                self._tick_store.queue_push(REQUESTS, "tick")
            except Exception as e:  # noqa: BLE001 (the store is gone: the clients will say so)
                log.debug("P-Reduce group generator %s: tick stopped: %s", self.prefix, e)
                return

    def _beat(self) -> None:
        next_check = 0.0
        while not self._stop.wait(self.beat_s):
            try:
                self._beat_store.set(BEAT, repr(time.time()))
                if self._heartbeat_key is not None and time.monotonic() >= next_check and self.failure is None:
                    next_check = time.monotonic() + 1.0
                    dead = self._dead_member()
                    if dead is not None:
                        self._fail(dead)
            except Exception as e:  # noqa: BLE001 (the store is gone: the clients will say so)
                log.debug("P-Reduce group generator %s: heartbeat stopped: %s", self.prefix, e)
                return

    def _dead_member(self) -> Optional[str]:
        """A line naming the members whose processes died (from their Engine heartbeats), or None."""
        from runtime.distributed import liveness

        now = time.time()
        dead = []
        for rank in self.groups.members:
            key = self._heartbeat_key(rank)
            if not self._beat_raw.check([key]):
                continue
            kind, detail = liveness(json.loads(self._beat_raw.get(key)), now, self.silent_after)
            if kind == "dead":
                dead.append(f"rank {rank}: {detail}")
        if not dead:
            return None
        return (f"{'; '.join(dead)}. A dead member of the P-Reduce group {list(self.groups.members)} never averages "
                f"again, so the group generator (rank {self.host_rank}) stopped forming groups; restart the run from "
                "its last checkpoint")

    def _fail(self, message: str) -> None:
        self.failure = message
        log.error("%s", message)
        try:
            self._beat_store.set(ERROR, message)
        except Exception as e:  # noqa: BLE001
            log.debug("P-Reduce group generator %s: could not record its failure: %s", self.prefix, e)

    def kill(self) -> None:
        """Stop serving and beating without a word, as if the generator had died (for fault tests)."""
        self._stop.set()
        with self._deadline_changed:
            self._deadline_changed.notify()
        try:
            self._beat_store.queue_push(REQUESTS, "stop")
        except Exception as e:  # noqa: BLE001
            log.debug("P-Reduce group generator %s: stop request failed: %s", self.prefix, e)

    def close(self) -> None:
        """Stop the service and wait for its threads to end (a client asking afterwards times out with an
        error). Called for every live service at ``atexit`` (see the module docstring)."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self.kill()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=CLOSE_JOIN_S)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("P-Reduce group generator %s: threads %s still run %g s after close", self.prefix, alive,
                        CLOSE_JOIN_S)


_LIVE: set[GeneratorService] = set()   # the services not yet closed, closed at exit
_LIVE_LOCK = threading.Lock()


def close_services() -> int:
    """Close every live :class:`GeneratorService` of this process (registered with ``atexit``: no
    service thread may be inside a store call when the interpreter finalizes); the number closed."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for service in live:
        service.close()
    return len(live)


atexit.register(close_services)


class SmartGenerator:
    """A rank's client of the smart generator: each :meth:`group` pushes a request and waits for the
    answer on a connection of its own, checking every :data:`WAIT_SLICE_S` that the generator lives.

    ``service``: the :class:`GeneratorService` when this rank hosts it (closed with this client).
    ``silence_s``: a heartbeat this old means the generator is gone; ``timeout_s``: the longest wait
    for one answer.
    """

    name = "smart"

    def __init__(self, store, prefix: str, rank: int, members: Sequence[int], *, host_rank: int,
                 service: Optional[GeneratorService] = None, silence_s: float = SILENCE_S, timeout_s: float = 300.0):
        from torch.distributed import PrefixStore

        self.rank, self.members, self.host_rank = rank, tuple(members), host_rank
        self.prefix, self.service, self.silence_s, self.timeout_s = prefix, service, silence_s, timeout_s
        self._raw = _own_connection(store, WAIT_SLICE_S)
        self._store = PrefixStore(prefix, self._raw)
        self.requests = 0
        self._started = time.monotonic()

    def group(self, iteration: int) -> tuple[int, ...]:
        """This rank's group for its next P-Reduce: one request, answered once every member is there."""
        return self._ask("request", iteration)

    def park(self, iteration: int) -> Optional[tuple[int, ...]]:
        """At a barrier: the group a worker gave this rank meanwhile (average in it now), or None; no
        group is given to this rank until its next :meth:`group` (:meth:`SmartGroups.park`)."""
        return self._ask("park", iteration)

    def _ask(self, kind: str, iteration: int) -> Optional[tuple[int, ...]]:
        self.requests += 1
        start = time.monotonic()
        try:
            self._store.queue_push(REQUESTS, f"{self.rank} {self.requests} {kind}")
            while True:
                try:
                    answer = self._store.queue_pop(f"answers/{self.rank}", block=True).decode()
                    break
                except RuntimeError as e:
                    if not _store_timeout(e):
                        raise
                    self._check(start, iteration)
        except GroupGeneratorError:
            raise
        except RuntimeError as e:
            raise GroupGeneratorError(
                f"rank {self.rank}, P-Reduce iteration {iteration}: the rendezvous store is unreachable ({e}); its "
                "host, rank 0, has likely died or stopped") from e
        if answer.startswith("error "):
            raise GroupGeneratorError(f"rank {self.rank}, P-Reduce iteration {iteration}: {answer[6:]}")
        if answer == "none":
            log.debug("P-Reduce rank %d parked (iteration %d): no group", self.rank, iteration)
            return None
        group = tuple(int(v) for v in answer.split(","))
        if self.rank not in group:
            raise GroupGeneratorError(f"rank {self.rank}, P-Reduce iteration {iteration}: the group generator "
                                      f"answered {group}, which does not hold this rank")
        log.debug("P-Reduce rank %d %s %d (iteration %d) -> %s", self.rank, kind, self.requests, iteration, group)
        return group

    def _check(self, start: float, iteration: int) -> None:
        """While waiting for an answer: raise if the generator reported a failure, went silent, or
        left this request unanswered past ``timeout_s``."""
        where = (f"rank {self.rank}, P-Reduce iteration {iteration}: the group generator on rank {self.host_rank} "
                 f"has not answered request {self.requests} for {time.monotonic() - start:.1f} s")
        if self._store.check([ERROR]):
            raise GroupGeneratorError(f"{where}; it reported: {self._store.get(ERROR).decode()}")
        if self.service is not None and self.service._stop.is_set():
            raise GroupGeneratorError(f"{where}; it was stopped on this rank (it died)")
        now = time.time()
        beat = float(self._store.get(BEAT).decode()) if self._store.check([BEAT]) else None
        if beat is None and time.monotonic() - self._started > self.silence_s:
            raise GroupGeneratorError(f"{where}, and it never started (no heartbeat in {self.silence_s:g} s): rank "
                                      f"{self.host_rank} failed before serving; its own error says why")
        if beat is not None and now - beat > self.silence_s:
            raise GroupGeneratorError(f"{where}, and its heartbeat stopped {now - beat:.1f} s ago: the generator "
                                      f"died (rank {self.host_rank} is dead, stopped or its generator thread "
                                      "ended); every rank of the group stops here")
        if time.monotonic() - start > self.timeout_s:
            raise GroupGeneratorError(f"{where} (timeout {self.timeout_s:g} s) although its heartbeat goes on: it is "
                                      "stuck; every rank of the group stops here")

    def close(self) -> None:
        """Stop the service if this rank hosts it."""
        if self.service is not None:
            self.service.close()
            self.service = None
