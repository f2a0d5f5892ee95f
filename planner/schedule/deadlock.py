"""Prove a pipeline schedule runs to completion before any process starts.

A schedule is one ordered action list per stage (:mod:`planner.schedule.actions`). Under the runtime's
rules a receive blocks and a send does not: forward ``F m`` on stage ``s`` waits for the
activations of micro-batch ``m`` from every stage feeding ``s``; backward ``B m`` waits for the
gradients of ``m`` from every stage ``s`` feeds. :func:`validate` checks, in order:

1. each stage runs every micro-batch's forward once and its backward once, after the forward;
2. along every edge, what one stage sends the other receives (micro-batch by micro-batch, per
   direction), else a :class:`ScheduleError` names the micro-batches sent and never received;
3. the lists run to completion: an abstract execution advances every stage while its next action's
   inputs exist; if some stage stops short, the stages wait on one another in a cycle, and the
   :class:`DeadlockError` names it (which stage waits at which action for what from whom).

Hanging a multi-process job is the costliest way to find these bugs, hence a check in one process.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Sequence, Union

from planner.plan import Plan, PlanError
from planner.schedule.actions import Action, build_schedule

Schedule = Sequence[Sequence[Action]]
Edge = tuple[int, int]  # (src_stage, dst_stage): src's forward output feeds dst


class ScheduleError(PlanError):
    """A schedule (or the plan it belongs to) cannot run: malformed lists or mismatched sends/receives."""


@dataclass(frozen=True)
class Wait:
    """Stage ``stage`` is blocked at position ``step`` of its list, on ``action``, waiting for
    ``producer`` to send the activations (forward) or gradients (backward) of its micro-batch."""

    stage: int
    step: int
    action: Action
    producer: int

    def __str__(self) -> str:
        what = "activations" if self.action.kind == "F" else "gradients"
        return (f"stage {self.stage} waits at step {self.step} ({self.action}) for the {what} of "
                f"micro-batch {self.action.micro_batch} from stage {self.producer}")


class DeadlockError(ScheduleError):
    """The stages in :attr:`cycle` wait on each other forever."""

    def __init__(self, cycle: list[Wait]):
        self.cycle = cycle
        super().__init__(
            "schedule deadlocks: " + "; ".join(map(str, cycle)) + ". Reorder the actions so every stage "
            "receives an input before it blocks on another (planner.schedule.actions.build_schedule lists are safe)"
        )


def validate(target: Union[Plan, Schedule]) -> None:
    """Raise :class:`ScheduleError` (or :class:`DeadlockError`) if ``target`` cannot run.

    ``target`` is a :class:`~planner.plan.Plan` (its schedule kind, micro-batch counts and
    boundaries are checked) or a schedule: one action list per stage of a chain pipeline.
    """
    if isinstance(target, Plan):
        validate_plan(target)
    else:
        validate_schedule(target)


def validate_schedule(schedule: Schedule, edges: Sequence[Edge] | None = None) -> None:
    """Check ``schedule`` (one list per stage); ``edges`` default to the chain ``s -> s+1``."""
    num_stages = len(schedule)
    if num_stages == 0:
        raise ScheduleError("schedule has no stages: give one action list per pipeline stage")
    edges = list(edges) if edges is not None else [(s, s + 1) for s in range(num_stages - 1)]
    for src, dst in edges:
        if not 0 <= src < dst < num_stages:
            raise ScheduleError(f"edge {src} -> {dst} is not a forward edge between stages 0..{num_stages - 1}")
    micro_batches = [_check_stage(s, actions) for s, actions in enumerate(schedule)]
    for src, dst in edges:
        _check_edge(src, dst, micro_batches[src], micro_batches[dst])
    _check_progress(schedule, edges)


def validate_plan(plan: Plan) -> None:
    """Check what simulating or running ``plan`` relies on: one forward and backward time per
    micro-batch on every worker (the same count within a tensor-parallel group), every stage
    staffed in every replica, boundaries linking the stages into one pipeline, and its schedule
    kind, whose lists (over those boundaries) must run to completion."""
    _check_workers(plan)
    edges = _plan_edges(plan)
    num_stages = len(plan.stages)
    if num_stages == 1:
        return  # gradient accumulation: no stage waits on another
    _validated_schedule(plan.schedule, num_stages, plan.num_micro_batch, tuple(edges))


@functools.lru_cache(maxsize=64)
def _validated_schedule(kind: str, num_stages: int, num_micro_batch: int, edges: tuple[Edge, ...]) -> None:
    """:func:`validate_schedule` of a named schedule's lists: a pure function of its arguments,
    run once for each (a planner simulates many plans of one pipeline shape). An error is raised
    each time, never remembered."""
    try:
        schedule = build_schedule(kind, num_stages, num_micro_batch)
    except ValueError as e:
        raise ScheduleError(f"plan.schedule: {e}") from None
    validate_schedule(schedule, edges)


def _check_workers(plan: Plan) -> None:
    num_stages = len(plan.stages)
    tp_groups: dict[tuple[int, int, int], list] = {}
    for i, w in enumerate(plan.workers):
        where = f"plan.workers[{i}]"
        if not 0 <= w.stage < num_stages:
            raise ScheduleError(f"{where}.stage is {w.stage}, the plan has stages 0..{num_stages - 1}")
        if not w.forward_ms or len(w.forward_ms) != len(w.backward_ms):
            raise ScheduleError(
                f"{where}: forward_ms and backward_ms need one entry per micro-batch, got "
                f"{len(w.forward_ms)} and {len(w.backward_ms)}; re-create the plan with `whalelike plan`"
            )
        if num_stages > 1 and len(w.forward_ms) != plan.num_micro_batch:
            raise ScheduleError(
                f"{where}.forward_ms has {len(w.forward_ms)} entries; every pipeline stage runs "
                f"num_micro_batch = {plan.num_micro_batch} micro-batches"
            )
        tp_groups.setdefault((w.replica, w.stage, w.dp_index), []).append(w)
    for (r, s, dp), ws in tp_groups.items():
        if len({len(w.forward_ms) for w in ws}) != 1:
            raise ScheduleError(
                f"plan.workers {[w.rank for w in ws]} (replica {r}, stage {s}, dp_index {dp}) form a tensor-parallel "
                f"group but have {[len(w.forward_ms) for w in ws]} micro-batches; they must process the same samples"
            )
    for r in range(plan.num_replicas):
        for s in range(num_stages):
            if not plan.stage_workers(s, r):
                raise ScheduleError(f"plan.workers: no worker runs stage {s} in replica {r}")


def _plan_edges(plan: Plan) -> list[Edge]:
    num_stages = len(plan.stages)
    edges: list[Edge] = []
    for i, b in enumerate(plan.boundaries):
        if not 0 <= b.src_stage < b.dst_stage < num_stages:
            raise ScheduleError(
                f"plan.boundaries[{i}]: {b.src_stage} -> {b.dst_stage} is not a forward edge between "
                f"stages 0..{num_stages - 1}"
            )
        if b.transfer_ms and len(b.transfer_ms) != plan.num_micro_batch:
            raise ScheduleError(
                f"plan.boundaries[{i}].transfer_ms has {len(b.transfer_ms)} entries for "
                f"{plan.num_micro_batch} micro-batches"
            )
        if (b.src_stage, b.dst_stage) in edges:
            raise ScheduleError(
                f"plan.boundaries[{i}]: a second boundary {b.src_stage} -> {b.dst_stage}; list every tensor "
                "crossing it in one boundary's tensors"
            )
        edges.append((b.src_stage, b.dst_stage))
    for s in range(num_stages):
        if s > 0 and not any(dst == s for _, dst in edges):
            raise ScheduleError(f"plan.boundaries: stage {s} receives from no stage; add a boundary with "
                                f"dst_stage={s} (usually src_stage={s - 1})")
        if s < num_stages - 1 and not any(src == s for src, _ in edges):
            raise ScheduleError(f"plan.boundaries: stage {s} feeds no stage; add a boundary with "
                                f"src_stage={s} (usually dst_stage={s + 1})")
    return edges


# -- the three checks ------------------------------------------------------------------------------
def _check_stage(stage: int, actions: Sequence[Action]) -> set[int]:
    forwards: set[int] = set()
    backwards: set[int] = set()
    for step, a in enumerate(actions):
        done = forwards if a.kind == "F" else backwards
        if a.micro_batch in done:
            raise ScheduleError(f"stage {stage} runs {a} twice (again at step {step})")
        if a.kind == "B" and a.micro_batch not in forwards:
            raise ScheduleError(f"stage {stage} runs {a} at step {step} before F{a.micro_batch}")
        done.add(a.micro_batch)
    if forwards != backwards:
        raise ScheduleError(
            f"stage {stage} never runs the backward of micro-batch(es) {sorted(forwards - backwards)}"
        )
    return forwards


def _check_edge(src: int, dst: int, sent: set[int], received: set[int]) -> None:
    """Forward direction: src sends what it forwards, dst receives what it forwards. Backward
    direction: dst sends what it back-propagates, src receives what it back-propagates; per stage
    those equal the forwards (checked before), so the backward counts mirror the forward ones."""
    if sent == received:
        return
    problems = []
    if sent - received:
        problems.append(f"stage {dst} never receives micro-batch(es) {sorted(sent - received)} "
                        f"and never sends their gradients, which stage {src} waits for")
    if received - sent:
        problems.append(f"stage {src} never sends micro-batch(es) {sorted(received - sent)}, "
                        f"which stage {dst} waits for")
    raise ScheduleError(
        f"stages {src} -> {dst} disagree: forward, stage {src} sends {len(sent)} activations and stage {dst} "
        f"receives {len(received)}; backward, stage {dst} sends {len(received)} gradients and stage {src} "
        f"receives {len(sent)}: " + "; ".join(problems)
    )


def _check_progress(schedule: Schedule, edges: Sequence[Edge]) -> None:
    num_stages = len(schedule)
    feeds = [[src for src, dst in edges if dst == s] for s in range(num_stages)]
    fed = [[dst for src, dst in edges if src == s] for s in range(num_stages)]
    done: set[tuple[int, str, int]] = set()

    def blocker(s: int, a: Action) -> int | None:
        for other in feeds[s] if a.kind == "F" else fed[s]:
            if (other, a.kind, a.micro_batch) not in done:
                return other
        return None

    pc = [0] * num_stages
    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(schedule):
            while pc[s] < len(actions) and blocker(s, actions[pc[s]]) is None:
                a = actions[pc[s]]
                done.add((s, a.kind, a.micro_batch))
                pc[s] += 1
                progress = True
    stuck = [s for s in range(num_stages) if pc[s] < len(schedule[s])]
    if not stuck:
        return
    # Every stuck stage waits on one producer; the checks above guarantee the producer has the
    # awaited action still ahead of it, so it is stuck too and following the waits closes a cycle.
    chain: list[Wait] = []
    seen: dict[int, int] = {}
    s = stuck[0]
    while s not in seen:
        seen[s] = len(chain)
        a = schedule[s][pc[s]]
        producer = blocker(s, a)
        chain.append(Wait(s, pc[s], a, producer))
        s = producer
    raise DeadlockError(chain[seen[s]:])
