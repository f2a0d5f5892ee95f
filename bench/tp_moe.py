"""A Mixtral MoE block under ``split(2)``: experts by speed vs equal experts per rank, on emulated devices.

Workload: one pre-norm mixture-of-experts layer, ``x + MixtralSparseMoeBlock(RMSNorm(x))`` from
``transformers`` (the library's own router and experts module: 6 experts, top-2, hidden 256,
expert MLP 512, SwiGLU), batch 4 x 128 tokens, two gloo ranks, MSE loss against a random target,
SGD steps. The layer is built under ``with wl.split(2)``, captured with ``wl.capture`` and trained
by ``runtime.Engine``: its experts are spread over the two ranks (:mod:`runtime.tensor.experts`),
the router runs whole on both, tokens go to their experts' ranks and back by all-to-all.

* peer: expert parallelism as Megatron-LM and torchtitan lay it out, an equal number of experts
  per rank (3 + 3), whatever the devices: the same plan with its expert counts made even, run by
  the same runtime (same dispatch, combine and collectives), so the two sides differ only in how
  many experts each rank holds.
* whalelike: ``planner.plan`` onto the two devices from their nominal speeds, which gives the
  faster one more experts (4 + 2 at speeds 1 and 0.5).

Fair emulation (docs/ARCHITECTURE.md section 4): on both sides every local expert matmul, forward
and backward, is padded to its modeled time on the emulated device by the same emulator (FLOPs of
the rows it ran); the router, the dispatch and combine, the norm and the collectives run at the
machine's real speed. The bench checks that both sides padded the same total FLOPs (the routing is
the same, only who runs which expert differs) and that their losses agree. The routing decides
the work: with 1024 (token, expert) pairs per step the experts' loads differ by a few percent, so
the bench also prints the ideal ratio of this routing (each side's busiest rank's pairs over its
speed) next to the measured one.

Size: 1.2 GFLOP of expert matmuls per rank and step with equal experts, 1.2 s on the slow rank at
the default ``--base-gflops 2``; the run takes about 2 minutes. The two sides alternate in rounds;
medians are reported. The last line states both ratios (targets: >= 1.35x at speeds 1/0.5, ideal
1.5x; >= 0.95x at equal speeds).

    .venv/bin/python bench/tp_moe.py [--steps 3 --rounds 3 --batch 4 --seq 128 --base-gflops 2]
    .venv/bin/python bench/tp_moe.py --smoke   # tiny sizes, seconds: checks that it runs
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.tensor.experts import ExpertParallel  # noqa: E402
from whalelike.cluster import Cluster, Device, Emulation, Network  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, seconds_per_step, spawn_ranks  # noqa: E402

WORLD = 2
SCENARIOS = {"equal speeds 1, 1": (1.0, 1.0), "speeds 1, 0.5": (1.0, 0.5)}
EXPERTS = "moe.experts"
SIDES = ("equal experts", "whalelike")


class MoELayer(nn.Module):
    """``x + MixtralSparseMoeBlock(RMSNorm(x))``, weights drawn as Mixtral's ``_init_weights`` draws them."""

    def __init__(self, args):
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm, MixtralSparseMoeBlock
        config = MixtralConfig(hidden_size=args.dim, intermediate_size=args.ffn, num_local_experts=args.experts,
                               num_experts_per_tok=args.top_k, router_jitter_noise=0.0,
                               experts_implementation="grouped_mm")
        self.norm, self.moe = MixtralRMSNorm(args.dim), MixtralSparseMoeBlock(config)
        with torch.no_grad():
            for p in self.moe.parameters():    # a bare block is not initialised (post_init does it for a model)
                p.normal_(0.0, config.initializer_range)

    def forward(self, x):
        return x + self.moe(self.norm(x))


def build_model(args) -> nn.Module:
    torch.manual_seed(0)
    with wl.split(WORLD):
        return MoELayer(args)


def cluster(speeds, args) -> Cluster:
    """Two emulated devices; spec sheets as the emulated presets write them (speed x base / 0.4)."""
    devices = tuple(Device(f"emu-{i}", f"emu-{s:g}", "localhost", peak_tflops=s * args.base_gflops / 0.4 / 1e3,
                           memory_gib=16.0, emulated_speed=s) for i, s in enumerate(speeds))
    return Cluster("bench-moe", devices, Network(2.0, 2.0, 50.0), Emulation(base_gflops=args.base_gflops))


