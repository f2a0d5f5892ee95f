"""A plan's schedule lowered onto its boundaries: each stage's *program* of compute and transfers.

Why: a schedule (:func:`planner.schedule.actions.build_schedule`) says in which order a stage
computes; what crosses a boundary, and when, was implied by it (a forward's values leave when it
ends, a backward's gradients when it ends, or in the middle under delayed weight gradients), and
each of the deadlock proof, the simulator and the runtime re-derived it. A zero-bubble schedule
cannot be written that way: its input and weight halves are separate actions and the gradients
must leave between them. So the transfers are actions too (:data:`planner.schedule.actions.TRANSFERS`),
written out here once, and the proof (:mod:`planner.schedule.deadlock`), the simulator
(:mod:`planner.schedule.simulator`) and the runtime (``runtime.parallel.pipeline``) all run the
same lowered lists.

The lowering, per stage ``s`` with producers ``P`` (stages whose values it receives, ascending) and
consumers ``C`` (stages it feeds, ascending), along the stage's compute actions:

* ``F m`` -> ``RECV_F m <- p`` for each ``p`` in ``P``, ``F m``, ``SEND_F m -> c`` for each ``c`` in ``C``;
* ``B m`` / ``BI m`` -> ``RECV_B m <- c`` for each ``c`` in ``C``, the compute, ``SEND_B m -> p`` for
  each ``p`` in ``P``; ``BW m`` stays as it is (it moves nothing);
* on a stage that splits its backward (:func:`splits_backward`) a ``B m`` of a whole-backward
  schedule under ``Plan.delay_weight_gradients`` becomes ``BI m``, its sends, ``BW m`` (the weight
  half right after the sends, as the runtime always ran it); on a stage that cannot split, a
  split schedule's ``BI m`` becomes ``B m`` and its ``BW m`` goes (the whole backward where the
  input half was: the stage's gradients still leave as early as it can make them).

Receives come right before the compute that needs them and sends right after the compute that
made them, each in ascending peer order, which is the order the runtime's crossings were always
posted in (``runtime.parallel.boundaries``: one value's gradients from several consumers are summed
in ascending consumer order, bitwise as before).

Which stages split (:func:`splits_backward`, the one rule the simulator and the runtime share):
those of a pipeline that asks (a split schedule, or ``Plan.delay_weight_gradients``) whose backward
has no collective inside (no tensor-parallel group, no synchronised BatchNorm, no ZeRO sync: their
collectives are hooked into the backward and would run in the input half, before the weight
gradients exist) and that does not recompute (torch's checkpoint frees what it recomputed once the
input half has used it, so the weight half would run the stage's forward a third time). The input
half's share of a stage's backward time (:func:`input_share`): none on a stage that receives
nothing (its input half computes no gradient: the first stage), else half (a Linear's input and
weight gradients are matmuls of the same size); the runtime's emulator splits the backward's FLOPs
by its own reading of the same rule.
"""
from __future__ import annotations

import functools
from typing import Sequence

from planner.plan import Plan
from planner.schedule.actions import SPLIT_SCHEDULES, Action

Program = tuple[tuple[Action, ...], ...]   # one tuple of actions per stage
Edge = tuple[int, int]                      # (src_stage, dst_stage): src's forward output feeds dst


def asks_split(plan: Plan) -> bool:
    """Whether ``plan`` wants backwards split: a split schedule (``zb-h1``) or delayed weight gradients."""
    return plan.schedule in SPLIT_SCHEDULES or plan.delay_weight_gradients


def splits_backward(plan: Plan, stage: int) -> bool:
    """Whether stage ``stage`` of ``plan`` runs its backward as an input half and a weight half
    (module docstring): a pipeline of several stages that asks for it (:func:`asks_split`), on a
    stage with no tensor-parallel group, no synchronised BatchNorm, no ZeRO sync and no recompute."""
    if len(plan.stages) < 2 or not asks_split(plan):
        return False
    st = plan.stages[stage]
    if plan.sync_batchnorm or st.recompute or st.zero_stage > 0 or st.replica_sync in ("fsdp", "ragged"):
        return False
    return all(w.tp_size == 1 for w in plan.workers if w.stage == stage)


