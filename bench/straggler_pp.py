"""Dynamic balancing, pipeline: one stage's device slows 2x; a static plan (``Engine(balance="off")``)
vs the adaptive one (``Engine(balance="exact")``), which moves layers between the stages.

Workload: ``--blocks`` pre-norm residual blocks (LayerNorm, Linear, ReLU) of width ``--dim`` and a
classifier head, annotated as two ``wl.replicate(1)`` regions (plain replicate stages, so the
planner may move layers across the cut), a float64 model learning a fixed random teacher's labels
(cross-entropy, AdamW); 2 gloo ranks on CPU, 1F1B over ``--micro-batches`` micro-batches, emulated
devices of speed 1 (docs/ARCHITECTURE.md section 4). :func:`planner.plan` makes the plan from the nominal
speeds; both runs start from it, from the same initial weights, on the same batches, under the same
emulation, whose straggler schedule slows the device of stage 1 by ``--factor`` from step
``--onset`` to the end.

Adaptive measures each rank's compute speed and, when a stage's share of the total speed moves
past 10%, re-plans at a step boundary with :func:`planner.balance.replan.rebalance`: the pipeline
partitioner moves layers from the slow stage to the fast one and the layers' parameters and AdamW
state travel P2P (:mod:`runtime.state.transfer`). The time of that move is part of the step it
happens in, and that step is part of the measured stretch. Layer moves are exact: the two runs'
losses must agree (``torch.testing.assert_close``). The two runs alternate step by step (each
Engine has its own emulated devices and step count), so drift in the machine's load hits both
alike; each step is timed on rank 0 from a barrier to its return.

Headline: seconds over the slowed stretch ``[onset, steps)``, static / adaptive (target >= 1.3x;
with a 2x slowdown of one of two equal stages the best split gives at most 1.5x, less the
pipeline's fill and drain, the detection steps and the move).

Run (spawns 2 ranks itself, about a minute)::

    .venv/bin/python bench/straggler_pp.py [--steps 50 --onset 10 --factor 2 --blocks 12 --dim 256
                                           --batch 64 --micro-batches 8 --base-gflops 0.5]
    .venv/bin/python bench/straggler_pp.py --smoke   # tiny sizes, seconds: checks that it runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from runtime import Engine  # noqa: E402
from whalelike.cluster import Cluster, Device, Emulation, Network, Straggler  # noqa: E402
import side_by_side  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, spawn_ranks  # noqa: E402

POLICIES = ("off", "exact")   # static, adaptive
WORLD = 2
CLASSES = 16


class Block(nn.Module):
    """Pre-norm residual ``x + relu(fc(norm(x)))``: a deep stack of these trains (plain ReLU stacks
    of this depth barely move their loss in a few dozen steps)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, dim)

    def forward(self, x):
        return x + F.relu(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, blocks: int, dim: int):
        super().__init__()
        half = blocks // 2
        with wl.replicate(1):
            self.lower = nn.Sequential(*[Block(dim) for _ in range(half)])
        with wl.replicate(1):
            self.upper = nn.Sequential(*[Block(dim) for _ in range(blocks - half)])
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, CLASSES)

    def forward(self, x):
        return self.head(self.norm(self.upper(self.lower(x))))


def make_model(args) -> nn.Module:
    torch.manual_seed(0)
    return Net(args.blocks, args.dim).double()


def make_batches(args) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """The learnable task: labels are a fixed random teacher's argmax, the same batches on every rank."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(args.dim, CLASSES, generator=g, dtype=torch.float64)
    batches = []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.dim, generator=g, dtype=torch.float64)
        batches.append(((x,), (x @ teacher).argmax(dim=1)))
    return batches


def make_cluster(args, slow_rank: int | None) -> Cluster:
    devices = tuple(Device(f"emu-{r}", "emu-1", "localhost", peak_tflops=1.0, memory_gib=16.0, emulated_speed=1.0)
                    for r in range(WORLD))
    stragglers = () if slow_rank is None else (Straggler(rank=slow_rank, factor=args.factor, start_step=args.onset),)
    return Cluster("straggler-pp", devices, Network(2.0, 2.0, 50.0),
                   Emulation(base_gflops=args.base_gflops, stragglers=stragglers))


def stage_layers(plan) -> str:
    return " | ".join(f"stage {s.index}: layers {s.layers[0]}..{s.layers[-1]} ({len(s.layers)})" for s in plan.stages)


def train_side_by_side(cluster: Cluster, plan, batches, args) -> dict[str, dict]:
    """Both runs alternating step by step (bench/side_by_side.py), plus each run's final stages."""
    def make_engine(policy: str) -> Engine:
        return Engine(make_model(args), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                      loss_fn=F.cross_entropy, cluster=cluster, example_args=(batches[0][0][0][:2],),
                      timeout_s=120, balance=policy)

    runs = side_by_side.train_side_by_side(make_engine, POLICIES, batches)
    for run in runs.values():
        run["layers"] = stage_layers(run.pop("plan"))
    return runs


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        batches = make_batches(args)
        graphs = wl.capture(make_model(args), (batches[0][0][0][:2],))
        config = wl.Config(global_batch_size=args.batch, num_micro_batch=args.micro_batches, schedule="1f1b")
        plan = planner.plan(graphs, make_cluster(args, None), config)
        slow_rank = plan.stage_workers(1)[0].rank
        cluster = make_cluster(args, slow_rank)
        runs = train_side_by_side(cluster, plan, batches, args)
        if rank == 0:
            results.update(runs=runs, slow_rank=slow_rank, layers=stage_layers(plan), names=graphs_names(graphs))


