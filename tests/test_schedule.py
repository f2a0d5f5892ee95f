"""Pipeline schedules as data, and the validator that proves a set of action lists can run."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.schedule.actions import (SCHEDULES, SPLIT_SCHEDULES, Action, build_schedule, gradient_accumulation,
                                      max_in_flight, parse_actions)
from planner.schedule.deadlock import DeadlockError, ScheduleError, Wait, proven_program, validate, validate_schedule
from planner.plan import BoundaryPlan
from planner.schedule.program import input_share, lower, split_flags
from plans import make_plan, worker


def parse(text: str) -> list[list[Action]]:
    """'F0 F1 B0 B1 | F0 B0 F1 B1' -> one action list per stage."""
    return [[Action(tok[0], int(tok[1:])) for tok in stage.split()] for stage in text.split("|")]


@given(kind=st.sampled_from(sorted(SCHEDULES)), num_stages=st.integers(1, 8), num_micro_batch=st.integers(1, 12))
def test_built_in_schedules_are_valid_and_complete(kind, num_stages, num_micro_batch):
    schedule = build_schedule(kind, num_stages, num_micro_batch)
    validate(schedule)
    # a split schedule runs each backward as its input half and its weight half, the others whole
    backward = ["BI", "BW"] if kind in SPLIT_SCHEDULES else ["B"]
    for actions in schedule:
        assert sorted(str(a) for a in actions) == sorted(
            [f"F{m}" for m in range(num_micro_batch)] + [f"{b}{m}" for b in backward for m in range(num_micro_batch)])


@pytest.mark.parametrize("num_stages,num_micro_batch", [(1, 4), (4, 2), (4, 8), (6, 16)])
def test_in_flight_micro_batches_per_schedule(num_stages, num_micro_batch):
    peaks = {kind: [max_in_flight(a) for a in build_schedule(kind, num_stages, num_micro_batch)] for kind in SCHEDULES}
    assert peaks["gpipe"] == [num_micro_batch] * num_stages
    assert peaks["1f1b"] == [min(num_stages - s, num_micro_batch) for s in range(num_stages)]
    assert peaks["eager-1f1b"] == [min(2 * (num_stages - s) - 1, num_micro_batch) for s in range(num_stages)]


def test_eager_1f1b_matches_alpas_overlap_friendly_schedule():
    """The first steps of Alpa's OverlapFriendlyPipeDreamSchedule for three stages."""
    schedule = build_schedule("eager-1f1b", 3, 6)
    assert " ".join(map(str, schedule[0][:8])) == "F0 F1 F2 F3 F4 B0 F5 B1"
    assert " ".join(map(str, schedule[1][:6])) == "F0 F1 F2 B0 F3 B1"
    assert " ".join(map(str, schedule[2][:4])) == "F0 B0 F1 B1"


def test_gradient_accumulation_keeps_one_micro_batch_in_flight():
    assert " ".join(map(str, gradient_accumulation(3))) == "F0 B0 F1 B1 F2 B2"


def test_unknown_schedule_lists_the_choices():
    with pytest.raises(ValueError, match="unknown schedule 'zb' ; choose one of gpipe, 1f1b, eager-1f1b".replace(" ;", ";")):
        build_schedule("zb", 2, 2)


@pytest.mark.parametrize("kind,micro_batch,message", [("X", 0, "Action.kind"), ("F", -1, "Action.micro_batch"),
                                                      ("B", 1.0, "Action.micro_batch")])
def test_actions_are_validated(kind, micro_batch, message):
    with pytest.raises(ValueError, match=message):
        Action(kind, micro_batch)


def test_crossed_orders_deadlock_and_the_cycle_is_named():
    # stage 0 wants gradient 0 before sending activation 1; stage 1 wants activation 1 first
    with pytest.raises(DeadlockError) as info:
        validate(parse("F0 B0 F1 B1 | F0 F1 B0 B1"))
    assert info.value.cycle == [Wait(0, 1, Action("B", 0), 1), Wait(1, 1, Action("F", 1), 0)]
    assert str(info.value).startswith(
        "schedule deadlocks: stage 0 waits at step 1 (B0) for the gradients of micro-batch 0 from stage 1; "
        "stage 1 waits at step 1 (F1) for the activations of micro-batch 1 from stage 0.")


