"""Timeline exports: Chrome trace JSON and the PNG Gantt chart, written atomically."""
from __future__ import annotations

import json

import pytest

from planner.schedule.simulator import simulate
from planner.schedule.timeline import busiest_workers, write_chrome_trace, write_png
from test_simulator import chain_plan, make_plan, worker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_chrome_trace_has_one_slice_per_action_and_transfer(tmp_path):
    m = 4
    plan = chain_plan([(1.0, 2.0)] * 3, m, "1f1b", transfer_ms=0.5)
    for w in plan.workers:
        w.allreduce_ms = 1.0
    path = tmp_path / "step.json"
    result = write_chrome_trace(plan, path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in slices if e["tid"] == 0 and e["cat"] in ("forward", "backward")]
    assert len(compute) == 3 * 2 * m
    for rank in range(3):
        names = sorted(e["name"] for e in compute if e["pid"] == rank)
        assert names == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    assert sum(e["cat"] == "transfer" and e["tid"] == 1 for e in slices) == 2 * 2 * m
    assert sum(e["cat"] == "all-reduce" for e in slices) == 3
    assert len(slices) == len(result.events)
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(result.step_time_ms * 1e3)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[1] == "rank 1 · stage 1 · replica 0 · dev1"
    assert trace["otherData"]["step_time_ms"] == pytest.approx(result.step_time_ms)


def test_png_from_a_plan_or_a_result(tmp_path):
    plan = chain_plan([(1.0, 2.0), (1.5, 3.0)], 4, "gpipe", transfer_ms=0.2)
    write_png(plan, tmp_path / "plan.png")
    write_png(simulate(plan), tmp_path / "result.png")
    for name in ("plan.png", "result.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png", "result.png"]


def test_png_of_a_large_plan_shows_the_busiest_workers_of_each_stage(tmp_path):
    m = 2
    workers = [worker(r, r // 30, [1.0 + r % 30] * m, [1.0] * m, dp=r % 30) for r in range(60)]
    result = write_png(make_plan(workers, m, "1f1b"), tmp_path / "big.png", max_rows=10)
    assert (tmp_path / "big.png").read_bytes().startswith(PNG_MAGIC)
    assert len(result.workers) == 60
    # forward time grows with dp_index, so each stage's last five workers are its busiest
    assert [w.rank for w in busiest_workers(result, 10)] == [25, 26, 27, 28, 29, 55, 56, 57, 58, 59]
    assert busiest_workers(result, 60) == result.workers


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    plan = chain_plan([(1.0, 2.0)], 2)
    with pytest.raises(TypeError, match="expected a planner.Plan or a SimResult"):
        write_chrome_trace({"not": "a plan"}, tmp_path / "x.json")

    def dump_half(document, f):
        f.write('{"traceEvents": [')
        raise OSError("disk full")

    monkeypatch.setattr("planner.schedule.timeline.json.dump", dump_half)
    with pytest.raises(OSError, match="disk full"):
        write_chrome_trace(plan, tmp_path / "x.json")
    assert list(tmp_path.iterdir()) == []


def test_timelines_on_a_network_show_the_resharding_and_the_host_interfaces(tmp_path):
    """Simulated on a network, each send carries its resharding (strategy, unit task, receivers),
    every host interface a send held has its own track, and each boundary's resharding (strategy,
    unit tasks, predicted time) is listed; the PNG draws the interfaces as rows of their own."""
    from test_simulator_network import network_of, straddling_plan

    plan = straddling_plan()
    network = network_of(plan, latency_us=5.0)
    path = tmp_path / "step.json"
    result = write_chrome_trace(plan, path, network=network)
    trace = json.loads(path.read_text())
    sends = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "transfer"]
    assert sends and all(e["args"]["resharding"].startswith("broadcast task ") for e in sends)
    nic_pid = len(plan.workers)
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == nic_pid}
    assert tracks == {"A out", "A in", "B out", "B in", "C out", "C in"}
    on_nics = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == nic_pid]
    assert len(on_nics) == sum(len(e["args"]["nics"]) for e in sends) == 2 * len(sends)   # every send crosses hosts
    listed = trace["otherData"]["reshardings"]
    assert listed == [t.describe() for t in result.reshardings] and len(listed) == 2   # forward and backward
    assert "broadcast, 3 unit task(s), 3 transfer(s), predicted" in listed[0]
    picture = tmp_path / "step.png"
    write_png(plan, picture, network=network)
    assert picture.read_bytes().startswith(PNG_MAGIC)
