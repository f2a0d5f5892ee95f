"""A shares-only re-plan of a pipeline: adopted in place against rebuilding the executor, side by side.

Workloads (``--model``), each on the built-in emulated 4-device cluster, 4 gloo ranks on CPU,
planned as a ``replicate(2)`` stage (the two slower devices) feeding a
``split(2)`` one (the two fast ones):

* ``hf_gpt2`` (default): ``examples/hf_gpt2.py``, a ``transformers`` GPT-2 annotated by path, its
  first blocks (with the embeddings) replicated, the last blocks and the tied LM head split; a
  global batch of 16 in 4 micro-batches;
* ``demo``: ``make demo``'s model (``examples/hybrid_classifier.py``, a convolutional feature
  extractor feeding a 20,000-class classifier), as ``bench/checkpoint_cost.py`` runs it; a global
  batch of 64 in 4 micro-batches.

Plan A is the planner's hardware-aware plan with two devices a stage
(``best_aware_plan(..., counts={0: 2, 1: 2})``; ``planner.plan`` itself gives the split head a third
device); :func:`planner.balance.replan.rebalance` with the replicated stage's
first device measured 3x slower makes plan B, which differs only in that stage's micro-batch sizes
(the re-plan the straggler monitor makes for a stage's data-parallel group; every part was allowed
to change).

Both sides train the same model from the same weights on the same batches, alternating step by
step, and switch A -> B -> A ... at the same steps (every ``--every`` steps):

* **in place** (issue 21 item 7): ``Engine.apply_plan`` asks the executor, which takes the plan in
  place (:meth:`runtime.parallel.pipeline.PipelineExecutor.set_plan`: sample ranges, schedule,
  boundary layout and the stage worker's figures derived again; modules, syncs, optimizer kept);
* **rebuild** (what ``Engine.apply_plan`` did before for every pipeline plan): the new plan's
  executor is built and the state moved by :func:`runtime.state.transfer.switch_executor`
  (which moves nothing here, but splits the graph, analyses and shards the split stage, wraps DDP
  and plans the boundaries again).

Each switch and each step is timed on rank 0 from a barrier to the barrier after it. The cost of
a re-plan is the switch plus what the first step after it takes beyond a steady step of the same
plan (the median of that plan's steps that follow no switch): lazily planned boundary
reshardings, the value specs' fake run, DDP's first iteration. Medians, since the machine is
shared. Both sides' losses must agree (``torch.testing.assert_close``): the two paths are equally
exact.

Run (spawns 4 ranks itself, about a minute each)::

    .venv/bin/python bench/pipeline_shares.py [--model hf_gpt2|demo --switches 8 --every 3]
    .venv/bin/python bench/pipeline_shares.py --smoke   # a small model, seconds: checks that it runs

The last line states the headline: the switch in place and rebuilding, and the re-plan's whole
cost in steps.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys

import torch
from torch.testing import assert_close

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import whalelike as wl  # noqa: E402
from planner.balance.replan import plan_changes, rebalance  # noqa: E402
from planner.devices.placement_search import best_aware_plan  # noqa: E402
from planner.devices.cost_model import device_tflops  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.distributed import MeasuredOnce, from_rank0  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, spawn_ranks, timed  # noqa: E402
from whalelike.cli import load_workload  # noqa: E402

WORLD = 4
SIDES = ("in place", "rebuild")
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
# --model: the example factory and the global batch and micro-batch count it trains with; --smoke: build()'s
# sizes of a small model that plans the same shape (a replicate(2) stage feeding a split(2) one)
MODELS = {"demo": ("hybrid_classifier.py:build", 64, 4, dict(num_classes=2000, width=8, image_size=16, feature_dim=32)),
          "hf_gpt2": ("hf_gpt2.py:build", 16, 4, dict(n_layer=2, d_model=32, n_head=2))}


def rebuild(engine: Engine, plan) -> None:
    """``Engine.apply_plan`` as it was for every pipeline plan: build the plan's executor and move
    the state (nothing, here) with ``switch_executor``."""
    runtime = engine.runtime.with_plan(plan)
    engine.slot.apply(runtime, in_place=False)
    engine.runtime = runtime


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        factory, global_batch, micro_batches, smoke_sizes = MODELS[args.model]
        if args.smoke:   # the same example's build() at small sizes (the full-size model is never built)
            sys.path.insert(0, EXAMPLES)
            workload = getattr(__import__(factory.split(".py")[0]), "build")(**smoke_sizes)
        else:
            workload = load_workload(os.path.join(EXAMPLES, factory))
        cluster = wl.Cluster.preset("emulated-4")
        with MeasuredOnce(rank) as share:   # every rank traces; rank 0 measures (and plans, below) for all
            graphs = wl.capture(workload.model, workload.example_args, share=share)

        def plans():
            # the planner's hardware-aware plan with two devices a stage (the split by work): what the bench
            # re-plans is a data-parallel stage's shares (planner.plan's search of the devices per stage gives
            # these models' split head a third device and leaves the replicated stage one, whose shares cannot move)
            config = wl.Config(global_batch_size=global_batch, num_micro_batch=micro_batches)
            prediction, first = best_aware_plan(graphs, cluster, config, counts={0: 2, 1: 2})
            first = dataclasses.replace(first, prediction=prediction)
            slow = first.stage_workers(0)[0].rank   # the feature stage's first device, measured 3x slower
            speeds = [device_tflops(cluster.devices[w.rank], first.precision) * 1e12 / (3 if w.rank == slow else 1)
                      for w in first.workers]
            slowed = rebalance(first, graphs, cluster, speeds)
            changes = plan_changes(first, slowed)
            if changes.kinds != {"shares"}:
                raise RuntimeError(f"the re-plan for rank {slow} slowed 3x changes {sorted(changes.kinds)}, not only "
                                   f"shares: {changes.describe()}")
            return first, slowed, changes, slow

        first, slowed, changes, slow = from_rank0(plans, rank)
        generator = torch.Generator().manual_seed(0)
        batches = [workload.make_batch(global_batch, generator) for _ in range(args.every * (args.switches + 1))]
        engines = {side: Engine(copy.deepcopy(workload.model), first, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                loss_fn=workload.loss_fn, cluster=cluster, timeout_s=300, balance="off")
                   for side in SIDES}
        executors = {side: [] for side in SIDES}
        runs = {side: {"losses": [], "steps": [], "switches": []} for side in SIDES}
        for step, batch in enumerate(batches):
            for side, engine in engines.items():
                if step and step % args.every == 0:
                    plan = slowed if (step // args.every) % 2 else first
                    apply = (lambda: engine.apply_plan(plan)) if side == "in place" else (lambda: rebuild(engine, plan))
                    runs[side]["switches"].append(timed(apply))
                box = []
                runs[side]["steps"].append(timed(lambda: box.append(float(engine.train_step(batch)))))
                executors[side].append(id(engine.executor))   # built by the first step
                runs[side]["losses"].append(box[0])
        for step, (a, b) in enumerate(zip(runs["in place"]["losses"], runs["rebuild"]["losses"])):
            assert_close(a, b, msg=lambda m: f"step {step}: in place and rebuilt losses differ: {m}")
        if rank == 0:
            results.update(runs=runs, kept=len(set(executors["in place"])) == 1,
                           rebuilt=len(set(executors["rebuild"])) - 1, changes=changes.describe().replace("\n", "; "),
                           sizes=[(w.rank, w.stage, w.micro_batch_sizes) for w in first.workers],
                           strategies=[s.strategy for s in first.stages], slow=slow,
                           batch=(global_batch, micro_batches))


def cost(run: dict, every: int) -> dict:
    """Seconds: each re-plan's switch, the extra of the step after it over a steady step of the same
    plan (the median of that plan's steps that follow no switch; plans A and B run at different
    speeds), their sum, and the steady step of plan A."""
    steps = run["steps"]
    plan_of = [(k // every) % 2 for k in range(len(steps))]   # 0: plan A, 1: plan B
    after = [k for k in range(len(steps)) if k and k % every == 0]
    steady = {p: statistics.median(t for k, t in enumerate(steps) if k and k % every and plan_of[k] == p)
              for p in (0, 1)}
    extra = [steps[k] - steady[plan_of[k]] for k in after]
    return {"switch": run["switches"], "extra": extra, "total": [a + b for a, b in zip(run["switches"], extra)],
            "steady": steady[0]}


def report(results: dict, args) -> None:
    runs = results["runs"]
    print(f"\n{args.model}{' (smoke sizes)' if args.smoke else ''} ({MODELS[args.model][0]}) on emulated-4, 4 gloo "
          f"ranks; global batch {results['batch'][0]} in {results['batch'][1]} micro-batches; AdamW; torch "
          f"{torch.__version__}")
    print(f"plan A: stages {results['strategies']}, (rank, stage, micro-batch sizes) {results['sizes']}")
    print(f"plan B (rebalance, rank {results['slow']} measured 3x slower): {results['changes']}")
    print(f"{args.switches} switches A <-> B every {args.every} steps per side; timed on rank 0, barrier to barrier; "
          "medians\n")
    header = f"{'side':10} {'steady step ms':>15} {'switch ms':>10} {'next step +ms':>14} {'re-plan ms':>11} {'in steps':>9}"
    print(header)
    print("-" * len(header))
    figures = {}
    for side in SIDES:
        c = cost(runs[side], args.every)
        median = {key: statistics.median(c[key]) for key in ("switch", "extra", "total")}
        figures[side] = (c["steady"], median)
        print(f"{side:10} {c['steady'] * 1e3:15.1f} {median['switch'] * 1e3:10.1f} {median['extra'] * 1e3:14.1f} "
              f"{median['total'] * 1e3:11.1f} {median['total'] / c['steady']:9.2f}")
        print(f"{'':10} each switch ms: {', '.join(f'{x * 1e3:.0f}' for x in c['switch'])}; "
              f"next step +ms: {', '.join(f'{x * 1e3:.0f}' for x in c['extra'])}")
    print(f"executor objects: in place kept one ({'yes' if results['kept'] else 'NO'}), rebuild made "
          f"{results['rebuilt']} new ones; losses of the two sides identical (assert_close)")
    (steady, inplace), (steady_rebuilt, rebuilt) = figures["in place"], figures["rebuild"]
    print(f"pipeline_shares ({args.model}): a shares-only re-plan's switch takes {inplace['switch'] * 1e3:.1f} ms in place vs "
          f"{rebuilt['switch'] * 1e3:.1f} ms rebuilding the executor ({rebuilt['switch'] / inplace['switch']:.0f}x); "
          f"with the next step's extra {inplace['total'] * 1e3:.0f} vs {rebuilt['total'] * 1e3:.0f} ms "
          f"({inplace['total'] / steady:.2f} vs {rebuilt['total'] / steady_rebuilt:.2f} steps of {steady * 1e3:.0f} ms); "
          f"executor {'kept' if results['kept'] else 'REBUILT in place'}, losses identical")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switches", type=int, default=8, help="re-plans per side (A -> B, B -> A, ...)")
    parser.add_argument("--every", type=int, default=3, help="steps between re-plans")
    parser.add_argument("--model", choices=sorted(MODELS), default="hf_gpt2",
                        help="make demo's hybrid classifier, or the transformers GPT-2 example (a split stage of blocks)")
    args = parse_args(parser, smoke=dict(switches=2, every=2))
    results = spawn_ranks(worker, args, WORLD)
    report(results, args)


if __name__ == "__main__":
    main()