def input_share(plan: Plan, stage: int) -> float:
    """The input half's share of stage ``stage``'s backward time on a stage that splits it: 0 on a
    stage no boundary feeds (its input half computes nothing), else 0.5 (module docstring)."""
    return 0.5 if any(b.dst_stage == stage for b in plan.boundaries) else 0.0


def edges_of(plan: Plan) -> tuple[Edge, ...]:
    """The plan's boundaries as (source stage, destination stage) pairs, in the plan's order."""
    return tuple((b.src_stage, b.dst_stage) for b in plan.boundaries)


def lower(schedule: Sequence[Sequence[Action]], edges: Sequence[Edge], split: Sequence[bool]) -> Program:
    """Each stage's program (module docstring) from its compute actions in ``schedule``, the
    boundaries ``edges`` and whether each stage splits its backward."""
    return lower_with_origins(schedule, edges, split)[0]


def lower_with_origins(schedule: Sequence[Sequence[Action]], edges: Sequence[Edge], split: Sequence[bool]
                       ) -> tuple[Program, tuple[tuple[int, ...], ...]]:
    """:func:`lower`, and for every action of the program the position of the compute action it
    came from in ``schedule`` (so a proof can name the step of the list it was given)."""
    num_stages = len(schedule)
    producers = [sorted(src for src, dst in edges if dst == s) for s in range(num_stages)]
    consumers = [sorted(dst for src, dst in edges if src == s) for s in range(num_stages)]
    programs, origins = [], []
    for s, actions in enumerate(schedule):
        out: list[Action] = []
        origin: list[int] = []
        for step, a in enumerate(actions):
            m = a.micro_batch
            if a.kind == "F":
                lowered = ([Action("RECV_F", m, p) for p in producers[s]] + [a]
                           + [Action("SEND_F", m, c) for c in consumers[s]])
            elif a.kind in ("B", "BI"):
                receive = [Action("RECV_B", m, c) for c in consumers[s]]
                send = [Action("SEND_B", m, p) for p in producers[s]]
                if a.kind == "B" and split[s]:
                    lowered = receive + [Action("BI", m)] + send + [Action("BW", m)]
                elif a.kind == "BI" and not split[s]:
                    lowered = receive + [Action("B", m)] + send
                else:
                    lowered = receive + [a] + send
            elif a.kind == "BW":
                lowered = [a] if split[s] else []
            else:
                raise ValueError(f"stage {s}, step {step}: {a} is a transfer; a schedule lists compute actions "
                                 "only (F, B, BI, BW) and the lowering writes its transfers")
            out.extend(lowered)
            origin.extend([step] * len(lowered))
        programs.append(tuple(out))
        origins.append(tuple(origin))
    return tuple(programs), tuple(origins)


def split_flags(plan: Plan) -> tuple[bool, ...]:
    """:func:`splits_backward` of every stage of ``plan``."""
    return tuple(splits_backward(plan, s) for s in range(len(plan.stages)))


@functools.lru_cache(maxsize=64)
def forward_program(producers: tuple[int, ...], consumers: tuple[int, ...], count: int) -> tuple[Action, ...]:
    """A stage's forwards alone (an evaluation): ``count`` forwards in order, each with its receives
    from ``producers`` and its sends to ``consumers``. Every stage runs its forwards in micro-batch
    order and waits only on earlier stages, so these programs never deadlock."""
    out: list[Action] = []
    for m in range(count):
        out += [Action("RECV_F", m, p) for p in producers]
        out.append(Action("F", m))
        out += [Action("SEND_F", m, c) for c in consumers]
    return tuple(out)
