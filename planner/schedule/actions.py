"""Pipeline schedules as data: for each stage, the ordered list of its actions.

An :class:`Action` is one of

* compute: ``F`` (forward), ``B`` (the whole backward), ``BI`` (its input half: the gradients of
  the values the stage received, which the previous stage waits for) and ``BW`` (its weight half:
  the parameters' gradients, which nobody needs before the optimizer step);
* transfer: ``SEND_F``/``RECV_F`` (a forward's values to / from stage ``peer``) and
  ``SEND_B``/``RECV_B`` (a backward's gradients to / from stage ``peer``).

A *schedule* (:func:`build_schedule`) lists each stage's compute actions only: GPipe, 1F1B,
eager-1F1B and ZB-H1 are written here, gradient accumulation for one stage alone. A *program*
(:mod:`planner.schedule.program`) is a schedule lowered onto a plan's boundaries: every transfer
written out where it happens (a receive right before the compute that needs it, a send right after
the compute that made it), and each stage's backward whole or split as the stage can run it. The
program is what the deadlock proof (:mod:`planner.schedule.deadlock`), the simulator
(:mod:`planner.schedule.simulator`) and the runtime (``runtime.parallel.pipeline``) all read, so
what is proven and simulated is what runs. Receives block, sends do not (``isend``).

**ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, the H1 schedule): stage ``s``
of ``S`` warms up with 1F1B's ``S - s - 1`` forwards, then runs cycles of one forward, one input
half and one weight half, except that its first ``s`` cycles leave their weight half out; those
``s`` weight halves run at the end, where 1F1B leaves stage ``s`` idle while the last gradients
travel to stage 0. The input halves, on the critical path, go upstream as soon as they are
computed. The memory bound is H1's: every stage holds at most ``S`` micro-batches whose weight half
has not run (1F1B's largest in-flight count, stage 0's; a later stage holds more than it does under
1F1B, ``S`` instead of ``S - s``, and the memory model prices each stage at its own count). With
equal stages (forward ``f``, input and weight halves ``b/2`` each) the step is ``m (f + b) + (S - 1) f``
where 1F1B takes ``(m + S - 1)(f + b)``. The order is fixed, not derived from stage times: any
stage times keep it matched and deadlock-free (proven per plan); unequal stages only change how
much of the drain the deferred weight halves fill.

Why not ``torch.distributed.pipelining``'s actions (``_Action``, ``_add_send_recv``): its lowering
pairs one rank per stage and one micro-batch shape for all, and its schedules are classes run by
its own stage objects; here a stage is a device group with uneven shares per worker, a
send or receive is a cross-mesh resharding (``runtime.parallel.boundaries``), and the same lists
must be priced by the planner's simulator and proven in one process before any rank starts. The
action kinds are the same ideas (F, I, W, SEND/RECV) kept as plain data.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from whalelike.config import SCHEDULES as SCHEDULE_NAMES

COMPUTE = ("F", "B", "BI", "BW")
TRANSFERS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + TRANSFERS
# the schedules whose lists split every backward into BI and BW (the others use B)
SPLIT_SCHEDULES = ("zb-h1",)


@dataclass(frozen=True)
class Action:
    """One step of a stage's list: ``kind`` (see the module docstring) on micro-batch
    ``micro_batch``; a transfer names the stage on the other side, ``peer``."""

    kind: str
    micro_batch: int
    peer: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind must be one of {', '.join(KINDS)} (F forward, B backward, BI/BW its input "
                             f"and weight halves, SEND_/RECV_ transfers), got {self.kind!r}")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise ValueError(f"Action.micro_batch must be an integer >= 0, got {self.micro_batch!r}")
        if self.kind in TRANSFERS:
            if isinstance(self.peer, bool) or not isinstance(self.peer, int) or self.peer < 0:
                raise ValueError(f"Action {self.kind}{self.micro_batch}: a transfer names its peer stage, an integer "
                                 f">= 0, got peer={self.peer!r}")
        elif self.peer is not None:
            raise ValueError(f"Action {self.kind}{self.micro_batch}: a compute action has no peer, got "
                             f"peer={self.peer!r}; leave it out")

    @property
    def is_transfer(self) -> bool:
        return self.peer is not None

    @property
    def direction(self) -> str:
        """``"F"`` (values go forward) or ``"B"`` (gradients go back); BW moves nothing but is a backward."""
        return "F" if self.kind in ("F", "SEND_F", "RECV_F") else "B"

    def __str__(self) -> str:
        if self.kind.startswith("SEND"):
            return f"{self.kind}{self.micro_batch}->{self.peer}"
        if self.kind.startswith("RECV"):
            return f"{self.kind}{self.micro_batch}<-{self.peer}"
        return f"{self.kind}{self.micro_batch}"


def parse_actions(text: str) -> list[Action]:
    """``"F0 SEND_F0->1 RECV_B0<-1 B0"`` -> actions (the form :meth:`Action.__str__` prints)."""
    out = []
    for token in text.split():
        peer = None
        for arrow in ("->", "<-"):
            if arrow in token:
                token, peer_text = token.split(arrow)
                peer = int(peer_text)
        digits = len(token) - len(token.rstrip("0123456789"))
        if not digits:
            raise ValueError(f"action {token!r} has no micro-batch number; write e.g. F0, BI3, SEND_F2->1")
        out.append(Action(token[:-digits], int(token[-digits:]), peer))
    return out


def gpipe(num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    """All forwards, then all backwards (in reverse micro-batch order is not needed: FIFO)."""
    per_stage = [Action("F", m) for m in range(num_micro_batch)] + [
        Action("B", m) for m in range(num_micro_batch)
    ]
    return [list(per_stage) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): stage s warms up with ``num_stages - s - 1`` forwards, then
    alternates one forward and one backward, then drains the remaining backwards. At most
    ``num_stages - s`` micro-batches are in flight on stage s."""
    return [_warmup_then_alternate(num_stages - s - 1, num_micro_batch) for s in range(num_stages)]


