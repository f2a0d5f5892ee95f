"""Whale's hardware-aware setting: predicted speed-up of the hardware-aware plan over the naive one.

Whale (ATC'22) trains BERT-Large on 8 V100-32GB + 8 P100-16GB and reports 1.3-1.4x for
hardware-aware data parallelism and 1.2x for the hardware-aware pipeline over capacity-blind
baselines. This script plans the same two settings on the ``whale-v100-p100`` cluster preset with a
BERT-Large-like model (24 encoder layers after the token embedding; the embedding makes the first
TaskGraph the one with the larger peak memory) and prints the simulator's predicted step times of
both plans side by side, as the planner predicts them (the gradient all-reduce overlapped with the
backward in DDP's buckets, boundary transfers queued on the host interfaces) and, on a second line,
without the network model:

* DP: one ``replicate(16)`` TaskGraph; batch shares by speed vs equal shares.
* pipeline: two ``replicate(8)`` TaskGraphs (stage 0 lands on the 32 GB devices); layers moved
  toward the faster stage by the partitioner vs equal layer counts.

Run: ``.venv/bin/python bench/whale_setting.py`` (planner only, seconds; ``--smoke`` runs the same,
there is nothing to shrink)
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import planner  # noqa: E402
from synthetic import bert_large  # noqa: E402
from whalelike import Cluster, Config, replicate  # noqa: E402
from smoke import parse_args  # noqa: E402


def compare(name: str, graphs, cluster: Cluster, config: Config) -> float:
    plan = planner.plan(graphs, cluster, config)
    p, n = plan.prediction, plan.naive_prediction
    speedup = n.step_time_ms / p.step_time_ms
    stage0 = sorted({w.device.rsplit("-", 1)[0] for w in plan.workers if w.stage == 0})
    print(f"{name:9s} naive {n.step_time_ms:9.1f} ms  hardware-aware {p.step_time_ms:9.1f} ms  "
          f"speed-up {speedup:.2f}x  (solver {plan.solver}; stage 0 on {', '.join(stage0)})")
    naive = planner.naive_plan(graphs, cluster, config)
    serial = [planner.simulate(p, record_events=False).step_time_ms for p in (naive, plan)]
    print(f"{'':9s} naive {serial[0]:9.1f} ms  hardware-aware {serial[1]:9.1f} ms  speed-up "
          f"{serial[0] / serial[1]:.2f}x  (without the network model: all-reduce after the backward, no NIC queues)")
    return speedup


def main() -> None:
    parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), smoke={})
    cluster = Cluster.preset("whale-v100-p100")
    print(f"cluster {cluster.name}: " + ", ".join(
        f"{sum(d.kind == k for d in cluster.devices)} x {k}" for k in dict.fromkeys(d.kind for d in cluster.devices)))
    dp = compare("DP", bert_large([replicate(16)]), cluster, Config(global_batch_size=256, num_micro_batch=1))
    pipe = compare("pipeline", bert_large([replicate(8), replicate(8)]), cluster,
                   Config(global_batch_size=256, num_micro_batch=8, schedule="1f1b"))
    # the preset's 25 Gb/s between the servers is an assumption (Whale does not say): with overlap, the
    # 1.3 GB gradient all-reduce across it (~0.8 s) bounds both DP plans; at 100 Gb/s it hides in the backward
    fast = dataclasses.replace(cluster, network=dataclasses.replace(cluster.network, inter_host_gbps=12.5))
    print("with 100 Gb/s (12.5 GB/s) between the servers instead of 25 Gb/s:")
    dp_fast = compare("DP", bert_large([replicate(16)]), fast, Config(global_batch_size=256, num_micro_batch=1))
    print(f"headline: predicted speed-up of the hardware-aware plan (DDP-bucket overlap, NIC queues): DP {dp:.2f}x at "
          f"25 Gb/s, {dp_fast:.2f}x at 100 Gb/s (Whale reports 1.3-1.4x), pipeline {pipe:.2f}x (Whale reports 1.2x)")


if __name__ == "__main__":
    main()