def test_deadlock_deep_in_a_pipeline_reports_only_the_cycle():
    """Stages 2 and 3 cross their orders; stages 0 and 1 block behind them but are not the cause."""
    schedule = build_schedule("gpipe", 4, 2)
    schedule[2:] = parse("F0 B0 F1 B1 | F0 F1 B0 B1")
    with pytest.raises(DeadlockError) as info:
        validate(schedule)
    assert info.value.cycle == [Wait(2, 1, Action("B", 0), 3), Wait(3, 1, Action("F", 1), 2)]


def assert_closed(cycle: list[Wait]) -> None:
    for wait, following in zip(cycle, cycle[1:] + cycle[:1]):
        assert wait.producer == following.stage


def test_skip_edges_are_checked_too():
    """A U-shaped model: stage 2 also consumes stage 0's output (and sends it gradients)."""
    edges = [(0, 1), (1, 2), (0, 2)]
    for kind in SCHEDULES:
        validate_schedule(build_schedule(kind, 3, 4), edges)
    with pytest.raises(DeadlockError) as info:
        validate_schedule(parse("F0 B0 F1 B1 | F0 F1 B0 B1 | F0 F1 B0 B1"), edges)
    assert_closed(info.value.cycle)
    assert len(info.value.cycle) == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("F0 F1 B0 B1 | F0 B0", r"stages 0 -> 1 disagree: forward, stage 0 sends 2 activations and stage 1 receives 1; "
                                r"backward, stage 1 sends 1 gradients and stage 0 receives 2: stage 1 never receives "
                                r"micro-batch\(es\) \[1\]"),
        ("F0 B0 | F0 F1 B0 B1", r"stage 0 never sends micro-batch\(es\) \[1\], which stage 1 waits for"),
        ("F0 F0 B0 | F0 B0", r"stage 0 runs F0 twice \(again at step 1\)"),
        ("F0 B1 B0 | F0 B0", r"stage 0 runs B1 at step 1 before F1"),
        ("F0 F1 B0 | F0 F1 B0 B1", r"stage 0 never runs the backward of micro-batch\(es\) \[1\]"),
        ("", "edge 0 -> 1 is not a forward edge"),
    ],
)
def test_malformed_schedules_are_rejected(text, message):
    schedule = parse(text) if text else [[]]
    edges = [(0, 1)] if not text else None
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(schedule, edges)


def test_an_empty_schedule_is_rejected():
    with pytest.raises(ScheduleError, match="schedule has no stages"):
        validate([])


def test_every_configurable_schedule_is_built_here():
    from whalelike.config import SCHEDULES as CONFIGURABLE

    assert set(CONFIGURABLE) == set(SCHEDULES)


# -- ZB-H1 and programs (actions with their transfers) ---------------------------------------------------
def text(actions) -> str:
    return " ".join(map(str, actions))


def test_zb_h1_defers_the_first_s_weight_halves_of_stage_s_to_the_drain():
    """Stage s warms up as in 1F1B (S - s - 1 forwards), then runs F, BI, BW cycles whose first s
    leave the weight half out; those s run last (Qi et al., ZB-H1)."""
    schedule = build_schedule("zb-h1", 3, 4)
    assert text(schedule[0]) == "F0 F1 F2 BI0 BW0 F3 BI1 BW1 BI2 BW2 BI3 BW3"
    assert text(schedule[1]) == "F0 F1 BI0 F2 BI1 BW0 F3 BI2 BW1 BI3 BW2 BW3"
    assert text(schedule[2]) == "F0 BI0 F1 BI1 F2 BI2 BW0 F3 BI3 BW1 BW2 BW3"
    # the order of forwards and input halves is 1F1B's
    for zb, ofob in zip(schedule, build_schedule("1f1b", 3, 4)):
        assert [(a.kind, a.micro_batch) for a in zb if a.kind != "BW"] == \
               [("BI" if a.kind == "B" else "F", a.micro_batch) for a in ofob]


