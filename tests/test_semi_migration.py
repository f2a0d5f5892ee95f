"""FlexTP's decisions (planner/balance/semi_migration.py) on worked examples computed by hand in each test:
Eq. (1) against T_avg and T_min, Eq. (2)'s beta, Eq. (3)'s f(x) and Algorithm 2's branches."""
from __future__ import annotations

import dataclasses

import pytest

from planner.balance.semi_migration import (LinearCost, PiecewiseLinearCost, SemiCosts, migration_gain, pruning_ratio,
                                    pruning_ratios, resize_bound, resize_decision, semi_decision, solve_beta, unresized)
from whalelike.errors import WhaleError

APPROX = dict(abs=1e-9)
# Omega1 = 0.1 s, Omega2(n) = 0.01 n, Phi1(n) = 0.02 n, Phi2(n) = 0.03 n (n in columns)
LINEAR = SemiCosts(omega1=0.1, omega2=lambda n: 0.01 * n, phi1=lambda n: 0.02 * n, phi2=lambda n: 0.03 * n)


def test_eq1_pruning_ratio():
    assert pruning_ratio(3.0, 2.0, 2.0) == pytest.approx(0.5)          # (3 - 2) / 2
    assert pruning_ratio(10.0, 2.0, 2.0) == pytest.approx(0.9)         # 4 clipped to max_gamma
    assert pruning_ratio(10.0, 2.0, 2.0, max_gamma=0.5) == pytest.approx(0.5)
    assert pruning_ratio(1.5, 2.0, 2.0) == 0.0                         # faster than the reference
    assert pruning_ratio(1.5, 2.0, 0.0) == 0.0                         # not a straggler: no matmul time needed
    # mean of [1, 1, 1, 3] is 1.5: (3 - 1.5) / 2 = 0.75; min is 1: (3 - 1) / 2 = 1 -> 0.9
    assert pruning_ratios([1, 1, 1, 3], [1, 1, 1, 2]) == pytest.approx([0, 0, 0, 0.75])
    assert pruning_ratios([1, 1, 1, 3], [1, 1, 1, 2], "min") == pytest.approx([0, 0, 0, 0.9])
    assert pruning_ratios([2, 1, 1.5], [2, 1, 1], "min") == pytest.approx([0.5, 0, 0.5])


def test_eq1_bad_input():
    with pytest.raises(WhaleError, match="3 step times but 2 matmul times"):
        pruning_ratios([1, 2, 3], [1, 1])
    with pytest.raises(WhaleError, match="step times must be finite and >= 0"):
        pruning_ratios([1, -2], [1, 1])
    with pytest.raises(WhaleError, match="matmul times must be finite and >= 0"):
        pruning_ratios([1, 2], [1, float("nan")])
    with pytest.raises(WhaleError, match="pruning cannot help"):
        pruning_ratio(3.0, 2.0, 0.0)
    with pytest.raises(WhaleError, match="reference must be 'mean' or 'min'"):
        pruning_ratios([1, 2], [1, 1], "median")
    with pytest.raises(WhaleError, match="max_gamma"):
        pruning_ratio(3.0, 2.0, 1.0, max_gamma=1.5)


def test_resize_decision_uses_the_mean():
    decision = resize_decision([1, 1, 1, 3], [1, 1, 1, 2])
    assert decision.resize == pytest.approx({3: 0.75}) and decision.migrate == {}
    assert decision.stragglers == (3,)
    assert resize_decision([2, 2], [1, 1]).resize == {}


def test_fitted_costs():
    line = LinearCost.fit([(0, 0.1), (10, 0.3), (20, 0.5)])
    assert (line.intercept, line.slope) == (pytest.approx(0.1), pytest.approx(0.02))
    assert line(5) == pytest.approx(0.2)
    piece = PiecewiseLinearCost.fit([(20, 4.0), (0, 0.0), (10, 1.0)])   # unsorted input
    assert piece(15) == pytest.approx(2.5)     # between (10, 1) and (20, 4)
    assert piece(30) == pytest.approx(7.0)     # extended with the last slope 0.3
    assert piece(-10) == pytest.approx(-1.0)   # extended with the first slope 0.1
    with pytest.raises(WhaleError, match="at least 2"):
        LinearCost.fit([(1, 1)])
    with pytest.raises(WhaleError, match="same x"):
        PiecewiseLinearCost.fit([(1, 1), (1, 2)])


def test_eq2_beta_balances_resizing_and_migration():
    # L = 100, gamma = 0.5, e = 4: excess 50 columns;
    # 0.1 + 0.01*50*(1-b) = 0.02*50*b + 0.03*50*b/3  ->  0.6 - 0.5b = 1.5b  ->  b = 0.3
    assert solve_beta(100, 0.5, 4, LINEAR) == pytest.approx(0.3, **APPROX)
    # with fitted costs the same root
    fitted = SemiCosts(0.1, LinearCost.fit([(0, 0), (100, 1)]), PiecewiseLinearCost.fit([(0, 0), (50, 1)]),
                       LinearCost.fit([(0, 0), (10, 0.3)]))
    assert solve_beta(100, 0.5, 4, fitted) == pytest.approx(0.3, **APPROX)
    # migration cheaper everywhere: everything migrates; resizing cheaper everywhere: nothing does
    free_migration = SemiCosts(1.0, lambda n: n, lambda n: 0.0, lambda n: 0.0)
    assert solve_beta(100, 0.5, 4, free_migration) == 1.0
    free_resizing = SemiCosts(0.0, lambda n: 0.0, lambda n: n, lambda n: n)
    assert solve_beta(100, 0.5, 4, free_resizing) == 0.0
    with pytest.raises(WhaleError, match="at least 2 ranks"):
        solve_beta(100, 0.5, 1, LINEAR)


def test_algorithm2_single_straggler_splits_by_eq2():
    # T_min = 1; rank 3: gamma = (2 - 1) / 1.6 = 0.625, excess 62.5 columns;
    # 0.1 + 0.625*(1-b) = 1.25b + 0.625b  ->  0.725 = 2.5b  ->  b = 0.29
    decision = semi_decision([1.0, 1.0, 1.0, 2.0], [0.8, 0.8, 0.8, 1.6], 100, LINEAR)
    assert decision.stragglers == (3,)
    assert decision.beta == pytest.approx(0.29, **APPROX)
    assert decision.migrate == pytest.approx({3: 0.625 * 0.29})
    assert decision.resize == pytest.approx({3: 0.625 * 0.71})
    assert decision.local_ratio(3) == pytest.approx(0.625 * 0.71 / (1 - 0.625 * 0.29))
    assert decision.local_ratio(0) == 0.0
    # without pre-tested costs resizing is priced at 0, so Eq. (2) gives beta = 0: resize only
    default = semi_decision([1.0, 1.0, 1.0, 2.0], [0.8, 0.8, 0.8, 1.6])
    assert default.beta == 0.0 and default.migrate == {} and default.resize == pytest.approx({3: 0.625})
    # phi2 from the fastest rank's matmul time per column: 0.8 s / 100 columns
    assert SemiCosts.from_step([0.8, 1.6], [100, 100]).phi2(50) == pytest.approx(0.4)


def test_a_pre_tested_loss_cost_caps_resizing_and_migrates_the_rest():
    # the same straggler (gamma 0.625, Eq. 2 alone: beta 0.29, resize 0.44 of 100 columns), now with
    # resizing priced in accuracy: 1% loss per 10 columns pruned, budget 2% -> at most 20 columns
    priced = dataclasses.replace(LINEAR, loss=lambda n: n / 1000, loss_budget=0.02)
    assert resize_bound(priced, 62.5) == pytest.approx(20.0, abs=1e-6)
    decision = semi_decision([1.0, 1.0, 1.0, 2.0], [0.8, 0.8, 0.8, 1.6], 100, priced)
    assert decision.resize == pytest.approx({3: 0.2}) and decision.migrate == pytest.approx({3: 0.425})
    assert decision.beta == pytest.approx(0.68) and decision.resize_cap == pytest.approx(0.2)
    # a budget that resizing all of it fits leaves Eq. 2's split alone; a zero budget migrates everything
    loose = dataclasses.replace(priced, loss_budget=1.0)
    assert semi_decision([1.0, 1.0, 1.0, 2.0], [0.8, 0.8, 0.8, 1.6], 100, loose).beta == pytest.approx(0.29, **APPROX)
    strict = semi_decision([1.0, 1.0, 1.0, 2.0], [0.8, 0.8, 0.8, 1.6], 100, dataclasses.replace(priced, loss_budget=0))
    assert strict.resize == {} and strict.migrate == pytest.approx({3: 0.625}) and strict.beta == pytest.approx(1.0)
    # accuracy not priced (loss None): no cap, as before
    assert resize_bound(LINEAR, 62.5) == 62.5 and semi_decision([1.0, 2.0], [0.8, 1.6], 100, LINEAR).resize_cap is None
    with pytest.raises(WhaleError, match="loss_budget must be >= 0"):
        resize_bound(dataclasses.replace(priced, loss_budget=-1.0), 62.5)


def test_algorithm2_several_stragglers_choose_x_by_eq3():
    times, matmul = [4.0, 1.0, 2.0, 1.2], [3.2, 0.8, 1.6, 0.96]
    order = [0, 2, 3, 1]                                   # descending time; T_min = 1
    costs = SemiCosts(0.0, lambda n: 0.0, lambda n: 0.01 * n, lambda n: 0.0)
    columns = [100, 100, 100, 100]
    # x=1: Gamma = 100*3/4 = 75, 3 receivers get 25 each, slowest receiver 25*2.0/100 = 0.5;
    #      f(1) = 3 - 0.75 - 0.5 = 1.75
    assert migration_gain(order, 1, times, columns, costs.phi1) == pytest.approx(1.75)
    # x=2: Gamma = 75 + 100*1/2 = 125, 2 receivers get 62.5, slowest 62.5*1.2/100 = 0.75;
    #      f(2) = 1 - 1.25 - 0.75 = -1  ->  x = 1
    assert migration_gain(order, 2, times, columns, costs.phi1) == pytest.approx(-1.0)
    decision = semi_decision(times, matmul, columns, costs)
    assert decision.stragglers == (0, 2, 3) and decision.migrating == 1 and decision.beta is None
    # gamma_i against T_min: 3/3.2, 1/1.6, 0.2/0.96
    assert decision.migrate == pytest.approx({0: 0.9375})
    assert decision.resize == pytest.approx({2: 0.625, 3: 0.2 / 0.96})
    # free communication: f(2) = 1 - 0.75 = 0.25 >= 0, f(3): Gamma = 125 + 100*0.2/1.2, one
    # receiver (rank 1, 1.0/100 s per column): 0.2 - 141.67/100 < 0  ->  x = 2
    free = SemiCosts(0.0, lambda n: 0.0, lambda n: 0.0, lambda n: 0.0)
    assert migration_gain(order, 2, times, columns, free.phi1) == pytest.approx(0.25)
    assert migration_gain(order, 3, times, columns, free.phi1) == pytest.approx(0.2 - (125 + 100 * 0.2 / 1.2) / 100)
    decision = semi_decision(times, matmul, 100, free)
    assert decision.migrating == 2
    assert decision.migrate == pytest.approx({0: 0.9375, 2: 0.625})
    assert decision.resize == pytest.approx({3: 0.2 / 0.96})


def test_algorithm2_no_straggler_and_tolerance():
    assert semi_decision([1.0, 1.0], [0.5, 0.5], 10, LINEAR) == semi_decision([2, 2], [1, 1], [3, 4], LINEAR)
    assert semi_decision([1.0, 1.0], [0.5, 0.5], 10, LINEAR).migrate == {}
    assert semi_decision([1.0, 1.05], [0.5, 0.5], 10, LINEAR, tolerance=0.1).stragglers == ()
    assert semi_decision([1.0, 1.05], [0.5, 0.5], 10, LINEAR).stragglers == (1,)


def test_algorithm2_bad_input():
    with pytest.raises(WhaleError, match="2 step times but 3 matmul times"):
        semi_decision([1, 2], [1, 1, 1], 10, LINEAR)
    with pytest.raises(WhaleError, match="one positive count per rank"):
        semi_decision([1, 2], [1, 1], [10], LINEAR)
    with pytest.raises(WhaleError, match="step times must be finite and >= 0"):
        semi_decision([-1, 2], [1, 1], 10, LINEAR)
    with pytest.raises(WhaleError, match="tolerance"):
        semi_decision([1, 2], [1, 1], 10, LINEAR, tolerance=-0.1)
    with pytest.raises(WhaleError, match="no step times"):
        semi_decision([], [], 10, LINEAR)


def test_unresized_times_undo_the_pruning():
    # rank 1 measured T' = 1.5, M' = 0.5 with half its matmul work pruned: M = 1.0, T = 2.0
    times, matmul = unresized([1.0, 1.5], [0.5, 0.5], [0.0, 0.5])
    assert times == pytest.approx([1.0, 2.0]) and matmul == pytest.approx([0.5, 1.0])
    assert pruning_ratios(times, matmul, "min") == pytest.approx([0.0, 0.9])   # (2 - 1) / 1 clipped
    with pytest.raises(WhaleError, match="one fraction in"):
        unresized([1.0], [0.5], [1.0])
