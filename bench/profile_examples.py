"""Every example of the repository, planned from a profile: predicted against measured step time
(issue 20: "every example and bench reports the error"; target within 3%).

For each example of ``examples/`` that ``examples/train.py`` runs, with the global batch and
micro-batches BENCHMARKS.md and the README run it with on ``emulated-4``, in one job of 4 ranks
(spawned with bench/timing.py's helpers), what a user runs as ``torchrun ... whalelike profile``,
``whalelike plan --profile`` and ``torchrun ... train.py --profile``:

1. ``runtime.profiling.profile_cluster`` on every rank (a fresh cache: every device measured),
   micro-batches up to ``--max-batch``;
2. rank 0 captures the model and plans it from the profile (``planner.plan(..., profile=)``);
3. ``runtime.Engine`` trains that plan (dynamic balancing off: the plan as made is measured) for
   ``--rounds`` rounds of ``--steps`` timed steps (bench/profile_vs_spec.py's ``train_rounds``);
   the median round's milliseconds per step against the plan's ``prediction.step_time_ms``.

Per example, each rank's median step is split into the emulator's modeled compute, its segments'
overrun past it, and the rest (communication, waiting for peers: the pipeline's bubbles, the
update, the loss and Python at the machine's own speed), beside the plan's predicted bubble, so a
missed target says which term is off. ``wide_mlp`` is run on ``emulated-4`` too (the README runs it
on a small-memory variant to show ZeRO; here the point is the step time).

    .venv/bin/python bench/profile_examples.py [--examples gpt,hf_gpt2]
    .venv/bin/python bench/profile_examples.py --smoke   # tiny sizes, seconds: checks that it runs
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from profile_vs_spec import train_rounds  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.profiling import profile_cluster  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, spawn_ranks  # noqa: E402
from whalelike.display import format_table  # noqa: E402

WORLD = 4
# the plan from the profile, and the control: the plan from the spec sheet, which on emulated-4 is the
# emulation's truth (peak_tflops = emulated_speed x base_gflops / 0.4, no efficiency curve or bandwidth)
SIDES = ("profile", "spec")
# example module: (global batch, micro-batches) as BENCHMARKS.md / the README / `make demo` run it on emulated-4
EXAMPLES = {
    "hybrid_classifier": (64, 4),
    "gpt": (16, 2),
    "third_party": (16, 2),
    "hf_gpt2": (32, 4),
    "hf_llama": (16, 2),
    "wide_mlp": (64, 1),
}
# a smoke run's tiny models (factory keyword arguments)
SMOKE_SIZES = {
    "hybrid_classifier": dict(num_classes=64, width=4, image_size=8, feature_dim=16),
    "gpt": dict(vocab_size=64, seq_len=8, n_layer=2, d_model=16, n_head=2),
    "third_party": dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, seq_len=8, vocab_size=64),
    "hf_gpt2": dict(vocab_size=64, seq_len=8, n_layer=2, d_model=16, n_head=2),
    "hf_llama": dict(vocab_size=64, seq_len=8, n_layer=2, hidden_size=16, n_head=2, n_kv_head=1),
    "wide_mlp": dict(width=16, blocks=2),
}


def workload(name: str, args) -> wl.Workload:
    """A fresh copy of ``examples/<name>.py``'s workload (its factory seeds the weights)."""
    return importlib.import_module(name).build(**(SMOKE_SIZES[name] if args.smoke else {}))


