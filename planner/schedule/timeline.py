"""Pictures of a simulated step: a Chrome trace (open in https://ui.perfetto.dev) and a PNG Gantt chart.

Both take a :class:`~planner.plan.Plan` (simulated here, on ``network`` when given: the cluster it
was made for) or a :class:`~planner.schedule.simulator.SimResult`, draw in memory and write with
:func:`whalelike.files.write_atomic` (the path's extension is checked: ``.json`` for traces,
``.png`` for pictures), so a failed export never leaves a half-written or a temporary file where
the CLI said it would put one.

Simulated on a network, the boundary transfers are the resharding each boundary runs: every send
is labelled with its strategy, unit task and receivers, the host network interfaces get rows of
their own (where one sender host feeding many receivers queues), and the resharding chosen at each
boundary (strategy, unit tasks, predicted time) is listed (PNG: under the chart; trace:
``otherData.reshardings``).
"""
from __future__ import annotations

import io
import json
import os
from typing import Optional, Union

from whalelike.files import write_atomic

from planner.plan import Plan
from planner.schedule.simulator import SimResult, WorkerTime, simulate

COLOURS = {"F": "#4C72B0", "B": "#55A868", "BI": "#8FD19E", "BW": "#2F6B3D", "send": "#8C8C8C", "allreduce": "#C44E52",
           "update": "#8172B2"}
CATEGORIES = {"F": "forward", "B": "backward", "BI": "backward (input half)", "BW": "backward (weight half)",
              "send": "transfer", "allreduce": "all-reduce", "update": "optimizer update"}
COMPUTE_TRACK, SEND_TRACK = 0, 1


def write_chrome_trace(source: Union[Plan, SimResult], path: str | os.PathLike, network=None) -> SimResult:
    """Write the step as Chrome trace JSON: one process per worker with a compute track (forward,
    backward, all-reduce) and a transfer track (sends overlap compute, so they get their own), and
    a process of host network interfaces, one track each. Returns the simulation it drew."""
    result = _as_result(source, network)
    trace = []
    nic_pid = 1 + max((w.rank for w in result.workers), default=-1)
    nic_tid = {nic: k for k, nic in enumerate(nic_rows(result))}
    if nic_tid:
        trace += [{"name": "process_name", "ph": "M", "pid": nic_pid, "args": {"name": "host network interfaces"}},
                  {"name": "process_sort_index", "ph": "M", "pid": nic_pid, "args": {"sort_index": nic_pid}}]
        trace += [{"name": "thread_name", "ph": "M", "pid": nic_pid, "tid": tid, "args": {"name": nic}}
                  for nic, tid in nic_tid.items()]
    for w in result.workers:
        name = f"rank {w.rank} · stage {w.stage} · replica {w.replica} · {w.device}"
        trace += [
            {"name": "process_name", "ph": "M", "pid": w.rank, "args": {"name": name}},
            {"name": "process_sort_index", "ph": "M", "pid": w.rank, "args": {"sort_index": w.rank}},
            {"name": "thread_name", "ph": "M", "pid": w.rank, "tid": COMPUTE_TRACK, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": w.rank, "tid": SEND_TRACK, "args": {"name": "send"}},
        ]
    for e in result.events:
        args = {"stage": e.stage, "micro_batch": e.micro_batch}
        if e.peer_stage is not None:
            args["to_stage"] = e.peer_stage
        if e.detail:
            args["resharding"] = e.detail
        if e.nics:
            args["nics"] = list(e.nics)
        timing = {"ts": e.start_ms * 1e3, "dur": e.duration_ms * 1e3}  # Chrome traces count microseconds
        trace.append({"name": e.label, "cat": CATEGORIES[e.kind], "ph": "X", **timing, "pid": e.rank,
                      "tid": SEND_TRACK if e.kind == "send" else COMPUTE_TRACK, "args": args})
        trace += [{"name": e.label, "cat": "network interface", "ph": "X", **timing, "pid": nic_pid,
                   "tid": nic_tid[nic], "args": {**args, "rank": e.rank}} for nic in e.nics]
    document = {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": result.schedule, "num_micro_batch": result.num_micro_batch,
                      "step_time_ms": result.step_time_ms, "bubble_fraction": result.bubble_fraction,
                      "reshardings": [t.describe() for t in result.reshardings]},
    }
    text = io.StringIO()
    json.dump(document, text)
    write_atomic(path, text.getvalue(), kind="json")
    return result


