"""Uneven tensor parallelism (whalelike) vs DTensor ColwiseParallel/RowwiseParallel, on emulated devices.

Workload: one transformer MLP block ``fc1 (d -> 4d), GELU, fc2 (4d -> d)`` sharded Megatron-style
over 2 gloo ranks on CPU, its input requiring grad as inside a real network, SGD steps.

* peer: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` on fc1 and
  ``RowwiseParallel`` on fc2 over ``DeviceMesh("cpu")``. DTensor can only split the 4d hidden
  dimension in equal halves.
* whalelike: :class:`runtime.tensor.layers.ColumnParallelLinear` + :class:`RowParallelLinear` with the
  hidden dimension split proportionally to the device speeds (largest remainder).

Fair emulation (docs/ARCHITECTURE.md section 4). Both sides run the real computation and each rank pads every
local matmul, forward and backward, to its modeled time on the emulated device with the same
:class:`runtime.emulation.compute.Emulator` (FLOPs of the *local* shard: ``2 * rows * in_local * out_local``
forward, twice that backward). whalelike does it inside its local-matmul autograd functions (a
column layer pads its backward as two segments, dX then dW, so its input-gradient all-reduce can
overlap dW); the bench checks that both sides padded the same FLOPs, summed over the ranks. For
DTensor the same pads are attached to the parallelized modules with hooks placed so that no
segment spans a collective:

* forward: a pre-hook (prepended, before DTensor's input redistribution, which is communication-free
  for these layouts) starts the segment; a forward hook *prepended before* DTensor's output hook
  (where RowwiseParallel all-reduces its partial sums) ends it;
* backward: a full backward pre-hook (gradient of the module output ready) starts the segment and a
  full backward hook (gradient of the module input computed, before ColwiseParallel's input
  all-reduce in ``from_local``'s backward) ends it.

The overrun counts printed per side show whether real compute (or an accidental wait) exceeded the
modeled time; with the hooks above they stay at zero on a quiet machine. The two sides alternate in
rounds and the median step time per side is reported, to share the machine's noise fairly.

    .venv/bin/python bench/tp_vs_dtensor.py [--steps 10 --rounds 3 --dim 512 --batch 32 --base-gflops 1]
    .venv/bin/python bench/tp_vs_dtensor.py --smoke   # tiny sizes, seconds: checks that it runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.emulation.compute import EmulationStats, Emulator  # noqa: E402
from runtime.tensor.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from whalelike.cluster import Emulation  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, seconds_per_step, spawn_ranks  # noqa: E402

WORLD = 2
SCENARIOS = {"equal speeds 1, 1": (1.0, 1.0), "speeds 1, 0.5": (1.0, 0.5)}


def proportional_sizes(total: int, speeds) -> list[int]:
    """Split ``total`` proportionally to ``speeds`` (largest remainder, every share >= 1)."""
    exact = [total * s / sum(speeds) for s in speeds]
    sizes = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def mlp(dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


def emulate_dtensor_linear(module: nn.Linear, emulator: Emulator) -> None:
    """Pad the local matmul of a DTensor-parallelized Linear, forward and backward (see module doc)."""
    local_weight = module.weight.to_local()
    unit = {}

    def forward_start(mod, args):
        x = args[0]
        unit["flops"] = 2.0 * (x.numel() // x.shape[-1]) * local_weight.shape[0] * local_weight.shape[1]
        unit["samples"] = x.shape[0]
        emulator.begin(unit["flops"], unit["samples"])

    def forward_end(mod, args, output):
        emulator.wait_deadline()

    def backward_start(mod, grad_output):
        emulator.begin(2 * unit["flops"], unit["samples"])

    def backward_end(mod, grad_input, grad_output):
        emulator.wait_deadline()

    module.register_forward_pre_hook(forward_start, prepend=True)
    module.register_forward_hook(forward_end, prepend=True)
    module.register_full_backward_pre_hook(backward_start)
    module.register_full_backward_hook(backward_end)


def build_dtensor(dim: int, emulator: Emulator) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    model = parallelize_module(mlp(dim), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    emulate_dtensor_linear(model[0], emulator)
    emulate_dtensor_linear(model[2], emulator)
    return model


def build_whalelike(dim: int, emulator: Emulator, speeds, rank: int) -> nn.Module:
    full = mlp(dim)
    sizes = proportional_sizes(4 * dim, speeds)
    return nn.Sequential(
        ColumnParallelLinear(full[0], sizes, rank, gather_output=False, emulator=emulator),
        nn.GELU(),
        RowParallelLinear(full[2], sizes, rank, emulator=emulator),
    )


def train_step(model: nn.Module, opt, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
        for scenario, speeds in SCENARIOS.items():
            emulators = {side: Emulator(speeds[rank], Emulation(base_gflops=args.base_gflops), rank)
                         for side in ("dtensor", "whalelike")}
            models = {"dtensor": build_dtensor(args.dim, emulators["dtensor"]),
                      "whalelike": build_whalelike(args.dim, emulators["whalelike"], speeds, rank)}
            opts = {side: torch.optim.SGD(m.parameters(), lr=1e-3) for side, m in models.items()}
            times = {side: [] for side in models}
            for side in models:  # warm-up (DTensor caches its sharding propagation)
                seconds_per_step(lambda: train_step(models[side], opts[side], x), 2)
                emulators[side].stats = EmulationStats()
            for _ in range(args.rounds):
                for side in models:
                    times[side].append(seconds_per_step(lambda: train_step(models[side], opts[side], x), args.steps))
            stats = {side: (e.stats.segments, e.stats.overruns, e.stats.flops) for side, e in emulators.items()}
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, stats)
            if rank == 0:
                results[scenario] = {"speeds": speeds, "sizes": proportional_sizes(4 * args.dim, speeds),
                                     "times": times, "stats": gathered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    parser.add_argument("--dim", type=int, default=512, help="model dimension d (hidden 4d)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--base-gflops", type=float, default=1.0, help="emulated GFLOP/s of a speed-1 device")
    args = parse_args(parser, smoke=dict(steps=2, rounds=1, dim=64, batch=8, base_gflops=0.02))

    results = spawn_ranks(worker, args, WORLD)

    print(f"MLP block d={args.dim} (hidden {4 * args.dim}), batch {args.batch}, {WORLD} gloo ranks, "
          f"emulated base {args.base_gflops} GFLOP/s, {args.rounds} rounds x {args.steps} steps per side")
    print(f"{'scenario':<20}{'DTensor ms/step':>17}{'whalelike ms/step':>19}{'whalelike shards':>18}"
          f"{'speed-up':>10}{'overruns D/W':>14}")
    for scenario, r in results.items():
        dtensor = statistics.median(r["times"]["dtensor"]) * 1e3
        ours = statistics.median(r["times"]["whalelike"]) * 1e3
        # Fairness: both sides must pad the same modeled matmul work. Not the same number of segments:
        # whalelike's column layers pad a backward as two segments (dX, then dW, so the input-gradient
        # all-reduce can overlap dW) where the DTensor hooks pad one; the FLOPs summed over the ranks
        # are the same for any split of the hidden dimension.
        segments = {side: sum(s[side][0] for s in r["stats"]) for side in ("dtensor", "whalelike")}
        flops = {side: sum(s[side][2] for s in r["stats"]) for side in ("dtensor", "whalelike")}
        if flops["dtensor"] <= 0 or abs(flops["dtensor"] - flops["whalelike"]) > 1e-6 * flops["dtensor"]:
            raise RuntimeError(f"{scenario}: the sides padded different modeled work: FLOPs {flops} in "
                               f"segments {segments}; the DTensor emulation hooks did not fire as expected")
        overruns = "/".join(str(sum(s[side][1] for s in r["stats"])) for side in ("dtensor", "whalelike"))
        print(f"{scenario:<20}{dtensor:>17.1f}{ours:>19.1f}{str(r['sizes']):>18}{dtensor / ours:>9.2f}x{overruns:>14}")


if __name__ == "__main__":
    main()
