"""Dynamic balancing, tensor parallel: one matmul straggler (FlexTP's chi) on a split(4) model; static
vs ZERO-resizing vs migration vs SEMI-migration vs exact re-shard, side by side in one run.

Workload: a float32 stack of ``--blocks`` residual Megatron MLP blocks ``x + down(gelu(up(x)))``
(``up: d -> hidden`` column-parallel, ``down: hidden -> d`` row-parallel, sharded by MLP features
in granules of 8, so shard sizes can follow speeds in steps of 8 of ``--hidden`` features) under
``wl.split(4)``, learning a fixed random teacher (``y = tanh(x A) B``, MSE, AdamW). Four gloo ranks
on CPU, emulated devices of equal speed (docs/ARCHITECTURE.md section 4): every local matmul, forward and
backward, is padded to its modeled time. From step ``--onset`` to the end, rank 3's matmuls (only
its matmuls: ``Straggler(ops="matmul")``, the paper's straggling skewness chi) run chi times slower.

Methods, each its own ``runtime.Engine`` run from the same initial weights on the same batches and
the same emulation, all with ``BalanceConfig``'s defaults (warm-up 2 steps, window 3, threshold 10%):

* static:    ``policy="off"`` (measures and logs, changes nothing: plain 1D tensor parallelism);
* resize:    ``policy="resize"``, ZERO-resizing alone (Eq. 1 against the mean, approximate);
* migrate:   ``policy="exact", tp_lossless="migrate"``: FlexTP's lossless migration (the owner keeps
             parameters and optimizer state, a speed-proportional compute layout runs the step,
             migrated slices' values out and gradients back P2P every step);
* semi:      ``policy="semi"``, SEMI-migration (Algorithm 2; a single straggler is pre-tested first,
             line 1, ``runtime.balance.semi_pretest``: resizing's loss on the last 2 batches and both
             sides' time, so Eq. 2 migrates what resizing within the 0.5% loss budget cannot cover;
             several are split between migration and resizing by Eq. 3);
* reshard:   ``policy="exact", tp_lossless="reshard"``: a permanent uneven re-shard at once
             (columns and their optimizer state move P2P once).

Step times are rank 0's wall time per ``train_step`` (each step ends in the speed exchange, a
collective, so every rank's step ends together). "settled" is the mean over the slowed steps after
every method's first re-plan (the same steps for all methods of a scenario), "whole" the mean over
all steps (warm-up, detection and the re-plan's own cost included). In the round-robin scenario
"settled" is every step from the onset: each rotation has to be detected again.

The ideal step. With every rank's matmul speed ``v_r`` (1 for healthy ranks, ``1/chi`` for a
straggler) perfectly proportional work makes the matmul part of a step ``n / sum_r v_r`` times the
unslowed one (``4 / (3 + 1/chi)`` for one straggler; ``4 / (2 + 1/2 + 1/6)`` for chi 2 and 6). Only
the matmuls are slowed, so only the matmul part is scaled::

    ideal = M0 * n / sum_r v_r + rest

``M0`` is the slowest rank's matmul time in the static run's unslowed steps (2 .. onset-1; under
emulation it is the modeled time, the same every step), ``rest`` the rest of a step that no method
rebalances and the straggler does not slow (the all-reduces, elementwise ops, optimizer, Python):
the median over the static run's steps from 2 on of step time minus the slowest rank's matmul time
(all its steps, not only the few before the onset: on a shared 2-core machine those few are too
noisy, and the rest does not change at the onset). ``M0 + rest`` is the unslowed step ``T0``;
scaling all of it (``T0 * n / sum v``) would give a larger, easier ideal, printed beside it.
"of ideal" = ideal / settled step time; a few percent above 100% is the noise of ``rest``.

Loss. "final loss" is the held-out MSE (a fixed batch of ``--eval`` samples) of each run's trained
weights after the run, evaluated in one process from ``Engine.state_dict()`` with every column
(resizing changes training, never this evaluation); "vs exact" is its relative difference from the
re-shard run's. "last train" is the training loss of the last step as the run computed it (pruned
where ZERO-resizing was on). The lossless methods (static, migrate, reshard) train the same model
up to float32 summation order. "approx" counts the steps ``Engine.stats`` marks approximate, and
"pruned" is the largest fraction of one rank's matmul work ZERO-resizing actually pruned in any
step (rows x pruned inner columns over all local weights): a step can be marked approximate while
nothing is pruned.

Also: the paper's multi-straggler case (two stragglers of different chi, ``--multi 2,6`` on ranks
2 and 3) for static vs SEMI vs re-shard, and the round-robin scenario
(:func:`whalelike.cluster.round_robin_stragglers`, chi ``--rr-chi`` rotating every ``--rr-period``
steps) for static vs the exact default (``tp_lossless="auto"``: migrate, re-shard after 20 steps).

Calibration: ``--base-gflops`` is low enough that the modeled time dominates the real compute on
2 CPU cores with 4 ranks: the emulation overruns (segments whose real time exceeded the modeled
time) are printed per run from step 1 on (the first step pays one-time costs), with the steps they
fell in: 0 except in the first step after a re-plan, whose new executor pays them again.

Run (spawns 4 ranks itself, about 5 minutes)::

    .venv/bin/python bench/straggler_tp.py [--chis 2,4,8 --steps 32 --onset 6 --base-gflops 0.5]
    .venv/bin/python bench/straggler_tp.py --smoke   # tiny sizes, seconds: checks that it runs

The last line states the headline ratios at chi 8 against the targets of issue 9: the best lossless
method >= 3.5x over static and >= 80% of the ideal; SEMI's final loss within 0.5% of the exact run.
"""
from __future__ import annotations

