"""The step-boundary controllers (runtime.control): the board's order, inert controllers, one change
a step, the exchange shared by the controllers, and a controller of one's own on a real Engine.

In one process: the board runs controllers in ``(order, adding order)``, refuses a second controller
of one name, skips inert ones (neither exchanging nor reacting), applies the first change only and
tells the others; parts compose into one summed vector.

One 4-rank spawn (float64, the data-parallel setting of test_runtime_dp): an Engine with
:class:`runtime.control.step_log.StepLog` and a controller that asks, at step 1, for a plan of other
shares and, at step 3, for the first plan again: training equals the single-process reference, the
controller was told its changes were applied, the re-planner heard of them, and rank 0's log has one
JSON line per step with every rank's figures of the step before.
"""
from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from dist_utils import run_ranks
from reference import train_reference
from runtime.control.board import Board
from runtime.control.exchange import Part, compose
from runtime.control.protocol import Controller, PlanChange
from whalelike.errors import WhaleError

from test_runtime_dp import OPTIMIZERS, Net, batches, make_cluster, make_plan


class Recorder(Controller):
    """Logs what the board asks of it; returns ``change`` from :meth:`react` when given one."""

    def __init__(self, name: str, order: int, log: list, change=None, holds: frozenset = frozenset()):
        self.name, self.order, self.log, self.change, self.holds = name, order, log, change, holds

    def suppresses(self, plan):
        return self.holds

    def exchange(self, step, runtime, so_far):
        self.log.append((self.name, "exchange"))
        return Part(1, lambda: torch.tensor([1.0]), lambda v: self.log.append((self.name, "arrived", float(v[0]))))

    def react(self, view):
        self.log.append((self.name, "react"))
        return self.change

    def applied(self, view, change, report):
        self.log.append((self.name, "applied", change.kind))

    def changed(self, view, change):
        self.log.append((self.name, "changed", change.kind))

    def resumed(self, view):
        self.log.append((self.name, "resumed"))


def test_the_board_orders_holds_and_applies_one_change():
    log: list = []
    board = Board()
    plan = SimpleNamespace(stages=[])
    view = SimpleNamespace(plan=plan)
    late = board.add(Recorder("late", 100, log, change=PlanChange("end_migration", reason="second")))
    first = board.add(Recorder("first", 0, log))
    board.add(Recorder("middle", 10, log, change=PlanChange("end_migration", reason="first")))
    assert [c.name for c in board.controllers] == ["first", "middle", "late"]
    with pytest.raises(WhaleError, match="a controller named 'first' already runs"):
        board.add(Recorder("first", 5, log))
    passenger = board.exchange(0, SimpleNamespace(plan=plan), lambda: None)
    assert passenger.fill().tolist() == [1.0, 1.0, 1.0]      # one value each, in board order
    passenger.arrived(torch.tensor([4.0, 4.0, 4.0]))            # summed over four ranks
    assert [e for e in log if e[1] == "arrived"] == [("first", "arrived", 4.0), ("middle", "arrived", 4.0),
                                                       ("late", "arrived", 4.0)]
    log.clear()
    proposer, change, _ = board.decide(lambda figures: view)
    assert proposer.name == "middle" and change.reason == "first"
    assert log == [("first", "react"), ("middle", "react")]     # the later controller did not react
    log.clear()
    board.settle(view, proposer, change, None)
    assert log == [("middle", "applied", "end_migration"), ("first", "changed", "end_migration"),
                   ("late", "changed", "end_migration")]
    # an inert controller neither exchanges nor reacts; it is told when it resumes
    first.holds = frozenset({"late"})
    log.clear()
    board.exchange(1, SimpleNamespace(plan=plan), lambda: None)
    assert ("late", "exchange") not in log
    assert board.decide(lambda figures: view)[0].name == "middle"
    first.holds = frozenset()
    log.clear()
    board.settle(view, board.get("middle"), change, None)
    assert ("late", "resumed") in log
    assert late.approximate is False and not board.approximate


def test_parts_compose_into_one_vector():
    got = []
    passenger = compose([Part(2, lambda: torch.tensor([1.0, 2.0]), got.append), Part(0, None, None),
                         Part(1, lambda: torch.tensor([3.0]), got.append)])
    assert passenger.fill().tolist() == [1.0, 2.0, 3.0] and not passenger.carried
    passenger.arrived(torch.tensor([2.0, 4.0, 6.0]))
    assert passenger.carried and [g.tolist() for g in got] == [[2.0, 4.0], [6.0]]
    assert compose([]) is None
    with pytest.raises(ValueError, match="filled with 3"):
        compose([Part(2, lambda: torch.tensor([1.0, 2.0, 3.0]), got.append)]).fill()
    with pytest.raises(WhaleError, match="needs the plan"):
        PlanChange("apply")


class Switcher(Controller):
    """Asks for ``plans[step]`` at the boundaries named there."""

    name = "switcher"

    def __init__(self, plans: dict):
        self.plans, self.applied_at = plans, []

    def react(self, view):
        plan = self.plans.get(view.step)
        return PlanChange("apply", plan, reason=f"step {view.step}") if plan is not None else None

    def applied(self, view, change, report):
        self.applied_at.append((view.step, report is None))


def _ranks(rank: int, world_size: int, directory: str) -> dict:
    from runtime import Engine
    from runtime.control.step_log import StepLog

    torch.manual_seed(0)
    model = Net().double()
    first, other = make_plan(model, [[8], [8], [4], [2]]), make_plan(model, [[4, 4], [6], [6], [2]])
    data = [((x.double(), z.double()), y) for (x, z), y in batches(22, seed=4) * 2]
    losses, final = train_reference(model, data, OPTIMIZERS["adamw"], lambda out, t: F.cross_entropy(out, t))
    engine = Engine(copy.deepcopy(model), first, optimizer=OPTIMIZERS["adamw"], loss_fn=F.cross_entropy,
                    cluster=make_cluster(None), timeout_s=60, balance="off")
    log = engine.add_controller(StepLog(os.path.join(directory, "steps.jsonl")))
    switcher = engine.add_controller(Switcher({1: other, 3: first}))
    got = [engine.train_step(batch) for batch in data]
    for step, (loss, expected) in enumerate(zip(got, losses)):
        assert_close(loss, expected, msg=lambda m: f"loss of step {step}: {m}")
    state = engine.state_dict()
    for key, value in final.items():
        assert_close(state[key], value, msg=lambda m: f"final {key}: {m}")
    log.close()
    return {"applied": switcher.applied_at, "sizes": engine.worker.micro_batch_sizes, "lines": log.lines,
            "replanner": engine.rebalancer.history}


def test_a_controller_of_ones_own_changes_the_plan_exactly(tmp_path):
    results = run_ranks(_ranks, 4, args=(str(tmp_path),), init_process_group=False, timeout_s=300)
    for r, got in enumerate(results):
        assert got["applied"] == [(1, True), (3, True)], got["applied"]     # shares in place: nothing moved
        assert got["sizes"] == [[8], [8], [4], [2]][r]
    assert results[0]["lines"] == 6 and all(r["lines"] == 0 for r in results[1:])
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6))
    assert all(line["plan_kind"] == "data_parallel" and line["loss"] > 0 for line in lines)
    later = lines[2]["wall_s_of_ranks"]
    assert later["step"] == 1 and later["min"] <= later["median"] <= later["max"]
    assert "wall_s_of_ranks" not in lines[0]      # nobody had a step before the first
