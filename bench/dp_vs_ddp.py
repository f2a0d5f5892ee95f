"""Data parallel on unequal devices: whalelike's uneven shares vs torch DDP with equal shares.

Both sides train the same MLP on the same data on 4 emulated devices (docs/ARCHITECTURE.md section
4) and run on the same emulation: the same kind of :class:`runtime.emulation.compute.Emulator` pads the
forward per micro-batch (hooks on the module) and the backward, and the same emulated network
(:mod:`runtime.emulation.network`) pads each DDP bucket's all-reduce to its ring time on the
cluster's :class:`planner.devices.network.NetworkModel`, overlapped with the backward bucket by bucket.
The peer is stock ``DistributedDataParallel`` with equal shares (``global_batch / 4`` each, DDP's
own averaging) wrapped by :func:`runtime.replicas.ddp_sync.wrap_ddp`, so its comm hook pads exactly as
whalelike's does; whalelike runs ``runtime.Engine`` with the plan ``planner.plan`` makes for the
cluster (the planner reads nominal ``peak_tflops``, never the emulated speeds). Both keep DDP's
default buckets.

Cases (speeds 1, 1, 0.5, 0.25 have the ideal ratio 2.75x: equal shares wait for the slowest
device, speed-proportional ones finish together):

* ``emulated-4``: one host (target >= 90% of ideal);
* ``emulated-4-equal``: 4 equal devices (target: within 5% of DDP);
* ``two-hosts``: ``examples/clusters/emulated-4-two-hosts.yaml``, the speeds of emulated-4 on 2
  hosts of 2 devices over a 1 Gb/s link, the gradient all-reduce a real part of the step (the
  output says how much, and how much of it stays exposed after the backward); target >= 95%.

The sides alternate in rounds of ``--steps`` steps and the median round is reported, so drift in
machine load hits both alike. Next to each measured step time stands the planner's prediction:
``planner.simulate`` of the plan (whalelike) and of ``planner.naive_plan`` (equal shares: DDP),
with the all-reduce overlapped in DDP's buckets (:func:`planner.schedule.gradient_buckets.gradient_buckets`).

Run (spawns 4 ranks itself)::

    .venv/bin/python bench/dp_vs_ddp.py [--base-gflops 1] [--cases two-hosts]
    # or: .venv/bin/torchrun --nproc_per_node 4 bench/dp_vs_ddp.py
    .venv/bin/python bench/dp_vs_ddp.py --smoke   # tiny sizes, seconds: checks that it runs

What is not emulated (the optimizer step, the loss, Python, the real all-reduces and the sleeps'
wake-up) costs both sides a fixed time per step on a 2-core machine (printed as "unmodeled":
~13-18 ms for DDP, ~2-5 ms more for whalelike, whose Engine also hands its progress records to a thread
and runs the straggler monitor); the ratio approaches the ideal as modeled compute grows (a larger
batch, or a lower ``base_gflops``). That is why two-hosts runs a global batch of 704 at 1 GFLOP/s
(whalelike's step ~490 ms modeled, 4x the one-host case's), and why its link is 1 Gb/s: the
all-reduce's share of the step goes as ``base_gflops / (link * samples per rank)``, so at 10 Gb/s
it would be ~0.3%, far below the unmodeled time. Each run also prints rank 0's
:func:`runtime.emulation.compute.calibrate` bound for each model, to confirm the rate in use is safe.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import planner  # noqa: E402
from planner.schedule.gradient_buckets import gradient_buckets  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.replicas.ddp_sync import wrap_ddp  # noqa: E402
from runtime.emulation.compute import Emulator, calibrate  # noqa: E402
from whalelike import Cluster, Config  # noqa: E402
from whalelike.graphs.capture import capture  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import free_port, start_method  # noqa: E402

WORLD = 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: ``cluster`` is a preset name or a cluster file (relative to the repository);
    ``batch`` the global batch (None: ``--batch``)."""

    name: str
    cluster: str
    batch: Optional[int] = None


CASES = {case.name: case for case in (
    Case("emulated-4", "emulated-4"),
    Case("emulated-4-equal", "emulated-4-equal"),
    Case("two-hosts", "examples/clusters/emulated-4-two-hosts.yaml", batch=704),
)}


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 10))


