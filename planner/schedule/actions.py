"""Pipeline schedules as data: for each stage, the ordered list of forward/backward actions.

Both the simulator and the runtime execute these lists, so what is simulated is what runs.
Sends are implied: a stage sends a forward's output to the next stage when the forward ends and
a backward's input gradient to the previous stage when the backward ends; receives block (the
action waits for its input), sends do not (``isend``/``batch_isend_irecv``). :mod:`planner.schedule.deadlock`
proves a set of lists free of deadlocks and mismatched sends/receives under these rules.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from whalelike.config import SCHEDULES as SCHEDULE_NAMES


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    micro_batch: int

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ValueError(f"Action.kind must be 'F' (forward) or 'B' (backward), got {self.kind!r}")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise ValueError(f"Action.micro_batch must be an integer >= 0, got {self.micro_batch!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


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


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "eager-1f1b": eager_one_f_one_b}
# the configurable schedules (whalelike.config.SCHEDULES, their one list) with their builders: a name
# added there without a builder here fails at import, naming it
SCHEDULES = {name: _BUILDERS[name] for name in SCHEDULE_NAMES}


def build_schedule(kind: str, num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    """Each stage's action list under schedule ``kind``: new lists (a caller may edit them) of
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
    """Largest number of micro-batches whose activations a stage holds at once under ``actions``."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
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
