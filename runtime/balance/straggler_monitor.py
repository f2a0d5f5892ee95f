"""Straggler detection: every rank measures its own compute speed, the ranks share it, and a
sustained change of one rank's speed *relative to the others* is reported.

Why measure compute only: under data parallelism the gradient all-reduce makes every rank's step
wall time equal (the fast ranks wait for the slow one), so wall time cannot tell which rank is
slow. Each rank therefore records the time its compute segments took (the Engine passes
``EmulationStats.padded_s`` and ``.flops`` of the step: waiting and communication excluded) and
its speed is ``flops / compute_s``. The monitor never reads the emulator's configured speeds: on
real hardware there is no configuration, and the planner must see what a real job would see
(docs/ARCHITECTURE.md section 4).

Why a median: a single slow step (a page fault, a noisy neighbour for a moment, the first step's
allocations) must not trigger a re-plan, whose cost is far above one step's. The smoothed speed is
the median over the last ``window`` steps, so a one-step spike changes nothing, while a sustained
change shows after ``ceil(window / 2)`` steps: with ``window=3`` a rank slowed 2x is seen on the
second slow step (plus up to ``exchange_every - 1`` steps until the next exchange).

Why steps whose emulation overran are set aside: on an emulated cluster a segment whose real
compute took longer than its modeled time (a loaded host) measures the host, not the emulated
device. One such step in a window changes no median, but two of three do, and a rank that overran
while the reference was taken looks, once it stops, like a rank that sped up. So
:meth:`StragglerMonitor.smoothed` takes the median over the last ``window`` steps without an
overrun when there are that many among the last ``2 * window`` steps, and over the last
``window`` steps, overruns and all, otherwise (a rank that overruns most steps: the emulation
cannot hold its speed, and the run's overrun warning says so). Real hardware never overruns, so
there the two are the same window.

Why relative speeds: if every rank slows alike (the machine is busy, a larger batch), the
balance is unchanged and re-planning gains nothing. :meth:`StragglerMonitor.changed` compares each
rank's share of the summed speed with its share in the reference the plan was made for.

Why ride on a collective that happens anyway: sharing is a collective, and even one small
all-gather per step cost 3-4 ms on a loaded 2-core machine with 4 ranks (``bench/dp_vs_ddp.py``,
equal speeds: 0.93-0.96x of DDP with it, 0.97-1.00x without). :meth:`outgoing` puts this rank's
three numbers in its slot of a zero vector; summed over the ranks in the all-reduce that ends every
step (the Engine hands a :class:`runtime.control.exchange.Passenger` to the executor: DDP's last gradient bucket, the
pipeline's loss), it gives every rank every rank's figures (:meth:`received`). The passenger is
filled right before that collective, when the step's compute is done, so the figures include the
step itself. :meth:`exchange` is the stand-alone all-gather, for callers without such a collective.

Invariant: after :meth:`StragglerMonitor.exchange` or :meth:`received` every rank holds the same
:class:`Measured` (the same reduced values, converted identically), and :meth:`~StragglerMonitor.changed` is a
pure function of it and of the reference, so every rank reaches the same decision at the same step
without further communication. This holds as long as every rank records every step and calls
``exchange`` at the same steps (it is collective).
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from whalelike.errors import SpecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One step of one rank: the FLOPs of its compute segments and the time they took (``matmul_s``
    is the part spent in matmul segments); ``overran``: some segment's real compute outlasted its
    emulated time. ``speed`` is NaN when the step ran no measured compute."""

    step: int
    flops: float
    compute_s: float
    matmul_s: float
    overran: bool = False

    @property
    def speed(self) -> float:
        if self.flops > 0 and self.compute_s > 0:
            return self.flops / self.compute_s
        return math.nan


@dataclass(frozen=True)
class Measured:
    """Smoothed figures of every rank at ``step``, lists indexed by rank: ``speeds`` in FLOP/s (NaN
    for a rank that measured no compute in its window), ``compute_s`` and ``matmul_s`` the medians
    of its per-step compute and matmul times over the same window."""

    step: int
    speeds: list[float]
    compute_s: list[float]
    matmul_s: list[float]


@dataclass(frozen=True)
class SpeedChange:
    """A rank whose share of the total speed changed: ``old_speed`` (the reference) and
    ``new_speed`` in FLOP/s, ``ratio`` = new share / old share (0.5: it now does half as much of the
    cluster's work per second as before, relative to the others)."""

    rank: int
    old_speed: float
    new_speed: float
    ratio: float


