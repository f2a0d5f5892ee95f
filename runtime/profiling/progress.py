"""The profiling progress bar: every rank's progress in the process group's store, one bar on rank 0.

Each rank profiles its own device at its own pace (a slow device takes longer at every batch), so
rank 0 alone cannot know how far the run is. Each rank writes ``done total note`` under its own key
of the default group's store (the rendezvous' key-value store, already there: no collective, so a
report never waits on a peer); rank 0 reads every rank's key when it reports, and while it waits
for the others, and draws one line on stderr: a bar over the summed work, the elapsed time and the
slowest rank's current task. On a terminal the line is redrawn in place; otherwise (a log file) a
line is printed at every tenth of the way. Work is counted in training steps (memory trials and
timed steps alike); a rank's total is an estimate until its largest batch is known.

Invariant: reporting never blocks on another rank and never changes what is measured (rank 0's
drawing happens between its segments, outside them).
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

import torch.distributed as dist

KEY = "whalelike/profile/{run}/progress/{rank}"   # run: the how-manieth profiling of this process group
WIDTH = 28
FAILED = "failed"   # a rank's last note when its measurement raised (it is finished too)


class Board:
    """Progress of the ranks of one profiling run (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, run: int = 0, enabled: bool = True,
                 stream: Optional[TextIO] = None):
        self.rank, self.world_size, self.run, self.enabled = rank, world_size, run, enabled
        self.stream = stream or sys.stderr
        self.store = dist.distributed_c10d._get_default_store()   # as runtime.distributed.Progress
        self.start = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._printed_tenths = -1
        self._width = 0

    def report(self, done: int, total: int, note: str) -> None:
        """This rank has run ``done`` of about ``total`` steps and is now doing ``note``."""
        self.store.set(KEY.format(run=self.run, rank=self.rank), f"{done} {max(total, done)} {note}")
        if self.rank == 0:
            self.draw()

    def states(self) -> list[tuple[int, int, str]]:
        """``(done, total, note)`` of every rank (``(0, 1, 'starting')`` before its first report)."""
        out = []
        for rank in range(self.world_size):
            key = KEY.format(run=self.run, rank=rank)
            if not self.store.check([key]):
                out.append((0, 1, "starting"))
                continue
            done, total, note = self.store.get(key).decode().split(" ", 2)
            out.append((int(done), int(total), note))
        return out

    def finished(self) -> bool:
        return all(done >= total and note in ("done", FAILED) for done, total, note in self.states())

    def wait(self, timeout_s: float) -> None:
        """Rank 0: draw until every rank reports ``done`` (at most ``timeout_s``; the gather that
        follows names a rank that never came)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.finished():
            self.draw()
            time.sleep(0.25)
        self.draw()

    def draw(self) -> None:
        if not self.enabled or self.rank != 0:
            return
        states = self.states()
        done = sum(s[0] for s in states)
        total = sum(s[1] for s in states)
        fraction = min(1.0, done / max(total, 1))
        slowest = min(range(len(states)), key=lambda r: states[r][0] / max(states[r][1], 1))
        bar = "#" * int(fraction * WIDTH) + "-" * (WIDTH - int(fraction * WIDTH))
        line = (f"profiling [{bar}] {fraction * 100:3.0f}%  {time.perf_counter() - self.start:6.1f} s  "
                f"rank {slowest}: {states[slowest][2]}")
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif int(fraction * 10) > self._printed_tenths:
            self._printed_tenths = int(fraction * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self, message: str) -> None:
        """Rank 0: end the bar's line and print ``message`` (the total time)."""
        if self.rank != 0:
            return
        if self.enabled and self.tty:
            self.stream.write("\n")
        self.stream.write(message + "\n")
        self.stream.flush()
