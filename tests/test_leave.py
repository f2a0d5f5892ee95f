"""Leaving without a restart (issue 23 item 2, :mod:`runtime.elastic.departure`).

One 4-rank spawn (gloo, float64): a pipeline of two data-parallel stages trains under
``runtime.Engine(departures=True)``; rank 0 (the store's host) receives SIGTERM during step 2 and
leaves at that step's boundary: the three others form a new world, the planner's plan for them is
in force at step 3, no checkpoint is read (an asynchronous checkpoint still being written when
rank 0 leaves is finished first; the next one is written by the three-rank world). During step 5
the rank then running stage 0 alone receives SIGTERM: its stage has no other holder, so its state
is handed to an heir and parked before the world shrinks to two. In the last step both ranks left
receive SIGTERM: nobody can stay, so both raise :class:`~runtime.elastic.departure.Stopping` with
the step complete. Every step's loss on every rank that stays, and the final state, equal the
single-process reference (same weights, same batches). The leavers exit through
:class:`~runtime.elastic.departure.Departed` (a ``SystemExit`` with code 0).

In-process: the slowness rule's hysteresis (noise and single dips never count; a sustained slow
rank leaves only after ``exchanges`` counted exchanges and once the plan in force was made for its
slowness; the band between the thresholds holds the count; a recovery resets it), its bad input,
and the passenger that carries the leave flags.
"""
from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

import planner
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, train_reference
from runtime.control.exchange import Part, compose
from runtime.elastic.departure import Departures, LeaveConfig, SlownessRule, SlownessWatch, worth
from test_dynamic_balance import BALANCE, Mlp, batches, cluster, loss_fn
from whalelike.errors import SpecError
from whalelike.graphs.capture import capture

NOTICES = {2: 0, 5: 1}   # step -> the original rank that receives SIGTERM during it
STEPS = 7


def _leaving(rank: int, world_size: int, folder: str) -> dict:
    from torch.testing import assert_close

    from runtime import Engine, checkpoint
    from runtime.elastic.departure import Departed, Stopping

    model, data, spec = Mlp(wl.replicate, wl.replicate).double(), batches(seed=4)[:STEPS], cluster([1.0] * 4)
    plan = planner.plan(capture(model, data[0][0]), spec, wl.Config(global_batch_size=16, num_micro_batch=2))
    losses, final = train_reference(model, data, OPTIMIZERS["adamw"], loss_fn)
    engine = Engine(copy.deepcopy(model), plan, optimizer=OPTIMIZERS["adamw"], loss_fn=loss_fn, cluster=spec,
                    balance=BALANCE, departures=True, timeout_s=60)
    worlds, stopped = [], None
    for step, batch in enumerate(data):
        # the handler only sets a flag: the step goes on; in the last step every rank left gets notice
        if NOTICES.get(step) == rank or step == STEPS - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        try:
            loss = engine.train_step(batch)
        except Departed as e:
            return {"left": e.step, "code": e.code, "pid": os.getpid()}
        except Stopping as e:        # nobody can stay: the step is complete and the job stops
            loss, stopped = e.loss, (e.step, engine.step)
        assert_close(loss, losses[step], msg=lambda m: f"rank {rank}, loss of step {step}: {m}")
        worlds.append(engine.plan.world_size)
        if step == 1:     # still being written when rank 0 (which completes checkpoints) leaves after step 2
            checkpoint.save_async(engine, folder, keep=None)
        if step == 3:     # the three-rank world writes through a group of its own
            checkpoint.save_async(engine, folder, keep=None).wait()
    state = engine.state_dict()
    for key, value in final.items():
        assert_close(state[key], value, msg=lambda m: f"rank {rank}, final {key}: {m}")
    return {"worlds": worlds, "rank": engine.rank, "stopped": stopped, "stages": [len(st.layers) for st in engine.plan.stages],
            "events": [(e.step, e.leavers, e.old_world, e.new_world, e.parked_bytes) for e in engine.departures.history]}


def test_sigterm_leaves_at_the_step_boundary_and_training_continues_exactly(tmp_path):
    from runtime import checkpoint

    results = run_ranks(_leaving, 4, (str(tmp_path),), init_process_group=False, timeout_s=240)
    assert results[0] == {"left": 2, "code": 0, "pid": results[0]["pid"]}
    assert results[1] == {"left": 5, "code": 0, "pid": results[1]["pid"]}
    for original in (2, 3):
        got = results[original]
        assert got["worlds"] == [4, 4, 3, 3, 3, 2, 2], got   # the world after each step
        assert got["rank"] == original - 2
        assert got["stopped"] == (STEPS, STEPS), got   # every rank's notice in the last step: Stopping, step done
        steps = [(step, leavers, old, new) for step, leavers, old, new, _ in got["events"]]
        # the second leaver is new rank 0 of the three-rank world (original rank 1)
        assert steps == [(2, (0,), 4, 3), (5, (0,), 3, 2)], got["events"]
        first, second = (parked for *_, parked in got["events"])
        assert first == 0, "rank 0's state is all held by its data-parallel peer: nothing is handed over"
        assert second > 0, "stage 0 ran on the leaver alone: its state is handed to an heir"
    # the checkpoint in flight at the leave was finished first; the next went through the new world's group
    assert [(c.step, c.world_size) for c in checkpoint.complete(tmp_path)] == [(2, 4), (4, 3)]


# -- the slowness rule, in process -------------------------------------------------------------------
RULE = SlownessRule(leave_below=0.25, recover_above=0.5, exchanges=3)
NOMINAL = [1.0, 1.0, 2.0]


def speeds(slow: float) -> list[float]:
    """Rank 1 measured at ``slow`` against its nominal 1 (its worth: 4 slow / (3 + slow)); the others as specified."""
    return [1.0, slow, 2.0]


