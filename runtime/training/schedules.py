"""Learning-rate schedules: the Engine's scheduler contract, and the warm-up + decay every recipe uses.

The contract (``Engine(scheduler=factory)``): ``factory(optimizer)`` returns a
``torch.optim.lr_scheduler.LRScheduler`` (or anything with ``step``, ``state_dict`` and
``load_state_dict``), built once, right after the Engine's optimizer. The Engine steps it after
each optimizer step that happened, never after a skipped one (a NaN loss under
``on_nonfinite="skip"``, an fp16 overflow); its state is saved in checkpoints and restored on
resume, onto the same plan or another; re-plans keep it, because they keep the optimizer object
(:func:`runtime.state.transfer.switch_executor` rebinds its parameters in place).

:func:`lr_schedule` builds the usual ones on torch's ``LambdaLR``: linear warm-up over
``warmup_steps`` optimizer steps from ``lr / warmup_steps`` to ``lr``, then ``cosine`` decay (as
torchtitan and most LLM recipes), ``linear`` decay, or ``constant``, down to
``min_ratio * lr`` at ``total_steps``. Why not torch's ``SequentialLR`` of a warm-up and a
``CosineAnnealingLR``: the chained schedulers compute each rate from the previous one, so a resumed
run's rates drift from the uninterrupted run's by rounding; a closed form of the step count is the
same after any resume.

Invariant: the learning rate of step ``s`` is a function of ``s`` alone (the number of optimizer
steps taken), so every rank, every plan and every resume computes the same rate.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from whalelike.errors import WhaleError

SCHEDULES = ("cosine", "linear", "constant")


class ScheduleError(WhaleError):
    """A schedule that cannot be built; the message names it and the fix."""


def lr_factor(step: int, kind: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """The multiple of the base learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - min_ratio) * progress


def lr_schedule(kind: str, warmup_steps: int = 0, total_steps: int = 1,
                min_ratio: float = 0.0) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """A scheduler factory for ``Engine(scheduler=...)`` (see the module docstring)."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"schedule {kind!r} is not one of {', '.join(SCHEDULES)}")
    for name, value, least in (("warmup_steps", warmup_steps, 0), ("total_steps", total_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ScheduleError(f"schedule {kind}: {name} must be an integer >= {least}, got {value!r}")
    if not (isinstance(min_ratio, (int, float)) and 0.0 <= min_ratio <= 1.0):
        raise ScheduleError(f"schedule {kind}: min_ratio must be in [0, 1] (the last rate over the peak), "
                            f"got {min_ratio!r}")

    def factory(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, kind, warmup_steps, total_steps, min_ratio))

    factory.__qualname__ = f"lr_schedule({kind!r}, warmup_steps={warmup_steps}, total_steps={total_steps})"
    return factory


def build_scheduler(factory: Callable, optimizer: torch.optim.Optimizer) -> Any:
    """``factory(optimizer)``, checked: a factory that raises or returns something that is not a
    scheduler is an error naming the factory and what it did."""
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    if not callable(factory):
        raise ScheduleError(f"Engine(scheduler=...) must be a factory optimizer -> LR scheduler (e.g. "
                            f"lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, ...)), got {factory!r}")
    try:
        scheduler = factory(optimizer)
    except Exception as e:
        raise ScheduleError(f"Engine(scheduler={name}) raised {type(e).__name__}: {e}; the factory gets the "
                            "Engine's optimizer and must return a torch.optim.lr_scheduler.LRScheduler") from e
    missing = [m for m in ("step", "state_dict", "load_state_dict") if not callable(getattr(scheduler, m, None))]
    if missing:
        raise ScheduleError(f"Engine(scheduler={name}) returned a {type(scheduler).__name__}, which has no "
                            f"{', '.join(missing)}; return a torch.optim.lr_scheduler.LRScheduler")
    return scheduler
