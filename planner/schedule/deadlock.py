"""Prove a pipeline schedule runs to completion before any process starts.

What is proven is a *program*: one ordered list per stage of compute actions and the transfers
between them (:mod:`planner.schedule.actions`, :mod:`planner.schedule.program`), the lists the
simulator and the runtime run. Under the runtime's rules a receive blocks and a send does not:
``RECV_F m <- p`` on stage ``s`` waits until stage ``p`` has run ``SEND_F m -> s``, ``RECV_B m <- c``
until stage ``c`` has run ``SEND_B m -> s``; compute and sends never wait. :func:`validate` checks,
in order:

1. each stage runs every micro-batch's forward once and its backward once after it: one ``B``, or
   one ``BI`` (input half) and then one ``BW`` (weight half);
2. along every edge, what one stage sends the other receives (micro-batch by micro-batch, per
   direction), else a :class:`ScheduleError` names the micro-batches sent and never received; in a
   program, also that each compute action has its receives before it and its sends after it, once
   each, on the plan's edges only (a send to a stage that never receives it, a forward that runs
   before its values arrive, a gradient sent before the backward made it: each named);
3. the lists run to completion: an abstract execution advances every stage while its next action
   may run; if some stage stops short, the stages wait on one another in a cycle, and the
   :class:`DeadlockError` names it (which stage waits at which action for what from whom).

A list of compute actions alone (a schedule) is lowered first (:func:`planner.schedule.program.lower`,
every stage splitting where the list says so) and its waits are named by the steps of the list
given. A plan's programs are built and proven once per shape (:func:`validate_plan` returns them).

Hanging a multi-process job is the costliest way to find these bugs, hence a check in one process.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from planner.groups import group_key
from planner.plan import Plan, PlanError
from planner.schedule.actions import Action, build_schedule
from planner.schedule.program import Program, lower_with_origins, split_flags

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
        what = "activations" if self.action.direction == "F" else "gradients"
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
    boundaries are checked) or one action list per stage of a chain pipeline: compute actions
    alone (a schedule) or a program with its transfers.
    """
    if isinstance(target, Plan):
        validate_plan(target)
    else:
        validate_schedule(target)


def validate_schedule(schedule: Schedule, edges: Sequence[Edge] | None = None) -> None:
    """Check ``schedule`` (one list per stage: compute actions, or a program with transfers);
    ``edges`` default to the chain ``s -> s+1``."""
    num_stages = len(schedule)
    if num_stages == 0:
        raise ScheduleError("schedule has no stages: give one action list per pipeline stage")
    edges = list(edges) if edges is not None else [(s, s + 1) for s in range(num_stages - 1)]
    for src, dst in edges:
        if not 0 <= src < dst < num_stages:
            raise ScheduleError(f"edge {src} -> {dst} is not a forward edge between stages 0..{num_stages - 1}")
    if any(a.is_transfer for actions in schedule for a in actions):
        _check_program(schedule, edges)
        return
    micro_batches = [_check_stage(s, actions) for s, actions in enumerate(schedule)]
    for src, dst in edges:
        _check_edge(src, dst, micro_batches[src], micro_batches[dst])
    # every stage as its list says: B whole, BI and BW split
    program, origins = lower_with_origins(schedule, edges, [True] * num_stages)
    _check_progress(program, origins, [list(actions) for actions in schedule])


def validate_plan(plan: Plan) -> Optional[Program]:
    """Check what simulating or running ``plan`` relies on: one forward and backward time per
    micro-batch on every worker (the same count within a tensor-parallel group), every stage
    staffed in every replica, boundaries linking the stages into one pipeline, and its schedule
    kind, whose program over those boundaries (:mod:`planner.schedule.program`) must run to
    completion. Returns that program, one tuple of actions per stage (None for a single stage:
    gradient accumulation over each worker's own micro-batches, no stage waits on another)."""
    _check_workers(plan)
    edges = _plan_edges(plan)
    num_stages = len(plan.stages)
    if num_stages == 1:
        return None
    return proven_program(plan.schedule, num_stages, plan.num_micro_batch, tuple(edges), split_flags(plan))


