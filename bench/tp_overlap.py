"""Tensor-parallel communication overlapped with compute: the column-parallel input-gradient all-reduce.

In a column/row MLP block under ``split`` (Megatron-LM), the backward of the column layer (fc1)
computes dX, all-reduces it over the tensor-parallel group, and computes dW. whalelike launches
the all-reduce right after dX and computes dW while it runs (``ColumnParallelLinear``'s default,
``runtime.tensor.layers._ColumnParallelMatmul``); the peer is the same layers with
``overlap_input_grad = False``: the all-reduce after the local backward (``copy_to_region``, as
DTensor's ``ColwiseParallel`` and Megatron's synchronous mode do). Same numbers on both sides
(checked: equal losses and gradients).

Two gloo ranks on two emulated hosts (``runtime.emulation.network``): every local matmul is a
compute segment padded to its modeled time (``runtime.emulation.compute``), every tensor-parallel
collective to its ring time on the link between the hosts, the asynchronous one from the latest
member's launch. Sizes are chosen so one matmul and one all-reduce of the activations take
comparable modeled time (tens of ms), the regime where the overlap shows; the forward's
row-parallel all-reduce cannot overlap anything in this block and stays on both sides. The sides
alternate in rounds; medians are reported, with the modeled expectation of each side.

    .venv/bin/python bench/tp_overlap.py [--blocks 2 --tokens 256 --d 512 --steps 3 --rounds 3]
    .venv/bin/python bench/tp_overlap.py --smoke   # tiny sizes, seconds: checks that it runs
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

from planner.devices.network import NetworkModel  # noqa: E402
from runtime.emulation.compute import Emulator  # noqa: E402
from runtime.emulation.network import NetworkEmulator, price_group  # noqa: E402
from runtime.tensor.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from whalelike.cluster import Emulation  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, seconds_per_step, spawn_ranks  # noqa: E402

WORLD = 2
DEVICES = {"d0": "host-a", "d1": "host-b"}


def network_model(args) -> NetworkModel:
    return NetworkModel(args.intra_gbps, args.inter_gbps, args.latency_us, DEVICES)


class Blocks(nn.Module):
    """``blocks`` column/row MLP pairs (d -> 4d -> d) with a residual, sharded evenly over the group."""

    def __init__(self, d: int, blocks: int, rank: int, emulator: Emulator, overlap: bool):
        super().__init__()
        torch.manual_seed(0)
        full = [(nn.Linear(d, 4 * d), nn.Linear(4 * d, d)) for _ in range(blocks)]
        half = [2 * d, 2 * d]
        self.pairs = nn.ModuleList()
        for fc1, fc2 in full:
            column = ColumnParallelLinear(fc1, half, rank, dist.group.WORLD, gather_output=False, emulator=emulator)
            column.overlap_input_grad = overlap
            self.pairs.append(nn.ModuleList([column, RowParallelLinear(fc2, half, rank, dist.group.WORLD, emulator=emulator)]))

    def forward(self, x):
        for fc1, fc2 in self.pairs:
            x = x + fc2(torch.tanh(fc1(x)))
        return x


def _rank(rank: int, init_file: str, args, results) -> None:
    os.environ.setdefault("TORCHELASTIC_RUN_ID", f"tp-overlap-{os.getppid()}")   # one NIC ledger for both ranks
    with process_group(rank, init_file, WORLD):
        network = NetworkEmulator(network_model(args), f"d{rank}")
        price_group(dist.group.WORLD, network, list(DEVICES))
        emulator = Emulator(1.0, Emulation(base_gflops=args.base_gflops), rank, network=network)
        sides = {"overlap": Blocks(args.d, args.blocks, rank, emulator, True),
                 "after": Blocks(args.d, args.blocks, rank, emulator, False)}
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.tokens, args.d, generator=g)
        target = torch.randn(args.tokens, args.d, generator=g)
        x.requires_grad_(True)   # the block's input needs its gradient, as inside a model

        def step(model):
            model.zero_grad(set_to_none=True)
            x.grad = None
            loss = (model(x) - target).pow(2).mean()
            loss.backward()
            return loss.detach()

        exact = {name: (step(m), x.grad.clone(), [p.grad.clone() for p in m.parameters()]) for name, m in sides.items()}
        times = {name: [] for name in sides}
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for name in order:
                times[name].append(seconds_per_step(lambda m=sides[name]: step(m), args.steps))
        if rank == 0:
            results["times"] = {name: statistics.median(t) for name, t in times.items()}
            results["exact"] = exact
            results["stats"] = (emulator.stats.overruns, emulator.stats.segments)
        network.close()


def modeled_ms(args) -> dict:
    """The modeled step time of each side: matmuls at ``base_gflops``, all-reduces of the
    activations (tokens x d float32) at their ring time between the two hosts."""
    matmul = 2.0 * args.tokens * args.d * (2 * args.d) / (args.base_gflops * 1e9) * 1e3   # a local shard's matmul
    allreduce = network_model(args).ring(list(DEVICES)).allreduce_ms(args.tokens * args.d * 4)
    forward = 2 * matmul + allreduce
    after = 4 * matmul + allreduce                  # fc2 dX, dW; fc1 dX, dW; then fc1's dX all-reduce
    overlap = 3 * matmul + max(matmul, allreduce)   # fc1's dX all-reduce under its dW
    return {"after": args.blocks * (forward + after), "overlap": args.blocks * (forward + overlap),
            "matmul": matmul, "allreduce": allreduce}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base-gflops", type=float, default=5.0)
    parser.add_argument("--inter-gbps", type=float, default=0.01, help="GB/s between the two hosts")
    parser.add_argument("--intra-gbps", type=float, default=1.0)
    parser.add_argument("--latency-us", type=float, default=50.0)
    args = parse_args(parser, smoke=dict(blocks=1, tokens=16, d=32, steps=1, rounds=1, base_gflops=0.02))
    model = modeled_ms(args)
    print(f"tensor parallel over 2 emulated hosts: {args.blocks} column/row MLP blocks d {args.d} -> {4 * args.d}, "
          f"{args.tokens} tokens, even shards; one local matmul {model['matmul']:.1f} ms modeled, one activation "
          f"all-reduce {model['allreduce']:.1f} ms ({args.inter_gbps:g} GB/s between the hosts)")
    out = spawn_ranks(_rank, args, WORLD)
    (loss_o, dx_o, grads_o), (loss_a, dx_a, grads_a) = out["exact"]["overlap"], out["exact"]["after"]
    exact = bool(torch.equal(loss_o, loss_a) and torch.equal(dx_o, dx_a)
                 and all(torch.equal(a, b) for a, b in zip(grads_o, grads_a)))
    times = {name: seconds * 1e3 for name, seconds in out["times"].items()}
    overruns, segments = out["stats"]
    print(f"{'side':42s} {'measured':>9s} {'modeled':>9s}")
    print(f"{'peer: all-reduce after the local backward':42s} {times['after']:8.1f}ms {model['after']:8.1f}ms")
    print(f"{'whalelike: all-reduce under the dW matmul':42s} {times['overlap']:8.1f}ms {model['overlap']:8.1f}ms")
    print(f"same loss, input gradient and parameter gradients on both sides: {'yes' if exact else 'NO'}; "
          f"overruns {overruns}/{segments} segments on rank 0")
    print(f"headline: overlapping the column-parallel input-gradient all-reduce is {times['after'] / times['overlap']:.2f}x "
          f"faster than all-reduce after the backward (modeled {model['after'] / model['overlap']:.2f}x); exact: "
          f"{'yes' if exact else 'no'}")


if __name__ == "__main__":
    main()