@pytest.mark.parametrize("num_stages,num_micro_batch", [(1, 4), (2, 1), (4, 2), (4, 8), (6, 16)])
def test_zb_h1_holds_at_most_1f1bs_largest_in_flight_count_on_every_stage(num_stages, num_micro_batch):
    peaks = [max_in_flight(a) for a in build_schedule("zb-h1", num_stages, num_micro_batch)]
    ofob = [max_in_flight(a) for a in build_schedule("1f1b", num_stages, num_micro_batch)]
    assert peaks == [min(num_stages, num_micro_batch)] * num_stages
    assert max(peaks) == max(ofob)


def test_lowering_writes_every_transfer_and_splits_as_each_stage_can():
    edges = [(0, 1)]
    # ZB-H1: the input half's gradients leave before the (deferred) weight half
    zb = lower(build_schedule("zb-h1", 2, 2), edges, [True, True])
    assert text(zb[0]) == "F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 BI0 BW0 RECV_B1<-1 BI1 BW1"
    assert text(zb[1]) == "RECV_F0<-0 F0 BI0 SEND_B0->0 RECV_F1<-0 F1 BI1 SEND_B1->0 BW0 BW1"
    # 1F1B with delayed weight gradients: each B is BI, its sends, BW (as the runtime always ran it)
    delayed = lower(build_schedule("1f1b", 2, 2), edges, [True, True])
    assert text(delayed[1]) == "RECV_F0<-0 F0 BI0 SEND_B0->0 BW0 RECV_F1<-0 F1 BI1 SEND_B1->0 BW1"
    assert text(lower(build_schedule("1f1b", 2, 2), edges, [False, False])[1]) == \
        "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0"
    # a stage that cannot split (tensor parallel, ZeRO, ...) runs its whole backward where BI was
    unsplit = lower(build_schedule("zb-h1", 2, 2), edges, [True, False])
    assert text(unsplit[1]) == "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0"
    # a skip edge: receives and sends in ascending peer order
    skip = lower(build_schedule("1f1b", 3, 1), [(0, 1), (1, 2), (0, 2)], [False] * 3)
    assert text(skip[0]) == "F0 SEND_F0->1 SEND_F0->2 RECV_B0<-1 RECV_B0<-2 B0"
    assert text(skip[2]) == "RECV_F0<-0 RECV_F0<-1 F0 B0 SEND_B0->0 SEND_B0->1"
    assert parse_actions(text(skip[2])) == list(skip[2])


@settings(max_examples=60, deadline=None)   # no timing in the suite: a busy machine must not fail it
@given(kind=st.sampled_from(sorted(SCHEDULES)), num_stages=st.integers(2, 6), num_micro_batch=st.integers(1, 10),
       split=st.lists(st.booleans(), min_size=6, max_size=6), skip=st.booleans())
def test_every_lowered_program_is_proven(kind, num_stages, num_micro_batch, split, skip):
    edges = [(s, s + 1) for s in range(num_stages - 1)] + ([(0, num_stages - 1)] if skip and num_stages > 2 else [])
    program = lower(build_schedule(kind, num_stages, num_micro_batch), edges, split[:num_stages])
    validate_schedule(program, edges)
    assert proven_program(kind, num_stages, num_micro_batch, tuple(edges), tuple(split[:num_stages])) == program


def zb_program(num_stages=3, num_micro_batch=4) -> list[list[Action]]:
    return [list(p) for p in lower(build_schedule("zb-h1", num_stages, num_micro_batch),
                                   [(s, s + 1) for s in range(num_stages - 1)], [True] * num_stages)]