class DDPPeer:
    """Stock DDP with equal shares, padded by an Emulator of the same device and, through
    :func:`wrap_ddp`'s comm hook, by the same emulated network (bucket all-reduces overlapped
    with the backward, each padded to its ring time), exactly as whalelike's executor is."""

    def __init__(self, model: nn.Module, cluster: Cluster, rank: int, global_batch: int, flops: tuple[float, float]):
        self.emulator = Emulator.for_device(cluster, cluster.devices[rank].name, rank)
        self.emulator.pad_forward(model, flops[0])
        self.backward_flops = flops[1]
        self.ddp = wrap_ddp(model, None, self.emulator, average=True, devices=[d.name for d in cluster.devices])
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
        self.emulator.wait_deadline()        # no-op: the last bucket's hook waited for it
        self.emulator.wait_communication()   # the overlapped all-reduces' modeled end
        self.optimizer.step()
        return loss


def timed_round(side, batches) -> float:
    dist.barrier()
    start = time.perf_counter()
    for batch in batches:
        side.train_step(batch)
    dist.barrier()
    return (time.perf_counter() - start) / len(batches)


def _figures(emulator: Emulator) -> list[float]:
    """This rank's cumulative padded compute, modeled all-reduce and post-backward all-reduce wait (s)."""
    network = emulator.network.stats if emulator.network is not None else None
    return [emulator.stats.padded_s, network.allreduce_modeled_s if network else 0.0,
            network.allreduce_waited_s if network else 0.0, float(emulator.stats.overruns)]


def _per_rank(values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(WORLD)]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]


def predictions(graphs, cluster: Cluster, config: Config, plan) -> dict:
    """The simulator's step of whalelike's plan and of the equal-shares plan, the all-reduce
    overlapped in DDP's buckets: step time, and the all-reduce's exposed (after the compute) and
    hidden parts on the worker that computes longest (ms)."""
    naive = planner.naive_plan(graphs, cluster, config)
    out = {}
    for side, p in (("ddp", naive), ("whalelike", plan)):
        sim = planner.simulate(p, record_events=False, buckets=gradient_buckets(p, graphs, cluster))
        slowest = max(sim.workers, key=lambda w: w.compute_ms)
        out[side] = {"step_ms": sim.step_time_ms, "exposed_ms": slowest.allreduce_ms,
                     "hidden_ms": slowest.hidden_allreduce_ms}
    return out


def bench_case(case: Case, args, rank: int) -> dict:
    cluster = Cluster.load(os.path.join(ROOT, case.cluster) if case.cluster.endswith(".yaml") else case.cluster)
    if args.base_gflops is not None:  # both sides, same modeled device rates
        cluster = dataclasses.replace(cluster, emulation=dataclasses.replace(cluster.emulation, base_gflops=args.base_gflops))
    batch_size = case.batch or args.batch
    speeds = [d.emulated_speed for d in cluster.devices]
    model = make_model(args.width)
    example = (torch.randn(8, 64),)
    graphs = capture(model, example)
    flops = (sum(g.forward_flops for g in graphs), sum(g.backward_flops for g in graphs))
    config = Config(global_batch_size=batch_size, num_micro_batch=1)
    plan = planner.plan(graphs, cluster, config)
    g = torch.Generator().manual_seed(1)
    batches = [((torch.randn(batch_size, 64, generator=g),), torch.randint(0, 10, (batch_size,), generator=g))
               for _ in range(args.steps)]
    smallest = min(b for w in plan.workers for b in w.micro_batch_sizes)
    (x,), y = batches[0]
    calibration = calibrate(make_model(args.width), (x[:smallest],), y[:smallest], F.cross_entropy, speeds, WORLD)
    ours = Engine(make_model(args.width), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                  loss_fn=F.cross_entropy, cluster=cluster, example_args=example, timeout_s=120)
    peer = DDPPeer(make_model(args.width), cluster, rank, batch_size, flops)
    for side in (peer, ours):  # warm-up: DDP's bucket rebuild, allocator, first all-reduce
        timed_round(side, batches[:2])
    times = {"ddp": [], "whalelike": []}
    before = {"ddp": _figures(peer.emulator), "whalelike": _figures(ours.emulator)}
    for _ in range(args.rounds):
        times["ddp"].append(timed_round(peer, batches))
        times["whalelike"].append(timed_round(ours, batches))
    steps = args.rounds * args.steps
    figures = {}
    for side, emulator in (("ddp", peer.emulator), ("whalelike", ours.emulator)):
        delta = [now - then for now, then in zip(_figures(emulator), before[side])]
        figures[side] = _per_rank(delta)
    result = {
        "case": case.name, "cluster": cluster.name, "batch": batch_size,
        "network": cluster.network, "hosts": len(cluster.hosts),
        "ideal": sum(speeds) / (len(speeds) * min(speeds)),
        "shares": [ours.plan.worker(r).batch_share for r in range(WORLD)],
        "predicted_ms": predictions(graphs, cluster, config, plan),
        "ddp_s": statistics.median(times["ddp"]),
        "whalelike_s": statistics.median(times["whalelike"]),
        "base_gflops": cluster.emulation.base_gflops,
        "calibration": calibration,
        # per side, per rank, per timed step: padded compute, modeled all-reduce, its exposed part
        "per_step_ms": {side: [[v * 1e3 / steps for v in rank_values[:3]] for rank_values in values]
                        for side, values in figures.items()},
        "overruns": {side: int(sum(rank_values[3] for rank_values in values)) for side, values in figures.items()},
    }
    return result