def eager_one_f_one_b(num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    """Eager-1F1B (Zhuang et al., MLSys'23, Fig. 4b; Alpa's ``OverlapFriendlyPipeDreamSchedule``):
    stage s warms up with ``2 * (num_stages - s - 1)`` forwards instead of ``num_stages - s - 1``.

    Under 1F1B a forward's output is needed by the next stage right away, so its transfer sits on
    the critical path. The extra warm-up forwards put one computation between each send and the
    action that consumes it, so the transfer overlaps compute. The price is activations for up to
    ``2 * (num_stages - s) - 1`` micro-batches in flight on stage s. Same step time as 1F1B when
    communication is free."""
    return [_warmup_then_alternate(2 * (num_stages - s - 1), num_micro_batch) for s in range(num_stages)]


def zb_h1(num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    """ZB-H1 (module docstring): stage ``s`` warms up with ``num_stages - s - 1`` forwards; cycle
    ``k`` runs the next forward (while any is left), ``BI k``, and ``BW k - s`` once ``k >= s``;
    the weight halves left over close the list. At most ``min(num_stages, num_micro_batch)``
    micro-batches are in flight (forward run, weight half not yet) on any stage."""
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_micro_batch)
        actions = [Action("F", m) for m in range(warmup)]
        forward = warmup
        weight = 0
        for k in range(num_micro_batch):
            if forward < num_micro_batch:
                actions.append(Action("F", forward))
                forward += 1
            actions.append(Action("BI", k))
            if k >= s:
                actions.append(Action("BW", weight))
                weight += 1
        actions.extend(Action("BW", m) for m in range(weight, num_micro_batch))
        out.append(actions)
    return out


def _warmup_then_alternate(warmup: int, num_micro_batch: int) -> list[Action]:
    warmup = min(warmup, num_micro_batch)
    actions = [Action("F", m) for m in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < num_micro_batch:
        actions.append(Action("F", fwd))
        fwd += 1
        actions.append(Action("B", bwd))
        bwd += 1
    actions.extend(Action("B", m) for m in range(bwd, num_micro_batch))
    return actions


def gradient_accumulation(num_micro_batch: int) -> list[Action]:
    """One stage alone: each backward right after its forward, so one micro-batch is in flight."""
    return _warmup_then_alternate(0, num_micro_batch)


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "eager-1f1b": eager_one_f_one_b, "zb-h1": zb_h1}
# the configurable schedules (whalelike.config.SCHEDULES, their one list) with their builders: a name
# added there without a builder here fails at import, naming it
SCHEDULES = {name: _BUILDERS[name] for name in SCHEDULE_NAMES}


def build_schedule(kind: str, num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    """Each stage's compute actions under schedule ``kind``: new lists (a caller may edit them) of
    the same frozen actions, built once per (kind, stages, micro-batches)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    return [list(stage) for stage in _built(kind, num_stages, num_micro_batch)]


@functools.lru_cache(maxsize=64)
def _built(kind: str, num_stages: int, num_micro_batch: int) -> tuple[tuple[Action, ...], ...]:
    # a 64-stage, 128-micro-batch pipeline is 16k validated Actions: the planner simulates such a
    # plan, checks it for deadlocks and prices its memory with the same lists
    return tuple(tuple(stage) for stage in SCHEDULES[kind](num_stages, num_micro_batch))


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of micro-batches whose activations a stage holds at once under ``actions``:
    from the forward until the backward that ends with the weight gradients (``B``, or ``BW``: the
    input half keeps the graph the weight half runs on). Transfers hold nothing."""
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
            peak = max(peak, live)
        elif a.kind in ("B", "BW"):
            live -= 1
    return peak


def in_flight_per_stage(schedule: str, num_stages: int, count: int) -> tuple[int, ...]:
    """Micro-batches in flight per stage under ``schedule`` with ``count`` micro-batches (one
    stage: gradient accumulation, one at a time).

    Every schedule warms up with a number of forwards that depends on the stage only, so in flight
    stops growing with the count past it (GPipe's, all forwards first, never does). When a schedule
    of ``2 * num_stages + 2`` micro-batches and one of one more agree, that is the answer for any
    larger count: the batch-size search prices up to
    :data:`planner.shares.batch_fit.MAX_MICRO_BATCHES` micro-batches without building their
    action lists."""
    probe = 2 * num_stages + 2
    if count > probe:
        short = _in_flight_of_schedule(schedule, num_stages, probe)
        if short == _in_flight_of_schedule(schedule, num_stages, probe + 1):
            return short
    return _in_flight_of_schedule(schedule, num_stages, count)


@functools.lru_cache(maxsize=256)
def _in_flight_of_schedule(schedule: str, num_stages: int, count: int) -> tuple[int, ...]:
    actions = build_schedule(schedule, num_stages, count) if num_stages > 1 else [gradient_accumulation(count)]
    return tuple(max_in_flight(stage) for stage in actions)