def test_a_zb_h1_program_that_waits_for_a_gradient_before_sending_its_forward_deadlocks():
    """Stage 1 asks for micro-batch 2's gradients before it sends micro-batch 2's activations, which
    stage 2 needs to compute them: the cycle is named, action by action."""
    program = zb_program()
    stage1 = program[1]
    receive = stage1.pop(stage1.index(Action("RECV_B", 2, 2)))
    stage1.insert(stage1.index(Action("SEND_F", 2, 2)), receive)
    step = stage1.index(receive)
    with pytest.raises(DeadlockError) as info:
        validate_schedule(program)
    assert info.value.cycle == [Wait(1, step, receive, 2), Wait(2, program[2].index(Action("RECV_F", 2, 1)),
                                                                Action("RECV_F", 2, 1), 1)]
    assert str(info.value).startswith(
        f"schedule deadlocks: stage 1 waits at step {step} (RECV_B2<-2) for the gradients of micro-batch 2 from "
        f"stage 2; stage 2 waits at step {program[2].index(Action('RECV_F', 2, 1))} (RECV_F2<-1) for the activations "
        "of micro-batch 2 from stage 1.")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda p: p[1].remove(Action("SEND_B", 2, 0)),
         r"stage 1 never runs SEND_B to stage 0 for micro-batch\(es\) \[2\], which stage 0 waits for"),
        (lambda p: p[1].remove(Action("BW", 3)), r"stage 1 never runs the weight half of micro-batch\(es\) \[3\]"),
        (lambda p: p[2].insert(p[2].index(Action("BI", 1)), p[2].pop(p[2].index(Action("BW", 1)))),
         r"stage 2 runs BW1 at step \d+ before BI1"),
        (lambda p: p[1].insert(0, p[1].pop(p[1].index(Action("F", 0)))),
         r"stage 1 runs F0 at step 0 before RECV_F0<-0: its inputs from stage 0 must be received first"),
        (lambda p: p[0].insert(0, Action("SEND_F", 0, 2)),
         r"stage 0 runs SEND_F0->2 at step 0, but it feeds stages \[1\] only"),
        (lambda p: p[1].insert(p[1].index(Action("BI", 0)), p[1].pop(p[1].index(Action("SEND_B", 0, 0)))),
         r"stage 1 runs SEND_B0->0 at step \d+ before B0/BI0 made what it sends; put the send after it"),
    ],
)
def test_a_broken_zb_h1_program_is_refused_by_name(edit, message):
    program = zb_program()
    validate_schedule(program)      # as built: proven
    edit(program)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(program)


def test_transfers_name_their_peer():
    with pytest.raises(ValueError, match=r"Action SEND_F0: a transfer names its peer stage"):
        Action("SEND_F", 0)
    with pytest.raises(ValueError, match=r"Action BI0: a compute action has no peer"):
        Action("BI", 0, 1)
    assert str(Action("RECV_B", 3, 2)) == "RECV_B3<-2" and str(Action("SEND_F", 1, 0)) == "SEND_F1->0"


def test_which_stages_split_their_backward_is_one_rule_of_the_plan():
    """planner.schedule.program.splits_backward, read by the simulator and the runtime alike: a
    pipeline that asks (ZB-H1 or delayed weight gradients), on a stage with no tensor-parallel group,
    synchronised BatchNorm, ZeRO sync or recompute; the input half's share is 0 where nothing is received."""
    workers = [worker(0, 0, sizes=[2, 2]), worker(1, 1, sizes=[2, 2]), worker(2, 2, sizes=[2, 2], tp_size=2),
               worker(3, 2, tp_index=1, sizes=[2, 2], tp_size=2)]
    plan = make_plan(3, workers, schedule="zb-h1")
    assert split_flags(plan) == (True, True, False)                       # stage 2 is tensor parallel
    assert split_flags(dataclasses.replace(plan, schedule="1f1b")) == (False, False, False)
    assert split_flags(dataclasses.replace(plan, schedule="1f1b", delay_weight_gradients=True)) == (True, True, False)
    assert split_flags(dataclasses.replace(plan, sync_batchnorm=True)) == (False, False, False)
    zero = [dataclasses.replace(st, zero_stage=2, replica_sync="fsdp") if st.index == 1 else st for st in plan.stages]
    assert split_flags(dataclasses.replace(plan, stages=zero)) == (True, False, False)
    recompute = [dataclasses.replace(st, recompute=True) if st.index == 0 else st for st in plan.stages]
    assert split_flags(dataclasses.replace(plan, stages=recompute)) == (False, True, False)
    alone = make_plan(1, [worker(0, 0, sizes=[2, 2])], schedule="zb-h1", delay_weight_gradients=True)
    assert split_flags(alone) == (False,)                                 # one stage sends nothing: never split
    with_boundaries = dataclasses.replace(plan, boundaries=[BoundaryPlan(0, 1, ["x"], 4.0), BoundaryPlan(1, 2, ["y"], 4.0)])
    assert [input_share(with_boundaries, s) for s in range(3)] == [0.0, 0.5, 0.5]