@functools.lru_cache(maxsize=64)
def proven_program(kind: str, num_stages: int, num_micro_batch: int, edges: tuple[Edge, ...],
                   split: tuple[bool, ...]) -> Program:
    """The program of schedule ``kind`` over ``edges`` with each stage split as ``split`` says
    (:func:`planner.schedule.program.lower`), proven: a pure function of its arguments, built and
    checked once for each (a planner simulates many plans of one pipeline shape; the runtime lowers
    onto the crossings its stage split has). An error is raised each time, never remembered."""
    try:
        schedule = build_schedule(kind, num_stages, num_micro_batch)
    except ValueError as e:
        raise ScheduleError(f"plan.schedule: {e}") from None
    micro_batches = [_check_stage(s, actions) for s, actions in enumerate(schedule)]
    for src, dst in edges:
        _check_edge(src, dst, micro_batches[src], micro_batches[dst])
    program, _ = lower_with_origins(schedule, edges, split)
    _check_program(program, edges)
    return program


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
        tp_groups.setdefault(group_key("tp", w), []).append(w)
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
    """Every micro-batch's forward once, then its backward once: ``B``, or ``BI`` then ``BW``.
    Returns the micro-batches the stage runs."""
    forwards: set[int] = set()
    done: dict[str, set[int]] = {"F": forwards, "B": set(), "BI": set(), "BW": set()}
    for step, a in enumerate(actions):
        if a.is_transfer:
            continue
        m = a.micro_batch
        if m in done[a.kind]:
            raise ScheduleError(f"stage {stage} runs {a} twice (again at step {step})")
        if a.kind != "F" and m not in forwards:
            raise ScheduleError(f"stage {stage} runs {a} at step {step} before F{m}")
        if a.kind in ("B", "BI") and m in done["B" if a.kind == "BI" else "BI"]:
            raise ScheduleError(f"stage {stage} runs {a} at step {step} after the other backward of micro-batch "
                                f"{m}; run its backward once: B{m}, or BI{m} then BW{m}")
        if a.kind == "BW" and m not in done["BI"]:
            raise ScheduleError(f"stage {stage} runs {a} at step {step} before BI{m} (the weight half needs the "
                                "input half's graph)" if m not in done["B"] else
                                f"stage {stage} runs {a} at step {step} after B{m}, which computed the weights' "
                                "gradients already")
        done[a.kind].add(m)
    backwards = done["B"] | done["BI"]
    if forwards != backwards:
        raise ScheduleError(
            f"stage {stage} never runs the backward of micro-batch(es) {sorted(forwards - backwards)}"
        )
    if done["BI"] != done["BW"]:
        raise ScheduleError(f"stage {stage} never runs the weight half of micro-batch(es) "
                            f"{sorted(done['BI'] - done['BW'])}: add BW after each BI")
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


def _check_program(program: Schedule, edges: Sequence[Edge]) -> None:
    """A program's own rules (module docstring, 1 and 2), then that it runs to completion (3)."""
    num_stages = len(program)
    producers = [sorted(src for src, dst in edges if dst == s) for s in range(num_stages)]
    consumers = [sorted(dst for src, dst in edges if src == s) for s in range(num_stages)]
    micro_batches = [_check_stage(s, actions) for s, actions in enumerate(program)]
    for src, dst in edges:
        _check_edge(src, dst, micro_batches[src], micro_batches[dst])
    for s, actions in enumerate(program):
        _check_transfers(s, actions, producers[s], consumers[s])
    _check_progress(program)


