"""Train a planned model under torchrun, optionally side by side with the capacity-blind plan.

    torchrun --nproc_per_node 4 examples/train.py examples/hybrid_classifier.py:build \\
        --plan out/plan.yaml --steps 30 --compare-naive

Every rank loads the same workload and plan, draws the same synthetic global batches (a seeded
generator: the "corpus" is made by the workload's ``make_batch``), and trains through
``runtime.Engine``; each rank computes only its share. With ``--compare-naive`` the same model,
from the same initial weights and on the same batches, is trained again under the naive plan
(equal shares, equal layer counts, equal shards on the same devices), and rank 0 prints both loss
curves and throughputs side by side. The emulated cluster's devices are "hardware": the plan was
made from nominal figures only.

Dynamic balancing (``--balance``, default ``exact``): the whalelike run re-plans when a device's
measured speed changes (an ``emulation.stragglers`` entry in the cluster spec makes one slow down
mid-run, e.g. ``--cluster examples/clusters/emulated-straggler.yaml``); rank 0 prints every re-plan
event as it happens, and ``--run-timeline out/run.png`` draws step times per rank with the events
(a Chrome trace goes next to it, ``.json``). The naive run never re-plans: it is the baseline.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch.distributed as dist

import planner
import runtime
import whalelike as wl
from whalelike.cli import load_workload
from whalelike.display import format_table

WARMUP_STEPS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="path/to/file.py:factory returning a whalelike.Workload with loss_fn and make_batch")
    p.add_argument("--plan", required=True, help="plan YAML written by `whalelike plan`")
    p.add_argument("--cluster", help="preset name or cluster YAML the plan was made for (default: the plan's preset)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic batches (default 0)")
    p.add_argument("--compare-naive", action="store_true", help="also train under the capacity-blind plan")
    p.add_argument("--balance", default="exact", choices=["exact", "semi", "resize", "off"],
                   help="dynamic balancing policy of the whalelike run (default exact: never approximate)")
    p.add_argument("--run-timeline", metavar="PNG", help="write step times per rank and re-plan events here "
                   "(and a Chrome trace next to it, .json)")
    return p.parse_args(argv)


def train(name: str, workload: wl.Workload, initial_state: dict, plan: planner.Plan, cluster: wl.Cluster,
          args) -> dict:
    """Train a fresh copy of the model under ``plan``; return its losses and timings (rank 0 prints)."""
    model = copy.deepcopy(workload.model)
    model.load_state_dict(initial_state)
    engine = runtime.Engine(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                            loss_fn=workload.loss_fn, cluster=cluster,
                            balance=args.balance if name == "whalelike" else "off")
    generator = torch.Generator().manual_seed(args.seed)
    losses, step_times = [], []
    show = dist.get_rank() == 0
    if show:
        print(f"\n[{name}] training {args.steps} steps of {plan.global_batch_size} samples on {plan.world_size} ranks",
              flush=True)
    for step in range(args.steps):
        batch = workload.make_batch(plan.global_batch_size, generator)
        start = time.perf_counter()
        loss = engine.train_step(batch)
        elapsed = time.perf_counter() - start
        losses.append(float(loss))
        if step >= WARMUP_STEPS:
            step_times.append(elapsed)
        if show:
            progress(step + 1, args.steps, losses[-1], elapsed, engine.stats[-1].approximate)
            if engine.replans and engine.replans[-1].step == step:
                print(f"  re-plan at {engine.replans[-1].line()}", flush=True)
    if args.run_timeline and name == "whalelike":
        from runtime.run_timeline import gather_run, write_run_png, write_run_trace

        record = gather_run(engine)
        if record is not None:
            write_run_png(record, args.run_timeline, title=f"{name}: step times per rank, policy {args.balance}")
            write_run_trace(record, args.run_timeline.rsplit(".", 1)[0] + ".json")
            print(f"  wrote {args.run_timeline} and its Chrome trace", flush=True)
    overruns = sum(s.overruns for s in engine.stats)
    segments = sum(s.segments for s in engine.stats)
    mean_step = sum(step_times) / len(step_times)
    return {"name": name, "losses": losses, "step_ms": mean_step * 1e3, "replans": len(engine.replans),
            "throughput": plan.global_batch_size / mean_step, "overruns": f"{overruns}/{segments}"}


def progress(step: int, steps: int, loss: float, elapsed: float, approximate: bool = False) -> None:
    """A bar redrawn in place on a terminal; every fifth step on its own line in a log. Losses of
    steps run with ZERO-resizing (policies semi/resize) are marked approximate."""
    done = step * 30 // steps
    line = (f"  [{'#' * done}{'.' * (30 - done)}] step {step}/{steps}  loss {loss:.4f}"
            + (" (approximate)" if approximate else "") + f"  {elapsed * 1e3:7.1f} ms")
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if step == steps else "", flush=True)
    elif step % 5 == 0 or step == steps:
        print(line, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps must exceed the {WARMUP_STEPS} warm-up steps, got {args.steps}")
    workload = load_workload(args.model)
    if workload.loss_fn is None or workload.make_batch is None:
        raise SystemExit(f"{args.model} must return a Workload with loss_fn and make_batch to train")
    plan = planner.Plan.from_yaml(args.plan)
    cluster = wl.Cluster.load(args.cluster or plan.cluster)
    initial_state = copy.deepcopy(workload.model.state_dict())
    runs = [("whalelike", plan)]
    if args.compare_naive:
        graphs = wl.capture(workload.model, workload.example_args, workload.example_kwargs)
        config = wl.Config(global_batch_size=plan.global_batch_size, num_micro_batch=plan.num_micro_batch,
                           schedule=plan.schedule)
        runs.append(("naive", planner.naive_plan(graphs, cluster, config)))
    results = [train(name, workload, initial_state, p, cluster, args) for name, p in runs]
    if dist.get_rank() == 0:
        report(results, args.steps)
    dist.destroy_process_group()


def report(results: list[dict], steps: int) -> None:
    marks = sorted({0, *range(4, steps, 5), steps - 1})
    print()
    print(format_table(["step", *(f"{r['name']} loss" for r in results)],
                       [[m + 1, *(f"{r['losses'][m]:.4f}" for r in results)] for m in marks],
                       title="loss curve"))
    print()
    print(format_table(["plan", "ms/step", "samples/s", "re-plans", "emulation overruns"],
                       [[r["name"], f"{r['step_ms']:.1f}", f"{r['throughput']:.1f}", r["replans"], r["overruns"]]
                        for r in results],
                       title=f"measured throughput (mean over steps {WARMUP_STEPS + 1}..{steps})"))
    if len(results) == 2:
        print(f"\nmeasured speed-up of the hardware-aware plan over the naive plan: "
              f"{results[0]['throughput'] / results[1]['throughput']:.2f}x")


if __name__ == "__main__":
    main()
