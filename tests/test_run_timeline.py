"""Pictures of a run (runtime/balance/run_timeline.py): step times per rank and the re-plan events, drawn
from real StepStats and ReplanEvents, as a PNG and a Chrome trace (in one process)."""
from __future__ import annotations

import json

from runtime.engine import StepStats
from runtime.balance.rebalance import ReplanEvent
from runtime.balance.run_timeline import RunRecord, write_run_png, write_run_trace
from runtime.balance.straggler_monitor import SpeedChange


def _record(memory: bool = False) -> RunRecord:
    def stats(rank: int, step: int) -> StepStats:
        slow = rank == 1 and 3 <= step < 5
        compute = 0.02 * (3 if slow else 1)
        return StepStats(step=step, wall_s=0.07 if 3 <= step < 5 else 0.03, compute_s=compute, modeled_s=compute,
                         padded_s=compute, wait_s=0.0, segments=2, overruns=0, flops=1e6,
                         approximate=step >= 5 and rank == 1, plan_version=int(step >= 5),
                         peak_memory_bytes=(rank + 1) * (step + 10) * 2**20 if memory else None)

    events = [ReplanEvent(4, (SpeedChange(1, 5e7, 1.7e7, 0.5),), "shares", "rank 1: [8] -> [4]", 1.5, True, 1),
              ReplanEvent(6, (SpeedChange(1, 1.7e7, 5e7, 2.0),), "resize", "gamma rank 1: 0.50", 0.4, False, 1)]
    return RunRecord([[stats(r, s) for s in range(8)] for r in range(2)], events, ["fast", "slow"])


def test_run_png_and_trace_show_every_step_and_event(tmp_path):
    record = _record()
    png, trace = tmp_path / "run.png", tmp_path / "run.json"
    write_run_png(record, png, title="two ranks")
    write_run_trace(record, trace)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    compute = [e for e in events if e.get("cat") == "compute"]
    assert len(compute) == 16 and {e["pid"] for e in compute} == {0, 1}
    slow = [e["dur"] for e in compute if e["pid"] == 1 and e["name"] in ("step 3 compute", "step 4 compute")]
    assert slow == [60000.0, 60000.0]                       # microseconds
    replans = [e for e in events if e.get("cat") == "replan"]
    assert [e["name"] for e in replans] == ["re-plan: shares", "re-plan: resize"]
    assert replans[0]["ts"] == sum(0.07 if 3 <= s < 5 else 0.03 for s in range(5)) * 1e6   # at step 5's start
    assert replans[1]["args"]["exact"] is False and "APPROXIMATE" in replans[1]["args"]["line"]
    assert [e["args"]["approximate"] for e in compute if e["pid"] == 1][-1] is True


def test_measured_memory_is_a_second_panel_and_a_counter_per_rank(tmp_path):
    """With StepStats.peak_memory_bytes the PNG gains a memory panel (a taller picture) and the trace
    one counter event per rank and step, in MiB, at the step's start; without, neither."""
    import struct

    def height(path):
        return struct.unpack(">II", path.read_bytes()[16:24])[1]

    plain, measured = _record(), _record(memory=True)
    assert not plain.has_memory and measured.has_memory
    write_run_png(plain, tmp_path / "plain.png")
    write_run_png(measured, tmp_path / "memory.png")
    assert height(tmp_path / "memory.png") > height(tmp_path / "plain.png")
    write_run_trace(plain, tmp_path / "plain.json")
    write_run_trace(measured, tmp_path / "memory.json")
    assert not [e for e in json.loads((tmp_path / "plain.json").read_text())["traceEvents"] if e.get("ph") == "C"]
    counters = [e for e in json.loads((tmp_path / "memory.json").read_text())["traceEvents"] if e.get("ph") == "C"]
    assert len(counters) == 16 and {e["pid"] for e in counters} == {0, 1}
    rank1 = {e["ts"]: e["args"]["MiB"] for e in counters if e["pid"] == 1}
    assert rank1[0.0] == 2 * 10                                   # rank 1, step 0: (1 + 1) * (0 + 10) MiB
    assert rank1[sum(0.07 if 3 <= s < 5 else 0.03 for s in range(5)) * 1e6] == 2 * 15   # step 5, at its start