def write_png(source: Union[Plan, SimResult], path: str | os.PathLike, max_rows: int = 32,
              network=None) -> SimResult:
    """Draw the step as a Gantt chart, one row per worker: forward, backward and all-reduce boxes
    (micro-batch numbers inside when they fit), sends as a thin strip under the row; then one row
    per host network interface a resharding send held (the busiest ``max_rows // 4`` at most), and
    the resharding of each boundary under the chart. Beyond ``max_rows`` workers each stage shows
    its busiest workers (where the step is decided). Returns the simulation it drew."""
    # a bare Figure renders with Agg and leaves pyplot's global state (and the user's backend) alone
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    result = _as_result(source, network)
    shown = busiest_workers(result, max_rows)
    row_of = {w.rank: i for i, w in enumerate(shown)}
    nics = nic_rows(result, max(1, max_rows // 4))
    nic_row = {nic: len(shown) + k for k, nic in enumerate(nics)}
    notes = [f"resharding {t.describe()}" for t in result.reshardings]
    step = result.step_time_ms or 1.0
    labels = [f"r{w.rank} s{w.stage} {w.device}" for w in shown] + [f"NIC {nic}" for nic in nics]
    rows = len(labels)
    # fixed margins in inches instead of tight_layout, which draws every label twice
    note_in = 0.16 * len(notes)
    width_in, height_in = 12.0, 1.2 + 0.42 * rows + note_in
    left_in = 0.3 + 0.07 * max(map(len, labels))  # 8-point tick labels
    fig = Figure(figsize=(width_in, height_in))
    ax = fig.subplots()
    fig.subplots_adjust(left=left_in / width_in, right=1 - 0.2 / width_in,
                        bottom=(0.6 + note_in) / height_in, top=1 - 0.4 / height_in)
    # a character of the 7-point box labels is about 4.2 pt wide
    char_ms = step * 4.2 / (72 * (width_in - left_in - 0.2))
    boxes = {kind: [] for kind in COLOURS}  # one collection per kind: thousands of bars stay fast
    for e in result.events:
        for nic in e.nics:
            if nic in nic_row:
                y = nic_row[nic]
                boxes[e.kind].append([(e.start_ms, y - 0.3), (e.end_ms, y - 0.3), (e.end_ms, y + 0.3),
                                      (e.start_ms, y + 0.3)])
        if e.rank not in row_of:
            continue
        y = row_of[e.rank]
        low, high = (y + 0.3, y + 0.42) if e.kind == "send" else (y - 0.3, y + 0.3)
        boxes[e.kind].append([(e.start_ms, low), (e.end_ms, low), (e.end_ms, high), (e.start_ms, high)])
        text = {"allreduce": "AR", "update": "U"}.get(e.kind, str(e.micro_batch))
        if e.kind != "send" and e.duration_ms > char_ms * (len(text) + 1):
            ax.text(e.start_ms + e.duration_ms / 2, y, text, ha="center", va="center", fontsize=7, color="white")
    for kind, verts in boxes.items():
        edge = "white" if kind != "send" or nics else "none"
        ax.add_collection(PolyCollection(verts, facecolors=COLOURS[kind], edgecolors=edge, linewidths=0.5),
                          autolim=False)
    ax.set_yticks(range(rows))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(rows - 0.4, -0.6)
    for k, note in enumerate(notes):
        fig.text(0.2 / width_in, (0.1 + 0.16 * (len(notes) - 1 - k)) / height_in, note, fontsize=7)
    ax.set_xlim(0, step * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.3)
    title = (f"{result.schedule}, {result.num_micro_batch} micro-batch(es): step {result.step_time_ms:.2f} ms, "
             f"bubble {100 * result.bubble_fraction:.1f}%")
    if len(shown) < len(result.workers):
        title += f" (busiest {len(shown)} of {len(result.workers)} workers)"
    ax.set_title(title, fontsize=10, loc="left")
    # a split backward's halves (ZB-H1, delayed weight gradients) only where a step has them
    shown_kinds = [k for k in COLOURS if boxes[k] or k not in ("BI", "BW")]
    ax.legend(handles=[Patch(color=COLOURS[k], label=CATEGORIES[k]) for k in shown_kinds], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=8, frameon=False, borderaxespad=0.2)
    picture = io.BytesIO()
    fig.savefig(picture, format="png", dpi=110)
    write_atomic(path, picture.getvalue(), kind="png")
    return result


def _as_result(source: Union[Plan, SimResult], network=None) -> SimResult:
    if isinstance(source, SimResult):
        return source
    if isinstance(source, Plan):
        return simulate(source, network=network)
    raise TypeError(f"expected a planner.Plan or a SimResult, got {type(source).__name__}")


def busiest_workers(result: SimResult, max_rows: int) -> list[WorkerTime]:
    """All workers if they fit in ``max_rows``, else each stage's busiest (an equal number per
    stage, at least one), in rank order: the rows a picture of a large plan shows."""
    if len(result.workers) <= max_rows:
        return result.workers
    stages = sorted({w.stage for w in result.workers})
    per_stage = max(1, max_rows // len(stages))
    keep = []
    for s in stages:
        members = [w for w in result.workers if w.stage == s]
        keep += sorted(members, key=lambda w: -w.busy_ms)[:per_stage]
    return sorted(keep, key=lambda w: w.rank)



def nic_rows(result: SimResult, limit: Optional[int] = None) -> list[str]:
    """The host interfaces the step's resharding sends held (``"host out"``, ``"host in"``), busiest
    first when ``limit`` keeps only some, else in name order."""
    busy: dict[str, float] = {}
    for e in result.events:
        for nic in e.nics:
            busy[nic] = busy.get(nic, 0.0) + e.duration_ms
    if limit is not None and len(busy) > limit:
        return sorted(sorted(busy, key=lambda nic: -busy[nic])[:limit])
    return sorted(busy)