def _check_transfers(stage: int, actions: Sequence[Action], producers: list[int], consumers: list[int]) -> None:
    """Each compute action has its receives before it and its sends after it, once each, between
    the stage and its peers on the edges: ``F m`` receives from every producer and sends to every
    consumer, ``B m``/``BI m`` receives from every consumer and sends to every producer."""
    peers = {"RECV_F": producers, "SEND_F": consumers, "RECV_B": consumers, "SEND_B": producers}
    makes = {"SEND_F": ("F",), "SEND_B": ("B", "BI")}
    needs = {"RECV_F": ("F",), "RECV_B": ("B", "BI")}
    seen: set[tuple[str, int, int]] = set()
    computed: set[tuple[str, int]] = set()
    for step, a in enumerate(actions):
        if not a.is_transfer:
            needed = [("RECV_F", p) for p in producers] if a.kind == "F" else (
                [("RECV_B", c) for c in consumers] if a.kind in ("B", "BI") else [])
            for kind, peer in needed:
                if (kind, a.micro_batch, peer) not in seen:
                    raise ScheduleError(f"stage {stage} runs {a} at step {step} before "
                                        f"{Action(kind, a.micro_batch, peer)}: its inputs from stage {peer} must be "
                                        "received first; put the receive before it")
            computed.add(("B" if a.kind == "BI" else a.kind, a.micro_batch))
            continue
        key = (a.kind, a.micro_batch, a.peer)
        if a.peer not in peers[a.kind]:
            side = "feeds" if a.kind in ("SEND_F", "RECV_B") else "is fed by"
            raise ScheduleError(f"stage {stage} runs {a} at step {step}, but it {side} stages {peers[a.kind]} only "
                                "(the plan's boundaries); remove it or add the boundary")
        if key in seen:
            raise ScheduleError(f"stage {stage} runs {a} twice (again at step {step})")
        if a.kind in makes and not any((("B" if k == "BI" else k), a.micro_batch) in computed for k in makes[a.kind]):
            raise ScheduleError(f"stage {stage} runs {a} at step {step} before {'/'.join(k + str(a.micro_batch) for k in makes[a.kind])} "
                                "made what it sends; put the send after it")
        if a.kind in needs and any((("B" if k == "BI" else k), a.micro_batch) in computed for k in needs[a.kind]):
            raise ScheduleError(f"stage {stage} runs {a} at step {step} after "
                                f"{'/'.join(k + str(a.micro_batch) for k in needs[a.kind])}, which needed it; put the "
                                "receive before it")
        seen.add(key)
    for kind in ("SEND_F", "SEND_B"):
        for peer in peers[kind]:
            missing = sorted(m for k, m in computed if k == makes[kind][0] and (kind, m, peer) not in seen)
            if missing:
                raise ScheduleError(f"stage {stage} never runs {kind} to stage {peer} for micro-batch(es) {missing}, "
                                    f"which stage {peer} waits for; add {Action(kind, missing[0], peer)} after "
                                    f"{makes[kind][-1] if kind == 'SEND_B' else 'F'}{missing[0]}")


def _check_progress(program: Schedule, origins: Optional[Sequence[Sequence[int]]] = None,
                    given: Optional[Sequence[Sequence[Action]]] = None) -> None:
    """Run ``program`` abstractly: a receive runs once its peer has run the matching send,
    everything else runs when reached. ``origins``/``given``: the compute list the program was
    lowered from, to name a wait by its step there."""
    num_stages = len(program)
    sent: set[tuple[int, str, int, int]] = set()   # (sender, direction, micro-batch, receiver)

    def blocker(s: int, a: Action) -> int | None:
        if a.kind.startswith("RECV") and (a.peer, a.direction, a.micro_batch, s) not in sent:
            return a.peer
        return None

    pc = [0] * num_stages
    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(program):
            position = pc[s]
            while position < len(actions):
                a = actions[position]
                if a.kind.startswith("RECV"):
                    if (a.peer, a.direction, a.micro_batch, s) not in sent:
                        break
                elif a.kind.startswith("SEND"):
                    sent.add((s, a.direction, a.micro_batch, a.peer))
                position += 1
            if position != pc[s]:
                pc[s] = position
                progress = True
    stuck = [s for s in range(num_stages) if pc[s] < len(program[s])]
    if not stuck:
        return
    # Every stuck stage waits at a receive; the checks above guarantee its peer has the matching
    # send still ahead of it, so the peer is stuck too and following the waits closes a cycle.
    chain: list[Wait] = []
    seen: dict[int, int] = {}
    s = stuck[0]
    while s not in seen:
        seen[s] = len(chain)
        a = program[s][pc[s]]
        producer = blocker(s, a)
        if origins is not None and given is not None:
            step = origins[s][pc[s]]
            chain.append(Wait(s, step, given[s][step], producer))
        else:
            chain.append(Wait(s, pc[s], a, producer))
        s = producer
    raise DeadlockError(chain[seen[s]:])