def test_worth_is_the_share_of_measured_speed_over_the_share_of_nominal_speed():
    assert worth([1.0, 1.0, 2.0], NOMINAL) == pytest.approx([1.0, 1.0, 1.0])
    assert worth(speeds(0.1), NOMINAL)[1] == pytest.approx((0.1 / 3.1) / (1 / 4))


def test_noise_and_single_dips_never_make_a_rank_leave():
    watch = SlownessWatch(RULE)
    noisy = [1.0, 0.8, 1.2, 0.9, 0.15, 1.1, 0.7, 0.12, 1.0, 0.95, 0.2, 1.05] * 3
    reference = speeds(0.1)           # even with a plan made for a slow rank 1
    assert all(watch.observe(speeds(s), reference, NOMINAL) is None for s in noisy)


def test_a_persistently_slow_rank_leaves_after_the_replan_cut_its_share():
    watch = SlownessWatch(RULE)
    # slow for 3 exchanges, but the plan in force still assumes its full speed: a re-plan comes first
    assert [watch.observe(speeds(0.1), speeds(1.0), NOMINAL) for _ in range(3)] == [None] * 3
    assert watch.observe(speeds(0.1), None, NOMINAL) is None    # no reference yet
    # the re-plan made for its slowness is in force and it stays slow: it leaves
    assert watch.observe(speeds(0.1), speeds(0.1), NOMINAL) == 1


def test_the_band_between_the_thresholds_holds_the_count_and_a_recovery_resets_it():
    planned = speeds(0.1)
    watch = SlownessWatch(RULE)
    assert watch.observe(speeds(0.1), planned, NOMINAL) is None    # count 1
    assert watch.observe(speeds(0.1), planned, NOMINAL) is None    # count 2
    assert watch.observe(speeds(0.33), planned, NOMINAL) is None   # worth 0.40, in the band: held
    assert watch.observe(speeds(0.1), planned, NOMINAL) == 1       # count 3
    watch = SlownessWatch(RULE)
    for _ in range(2):
        watch.observe(speeds(0.1), planned, NOMINAL)
    assert watch.observe(speeds(0.9), planned, NOMINAL) is None    # recovered: reset
    assert [watch.observe(speeds(0.1), planned, NOMINAL) for _ in range(3)] == [None, None, 1]


def test_the_rule_keeps_min_ranks_and_waits_for_every_speed():
    watch = SlownessWatch(SlownessRule(exchanges=1, min_ranks=2))
    assert watch.observe([1.0, 0.01], [1.0, 0.01], [1.0, 1.0]) is None       # would leave one rank
    watch = SlownessWatch(SlownessRule(exchanges=1))
    assert watch.observe([1.0, float("nan"), 0.01], [1.0, 1.0, 0.01], [1.0, 1.0, 1.0]) is None


@pytest.mark.parametrize("kwargs", [{"leave_below": 0.5, "recover_above": 0.4}, {"leave_below": 0.0},
                                    {"exchanges": 0}, {"min_ranks": True}, {"recover_above": 1.5}])
def test_bad_rules_are_refused(kwargs):
    with pytest.raises(SpecError, match="SlownessRule"):
        SlownessRule(**kwargs)


def test_leave_config_of():
    assert LeaveConfig.of(None) is None and LeaveConfig.of(False) is None
    assert LeaveConfig.of(True) == LeaveConfig(sigterm=True, slowness=None)
    with pytest.raises(SpecError, match="departures"):
        LeaveConfig.of("yes")


def test_the_leave_flags_ride_with_the_monitor_figures():
    from types import SimpleNamespace

    got = []
    inner = Part(3, lambda: torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), got.append)
    noticed = Departures(LeaveConfig(sigterm=False))
    noticed.notice()
    boarding = compose([inner, noticed.exchange(0, SimpleNamespace(world_size=2, rank=1), None)])
    assert boarding.fill().tolist() == [1.0, 2.0, 3.0, 0.0, 1.0]
    boarding.arrived(torch.tensor([2.0, 4.0, 6.0, 0.0, 1.0]))     # summed over two ranks
    assert boarding.carried and got[0].tolist() == [2.0, 4.0, 6.0]
    assert noticed.leaving() == [1]
    quiet = Departures(LeaveConfig(sigterm=False))
    alone = compose([quiet.exchange(0, SimpleNamespace(world_size=3, rank=0), None)])
    assert alone.fill().tolist() == [0.0, 0.0, 0.0]
    alone.arrived(alone.vector)
    assert quiet.leaving() == []


def test_a_notice_that_straddles_the_exchange_is_read_again_before_anyone_leaves():
    """torchrun's agent stops its workers with one SIGTERM each, one after another: rank 0's flag was
    in the step's exchange, rank 1's signal landed after it sent its own. Read again before anyone
    leaves, every rank has given notice: a stop, not a leave. A lone notice stays a leave."""
    from types import SimpleNamespace

    def boundary(noticed_late: bool):
        rank1 = Departures(LeaveConfig(sigterm=False))
        others = torch.tensor([1.0, 0.0], dtype=torch.float64)          # rank 0 gave notice before the exchange
        runtime = SimpleNamespace(world_size=2, rank=1, sum_alone=lambda v: v.add_(others))
        rank1.exchange(4, runtime, None).arrived(others.clone())          # the exchange carried rank 0's flag only
        if noticed_late:
            rank1.notice()
        return rank1.react(SimpleNamespace(step=4, runtime=runtime, figures={}))

    assert boundary(noticed_late=True).kind == "stop"
    lone = boundary(noticed_late=False)
    assert lone.kind == "leave" and lone.leavers == (0,)