def graphs_names(graphs) -> list[str]:
    return [getattr(layer, "name", str(layer.index)) for layer in graphs.layers]


def report(results: dict, args) -> None:
    static, adaptive = results["runs"]["off"], results["runs"]["exact"]
    events = adaptive["events"]
    slowed = range(args.onset, args.steps)
    print(f"\npipeline, 2 stages on 2 emulated ranks (speed 1 each), 1F1B, {args.micro_batches} micro-batches of a "
          f"global batch of {args.batch}; float64 {args.blocks} residual blocks (LayerNorm, Linear({args.dim}), "
          f"ReLU) + head on a random teacher, AdamW; the device of stage 1 (rank {results['slow_rank']}) slowed "
          f"{args.factor:g}x from step {args.onset} of {args.steps}; base {args.base_gflops:g} GFLOP/s; "
          f"torch {torch.__version__}")
    print(f"plan (planner.plan, nominal speeds): {results['layers']}")
    print(f"adaptive run's final plan:           {adaptive['layers']}")
    header = f"{'steps':30} {'static s':>9} {'adaptive s':>10} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    move = next((e.step for e in events if "layers" in e.action), None)
    phases = [("before onset", range(0, args.onset)), ("slowed, incl. the move", slowed)]
    if move is not None and move + 1 < args.steps:
        phases.append(("after the move", range(move + 1, args.steps)))
    phases.append(("whole run", range(args.steps)))
    for name, steps in phases:
        s, a = (sum(t[k] for k in steps) for t in (static["times"], adaptive["times"]))
        label = f"{name} [{steps.start}, {steps.stop})"
        print(f"{label:30} {s:9.2f} {a:10.2f} {s / a:8.2f}x")
    before = range(2, args.onset)
    after = range(move + 1, args.steps) if move is not None else range(0)
    print(f"median step ms: before onset static {_median(static, before):.1f} / adaptive "
          f"{_median(adaptive, before):.1f}; slowed static {_median(static, slowed):.1f}; adaptive after the move "
          f"{_median(adaptive, after):.1f}")
    marks = sorted({0, args.onset - 1, args.onset, args.onset + 1, args.onset + 2, args.onset + 3, args.onset + 4,
                    args.steps - 1})
    print("\nstep  static ms  adaptive ms  static loss  adaptive loss")
    for k in (m for m in marks if 0 <= m < args.steps):
        flag = "  <- layers moved" if k == move else ""
        print(f"{k:4} {static['times'][k] * 1e3:10.1f} {adaptive['times'][k] * 1e3:12.1f}  "
              f"{static['losses'][k]:11.6f}  {adaptive['losses'][k]:13.6f}{flag}")
    losses_ok = side_by_side.report_runs(static, adaptive)
    s, a = (sum(t[k] for k in slowed) for t in (static["times"], adaptive["times"]))
    n = move - args.onset if move is not None else 0
    moved = f"layers moved at step {move} ({n} step{'' if n == 1 else 's'} after onset)" if move is not None \
        else "NO layers moved"
    print(f"straggler_pp: adaptive {s / a:.2f}x over static over the slowed steps [{args.onset}, {args.steps}) "
          f"incl. the move (target >= 1.3x), {moved}, losses {'identical' if losses_ok else 'DIFFER'}")


def _median(run: dict, steps: range) -> float:
    return statistics.median(run["times"][k] for k in steps) * 1e3 if steps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--onset", type=int, default=10, help="first slowed step (slow to the end)")
    parser.add_argument("--factor", type=float, default=2.0, help="slow-down of stage 1's device")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--base-gflops", type=float, default=0.5, help="emulated GFLOP/s of a speed-1 device")
    args = parse_args(parser, smoke=dict(steps=12, onset=5, blocks=4, dim=32, batch=16, micro_batches=4,
                                         base_gflops=0.004))
    if not 5 <= args.onset < args.steps:
        parser.error("need 5 <= --onset < --steps (the first exchange of speeds is after step 4)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report(spawn_ranks(worker, args, WORLD), args)


if __name__ == "__main__":
    main()
