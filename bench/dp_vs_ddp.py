"""Data parallel on unequal devices: whalelike's uneven shares vs torch DDP with equal shares.

Both sides train the same MLP on the same data on 4 emulated devices (docs/ARCHITECTURE.md section 4), and
both are padded by the same kind of :class:`runtime.emulation.Emulator` (forward per micro-batch via
hooks on the module, backward up to the comm hook), so the comparison is fair: the peer is stock
``DistributedDataParallel`` with equal shares (``global_batch / 4`` each) whose comm hook only
waits for the backward's modeled end before its usual averaging all-reduce. whalelike runs
``runtime.Engine`` with the plan ``planner.plan`` makes for the cluster (the planner reads nominal
``peak_tflops``, never the emulated speeds).

Clusters: ``emulated-4`` (speeds 1, 1, 0.5, 0.25: ideal ratio 2.75x; target >= 90% of ideal) and
``emulated-4-equal`` (target: within 5% of DDP). The sides alternate in rounds of ``--steps`` steps
and the median round is reported, so drift in machine load hits both alike.

Run (spawns 4 ranks itself)::

    .venv/bin/python bench/dp_vs_ddp.py [--base-gflops 1]
    # or: .venv/bin/torchrun --nproc_per_node 4 bench/dp_vs_ddp.py

What is not emulated (the gradient all-reduce, the optimizer step, Python) costs both sides the same
fixed ~20 ms per step on a 2-core machine; the ratio approaches the ideal as modeled compute grows
(``--batch`` up, or ``--base-gflops`` down). Each run also prints rank 0's
:func:`runtime.emulation.calibrate` bound for this model, to confirm the rate in use is safe.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import planner  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.data_parallel import wrap_ddp  # noqa: E402
from runtime.emulation import Emulator, calibrate  # noqa: E402
from whalelike import Cluster, Config  # noqa: E402
from whalelike.capture import capture  # noqa: E402

WORLD = 4


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 10))


class DDPPeer:
    """Plain DDP with equal shares, padded by an Emulator of the same device."""

    def __init__(self, model: nn.Module, cluster: Cluster, rank: int, global_batch: int, flops: tuple[float, float]):
        self.emulator = Emulator.for_device(cluster, cluster.devices[rank].name, rank)
        self.emulator.pad_forward(model, flops[0])
        self.backward_flops = flops[1]
        self.ddp = wrap_ddp(model, None, self.emulator, average=True)
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3)
        self.share = global_batch // WORLD
        self.rank = rank

    def train_step(self, batch) -> torch.Tensor:
        (x,), y = batch
        lo = self.rank * self.share
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.ddp(x[lo:lo + self.share]), y[lo:lo + self.share])
        self.emulator.begin(self.backward_flops * self.share, self.share)
        loss.backward()
        self.emulator.wait_deadline()
        self.optimizer.step()
        return loss


def timed_round(side, batches) -> float:
    dist.barrier()
    start = time.perf_counter()
    for batch in batches:
        side.train_step(batch)
    dist.barrier()
    return (time.perf_counter() - start) / len(batches)


def overruns(emulator: Emulator) -> int:
    t = torch.tensor([emulator.stats.overruns])
    dist.all_reduce(t)
    return int(t.item())


def bench_cluster(name: str, args, rank: int) -> dict:
    cluster = Cluster.preset(name)
    if args.base_gflops is not None:  # both sides, same modeled device rates
        cluster = dataclasses.replace(cluster, emulation=dataclasses.replace(cluster.emulation, base_gflops=args.base_gflops))
    speeds = [d.emulated_speed for d in cluster.devices]
    model = make_model(args.width)
    example = (torch.randn(8, 64),)
    graphs = capture(model, example)
    flops = (sum(g.forward_flops for g in graphs), sum(g.backward_flops for g in graphs))
    plan = planner.plan(graphs, cluster, Config(global_batch_size=args.batch, num_micro_batch=1))
    g = torch.Generator().manual_seed(1)
    batches = [((torch.randn(args.batch, 64, generator=g),), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(args.steps)]
    smallest = min(b for w in plan.workers for b in w.micro_batch_sizes)
    (x,), y = batches[0]
    calibration = calibrate(make_model(args.width), (x[:smallest],), y[:smallest], F.cross_entropy, speeds, WORLD)
    ours = Engine(make_model(args.width), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                  loss_fn=F.cross_entropy, cluster=cluster, example_args=example, timeout_s=120)
    peer = DDPPeer(make_model(args.width), cluster, rank, args.batch, flops)
    for side in (peer, ours):  # warm-up: DDP's bucket rebuild, allocator, first all-reduce
        timed_round(side, batches[:2])
    times = {"ddp": [], "whalelike": []}
    for _ in range(args.rounds):
        times["ddp"].append(timed_round(peer, batches))
        times["whalelike"].append(timed_round(ours, batches))
    return {
        "cluster": name,
        # equal shares wait for the slowest device; speed-proportional shares finish together
        "ideal": sum(speeds) / (len(speeds) * min(speeds)),
        "shares": [w.batch_share for w in plan.workers],
        "predicted_ms": plan.prediction.step_time_ms,
        "ddp_s": statistics.median(times["ddp"]),
        "whalelike_s": statistics.median(times["whalelike"]),
        "base_gflops": cluster.emulation.base_gflops,
        "calibration": calibration,
        "overruns": {"ddp": overruns(peer.emulator), "whalelike": overruns(ours.emulator)},
    }


def report(results: list[dict], args) -> None:
    print(f"\ndata parallel, 4 emulated ranks, MLP width {args.width}, global batch {args.batch}, "
          f"base_gflops {args.base_gflops or 'of the presets'}, "
          f"median of {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
    header = f"{'cluster':18} {'shares':>14} {'DDP ms':>8} {'ours ms':>8} {'DDP s/s':>8} {'ours s/s':>8} " \
             f"{'ratio':>6} {'ideal':>6} {'of ideal':>8} {'overruns':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r["ddp_s"] / r["whalelike_s"]
        ideal = r["ideal"]
        print(f"{r['cluster']:18} {'/'.join(map(str, r['shares'])):>14} {r['ddp_s'] * 1e3:8.1f} "
              f"{r['whalelike_s'] * 1e3:8.1f} {args.batch / r['ddp_s']:8.1f} {args.batch / r['whalelike_s']:8.1f} "
              f"{ratio:5.2f}x {ideal:5.2f}x {ratio / ideal:7.1%} "
              f"{r['overruns']['ddp']:>4}/{r['overruns']['whalelike']:<4}")
    for r in results:
        print(f"{r['cluster']}: base_gflops {r['base_gflops']:g}; rank 0 calibration: {r['calibration']}")
    print("ratio = DDP step time / whalelike step time; targets: >= 90% of ideal at speeds 1/1/0.5/0.25, "
          ">= 95% with equal speeds.\noverruns: segments whose real compute exceeded the modeled time "
          "(DDP/whalelike, all ranks); non-zero means the machine was too loaded for the calibration.")


def run(rank: int, args) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    results = [bench_cluster(name, args, rank) for name in ("emulated-4", "emulated-4-equal")]
    if rank == 0:
        report(results, args)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    run(rank, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512, help="MLP hidden width")
    parser.add_argument("--batch", type=int, default=352,
                        help="global batch (352 = 2.75 x 128: exact ideal shares; large enough that modeled "
                             "compute dominates the real all-reduce and optimizer time)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--base-gflops", type=float, default=None,
                        help="override the presets' emulation.base_gflops (lower = longer modeled steps, "
                             "fewer overruns on a loaded machine)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_spawned, args=(args,), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
