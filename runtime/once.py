"""Work every rank of a job would do alike, done by rank 0 and sent to the others.

Why: at start every rank captures the same model and, without a plan file, plans it; measuring a
capture's costs on fake tensors and planning are pure functions of inputs every rank has, so
repeating them on each rank is only CPU (seconds a rank for a ``transformers`` model, on a machine
whose cores the ranks share). Rank 0 does them and broadcasts the result over the default group;
the others wait in that broadcast, within the job's collective timeout.

* :class:`MeasuredOnce`: capture's measuring step (``capture(share=...)``); each rank still traces its
  own model, since a trace is bound to its process's tensors. A rank takes rank 0's figures only
  under an equal :func:`whalelike.graphs.capture.measure_key`, else measures itself.
* :func:`from_rank0`: a value rank 0 computes (the plan made at start), or its error, raised on
  every rank alike.

Invariant: each helper is one broadcast that every rank enters exactly once, whatever happens in
the work it wraps (an error, a cache hit that skips the work), so no rank waits for one that never
comes; the result is what each rank would have computed itself.

Why not torch's ``broadcast_object_list`` alone: it is the transport; what is added is the
agreement on when the result applies (the key) and that errors travel too.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

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
    at once (see the module docstring). Call :meth:`finish` after the capture, also when it raised:
    it takes part in the broadcast if the capture did not (the capture reused this process's
    figures, or failed before measuring). Rank 0's measuring failing is sent as such and raised
    there; the others then measure, and fail alike. ``enter`` runs the broadcast (an Engine's
    :meth:`runtime.rank.RankRuntime.collective`, which names a failed peer)."""

    def __init__(self, rank: int, enter: Collective = _direct):
        self.rank, self.enter = rank, enter
        self.done = not _many()
        self.received = False   # whether this rank took rank 0's figures

    def __call__(self, key: str, measure: Callable[[], Any]) -> Any:
        if self.done:
            return measure()
        self.done = True
        if self.rank != 0:
            sent = _broadcast(None, self.enter)
            if sent is not None and sent[0] == key and sent[1] is not None:
                self.received = True
                return sent[1]
            return measure()
        try:
            figures = measure()
        except BaseException:
            _broadcast((key, None), self.enter)
            raise
        _broadcast((key, figures), self.enter)
        return figures

    def finish(self) -> None:
        if not self.done:
            self.done = True
            _broadcast(None, self.enter)


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
