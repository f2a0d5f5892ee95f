"""The background checkpoint saves of one Engine: the process group they write through and the saves
in flight (:func:`runtime.checkpoint.save_async` starts them).

Why a record of its own: a save written by a thread goes through a process group of the world it
started in; a leave (:mod:`runtime.elastic.departure`) ends that world, so it must first wait for
every save in flight and forget the group. The Engine holds one :class:`Checkpointer`; the
checkpoint functions and the leave use its methods, never its fields.

Invariant: every rank starts the same saves in the same order, so :meth:`Checkpointer.finish` (a
wait on each) is collective and every rank's group is the same group.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist


class Checkpointer:
    """The asynchronous saves of one Engine (see the module docstring)."""

    def __init__(self):
        self._group: Optional[dist.ProcessGroup] = None
        self._pending: list = []

    def group(self, collective: Callable[[Callable[[], Any]], Any]) -> dist.ProcessGroup:
        """The process group background saves write through: made once, collectively (through the
        rank's ``collective``), on the first asynchronous save of the world."""
        if self._group is None:
            self._group = collective(lambda: dist.new_group(backend="gloo"))
        return self._group

    def started(self, pending) -> None:
        """``pending`` (a :class:`runtime.checkpoint.PendingCheckpoint`) is being written; the ones
        finished are forgotten."""
        self._pending = [p for p in self._pending if not p.done()] + [pending]

    @property
    def in_flight(self) -> int:
        return sum(not p.done() for p in self._pending)

    def finish(self) -> None:
        """Wait (collectively: every rank started the same saves) for the saves in flight, then forget
        the group they write through: a leave re-initialises the default process group, which
        destroys that group with the old world."""
        for pending in self._pending:
            pending.wait()
        self._pending = []
        self._group = None