import argparse
import json
import logging
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
from runtime import Engine  # noqa: E402
from runtime.balance.rebalance import BalanceConfig  # noqa: E402
from whalelike.cluster import Cluster, Device, Emulation, Network, Straggler, round_robin_stragglers  # noqa: E402
from whalelike.files import check_output_paths, write_atomic  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, spawn_ranks  # noqa: E402

WORLD = 4
METHODS = {
    "static": BalanceConfig(policy="off"),
    "resize": BalanceConfig(policy="resize"),
    "migrate": BalanceConfig(policy="exact", tp_lossless="migrate"),
    "semi": BalanceConfig(policy="semi"),
    "reshard": BalanceConfig(policy="exact", tp_lossless="reshard"),
}
LOSSLESS = ("migrate", "reshard")


class Blocks(nn.Module):
    """Residual Megatron MLP blocks, all under one ``split(4)`` region."""

    def __init__(self, dim: int, hidden: int, blocks: int):
        super().__init__()
        torch.manual_seed(0)
        with wl.split(WORLD):
            self.up = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(blocks))
            self.down = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(blocks))
        for down in self.down:     # small residual branches: a well-conditioned start
            nn.init.normal_(down.weight, std=0.02)
            nn.init.zeros_(down.bias)

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            x = x + down(F.gelu(up(x)))
        return x


