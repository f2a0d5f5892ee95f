"""Pictures of a training *run*: step times per rank, the re-plan events and, when the steps were
measured (``Engine(measure_memory=True)``, always on GPUs), each rank's peak memory per step, as PNG
and Chrome trace.

:mod:`planner.schedule.timeline` draws one simulated step of a plan; this module draws what actually
happened over many steps of a run, so a user can see a straggler appear (its compute time rises,
everyone else's waiting rises with it), the re-plan that answered it (a vertical line, labelled
with the action and whether it was exact) and the step times after it; with measured memory
(``StepStats.peak_memory_bytes``) a second panel draws every rank's peak per step in MiB (a re-plan
that moves layers or shares moves memory too), and the trace carries it as one counter per rank.

:func:`gather_run` is a collective (every rank of the plan calls it; one ``all_gather_object`` of
each rank's :class:`runtime.engine.StepStats`); rank 0 gets a :class:`RunRecord`, the others None.
Files are written with :func:`whalelike.files.write_atomic` (all or nothing, ``.png`` and
``.json`` extensions checked), as planner.schedule.timeline does.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch.distributed as dist

from whalelike.files import write_atomic

COMPUTE, WAIT = "#4C72B0", "#C8C8C8"
MIB = float(2**20)


@dataclass(frozen=True)
class RunRecord:
    """Per rank, its StepStats in step order; the re-plan events (identical on every rank)."""

    stats: list[list]      # stats[rank] -> list[runtime.engine.StepStats]
    events: list           # runtime.balance.rebalance.ReplanEvent
    devices: list[str]     # device name per rank, from the plan

    @property
    def world_size(self) -> int:
        return len(self.stats)

    @property
    def has_memory(self) -> bool:
        """Whether some step of some rank has a measured peak (``StepStats.peak_memory_bytes``)."""
        return any(getattr(s, "peak_memory_bytes", None) is not None for rank in self.stats for s in rank)


def gather_run(engine) -> Optional[RunRecord]:
    """Collect every rank's step statistics on rank 0 (collective; others get None)."""
    mine = list(engine.stats)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    if engine.rank != 0:
        return None
    return RunRecord(parts, list(engine.replans), [w.device for w in engine.plan.workers])


