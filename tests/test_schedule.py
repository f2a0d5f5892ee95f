"""Pipeline schedules as data, and the validator that proves a set of action lists can run."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.schedule.actions import (SCHEDULES, SPLIT_SCHEDULES, Action, build_schedule, gradient_accumulation,
                                      max_in_flight)
from planner.schedule.deadlock import DeadlockError, ScheduleError, Wait, validate, validate_schedule


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