def make_data(args):
    """Training batches and a held-out batch, labelled by a fixed random teacher."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(args.dim, args.dim, generator=g) / args.dim ** 0.5
    b = torch.randn(args.dim, args.dim, generator=g) / args.dim ** 0.5

    def batch(n):
        x = torch.randn(n, args.dim, generator=g)
        return x, torch.tanh(x @ a) @ b * 2.0

    train = [batch(args.batch) for _ in range(max(args.steps, args.rr_steps))]
    return [((x,), y) for x, y in train], batch(args.eval)


def make_cluster(stragglers, args) -> Cluster:
    devices = tuple(Device(f"emu-{r}", "emu-1", "localhost", peak_tflops=args.base_gflops / 0.4 / 1e3,
                           memory_gib=16.0, emulated_speed=1.0) for r in range(WORLD))
    return Cluster("straggler-tp", devices, Network(150.0, 12.5, 5.0),
                   Emulation(base_gflops=args.base_gflops, stragglers=tuple(stragglers)))


def pruned_work(module: nn.Module) -> float:
    """The fraction of this rank's tensor-parallel matmul work ZERO-resizing prunes in the next step:
    rows x pruned inner columns of every parallel Linear whose resizing hook is set, over all weights."""
    total = pruned = 0
    for sub in module.modules():
        if hasattr(sub, "zero_resizing") and isinstance(getattr(sub, "weight", None), torch.Tensor):
            total += sub.weight.numel()
            if sub.zero_resizing is not None:
                pruned += sub.weight.shape[0] * len(sub.zero_resizing.pruned)
    return pruned / total if total else 0.0


def train(config: BalanceConfig, cluster: Cluster, plan, batches, held_out, args) -> dict:
    """One run; rank 0's per-step wall times, every rank's stats reduced, the held-out loss."""
    engine = Engine(Blocks(args.dim, args.hidden, args.blocks), plan,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr), loss_fn=F.mse_loss,
                    cluster=cluster, example_args=(batches[0][0][0],), timeout_s=300, balance=config)
    losses, ends, pruned = [], [], []
    dist.barrier()
    start = time.perf_counter()
    for batch in batches:
        losses.append(float(engine.train_step(batch)))
        ends.append(time.perf_counter())
        pruned.append(pruned_work(engine.executor_module()))
    dist.barrier()
    times = [b - a for a, b in zip([start, *ends], ends)]
    # per step, over ranks: the slowest rank's compute (matmul segments only in a split stage), overruns
    matmul = torch.tensor([s.padded_s for s in engine.stats], dtype=torch.float64)
    dist.all_reduce(matmul, op=dist.ReduceOp.MAX)
    overruns = torch.tensor([s.overruns for s in engine.stats])
    dist.all_reduce(overruns)
    most_pruned = torch.tensor(max(pruned))
    dist.all_reduce(most_pruned, op=dist.ReduceOp.MAX)
    segments = torch.tensor(sum(s.segments for s in engine.stats))
    dist.all_reduce(segments)
    migration = getattr(engine.executor, "stats", None)
    migrated = torch.tensor([migration.sent_elements / max(migration.steps, 1) if migration else 0.0])
    dist.all_reduce(migrated)
    state = engine.state_dict()
    layout = engine.compute_plan or engine.plan
    path = sorted(layout.stages[0].shard_sizes)[0]   # one layout per stage: every projection alike
    result = {"times": times, "losses": losses, "matmul": matmul.tolist(), "overruns": overruns.tolist(),
              "segments": int(segments), "events": [e.line() for e in engine.replans],
              "first_event": [e.step for e in engine.replans][:1],
              "actions": [e.action for e in engine.replans], "pruned": float(most_pruned),
              "approx": sum(s.approximate for s in engine.stats),
              "sizes": list(layout.stages[0].shard_sizes[path]), "migrated": float(migrated)}
    if dist.get_rank() == 0:
        model = Blocks(args.dim, args.hidden, args.blocks)
        model.load_state_dict(state)
        with torch.no_grad():
            result["final"] = float(F.mse_loss(model(held_out[0]), held_out[1]))
    return result


def scenario(stragglers, methods, batches, held_out, args) -> dict:
    cluster = make_cluster(stragglers, args)
    graphs = wl.capture(Blocks(args.dim, args.hidden, args.blocks), (batches[0][0][0],))
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=args.batch, num_micro_batch=1))
    return {name: train(METHODS.get(name, BalanceConfig()), cluster, plan, batches, held_out, args)
            for name in methods}


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD, logging.ERROR):
        batches, held_out = make_data(args)
        runs = {}
        for chi in args.chis:
            slow = (Straggler(rank=WORLD - 1, factor=chi, start_step=args.onset, ops="matmul"),)
            runs[f"chi={chi:g}"] = scenario(slow, list(METHODS), batches[:args.steps], held_out, args)
        if args.multi:
            slow = tuple(Straggler(rank=WORLD - len(args.multi) + i, factor=chi, start_step=args.onset, ops="matmul")
                         for i, chi in enumerate(args.multi))
            runs["multi"] = scenario(slow, ["static", "semi", "reshard"], batches[:args.steps], held_out, args)
        if args.rr_chi:
            slow = round_robin_stragglers(range(WORLD), args.rr_chi, args.rr_period, start_step=args.onset,
                                          end_step=args.rr_steps, ops="matmul")
            runs["round-robin"] = scenario(slow, ["static", "exact"], batches[:args.rr_steps], held_out, args)
        if rank == 0:
            results["runs"] = runs


def scenario_speeds(name: str, args) -> tuple[list[float], str]:
    """The emulated matmul speeds while slowed (for the ideal) and a title."""
    if name.startswith("chi="):
        chi = float(name[4:])
        return [1.0] * (WORLD - 1) + [1.0 / chi], f"{name}: rank {WORLD - 1}'s matmuls {chi:g}x slower"
    if name == "multi":
        first = WORLD - len(args.multi)
        return ([1.0] * first + [1.0 / c for c in args.multi],
                "multi-straggler: " + ", ".join(f"rank {first + i} chi={c:g}" for i, c in enumerate(args.multi)))
    return ([1.0] * (WORLD - 1) + [1.0 / args.rr_chi],
            f"round-robin: one rank at a time {args.rr_chi:g}x slower, rotating every {args.rr_period} steps")


def report(runs: dict, args, load: str) -> None:
    print(f"\ntensor parallel split({WORLD}), {args.blocks} residual MLP blocks d={args.dim} hidden={args.hidden} "
          f"(granules of 8), float32, batch {args.batch}, AdamW lr {args.lr:g}; 4 gloo ranks, equal emulated devices "
          f"at {args.base_gflops:g} GFLOP/s; stragglers slow matmuls only, from step {args.onset}; "
          f"torch {torch.__version__}; load average before the run {load}")
    headline = {}
    for name, methods in runs.items():
        static = methods["static"]
        steps = len(static["times"])
        speeds, title = scenario_speeds(name, args)
        m0 = statistics.mean(static["matmul"][s] for s in range(2, args.onset))
        rest = statistics.median(t - m for t, m in list(zip(static["times"], static["matmul"]))[2:])
        ideal = rest + m0 * WORLD / sum(speeds)
        if name == "round-robin":   # a new straggler every period: detection delays count, from the onset
            settle, what = args.onset, "slowed steps"
        else:
            firsts = [r["first_event"][0] for r in methods.values() if r["first_event"]]
            settle, what = (max(firsts) + 1 if firsts else args.onset), "settled steps after every re-plan"
        settled = range(settle, steps)
        exact = methods.get("reshard", methods.get("exact"))
        print(f"\n{title} from step {args.onset}, {steps} steps: unslowed matmuls M0 {m0 * 1e3:.1f} ms, rest "
              f"{rest * 1e3:.1f} ms; ideal {ideal * 1e3:.1f} ms (M0 x {WORLD / sum(speeds):.3f} + rest; scaling "
              f"the whole step: {(m0 + rest) * WORLD / sum(speeds) * 1e3:.1f} ms); 'settled' = {what} "
              f"[{settle}, {steps})")
        header = (f"{'method':9}{'settled ms':>11}{'whole ms':>10}{'speed-up':>9}{'of ideal':>9}{'final loss':>11}"
                  f"{'vs exact':>10}{'last train':>11}{'approx':>7}{'pruned':>7}{'overruns':>11}{'migr/step':>10}  shards")
        print(header)
        print("-" * len(header))
        static_mean = statistics.mean(static["times"][s] for s in settled)
        table = {}
        for method, r in methods.items():
            mean = statistics.mean(r["times"][s] for s in settled)
            vs_exact = (r["final"] - exact["final"]) / exact["final"]
            table[method] = (static_mean / mean, ideal / mean, vs_exact)
            overruns = sum(r["overruns"][1:])   # the first step pays one-time costs (allocations)
            print(f"{method:9}{mean * 1e3:11.1f}{statistics.mean(r['times']) * 1e3:10.1f}{static_mean / mean:8.2f}x"
                  f"{ideal / mean:9.1%}{r['final']:11.5f}{vs_exact:+10.2%}{r['losses'][-1]:11.5f}{r['approx']:7}{r['pruned']:7.0%}"
                  f"{overruns:>6}/{r['segments']:<5}{r['migrated']:10.0f}  {r['sizes']}")
        for method, r in methods.items():
            for line in r["events"]:
                print(f"  {method:8} {line[:220]}{'...' if len(line) > 220 else ''}")
                if "pre-test" in line and len(line) > 220:   # SEMI's pre-test and its decision, in full
                    print(f"  {method:8}   {line[line.index('pre-test'):].split('; stage')[0]}")
            late = [s for s, n in enumerate(r["overruns"]) if n and s > 0]
            if late:
                print(f"  {method:8} overruns at steps {late}")
        print(f"  training loss {static['losses'][0]:.4f} -> {static['losses'][-1]:.4f} (static)")
        headline[name] = table
    top = headline.get("chi=8")
    if top is None:
        print("straggler_tp: no chi=8 scenario run; pass --chis including 8 for the headline")
        return
    best = max(LOSSLESS, key=lambda m: top[m][0])
    speedup, of_ideal, _ = top[best]
    semi = top["semi"][2]
    semi_run = runs["chi=8"]["semi"]
    lossless = max(abs(top[m][2]) for m in ("static", *LOSSLESS))
    mark = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    resized = any("resize" in action for action in semi_run["actions"])
    idle = ": its resize pruned nothing" if resized and semi_run["pruned"] == 0 else ""
    print(f"straggler_tp chi=8: best lossless ({best}) {speedup:.2f}x over static (target >= 3.5x: "
          f"{mark(speedup >= 3.5)}), {of_ideal:.1%} of ideal (target >= 80%: {mark(of_ideal >= 0.8)}); "
          f"SEMI final loss {semi:+.2%} vs exact (target within 0.5%: {mark(abs(semi) <= 0.005)}; SEMI did "
          f"{'+'.join(semi_run['actions'][:1]) or 'nothing'}, pruned up to {semi_run['pruned']:.0%}{idle}) at "
          f"{top['semi'][0]:.2f}x; resize {top['resize'][2]:+.2%} at {top['resize'][0]:.2f}x; lossless runs' "
          f"final losses within {lossless:.1e} of exact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chis", type=lambda s: [float(v) for v in s.split(",")], default=[2.0, 4.0, 8.0],
                        help="straggling skewness of the single-straggler scenarios")
    parser.add_argument("--multi", type=lambda s: [float(v) for v in s.split(",") if v], default=[2.0, 6.0],
                        help="chi of the multi-straggler scenario's stragglers (last ranks); '' skips it")
    parser.add_argument("--rr-chi", type=float, default=4.0, help="chi of the round-robin scenario (0 skips it)")
    parser.add_argument("--rr-period", type=int, default=8, help="steps each rank stays slow in round-robin")
    parser.add_argument("--rr-steps", type=int, default=38, help="steps of the round-robin runs")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--onset", type=int, default=6, help="first slowed step")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval", type=int, default=1024, help="held-out samples for the final loss")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--base-gflops", type=float, default=0.5, help="emulated GFLOP/s of a speed-1 device")
    parser.add_argument("--json", help="also write every run's per-step figures to this file")
    args = parse_args(parser, smoke=dict(chis=[8.0], rr_period=2, rr_steps=8, steps=10, onset=5, dim=32, hidden=128,
                                         blocks=1, batch=16, eval=64, base_gflops=0.05))
    if not 5 <= args.onset < args.steps:
        parser.error("need 5 <= --onset < --steps (speeds in force are measured over steps 2-4)")
    check_output_paths({"--json": args.json}, kinds={"--json": "json"})   # before minutes of runs
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    runs = spawn_ranks(worker, args, WORLD)["runs"]
    if args.json:
        write_atomic(args.json, json.dumps({"args": vars(args), "runs": runs}, indent=1), kind="json")
    report(runs, args, load)


if __name__ == "__main__":
    main()