def write_run_png(record: RunRecord, path: str | os.PathLike, title: str = "") -> None:
    """One row per rank: per step a bar of compute time (dark) and waiting/communication (light);
    a vertical line at each re-plan, labelled with its action (dashed when approximate); when the
    run measured memory, a last panel with every rank's peak memory per step (MiB, one line each)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n = record.world_size
    memory = record.has_memory
    rows = n + (2 if memory else 0)   # the memory panel is two rows high
    fig = Figure(figsize=(12.0, 1.4 + 1.3 * rows))
    ratios = [1] * n + ([2] if memory else [])
    axes = fig.subplots(len(ratios), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": ratios})[:, 0]
    memory_ax, axes = (axes[-1], axes[:-1]) if memory else (None, axes)
    top = max((s.wall_s for rank in record.stats for s in rank), default=1.0) * 1e3 * 1.1
    for rank, ax in enumerate(axes):
        steps = [s.step for s in record.stats[rank]]
        compute = [min(s.padded_s, s.wall_s) * 1e3 for s in record.stats[rank]]
        wait = [max(0.0, s.wall_s * 1e3 - c) for s, c in zip(record.stats[rank], compute)]
        ax.bar(steps, compute, width=0.85, color=COMPUTE)
        ax.bar(steps, wait, bottom=compute, width=0.85, color=WAIT)
        ax.set_ylim(0, top)
        ax.set_ylabel(f"rank {rank}\n{record.devices[rank]}\nms", fontsize=8)
        ax.tick_params(labelsize=8)
        for e in record.events:
            ax.axvline(e.step + 0.5, color="#C44E52", linestyle="-" if e.exact else "--", linewidth=1.2)
    for e in record.events:
        axes[0].annotate(e.action, (e.step + 0.5, top), xytext=(2, -2), textcoords="offset points",
                         fontsize=7, color="#C44E52", va="top", rotation=90)
    if memory_ax is not None:
        for rank, stats in enumerate(record.stats):
            points = [(s.step, s.peak_memory_bytes / MIB) for s in stats if getattr(s, "peak_memory_bytes", None) is not None]
            if points:
                memory_ax.plot(*zip(*points), marker="o", markersize=3, linewidth=1.2,
                               label=f"rank {rank} {record.devices[rank]}")
        memory_ax.set_ylabel("peak memory\nMiB", fontsize=8)
        memory_ax.set_ylim(bottom=0)
        memory_ax.tick_params(labelsize=8)
        memory_ax.legend(fontsize=7, ncol=min(n, 4), loc="lower right", frameon=False)
        for e in record.events:
            memory_ax.axvline(e.step + 0.5, color="#C44E52", linestyle="-" if e.exact else "--", linewidth=1.2)
    (memory_ax if memory_ax is not None else axes[-1]).set_xlabel("step")
    axes[0].set_title(title or f"{n} ranks, {len(record.events)} re-plan(s)", fontsize=10, loc="left")
    axes[0].legend(handles=[Patch(color=COMPUTE, label="compute"), Patch(color=WAIT, label="wait + communication"),
                            Patch(color="#C44E52", label="re-plan")],
                   loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.5 / (1.4 + 1.3 * rows), bottom=0.45 / (1.4 + 1.3 * rows),
                        hspace=0.15)
    picture = io.BytesIO()
    fig.savefig(picture, format="png", dpi=100)
    write_atomic(path, picture.getvalue(), kind="png")


def write_run_trace(record: RunRecord, path: str | os.PathLike) -> None:
    """Chrome trace (https://ui.perfetto.dev): one process per rank, steps laid end to end, each
    split into compute and wait; re-plans as instant events with their details; a measured step's
    peak memory as a counter event (``"ph": "C"``, MiB) at the step's start on its rank."""
    trace: list[dict] = []
    for rank, stats in enumerate(record.stats):
        trace.append({"name": "process_name", "ph": "M", "pid": rank,
                      "args": {"name": f"rank {rank} · {record.devices[rank]}"}})
        clock = 0.0
        for s in stats:
            compute = min(s.padded_s, s.wall_s)
            trace.append({"name": f"step {s.step} compute", "cat": "compute", "ph": "X", "pid": rank, "tid": 0,
                          "ts": clock * 1e6, "dur": compute * 1e6, "args": _step_args(s)})
            trace.append({"name": f"step {s.step} wait", "cat": "wait", "ph": "X", "pid": rank, "tid": 0,
                          "ts": (clock + compute) * 1e6, "dur": max(0.0, s.wall_s - compute) * 1e6})
            if getattr(s, "peak_memory_bytes", None) is not None:
                trace.append({"name": "peak memory", "cat": "memory", "ph": "C", "pid": rank, "ts": clock * 1e6,
                              "args": {"MiB": s.peak_memory_bytes / MIB}})
            clock += s.wall_s
    starts = _step_starts(record.stats[0]) if record.stats else {}
    for e in record.events:
        trace.append({"name": f"re-plan: {e.action}", "cat": "replan", "ph": "i", "s": "g",
                      "ts": starts.get(e.step + 1, 0.0) * 1e6, "pid": 0, "tid": 0,
                      "args": {"line": e.line(), "exact": e.exact, "cost_ms": e.cost_ms}})
    write_atomic(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}), kind="json")


def _step_args(stats) -> dict:
    keep = ("flops", "segments", "overruns", "approximate", "plan_version")
    return {k: v for k, v in asdict(stats).items() if k in keep}


def _step_starts(stats: Sequence) -> dict[int, float]:
    starts, clock = {}, 0.0
    for s in stats:
        starts[s.step] = clock
        clock += s.wall_s
    return starts