def worker(rank: int, init_file: str, args, results) -> None:
    try:
        _work(rank, init_file, args, results)
    except Exception as e:      # say which rank failed and why (the others only see a closed connection)
        print(f"profile_examples: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise


def _work(rank: int, init_file: str, args, results) -> None:
    # profile_cluster checks that it runs one rank per device from torchrun's variables
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    cluster = wl.Cluster.preset(args.cluster)
    with process_group(rank, init_file, WORLD), tempfile.TemporaryDirectory() as cache_dir:
        out = {}
        for name in args.examples:
            out[name] = _example(rank, name, args, cluster, cache_dir)
        if rank == 0:
            results["examples"] = out


def _example(rank: int, name: str, args, cluster: wl.Cluster, cache_dir: str) -> dict:
    batch, micro_batches = (8, 2) if args.smoke else EXAMPLES[name]
    dist.barrier()
    started = time.perf_counter()
    profile = profile_cluster(workload(name, args), cluster, cap=args.max_batch, warmup=args.warmup,
                              repeats=args.repeats, cache_directory=cache_dir, refresh=True, progress=False)
    profile_s = time.perf_counter() - started
    plans = [None, None]
    if rank == 0:
        w = workload(name, args)
        graphs = wl.capture(w.model, w.example_args)
        config = wl.Config(global_batch_size=batch, num_micro_batch=micro_batches)
        plans = [planner.plan(graphs, cluster, config, profile=profile), planner.plan(graphs, cluster, config)]
    dist.broadcast_object_list(plans, src=0)
    plans = dict(zip(SIDES, plans))
    engines = {}
    for side, plan in plans.items():
        w = workload(name, args)
        engines[side] = Engine(w.model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=w.loss_fn,
                               cluster=cluster, example_args=w.example_args, balance="off",
                               profile=profile if side == "profile" else None)
    trained = train_rounds(engines, w.make_batch, batch, args.rounds, args.steps)
    return {"plans": plans, "profile_s": profile_s, "rows": [r["profile"] for r in trained["rows"]],
            "step_ms": trained["step_ms"]}


def shape(plan) -> str:
    """The plan in a few words: stages, and each stage's data-parallel and tensor-parallel widths."""
    parts = []
    for st in plan.stages:
        workers = [w for w in plan.workers if w.stage == st.index]
        tp = max(w.tp_size for w in workers)
        parts.append(f"{len(workers) // tp}dp" + (f"x{tp}tp" if tp > 1 else ""))
    return f"{len(plan.stages)} stage(s) " + "/".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES),
                        help=f"comma-separated examples/ modules (default: all: {', '.join(EXAMPLES)})")
    parser.add_argument("--cluster", default="emulated-4", help="preset of 4 devices (default: emulated-4)")
    parser.add_argument("--max-batch", type=int, default=32, help="largest micro-batch profiled (the cap)")
    parser.add_argument("--warmup", type=int, default=1, help="profiling: untimed steps per batch")
    parser.add_argument("--repeats", type=int, default=3, help="profiling: timed steps per batch (median)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (after one untimed)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parse_args(parser, smoke=dict(examples="gpt", max_batch=4, repeats=1, steps=1, rounds=1))
    args.examples = [e.strip() for e in args.examples.split(",")]
    unknown = [e for e in args.examples if e not in EXAMPLES]
    if unknown:
        raise SystemExit(f"bench/profile_examples.py: --examples: {', '.join(unknown)} not among {', '.join(EXAMPLES)}")
    if len(wl.Cluster.preset(args.cluster).devices) != WORLD:
        raise SystemExit(f"bench/profile_examples.py: --cluster {args.cluster} must have {WORLD} devices")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = spawn_ranks(worker, args, WORLD)["examples"]

    print(f"every example planned from a profile on {args.cluster} (cap {args.max_batch}, 1 warm-up + median of "
          f"{args.repeats}), {args.rounds} round(s) of {args.steps} timed steps; torch {torch.__version__}; load "
          f"average {os.getloadavg()[0]:.1f} at the end")
    summary, errors = [], {}
    for name, r in results.items():
        plan, rows, step = r["plans"]["profile"], r["rows"], r["step_ms"]["profile"]
        spec = r["plans"]["spec"]
        predicted = plan.prediction.step_time_ms
        errors[name] = step / predicted - 1
        busy = statistics.mean(row["modeled_ms"] for row in rows)
        summary.append([name, shape(plan), f"{plan.global_batch_size}/{plan.num_micro_batch}", f"{r['profile_s']:.0f}",
                        f"{predicted:.1f}", f"{step:.1f}", f"{errors[name]:+.1%}",
                        f"{plan.prediction.bubble_fraction:.1%}", f"{1 - busy / step:.1%}",
                        f"{r['step_ms']['spec'] / spec.prediction.step_time_ms - 1:+.1%}"])
        print(format_table(["rank", "device", "stage", "micro-batches", "modeled compute ms", "overrun ms", "overruns",
                            "rest of step ms"],
                           [[w.rank, w.device, w.stage, "+".join(map(str, w.micro_batch_sizes)),
                             f"{rows[w.rank]['modeled_ms']:.1f}", f"{rows[w.rank]['over_ms']:.1f}",
                             f"{rows[w.rank]['overruns']}/{rows[w.rank]['segments']}", f"{rows[w.rank]['rest_ms']:.1f}"]
                            for w in plan.workers],
                           title=f"\n{name}: {shape(plan)}, predicted {predicted:.1f} ms, measured {step:.1f} ms "
                                 f"(median timed step per rank: the emulator's modeled compute, its segments' overrun "
                                 f"past it, the rest of the step)"))
    print(format_table(["example", "plan", "batch/micro", "profile s", "predicted ms", "measured ms", "error",
                        "predicted idle", "measured idle", "spec plan's error"], summary,
                       title="\npredicted (from the profile) against measured step time; idle: the share of the step "
                             "the ranks spend outside modeled compute, as the simulator predicts it (bubble) and as "
                             "measured; the control: the error of the plan made from the spec sheet, which on "
                             "emulated-4 is the emulation's truth"))
    within = sum(abs(e) <= 0.03 for e in errors.values())
    worst = max(errors, key=lambda n: abs(errors[n]))
    print(f"profile_examples: {within} of {len(errors)} examples within 3% of the predicted step time; errors "
          + ", ".join(f"{n} {e:+.1%}" for n, e in errors.items()) + f"; worst {worst} {errors[worst]:+.1%}")


if __name__ == "__main__":
    main()
