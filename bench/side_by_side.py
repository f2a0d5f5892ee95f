"""Two balance policies trained side by side in one process group, for the dynamic-balancing benches.

Why alternate step by step instead of running one policy after the other: the machine the benches
run on is shared, and its load drifts over minutes; alternating makes any drift hit both runs
alike, so their ratio measures the policy, not the neighbours. Every step is timed on rank 0 from
a barrier to its return (a step ends in collectives: the loss and the speed exchange).

Invariant: both runs start from the same weights (``make_engine`` builds a fresh model each time)
and see the same batches in the same order; with exact policies their losses must be equal, which
:func:`report_runs` checks with ``torch.testing.assert_close``.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist


def train_side_by_side(make_engine: Callable[[str], object], policies: Sequence[str], batches) -> dict[str, dict]:
    """Per policy: losses, step times, total, events, (overruns, segments) summed over ranks, the
    slowest rank's modeled compute per step (``max_modeled``), and the Engine's final plan."""
    engines = {policy: make_engine(policy) for policy in policies}
    losses = {policy: [] for policy in policies}
    times = {policy: [] for policy in policies}
    for batch in batches:
        for policy, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            losses[policy].append(float(engine.train_step(batch)))
            times[policy].append(time.perf_counter() - start)
    modeled = torch.tensor([[s.modeled_s for s in e.stats] for e in engines.values()], dtype=torch.float64)
    dist.all_reduce(modeled, op=dist.ReduceOp.MAX)
    counts = torch.tensor([[sum(s.overruns for s in e.stats), sum(s.segments for s in e.stats)]
                           for e in engines.values()])
    dist.all_reduce(counts)
    return {policy: {"losses": losses[policy], "times": times[policy], "total": sum(times[policy]),
                     "events": list(engine.replans), "overruns": tuple(int(c) for c in counts[index]),
                     "max_modeled": modeled[index].tolist(), "plan": engine.plan}
            for index, (policy, engine) in enumerate(engines.items())}


def report_runs(static: dict, adaptive: dict, extra_overruns: str = "") -> bool:
    """Print the adaptive run's re-plan events, both runs' overruns and losses; True when the two
    runs' losses are equal (``torch.testing.assert_close``)."""
    events = adaptive["events"]
    print(f"\nre-plan events of the adaptive run ({len(events)}; an event at step s is in force from step s+1):")
    for e in events:
        print(f"  {e.line()}")
    print(f"static run events: {len(static['events'])} (policy off measures only: "
          f"{', '.join(e.action for e in static['events']) or 'none'})")
    print(f"emulation overruns (all ranks): static {static['overruns'][0]}/{static['overruns'][1]}, "
          f"adaptive {adaptive['overruns'][0]}/{adaptive['overruns'][1]} segments{extra_overruns}")
    same = True
    try:
        torch.testing.assert_close(adaptive["losses"], static["losses"])
    except AssertionError as e:
        same = False
        print(f"LOSSES DIFFER: {e}")
    print(f"losses: {static['losses'][0]:.4f} -> {static['losses'][-1]:.4f} (static), "
          f"{adaptive['losses'][0]:.4f} -> {adaptive['losses'][-1]:.4f} (adaptive); "
          f"max |difference| {max(abs(a - b) for a, b in zip(static['losses'], adaptive['losses'])):.2e}")
    return same
