"""The multi-process harness's warm-up (``tests/dist_utils.py``: ``spawn_ranks(..., warm=)``).

The suite's tests trust it to change nothing but what the ranks find already done: each rank must
see the warm-up's work (here a module global and whalelike's capture cache), start from torch's
random state as it would have had it without (Python's ``random`` is reseeded in every forked child
by Python itself), get its own ``RANK``, and report as a rank launched without it
does: a value, an error, an exit status, or a hang killed at the timeout (its whole process group,
the warm-up process and every rank). A warm-up that raises fails every rank with its traceback.
Every rank, warmed or not, starts with the forkserver's preload done, this folder's modules
included, and its heap frozen (``tests/frozen_heap.py``). Two ranks, no process group.
"""
from __future__ import annotations

import gc
import os
import random
import sys
import time

import torch

from dist_utils import spawn_ranks

WARMED: list[str] = []


def _warm() -> None:
    import whalelike as wl

    WARMED.append("warm")
    torch.rand(3)          # draws from the random state, which the ranks must not see
    random.random()
    wl.capture(torch.nn.Linear(4, 2), (torch.randn(2, 4),))


def _report(rank: int, world_size: int) -> dict:
    from whalelike.graphs.capture_cache import stats
    import whalelike as wl

    before = stats()
    wl.capture(torch.nn.Linear(4, 2), (torch.randn(2, 4),))
    after = stats()
    return {"warmed": list(WARMED), "rank": os.environ["RANK"], "torch": torch.rand(2),
            "hit": after["hits"] == before["hits"] + 1,
            "preloaded": [name for name in ("reference", "frozen_heap") if name in sys.modules],
            "frozen": gc.get_freeze_count()}


def test_ranks_find_the_warm_up_done_and_their_random_state_untouched():
    plain = spawn_ranks(_report, 2, init_process_group=False, timeout_s=120)
    warmed = spawn_ranks(_report, 2, init_process_group=False, timeout_s=120, warm=_warm)
    for rank, (a, b) in enumerate(zip(plain, warmed)):
        assert a.ok and b.ok and b.exitcode == 0, (a, b)
        assert a.value["warmed"] == [] and b.value["warmed"] == ["warm"]
        assert a.value["rank"] == b.value["rank"] == str(rank)
        torch.testing.assert_close(a.value["torch"], b.value["torch"], rtol=0, atol=0)
        assert not a.value["hit"] and b.value["hit"], "the warm-up's capture is a cache hit in every rank"
        for o in (a, b):   # the server found this folder's modules (its sys.path) and froze what it imported
            assert o.value["preloaded"] == ["reference", "frozen_heap"] and o.value["frozen"] > 100_000, o.value


def _raises() -> None:
    raise ValueError("the warm-up's own error")


def test_a_warm_up_that_raises_fails_every_rank_with_its_traceback():
    outcomes = spawn_ranks(_report, 2, init_process_group=False, timeout_s=120, warm=_raises)
    for o in outcomes:
        assert not o.ok and o.error_type == "WarmUpFailed" and o.exitcode == 1, o
        assert "ValueError: the warm-up's own error" in o.error and "_raises" in o.error, o.error


def _exit_or_hang(rank: int, world_size: int, folder: str) -> int:
    with open(os.path.join(folder, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        os._exit(3)
    if rank == 2:
        time.sleep(3600)
    return rank


def _gone(pid: int) -> bool:
    """Killed: no such process, or a zombie nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] in ("Z", "X") for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


def test_exit_codes_and_a_hang_killed_at_the_timeout_as_without_warm_up(tmp_path):
    start = time.monotonic()
    outcomes = spawn_ranks(_exit_or_hang, 3, args=(str(tmp_path),), init_process_group=False, timeout_s=15,
                           warm=_warm)
    assert time.monotonic() - start < 60
    assert outcomes[0].ok and outcomes[0].value == 0
    assert outcomes[1].exitcode == 3 and outcomes[1].value is None and outcomes[1].error is None
    assert outcomes[2].exitcode is None and not outcomes[2].ok   # hung, killed
    hung = int((tmp_path / "pid-2").read_text())
    deadline = time.monotonic() + 10
    while not _gone(hung) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(hung), "the hung rank outlived its spawn"
