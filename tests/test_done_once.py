"""runtime.distributed's work done once by rank 0 (MeasuredOnce, from_rank0), in one process:
without a process group of two or more ranks every helper does the work itself; an error that cannot be pickled travels as a WhaleError with its class and text. The
ranks' side (rank 0 measures and plans, the others take its figures, plan or error) is checked in
tests/test_runtime_dp.py (four Engines' captures) and tests/test_restart.py (a planning error at
start under torchrun, one line a job)."""
from __future__ import annotations

import pytest

from runtime import distributed
from whalelike.errors import WhaleError


def test_one_process_does_the_work_itself():
    share = distributed.MeasuredOnce(0)
    assert share("key", lambda: 41) == 41 and share.done
    share.finish()   # nothing to take part in
    assert distributed.from_rank0(lambda: "plan", 0) == "plan"
    with pytest.raises(ValueError, match="infeasible"):
        distributed.from_rank0(lambda: (_ for _ in ()).throw(ValueError("infeasible")), 0)


class _Unpicklable(Exception):
    def __init__(self, message, handle):
        super().__init__(message)
        self.handle = handle   # a lambda: pickling the exception fails

    def __reduce__(self):
        return (type(self), (str(self), self.handle))


def test_an_error_that_cannot_be_pickled_travels_as_a_whale_error():
    error = _Unpicklable("no plan fits", lambda: None)
    sent = distributed._sendable(error)
    assert isinstance(sent, WhaleError) and str(sent) == "_Unpicklable: no plan fits"
    plain = ValueError("bad batch")
    assert distributed._sendable(plain) is plain
