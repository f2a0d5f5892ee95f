"""whalelike's pipeline vs ``torch.distributed.pipelining`` Schedule1F1B, on emulated devices.

Workload: ``blocks`` Linear+ReLU blocks of width ``dim`` and a small head, annotated as two
``replicate(1)`` TaskGraphs (the pipeline's two stages), 2 gloo ranks on CPU, SGD steps,
``micro_batches`` micro-batches of the global batch under 1F1B on both sides.

* peer: ``PipelineStage`` + ``Schedule1F1B`` with an equal number of blocks per stage (what
  pipelining gives a user who cuts the model in the middle; it never chooses where to cut).
* whalelike: ``wl.capture`` the model, ``planner.plan`` balances the layers to the devices'
  nominal speeds (where to cut, and which device runs which stage), and
  :class:`runtime.parallel.pipeline.PipelineExecutor` runs the plan.

Fair emulation (docs/ARCHITECTURE.md section 4): both sides pad every forward and every backward of a stage
for one micro-batch to its modeled time with the same :class:`runtime.emulation.compute.Emulator`, from the
same captured FLOPs per sample of the stage's layers. whalelike does it inside its executor. The
peer's stage module is wrapped: the forward runs inside ``Emulator.segment``; identity autograd
functions at the stage output (its backward runs first: starts the segment) and at the stage input
(its backward runs last: ends it) pad the backward. No segment spans a send or receive on either
side. The two sides alternate in rounds; the median step time per side is reported.

    .venv/bin/python bench/pp_vs_pipelining.py [--steps 5 --rounds 3 --blocks 12 --dim 256 --batch 64
                                                --micro-batches 8 --base-gflops 0.5]
    .venv/bin/python bench/pp_vs_pipelining.py --smoke   # tiny sizes, seconds: checks that it runs
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from runtime.emulation.compute import Emulator  # noqa: E402
from runtime.parallel.pipeline import PipelineExecutor  # noqa: E402
from runtime.parallel.stage_split import node_stages_from_plan, stage_flops_from_plan  # noqa: E402
from whalelike.cluster import Cluster, Device, Emulation, Network  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, seconds_per_step, spawn_ranks  # noqa: E402

WORLD = 2
SCENARIOS = {"equal speeds 1, 1": (1.0, 1.0), "speeds 1, 0.5": (1.0, 0.5)}


class Net(nn.Module):
    def __init__(self, blocks: int, dim: int):
        super().__init__()
        half = blocks // 2
        with wl.replicate(1):
            self.lower = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(half)])
        with wl.replicate(1):
            self.upper = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(blocks - half)])
            self.head = nn.Linear(dim, 16)

    def forward(self, x):
        return self.head(self.upper(self.lower(x)))


# -- the peer: torch.distributed.pipelining under the same emulation ---------------------------------
class _EndBackward(torch.autograd.Function):
    """Identity at the stage input; its backward is the stage's last, so it ends the segment.
    ``anchor`` requires grad so the node exists even when the input does not (stage 0)."""

    @staticmethod
    def forward(ctx, emulator, anchor, x):
        ctx.emulator = emulator
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.emulator.wait_deadline()
        return None, None, grad


class _BeginBackward(torch.autograd.Function):
    """Identity at the stage output; its backward is the stage's first, so it starts the segment."""

    @staticmethod
    def forward(ctx, emulator, flops, samples, y):
        ctx.emulator, ctx.flops, ctx.samples = emulator, flops, samples
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.emulator.begin(ctx.flops, ctx.samples)
        return None, None, None, grad


class EmulatedStage(nn.Module):
    def __init__(self, body: nn.Module, emulator: Emulator, flops_per_sample: tuple[float, float]):
        super().__init__()
        self.body, self.emulator, self.flops = body, emulator, flops_per_sample
        self.anchor = torch.zeros((), requires_grad=True)   # not a parameter: never optimized

    def forward(self, x):
        n = x.shape[0]
        x = _EndBackward.apply(self.emulator, self.anchor, x)
        with self.emulator.segment(self.flops[0] * n, n):
            y = self.body(x)
        return _BeginBackward.apply(self.emulator, self.flops[1] * n, n, y)


