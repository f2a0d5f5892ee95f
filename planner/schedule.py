"""Pipeline schedules as data: for each stage, the ordered list of forward/backward actions.

Both the simulator and the runtime execute these lists, so what is simulated is what runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    micro_batch: int

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
    schedules = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_micro_batch)
        actions = [Action("F", m) for m in range(warmup)]
        fwd, bwd = warmup, 0
        while fwd < num_micro_batch:
            actions.append(Action("F", fwd))
            fwd += 1
            actions.append(Action("B", bwd))
            bwd += 1
        actions.extend(Action("B", m) for m in range(bwd, num_micro_batch))
        schedules.append(actions)
    return schedules


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(kind: str, num_stages: int, num_micro_batch: int) -> list[list[Action]]:
    try:
        return SCHEDULES[kind](num_stages, num_micro_batch)
    except KeyError:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}") from None


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of micro-batches whose activations a stage holds at once under ``actions``."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak
