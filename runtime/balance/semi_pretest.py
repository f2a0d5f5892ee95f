"""SEMI-migration's pre-test (FlexTP Algorithm 2 line 1) at run time: what resizing and migrating
one straggler's work would each cost, in time and in accuracy, measured before Eq. (2) splits it.

Why: Eq. (2) balances the straggler's cost of resizing (``Omega1 + Omega2``) against the other
ranks' cost of taking migrated columns (``Phi1 + Phi2``). Priced from one step's measurements
(:meth:`planner.balance.semi_migration.SemiCosts.from_step`) resizing is free, so a single straggler
was always resized, and bench/straggler_tp.py ended 63% worse in final loss than the exact run.
The paper runs a pre-test instead; this is it, plus the price the paper leaves to its reader:
the loss resizing costs (migration is exact and costs none).

What is measured, when the rebalancer's SEMI decision for one tensor-parallel group has a single
straggler it would resize (every rank runs this together: the loss evaluations are collective):

* ``loss(f)``: the straggler prunes ``f`` of its columns for ``f`` in (gamma / 2, gamma) (gamma of
  Eq. (1), at most ``max_gamma``), through its own :class:`~runtime.balance.flextp_resizing.ZeroResizer`
  (so priority pruning's choice of columns and Algorithm 1's differentiated ratios are what is
  priced, at the fraction of work they actually prune), and the global loss of the last
  ``BalanceConfig.pretest_batches`` training batches is evaluated (``Engine.eval_step``: forward
  only, nothing updated) with and without it: ``loss(f)`` is the relative increase. The weights
  are the ones the next steps train; a few batches' forward loss is the immediate price, not the
  final one (pruned columns also get no gradient while resizing lasts), which is why the budget
  is small (``BalanceConfig.semi_loss_budget``, 0.5%).
* ``Omega1``: the straggler's time to choose and record its pruned columns (``set_ratio``: the
  lineage table, the pruned index); ``Omega2(f)``: its time to extract the pruned copies of its
  local weights at ``f``. Measured with ``time.perf_counter`` on the straggler and shared in one
  all-reduce, so every rank decides on the same numbers.
* ``Phi1(f)``: migration's communication per step: the ``f`` of the straggler's local weights
  sent out as values and back as gradients (``2 * f * weights * element size`` bytes) over the
  slowest link of the group as the cluster declares it, plus a latency per message (two per
  layer). Under emulation every P2P transfer is padded to exactly this model; on real links it
  is the declared bandwidth, not a timed transfer (a timed one would need a group per straggler).
* ``Phi2``: as :meth:`SemiCosts.from_step` (the fastest rank's matmul time per column).

Invariant: the pre-test leaves the model as it found it (the straggler's resizing ratio restored,
no parameter or optimizer state touched); the batches evaluated are the ones the Engine trained
on (references, not copies: an Engine does not modify them).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from planner.balance.semi_migration import PiecewiseLinearCost, SemiCosts, SemiDecision

if TYPE_CHECKING:
    from runtime.control.protocol import StepView

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pretest:
    """The measured costs (``costs`` for :func:`planner.balance.semi_migration.semi_decision`) and
    what they came from, for the log: the pruned fractions tried and the loss each cost."""

    straggler: int
    costs: SemiCosts
    fractions: tuple[float, ...]      # of the straggler's matmul work actually pruned at each sample
    losses: tuple[float, ...]         # relative loss increase at each (empty: accuracy not priced)
    omega1_s: float
    omega2_s: tuple[float, ...]
    phi1_s: float                     # communication of migrating the whole excess gamma
    gamma: float
    batches: int
    seconds: float

    def line(self, decision: SemiDecision) -> str:
        """One line: what was measured and what Eq. (2) decided from it."""
        tried = ", ".join(f"{f:.2f}: {loss:+.2%}" for f, loss in zip(self.fractions, self.losses)) or "not priced"
        migrate = decision.migrate.get(self.straggler, 0.0)
        resize = decision.resize.get(self.straggler, 0.0)
        beta = decision.beta if decision.beta is not None else 0.0
        return (f"pre-test rank {self.straggler} ({self.seconds * 1e3:.0f} ms, {self.batches} batches): resizing "
                f"loss by pruned fraction {{{tried}}} against budget {self.costs.loss_budget:.2%}; time "
                f"Omega1 {self.omega1_s * 1e3:.2f} ms, Omega2 {self.omega2_s[-1] * 1e3:.2f} ms, Phi1 "
                f"{self.phi1_s * 1e3:.2f} ms -> beta {beta:.3f}: migrate {migrate:.3f}, resize {resize:.3f}")


def run_pretest(view: "StepView", batches: Sequence, resizer, ranks: Sequence[int], straggler: int, gamma: float,
                matmul_times: Sequence[float], *, max_gamma: float, loss_budget: float) -> Optional[Pretest]:
    """The pre-test for ``straggler`` (a global rank of the group ``ranks``) whose Eq. (1) ratio
    against the group's fastest is ``gamma``; collective over every rank. ``view``: the step
    boundary's (its ``evaluate`` runs the loss evaluations, its runtime the collective);
    ``batches``: the last training batches; ``resizer``: the straggler's ZERO-resizer (None on the
    other ranks); ``max_gamma`` and ``loss_budget``: ``BalanceConfig.max_gamma`` and
    ``semi_loss_budget``. None where nothing can be measured (no training batch seen yet)."""
    priced = math.isfinite(loss_budget)
    if priced and not batches:
        log.info("SEMI pre-test skipped: no training batch seen yet")
        return None
    start = time.perf_counter()
    previous = resizer.gamma if resizer is not None else 0.0
    targets = sorted({min(gamma, max_gamma) * k for k in (0.5, 1.0)})
    measured = torch.zeros(2 + 2 * len(targets), dtype=torch.float64)   # weights, omega1, (fraction, omega2)...

    def evaluate() -> float:
        return sum(float(view.evaluate(b)) for b in batches) / len(batches)

    if resizer is not None:
        resizer.set_ratio(0.0)
    base = evaluate() if priced else 0.0
    losses = []
    for i, fraction in enumerate(targets):
        if resizer is not None:
            tick = time.perf_counter()
            resizer.set_ratio(fraction)
            measured[1] = max(float(measured[1]), time.perf_counter() - tick)
            measured[2 + 2 * i] = resizer.pruned_work
            measured[3 + 2 * i] = _extraction_seconds(resizer)
        if priced:
            losses.append((evaluate() - base) / base if base > 0 else 0.0)
    if resizer is not None:
        resizer.set_ratio(previous)
        measured[0] = _weight_bytes(resizer)
    view.runtime.sum_alone(measured)   # the straggler's figures, to every rank
    weight_bytes, omega1 = float(measured[0]), float(measured[1])
    fractions = tuple(float(measured[2 + 2 * i]) for i in range(len(targets)))
    omega2 = tuple(float(measured[3 + 2 * i]) for i in range(len(targets)))
    link_s_per_byte, latency_s = _slowest_link(view.runtime, ranks)
    messages = 2 * len(getattr(resizer, "layers", ())) if resizer is not None else 2
    phi1 = lambda f: 0.0 if f <= 0 else 2.0 * f * weight_bytes * link_s_per_byte + messages * latency_s  # noqa: E731
    phi2 = SemiCosts.from_step(matmul_times, [1.0] * len(matmul_times)).phi2   # columns counted in shards
    loss = _through_zero(fractions, tuple(losses)) if priced else None
    costs = SemiCosts(omega1, _through_zero(fractions, omega2), phi1, phi2, loss=loss,
                      loss_budget=loss_budget)
    return Pretest(straggler, costs, fractions if priced else (), tuple(losses), omega1, omega2,
                   phi1(gamma), gamma, len(batches) if priced else 0, time.perf_counter() - start)


def _through_zero(fractions: Sequence[float], values: Sequence[float]):
    """A piecewise-linear cost through ``(0, 0)`` and the measured samples (duplicates averaged:
    differentiated ratios can prune the same fraction for two requests)."""
    points: dict[float, list[float]] = {0.0: [0.0]}
    for f, v in zip(fractions, values):
        points.setdefault(round(f, 12), []).append(v)
    samples = [(f, sum(v) / len(v)) for f, v in points.items()]
    if len(samples) < 2:   # nothing was pruned at any sample: no cost measured either
        return lambda n: 0.0
    return PiecewiseLinearCost.fit(samples)


def _extraction_seconds(resizer) -> float:
    """Omega2: the time to extract the pruned copies of every local weight (dual pruning's gather)."""
    tick = time.perf_counter()
    for layer in resizer.layers:
        if layer.entries:
            weight = layer.weight()
            weight.detach().index_select(-1, layer.entries[0].kept_index.to(weight.device))
    return time.perf_counter() - tick


def _weight_bytes(resizer) -> float:
    return float(sum(layer.rows * layer.columns * layer.weight().element_size() for layer in resizer.layers))


def _slowest_link(runtime, ranks: Sequence[int]) -> tuple[float, float]:
    """Seconds per byte over the group's slowest declared link, and the per-message latency."""
    network = runtime.cluster.network
    hosts = {w.host for w in runtime.plan.workers if w.rank in set(ranks)}
    gbps = network.intra_host_gbps if len(hosts) <= 1 else min(network.intra_host_gbps, network.inter_host_gbps)
    return 1.0 / (gbps * 1e9), network.latency_us * 1e-6