def build_peer(model: Net, graphs, rank: int, emulator: Emulator, args):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    blocks = [*model.lower, *model.upper]
    half = len(blocks) // 2
    body = nn.Sequential(*blocks[:half]) if rank == 0 else nn.Sequential(*blocks[half:], model.head)
    # the same captured FLOPs per sample as whalelike's stages: layers are lower.*, upper.*, head in order
    layers = range(0, half) if rank == 0 else range(half, len(graphs.layers))
    flops = (sum(graphs.layers[i].forward_flops for i in layers), sum(graphs.layers[i].backward_flops for i in layers))
    stage = PipelineStage(EmulatedStage(body, emulator, flops), rank, WORLD, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(body.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()

    return step, f"{half} + {len(blocks) - half} blocks (+ head)"


# -- whalelike ------------------------------------------------------------------------------------
def hardware_aware_plan(graphs, speeds, args):
    """``planner.plan`` onto the two devices from their nominal speeds; it picks the cut and which
    device runs which stage (rank r is device r, as under torchrun)."""
    cluster = Cluster("bench", tuple(Device(f"emu-{i}", f"emu-{s:g}", "localhost", peak_tflops=s, memory_gib=16.0)
                                     for i, s in enumerate(speeds)), Network(2.0, 2.0, 50.0))
    config = wl.Config(global_batch_size=args.batch, num_micro_batch=args.micro_batches, schedule="1f1b", optimizer="sgd")
    plan = planner.plan(graphs, cluster, config)
    where = [f"layers {_span(s.layers)} on rank {plan.stage_workers(s.index)[0].rank}" for s in plan.stages]
    return plan, f"{' | '.join(where)} (planner.plan)"


def _span(layers) -> str:
    return f"{layers[0]}..{layers[-1]}"


def build_whalelike(graphs, plan, emulator: Emulator):
    pipe = PipelineExecutor(graphs.graph_module, node_stages_from_plan(graphs, plan), plan, F.mse_loss,
                            emulator=emulator, stage_flops=stage_flops_from_plan(graphs, plan))
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        pipe.train_step((x,), y)
        opt.step()

    return step


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(args.batch, args.dim, generator=g), torch.randn(args.batch, 16, generator=g)
        for scenario, speeds in SCENARIOS.items():
            torch.manual_seed(0)
            model = Net(args.blocks, args.dim)
            peer_model = copy.deepcopy(model)
            graphs = wl.capture(model, (x[:2],), optimizer="sgd")
            emulation = Emulation(base_gflops=args.base_gflops)
            emulators = {side: Emulator(speeds[rank], emulation, rank) for side in ("pipelining", "whalelike")}
            plan, split = hardware_aware_plan(graphs, speeds, args)
            peer_step, peer_split = build_peer(peer_model, graphs, rank, emulators["pipelining"], args)
            steps = {"pipelining": peer_step, "whalelike": build_whalelike(graphs, plan, emulators["whalelike"])}
            for step in steps.values():     # warm-up: shape inference, process groups
                seconds_per_step(lambda: step(x, y), 1)
            times = {side: [] for side in steps}
            for _ in range(args.rounds):
                for side, step in steps.items():
                    times[side].append(seconds_per_step(lambda: step(x, y), args.steps))
            if rank == 0:
                results[scenario] = {
                    "times": {side: statistics.median(t) for side, t in times.items()},
                    "splits": {"pipelining": peer_split, "whalelike": split},
                }
            overruns = {side: (e.stats.overruns, e.stats.segments) for side, e in emulators.items()}
            results[(scenario, rank)] = overruns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (median reported)")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--base-gflops", type=float, default=0.5, help="emulated GFLOP/s of a speed-1 device")
    args = parse_args(parser, smoke=dict(steps=1, rounds=1, blocks=4, dim=32, batch=16, micro_batches=4,
                                         base_gflops=0.005))
    results = spawn_ranks(worker, args, WORLD)
    print(f"pipeline, 2 stages, 1F1B, {args.micro_batches} micro-batches of a global batch of {args.batch}, "
          f"{args.blocks} Linear({args.dim}) blocks + head, gloo CPU, emulated base {args.base_gflops} GFLOP/s")
    for scenario in SCENARIOS:
        r = results[scenario]
        peer, ours = r["times"]["pipelining"], r["times"]["whalelike"]
        print(f"\n{scenario}")
        for side, t in r["times"].items():
            over = ", ".join(f"rank {k}: {results[(scenario, k)][side][0]}/{results[(scenario, k)][side][1]}"
                             for k in range(WORLD))
            print(f"  {side:<10} {t * 1e3:8.1f} ms/step   {r['splits'][side]}   overruns {over}")
        print(f"  speed-up whalelike / pipelining: {peer / ours:.2f}x")


if __name__ == "__main__":
    main()