def report(results: list[dict], args) -> None:
    print(f"\ndata parallel, 4 emulated ranks, MLP width {args.width}, "
          f"median of {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}")
    header = f"{'case':17} {'batch':>5} {'shares':>14} {'DDP ms':>7} {'pred':>7} {'ours ms':>7} {'pred':>7} " \
             f"{'ratio':>6} {'pred':>6} {'ideal':>6} {'of ideal':>8} {'overruns':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = r["ddp_s"] / r["whalelike_s"]
        predicted = r["predicted_ms"]
        print(f"{r['case']:17} {r['batch']:5d} {'/'.join(map(str, r['shares'])):>14} {r['ddp_s'] * 1e3:7.1f} "
              f"{predicted['ddp']['step_ms']:7.1f} {r['whalelike_s'] * 1e3:7.1f} {predicted['whalelike']['step_ms']:7.1f} "
              f"{ratio:5.2f}x {predicted['ddp']['step_ms'] / predicted['whalelike']['step_ms']:5.2f}x {r['ideal']:5.2f}x "
              f"{ratio / r['ideal']:7.1%} {r['overruns']['ddp']:>4}/{r['overruns']['whalelike']:<4}")
    print("pred: the planner's simulated step (DDP: planner.naive_plan, equal shares; ours: planner.plan), "
          "all-reduce overlapped in DDP's buckets.")
    for r in results:
        net = r["network"]
        print(f"{r['case']}: cluster {r['cluster']} on {r['hosts']} host(s), {net.intra_host_gbps:g} GB/s within a "
              f"host, {net.inter_host_gbps:g} GB/s between hosts; base_gflops {r['base_gflops']:g}; "
              f"rank 0 calibration: {r['calibration']}")
        for side, label in (("ddp", "DDP"), ("whalelike", "ours")):
            per_rank = r["per_step_ms"][side]
            step_ms = r[f"{side}_s"] * 1e3
            compute = max(values[0] for values in per_rank)   # the slowest rank's padded compute
            allreduce = per_rank[0][1]                         # the same ring costs on every rank
            waited = statistics.mean(values[2] for values in per_rank)
            predicted = r["predicted_ms"][side]
            print(f"  {label:4} per step: compute {compute:6.1f} ms (slowest rank, padded), all-reduce {allreduce:5.1f} "
                  f"ms modeled ({allreduce / step_ms:5.1%} of the step; predicted {predicted['hidden_ms']:.1f} ms "
                  f"hidden in the backward, {predicted['exposed_ms']:.1f} exposed), waited for after the backward "
                  f"{waited:4.1f} ms; unmodeled {step_ms - compute - waited:5.1f} ms")
    print("ratio = DDP step time / whalelike step time; targets: >= 90% of ideal at speeds 1/1/0.5/0.25 on one "
          "host, >= 95% on two hosts, >= 95% with equal speeds.\noverruns: segments whose real compute exceeded the "
          "modeled time (DDP/whalelike, all ranks); non-zero means the machine was too loaded for the calibration.")
    print("headline: " + "; ".join(
        f"{r['case']} {r['ddp_s'] / r['whalelike_s']:.2f}x = {r['ddp_s'] / r['whalelike_s'] / r['ideal']:.1%} "
        f"of the ideal {r['ideal']:.2f}x" for r in results))


def run(rank: int, args) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    results = [bench_case(CASES[name], args, rank) for name in args.cases]
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
                        help="global batch of the one-host cases (352 = 2.75 x 128: exact ideal shares; large "
                             "enough that modeled compute dominates the real all-reduce and optimizer time); "
                             "two-hosts always uses 704 (= 2.75 x 256)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--base-gflops", type=float, default=None,
                        help="override the clusters' emulation.base_gflops (lower = longer modeled steps, "
                             "fewer overruns on a loaded machine)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                        help="which comparisons to run (default: all)")
    args = parse_args(parser, smoke=dict(width=32, batch=44, steps=1, rounds=1, base_gflops=0.1))
    if "RANK" in os.environ:  # under torchrun
        run(int(os.environ["RANK"]), args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))   # not a fixed port: two runs may overlap
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_spawned, args=(args,), nprocs=WORLD, join=True, start_method=start_method())


if __name__ == "__main__":
    main()
