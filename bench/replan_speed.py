"""How long :func:`planner.balance.replan.rebalance` takes: it runs inside a step boundary, on every rank.

Workload: GPT-2-like synthetic TaskGraphs (``tests/synthetic.py``: sequence 1024, vocabulary 50257
as the first layer, fp32 AdamW costs) of four sizes, small (12 layers, d 768) to XL (48 layers,
d 1600), each planned on 8 mixed devices (4 of 125 TFLOPS / 80 GiB, 4 of 65 TFLOPS / 40 GiB, four
per host) three ways: data parallel (one ``replicate`` TaskGraph), a 2-stage pipeline of plain
``replicate`` stages (layers movable) and ``replicate(2)+split(4)`` (uneven MLP shards). Rank 1
then measures half its assumed speed; ``rebalance()`` is timed (median of ``--repeat`` runs,
after one warm-up) with every part allowed to change. The table also shows what changed and the
predicted step time of the plan in force and of the new plan, both at the measured speeds.

The peer, in the same run: planning from scratch, ``planner.plan()`` on the cluster with the
measured speeds (``planner.balance.replan.measured_cluster``), which is what a restart with a new plan
would run. It may choose another device mapping, so its predicted step time shows what keeping the
mapping costs. The last line states the median speed-up of ``rebalance()`` over it.
Single process, CPU only.

Run: ``.venv/bin/python bench/replan_speed.py`` (``--smoke``: few repeats, seconds: checks that it runs)
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import planner  # noqa: E402
from planner import PlanError  # noqa: E402
from planner.devices.cost_model import device_tflops  # noqa: E402
from planner.balance.replan import measured_cluster, plan_changes, rebalance, replan  # noqa: E402
from synthetic import synthetic_cluster, synthetic_model  # noqa: E402
from whalelike import Config, replicate  # noqa: E402
from whalelike.display import format_table  # noqa: E402
from whalelike.strategy import Strategy  # noqa: E402
from smoke import parse_args  # noqa: E402

MODELS = {  # name: (decoder layers, d_model, heads)
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
LAYOUTS = {  # name: (strategies, global batch, micro-batches)
    "data parallel": ((replicate(),), 128, 4),
    "2-stage pipeline": ((replicate(), replicate()), 128, 16),
    "replicate(2)+split(4)": ((Strategy("replicate", 2, Strategy("split", 4)),), 128, 4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per case")
    parser.add_argument("--peer-repeat", type=int, default=3, help="timed runs of planner.plan() per case")
    args = parse_args(parser, smoke=dict(repeat=2, peer_repeat=1))
    logging.basicConfig(level=logging.ERROR)
    cluster = synthetic_cluster([(4, 125.0, 80), (4, 65.0, 40)], per_host=4, name="mixed-8")
    rows, medians, ratios = [], [], []
    for model, (layers, hidden, heads) in MODELS.items():
        for name, (strategies, batch, micro) in LAYOUTS.items():
            graphs = synthetic_model(layers + 1, strategies, hidden=hidden, seq=1024, heads=heads, vocab=50257)
            try:
                plan = planner.plan(graphs, cluster, Config(batch, micro))
            except PlanError as e:
                rows.append([model, name, "-", "-", f"does not fit: {str(e)[:60]}"])
                continue
            speeds = [device_tflops(cluster.device(w.device)) * 1e12 for w in plan.workers]
            speeds[1] /= 2
            result = replan(plan, graphs, cluster, speeds)   # warm-up, and what changes
            new = result.plan
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                rebalance(plan, graphs, cluster, speeds)
                times.append((time.perf_counter() - start) * 1e3)
            median = statistics.median(times)
            medians.append(median)
            measured = measured_cluster(plan, cluster, speeds)
            peer_times = []
            for _ in range(args.peer_repeat):
                start = time.perf_counter()
                scratch = planner.plan(graphs, measured, Config(batch, micro))
                peer_times.append((time.perf_counter() - start) * 1e3)
            peer = statistics.median(peer_times)
            ratios.append(peer / median)
            changes = plan_changes(plan, new)
            rows.append([model, name, f"{median:.1f}", f"{max(times):.1f}", f"{peer:.0f}", f"{peer / median:.1f}x",
                         ", ".join(sorted(changes.kinds)) or "none",
                         f"{result.in_force.step_time_ms:.0f} -> {new.prediction.step_time_ms:.0f} "
                         f"(scratch {scratch.prediction.step_time_ms:.0f})"])
    print(format_table(["model", "layout", "median ms", "max ms", "plan() ms", "speed-up", "what changes",
                        "predicted step ms (in force -> re-planned)"], rows))
    print(f"rebalance() on 8 devices, GPT-2 small to XL: median {statistics.median(medians):.1f} ms over "
          f"{len(medians)} cases (slowest case median {max(medians):.1f} ms); planning from scratch "
          f"(planner.plan) takes {statistics.median(ratios):.1f}x as long (median)")


if __name__ == "__main__":
    main()