def plans(model, x, spec):
    """The planner's plan (experts by speed) and the same plan with equal experts per rank."""
    graphs = wl.capture(model, (x,), optimizer="sgd")
    ours = planner.plan(graphs, spec, wl.Config(global_batch_size=x.shape[0], num_micro_batch=1, optimizer="sgd"))
    stage = ours.stages[0]
    experts = sum(stage.shard_sizes[EXPERTS])
    even = [experts // WORLD + (i < experts % WORLD) for i in range(WORLD)]
    equal = dataclasses.replace(ours, stages=[dataclasses.replace(stage, shard_sizes={**stage.shard_sizes,
                                                                                      EXPERTS: even})])
    return {"equal experts": equal, "whalelike": ours}


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.seq, args.dim, generator=g)
        y = torch.randn(args.batch, args.seq, args.dim, generator=g)
        for scenario, speeds in SCENARIOS.items():
            model = build_model(args)
            spec = cluster(speeds, args)
            made = plans(copy.deepcopy(model), x, spec)
            engines = {side: Engine(copy.deepcopy(model), made[side], optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                    loss_fn=F.mse_loss, cluster=spec, example_args=(x,)) for side in SIDES}
            losses = {side: [] for side in SIDES}

            def step(side):
                losses[side].append(float(engines[side].train_step((x, y))))

            base = {}
            for side in SIDES:   # warm-up: allocations, the first step's checks
                seconds_per_step(lambda: step(side), 1)
                base[side] = engines[side].emulator.stats.snapshot()
            times = {side: [] for side in SIDES}
            for _ in range(args.rounds):
                for side in SIDES:
                    times[side].append(seconds_per_step(lambda: step(side), args.steps))
            layers = {side: next(m for m in engines[side].executor.stage.module.modules()
                                 if isinstance(m, ExpertParallel)) for side in SIDES}
            stats = {side: e.emulator.stats.since(base[side]) for side, e in engines.items()}
            mine = {side: {"stats": (stats[side].segments, stats[side].overruns, stats[side].flops),
                           "pairs": layers[side].last_pairs, "held": layers[side].counts[rank]} for side in SIDES}
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                results[scenario] = {"times": times, "ranks": gathered, "losses": losses,
                                     "sizes": {side: made[side].stages[0].shard_sizes[EXPERTS] for side in SIDES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (median reported)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="each expert's MLP width")
    parser.add_argument("--experts", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--base-gflops", type=float, default=2.0, help="emulated GFLOP/s of a speed-1 device")
    args = parse_args(parser, smoke=dict(steps=1, rounds=1, batch=2, seq=8, dim=32, ffn=64, base_gflops=0.05))

    results = spawn_ranks(worker, args, WORLD)

    print(f"MoE layer (Mixtral sparse MoE block) d={args.dim}, {args.experts} experts of MLP {args.ffn}, top-"
          f"{args.top_k}, batch {args.batch} x {args.seq} tokens, {WORLD} gloo ranks, emulated base "
          f"{args.base_gflops} GFLOP/s, {args.rounds} rounds x {args.steps} steps per side, torch {torch.__version__}")
    ratios = {}
    for scenario, r in results.items():
        speeds = SCENARIOS[scenario]
        ms = {side: statistics.median(r["times"][side]) * 1e3 for side in SIDES}
        ratios[scenario] = ms["equal experts"] / ms["whalelike"]
        busiest = {side: max(rank[side]["pairs"] / s for rank, s in zip(r["ranks"], speeds)) for side in SIDES}
        flops = {side: sum(rank[side]["stats"][2] for rank in r["ranks"]) for side in SIDES}
        print(f"\n{scenario}")
        for side in SIDES:
            held = " + ".join(str(rank[side]["held"]) for rank in r["ranks"])
            pairs = " + ".join(str(rank[side]["pairs"]) for rank in r["ranks"])
            print(f"  {side:13s} {ms[side]:8.1f} ms/step   experts {held} (plan {r['sizes'][side]}), pairs in the "
                  f"last step {pairs}, padded segments {sum(rank[side]['stats'][0] for rank in r['ranks'])}, "
                  f"overruns {sum(rank[side]['stats'][1] for rank in r['ranks'])}")
        print(f"  speed-up {ratios[scenario]:.2f}x; this routing's ideal {busiest['equal experts'] / busiest['whalelike']:.2f}x "
              f"(busiest rank's pairs over its speed, last step)")
        if abs(flops["equal experts"] - flops["whalelike"]) > 1e-6 * flops["whalelike"]:
            print("  NOTE: the sides padded different matmul work")
        same = all(abs(a - b) <= 1e-4 * max(abs(a), 1e-12) for a, b in zip(*(r["losses"][s] for s in SIDES)))
        print(f"  losses of the two sides agree step by step: {'yes' if same else 'NO: LOSSES DIFFER'}")
    print(f"\nwhalelike / equal experts per rank speed-up: speeds 1/0.5 {ratios['speeds 1, 0.5']:.2f}x (target >= "
          f"1.35x, ideal 1.5x); equal speeds {ratios['equal speeds 1, 1']:.2f}x (target >= 0.95x)")


if __name__ == "__main__":
    main()
