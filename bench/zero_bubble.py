"""ZB-H1 against 1F1B and eager-1F1B on a pipeline of unequal emulated devices (issue 31, item 6).

Workload: ``blocks`` Linear+Tanh blocks of width ``dim`` in ``stages`` (4) ``replicate(1)`` regions
(the pipeline's stages) and a small head, float64, on emulated devices of speeds 1, 0.8, 0.6 and 0.5
on one host (one gloo rank each), SGD steps on one global batch of ``batch`` samples in
``micro_batches`` micro-batches.

Sides, one ``runtime.Engine`` each on the same ranks, same emulation, same initial weights and
batch, alternating in rounds (rotated order; the median round per side is reported):

* ``1f1b``: PipeDream-flush, each backward whole;
* ``eager-1f1b``: 1F1B with twice the warm-up forwards (transfers overlap compute; more activations);
* ``zb-h1``: zero-bubble H1 (Qi et al., ICLR 2024): each backward split into its input half, whose
  gradients go upstream at once, and its weight half, deferred into the drain; at most 1F1B's
  largest in-flight count on every stage (:mod:`planner.schedule.actions`).

Each side's plan is ``planner.plan`` with that schedule pinned (the partitioner moves layers between
the stages for the unequal speeds, under the schedule's own step), and ``Config.schedule="auto"``
is planned too, to show which the planner keeps. The predicted step and bubble are the planner's
simulator running the plan's programs (:mod:`planner.schedule.program`: the same lowered action
lists, transfers included, that each rank runs); the measured step is the median round between
barriers. The emulator pads every forward, input half, weight half and backward to its modeled time
(``Emulator.segment``; base ``base_gflops`` GFLOP/s at speed 1, so a stage's micro-batch takes a few
hundred milliseconds where its real compute takes about one) and every boundary transfer to the
network model's (one host: 1 GB/s, 50 us). What the model leaves out is the machine's own latency per
message and wake-up (a few milliseconds on a loaded 2-core machine); ZB-H1 leaves less slack than
1F1B for it to hide in, so its measured step drifts above its prediction first when the machine is
busy (the modeled times are long to keep that drift small). Exactness: every side's loss at every step equals 1F1B's
(``torch.testing.assert_close``, float64); the emulation's overruns (segments whose real time
exceeded the modeled one) are counted per side.

The last line: the predicted bubble of ZB-H1 over 1F1B's (target <= 0.5x) and over eager-1F1B's,
each side's measured step against its prediction (target: ZB-H1 within 3%), the measured speed-ups,
the auto choice and exactness.

    .venv/bin/python bench/zero_bubble.py [--rounds 3 --steps 2 --blocks 48 --dim 96 --batch 64
                                           --micro-batches 8 --base-gflops 0.0125]
    .venv/bin/python bench/zero_bubble.py --smoke   # tiny sizes, seconds: checks that it runs
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from planner.schedule.deadlock import validate_plan  # noqa: E402
from runtime import Engine  # noqa: E402
from whalelike.cluster import Cluster, Device, Emulation, Network  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, seconds_per_step, spawn_ranks  # noqa: E402

SPEEDS = (1.0, 0.8, 0.6, 0.5)   # the devices, in rank order; --stages takes the first ones
SIDES = ("1f1b", "eager-1f1b", "zb-h1")
ONE_F_ONE_B, EAGER, ZB = SIDES


class Net(nn.Module):
    """``stages`` ``replicate(1)`` regions of Linear+Tanh blocks, the head in the last; every block is
    a Layer of its own (``blocks.k``), so the partitioner can move blocks between the stages."""

    def __init__(self, blocks: int, dim: int, stages: int = 4):
        super().__init__()
        per = [blocks // stages + (1 if i < blocks % stages else 0) for i in range(stages)]
        made = []
        for i, n in enumerate(per):
            with wl.replicate(1):
                made += [nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n)]
                if i == stages - 1:
                    self.head = nn.Linear(dim, 16)
        self.blocks = nn.ModuleList(made)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_cluster(args) -> Cluster:
    """``args.stages`` emulated devices on one host; ``peak_tflops = speed * base / 1000 / 0.4`` (the
    planner assumes 40% of peak), so predictions and the emulated time meet (docs/ARCHITECTURE.md
    section 4)."""
    devices = tuple(Device(f"emu-{i}", f"emu-{s:g}", "localhost", peak_tflops=s * args.base_gflops / 1000 / 0.4,
                           memory_gib=16.0, emulated_speed=s) for i, s in enumerate(SPEEDS[:args.stages]))
    return Cluster("zero-bubble-unequal", devices, Network(intra_host_gbps=1.0, inter_host_gbps=1.0, latency_us=50.0),
                   Emulation(base_gflops=args.base_gflops))


def make_plans(graphs, cluster: Cluster, args) -> tuple[dict, "planner.Plan"]:
    plans = {}
    for schedule in SIDES:
        config = wl.Config(global_batch_size=args.batch, num_micro_batch=args.micro_batches, schedule=schedule,
                           optimizer="sgd")
        plans[schedule] = planner.plan(graphs, cluster, config)
    auto = planner.plan(graphs, cluster, wl.Config(global_batch_size=args.batch, num_micro_batch=args.micro_batches,
                                                   schedule="auto", optimizer="sgd"))
    return plans, auto


def worker(rank: int, init_file: str, args, results) -> None:
    cluster = make_cluster(args)
    world = args.stages
    with process_group(rank, init_file, world):
        torch.manual_seed(0)
        model = Net(args.blocks, args.dim, args.stages).double()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.dim, generator=g, dtype=torch.float64)
        y = torch.randn(args.batch, 16, generator=g, dtype=torch.float64)
        graphs = wl.capture(model, (x[:2],), optimizer="sgd")
        plans, auto = make_plans(graphs, cluster, args)
        engines = {side: Engine(copy.deepcopy(model), plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                loss_fn=F.mse_loss, cluster=cluster, example_args=(x,), balance="off")
                   for side, plan in plans.items()}
        losses = {side: [] for side in engines}

        def step(side):
            losses[side].append(float(engines[side].train_step((x, y))))

        for side in SIDES if args.warmup else ():   # warm-up: process groups, shape inference, allocations
            seconds_per_step(lambda: step(side), args.warmup)
        before = {side: copy.copy(e.emulator.stats) for side, e in engines.items()}
        times = {side: [] for side in SIDES}
        for round_index in range(args.rounds):
            shift = round_index % len(SIDES)
            for side in SIDES[shift:] + SIDES[:shift]:
                times[side].append(seconds_per_step(lambda: step(side), args.steps))
        counts = {side: (e.emulator.stats.overruns - before[side].overruns,
                         e.emulator.stats.segments - before[side].segments) for side, e in engines.items()}
        gathered = [None] * world
        dist.all_gather_object(gathered, counts)
        # each rank's program (planner.schedule.program: what the simulator ran for its prediction)
        programs = [None] * world
        dist.all_gather_object(programs, (engines[ZB].executor.worker.stage,
                                          " ".join(map(str, engines[ZB].executor.schedule))))
        for engine in engines.values():
            engine.emulator.network.close()
        if rank == 0:
            results["times"] = times
            results["losses"] = losses
            results["counts"] = gathered
            results["plans"] = {side: (p.prediction.step_time_ms, p.prediction.bubble_fraction,
                                       [st.layers for st in p.stages], [w.device for w in p.workers])
                                for side, p in plans.items()}
            results["auto"] = (auto.schedule, dict(auto.schedule_steps_ms))
            results["programs"] = dict(programs)
            simulated = validate_plan(plans[ZB])   # the programs the planner's simulator ran for its prediction
            results["same_programs"] = all(" ".join(map(str, simulated[stage])) == text for stage, text in programs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (median reported)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per timed round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side before the rounds")
    parser.add_argument("--stages", type=int, default=4, choices=range(2, len(SPEEDS) + 1),
                        help="pipeline stages, one rank each, on the first devices of speeds 1, 0.8, 0.6, 0.5")
    parser.add_argument("--blocks", type=int, default=48, help="Linear+Tanh blocks (the partitioner moves them)")
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--base-gflops", type=float, default=0.0125, help="emulated GFLOP/s of a speed-1 device")
    args = parse_args(parser, smoke=dict(rounds=1, steps=1, warmup=0, stages=2, blocks=4, dim=16, batch=8,
                                         micro_batches=4, base_gflops=0.002))
    # one run id for the ranks' emulated NIC ledger (runtime.emulation.network.default_run_id)
    os.environ["TORCHELASTIC_RUN_ID"] = f"zero-bubble-{os.getpid()}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"ZB-H1 vs 1F1B vs eager-1F1B: {args.stages} stages on emulated devices of speeds "
          f"{', '.join(map(str, SPEEDS[:args.stages]))} "
          f"(base {args.base_gflops} GFLOP/s), {args.blocks} Linear({args.dim})+Tanh blocks + head, float64, global "
          f"batch {args.batch} in {args.micro_batches} micro-batches; median of {args.rounds} rounds x {args.steps} "
          f"steps", flush=True)
    start = time.perf_counter()
    results = spawn_ranks(worker, args, args.stages)
    losses = results["losses"]
    exact = True
    for side in SIDES:
        try:
            torch.testing.assert_close(losses[side], losses[ONE_F_ONE_B])
        except AssertionError as e:
            exact = False
            print(f"LOSSES DIFFER between {side!r} and {ONE_F_ONE_B!r}: {e}")
    print(f"exactness: {'every side' if exact else 'NOT every side'} has 1F1B's loss at every step "
          f"({len(losses[ONE_F_ONE_B])} steps each; {losses[ONE_F_ONE_B][0]:.6f} -> {losses[ONE_F_ONE_B][-1]:.6f})")
    median = {side: statistics.median(t) * 1e3 for side, t in results["times"].items()}
    predicted = {side: results["plans"][side][0] for side in SIDES}
    bubble = {side: results["plans"][side][1] for side in SIDES}
    print(f"{'side':12s} {'layers per stage':28s} {'predicted':>9s} {'bubble':>7s} {'measured':>9s} "
          f"{'meas/pred':>9s}  overruns")
    for side in SIDES:
        _, _, layers, devices = results["plans"][side]
        split = " | ".join(f"{len(ls)}@{d}" for ls, d in zip(layers, devices))
        over = sum(c[side][0] for c in results["counts"])
        segments = sum(c[side][1] for c in results["counts"])
        print(f"{side:12s} {split:28s} {predicted[side]:7.1f}ms {bubble[side]:7.1%} {median[side]:7.1f}ms "
              f"{median[side] / predicted[side] - 1:+8.1%}  {over}/{segments}")
    print(f"zb-h1 program of stage 1: {results['programs'][1]}; every rank ran the program the simulator ran: "
          f"{'yes' if results['same_programs'] else 'NO'}")
    chosen, steps = results["auto"]
    print(f"Config.schedule='auto' planned {', '.join(f'{s} {ms:.1f} ms' for s, ms in steps.items())}: kept {chosen}")
    print(f"(total {time.perf_counter() - start:.0f} s)")
    print(f"zero_bubble: predicted bubble ZB-H1 {bubble[ZB]:.1%} = {bubble[ZB] / bubble[ONE_F_ONE_B]:.2f}x 1F1B's "
          f"{bubble[ONE_F_ONE_B]:.1%} (target <= 0.50x), {bubble[ZB] / bubble[EAGER]:.2f}x eager-1F1B's "
          f"{bubble[EAGER]:.1%}; measured step ZB-H1 {median[ZB]:.1f} ms = {median[ZB] / predicted[ZB] - 1:+.1%} of "
          f"predicted (target within 3%), 1F1B {median[ONE_F_ONE_B] / predicted[ONE_F_ONE_B] - 1:+.1%}, eager-1F1B "
          f"{median[EAGER] / predicted[EAGER] - 1:+.1%}; measured ZB-H1 {median[ONE_F_ONE_B] / median[ZB]:.2f}x "
          f"faster than 1F1B, {median[EAGER] / median[ZB]:.2f}x than eager-1F1B; auto kept {chosen}; "
          f"programs as simulated: {'yes' if results['same_programs'] else 'NO'}; exact: {'yes' if exact else 'NO'}")


if __name__ == "__main__":
    main()