class StragglerMonitor:
    """Per-rank speed measurement and the collective exchange of it (see the module docstring).

    ``rank`` and ``world_size`` are this rank's index and the size of ``group`` (default: the world);
    ``window`` steps are smoothed by their median; ``threshold`` is the relative change of a rank's
    share of the total speed that counts as a change (0.10 = 10%); ``exchange_every`` K: exchanges
    happen at steps that are multiples of K.
    """

    def __init__(self, rank: int, world_size: int, group: Optional[dist.ProcessGroup] = None, *,
                 window: int = 3, threshold: float = 0.10, exchange_every: int = 1):
        _check_int("world_size", world_size, 1, "the number of ranks in the group")
        _check_int("rank", rank, 0, "this rank's index in the group")
        if rank >= world_size:
            raise SpecError(f"StragglerMonitor: rank must be in 0..{world_size - 1} (world_size {world_size}), "
                            f"got {rank}")
        _check_int("window", window, 1, "steps the median is taken over, e.g. 3")
        _check_int("exchange_every", exchange_every, 1, "steps between speed exchanges, e.g. 1")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not (math.isfinite(threshold) and 0.0 < threshold < 1.0):
            raise SpecError(f"StragglerMonitor: threshold must be in (0, 1), a relative speed change "
                            f"(0.10 = 10%), got {threshold!r}")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.window, self.threshold, self.exchange_every = window, float(threshold), exchange_every
        self.samples: deque[Sample] = deque(maxlen=window)
        self.clean: deque[Sample] = deque(maxlen=window)   # the last steps whose emulation did not overrun
        self._last_step: Optional[int] = None
        self._group_checked = False
        self._warned_unmeasured = False

    # -- local measurement ---------------------------------------------------------------------------
    def record(self, step: int, flops: float, compute_s: float, matmul_s: float = 0.0, *,
               overran: bool = False) -> None:
        """Record this rank's compute of ``step``: FLOPs of its compute segments, the time they took
        (no waiting, no communication) and the part of it spent in matmul segments; ``overran``:
        the emulation overran some segment of the step (it then measured the host)."""
        _check_int("step", step, 0, "the training step")
        if self._last_step is not None and step <= self._last_step:
            raise SpecError(f"StragglerMonitor.record: step must increase, got step {step} after step "
                            f"{self._last_step}; record each step once")
        for name, value in (("flops", flops), ("compute_s", compute_s), ("matmul_s", matmul_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise SpecError(f"StragglerMonitor.record (step {step}): {name} must be a finite number >= 0, "
                                f"got {value!r}")
        if matmul_s > compute_s * (1 + 1e-9) + 1e-12:
            raise SpecError(f"StragglerMonitor.record (step {step}): matmul_s ({matmul_s:g}) is part of compute_s "
                            f"and cannot exceed it ({compute_s:g}); pass the step's matmul time as matmul_s")
        sample = Sample(step, float(flops), float(compute_s), float(matmul_s), bool(overran))
        self.samples.append(sample)
        if not sample.overran:
            self.clean.append(sample)
        self._last_step = step

    def reset(self) -> None:
        """Forget the recorded steps (after a re-plan, so old samples do not outvote new ones)."""
        self.samples.clear()
        self.clean.clear()

    def smoothed(self) -> tuple[float, float, float]:
        """This rank's ``(speed, compute_s, matmul_s)``: medians over the last ``window`` steps
        without an emulation overrun when they are among the last ``2 * window``, else over the
        last ``window`` steps (speed over the steps that measured compute; NaN where there is
        nothing to take the median of)."""
        clean = len(self.clean) == self.window and self.clean[0].step > self._last_step - 2 * self.window
        kept = list(self.clean if clean else self.samples)
        speeds = [s.speed for s in kept if not math.isnan(s.speed)]
        speed = statistics.median(speeds) if speeds else math.nan
        if not kept:
            return speed, math.nan, math.nan
        return (speed, statistics.median(s.compute_s for s in kept), statistics.median(s.matmul_s for s in kept))

    # -- riding on a collective that happens anyway ---------------------------------------------------
    def outgoing(self) -> torch.Tensor:
        """This rank's :meth:`smoothed` figures in its slot of a ``3 * world_size`` float64 vector,
        zeros elsewhere. Summed over the ranks (the executors add it to the all-reduce that ends
        every step: DDP's last gradient bucket, the pipeline's loss), every rank holds every
        rank's figures, so sharing them costs no collective of its own; see :meth:`received`."""
        out = torch.zeros(3 * self.world_size, dtype=torch.float64)
        out[3 * self.rank:3 * self.rank + 3] = torch.tensor(self.smoothed(), dtype=torch.float64)
        return out

    def received(self, step: int, summed: torch.Tensor) -> Measured:
        """The :class:`Measured` of an :meth:`outgoing` vector summed over the ranks (identical on
        every rank: the same all-reduced values, converted alike)."""
        if summed.numel() != 3 * self.world_size:
            raise SpecError(f"StragglerMonitor.received: expected {3 * self.world_size} values (3 per rank), "
                            f"got {summed.numel()}")
        rows = summed.detach().to("cpu", torch.float64).view(self.world_size, 3).tolist()
        return self._measured(step, rows)

    # -- the exchange (collective) -------------------------------------------------------------------
    def exchange(self, step: int) -> Optional[Measured]:
        """At steps that are multiples of ``exchange_every``: one all-gather of every rank's
        smoothed figures, the same :class:`Measured` on every rank. Otherwise None, and no
        communication. Collective: every rank of the group must call it at the same steps."""
        _check_int("step", step, 0, "the training step")
        if step % self.exchange_every:
            return None
        self._check_group()
        device = _device_for(self.group)
        mine = torch.tensor(self.smoothed(), dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        return self._measured(step, torch.stack(gathered).cpu().tolist())

    def _measured(self, step: int, rows: list) -> Measured:
        measured = Measured(step, [row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows])
        unmeasured = [r for r, speed in enumerate(measured.speeds) if math.isnan(speed)]
        if unmeasured and not self._warned_unmeasured and self.rank == 0:
            self._warned_unmeasured = True
            log.warning("straggler monitor, step %d: ranks %s recorded no compute (FLOPs and compute time > 0) "
                        "in their last %d steps; their speed is unknown and no change is reported while it is",
                        step, unmeasured, self.window)
        return measured

    def _check_group(self) -> None:
        if self._group_checked:
            return
        size, index = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (size, index) != (self.world_size, self.rank):
            raise SpecError(f"StragglerMonitor: built for rank {self.rank} of {self.world_size}, but the process "
                            f"group has this process as rank {index} of {size}; pass the group the plan's ranks "
                            "form and this rank's index in it")
        self._group_checked = True

    # -- the decision (pure) -------------------------------------------------------------------------
    def changed(self, measured: Measured, reference_speeds: Sequence[float]) -> list[SpeedChange]:
        """Ranks (in rank order) whose share of the summed speed moved by more than ``threshold``
        from their share of the summed ``reference_speeds`` (the speeds the plan in force was made
        for). When one rank slows, the others' shares grow too, so they may be listed as well, with
        ratios above 1. Nothing is reported while some rank's speed is unknown (NaN)."""
        reference = [float(v) for v in reference_speeds]
        if len(reference) != self.world_size or len(measured.speeds) != self.world_size:
            raise SpecError(f"StragglerMonitor.changed: need one speed per rank ({self.world_size}), got "
                            f"{len(reference)} reference and {len(measured.speeds)} measured speeds")
        for what, values in (("reference", reference), ("measured", measured.speeds)):
            bad = [v for v in values if not math.isnan(v) and not (math.isfinite(v) and v > 0)]
            if bad:
                raise SpecError(f"StragglerMonitor.changed: {what} speeds must be > 0 FLOP/s (NaN: unknown), "
                                f"got {list(values)}")
        if any(math.isnan(v) for v in (*reference, *measured.speeds)):
            return []
        old_total, new_total = sum(reference), sum(measured.speeds)
        changes = []
        for rank, (old, new) in enumerate(zip(reference, measured.speeds)):
            ratio = (new / new_total) / (old / old_total)
            if abs(ratio - 1.0) > self.threshold:
                changes.append(SpeedChange(rank, old, new, ratio))
        return changes


def _check_int(name: str, value: object, minimum: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"StragglerMonitor: {name} must be an integer >= {minimum} ({meaning}), got {value!r}")


def _device_for(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the exchanged tensor must live: the current CUDA device under nccl, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
