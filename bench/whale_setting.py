"""Whale's hardware-aware setting: predicted speed-up of the hardware-aware plan over the naive one.

Whale (ATC'22) trains BERT-Large on 8 V100-32GB + 8 P100-16GB and reports 1.3-1.4x for
hardware-aware data parallelism and 1.2x for the hardware-aware pipeline over capacity-blind
baselines. This script plans the same two settings on the ``whale-v100-p100`` cluster preset with a
BERT-Large-like model (24 encoder layers after the token embedding; the embedding makes the first
TaskGraph the one with the larger peak memory) and prints the simulator's predicted step times of
both plans side by side:

* DP: one ``replicate(16)`` TaskGraph; batch shares by speed vs equal shares.
* pipeline: two ``replicate(8)`` TaskGraphs (stage 0 lands on the 32 GB devices); layers moved
  toward the faster stage by the partitioner vs equal layer counts.

Run: ``.venv/bin/python bench/whale_setting.py``
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import planner  # noqa: E402
from planner.gradient_buckets import gradient_buckets  # noqa: E402
from synthetic import bert_large  # noqa: E402
from whalelike import Cluster, Config, replicate  # noqa: E402


def compare(name: str, graphs, cluster: Cluster, config: Config) -> float:
    plan = planner.plan(graphs, cluster, config)
    p, n = plan.prediction, plan.naive_prediction
    speedup = n.step_time_ms / p.step_time_ms
    stage0 = sorted({w.device.rsplit("-", 1)[0] for w in plan.workers if w.stage == 0})
    print(f"{name:9s} naive {n.step_time_ms:9.1f} ms  hardware-aware {p.step_time_ms:9.1f} ms  "
          f"speed-up {speedup:.2f}x  (solver {plan.solver}; stage 0 on {', '.join(stage0)})")
    naive = planner.naive_plan(graphs, cluster, config)
    overlap = [planner.simulate(p, record_events=False, buckets=gradient_buckets(p, graphs, cluster)).step_time_ms
               for p in (naive, plan)]
    print(f"{'':9s} naive {overlap[0]:9.1f} ms  hardware-aware {overlap[1]:9.1f} ms  speed-up "
          f"{overlap[0] / overlap[1]:.2f}x  (gradient all-reduce overlapped with backward, DDP buckets)")
    return speedup


def main() -> None:
    cluster = Cluster.preset("whale-v100-p100")
    print(f"cluster {cluster.name}: " + ", ".join(
        f"{sum(d.kind == k for d in cluster.devices)} x {k}" for k in dict.fromkeys(d.kind for d in cluster.devices)))
    compare("DP", bert_large([replicate(16)]), cluster, Config(global_batch_size=256, num_micro_batch=1))
    compare("pipeline", bert_large([replicate(8), replicate(8)]), cluster,
            Config(global_batch_size=256, num_micro_batch=8, schedule="1f1b"))
    print("Whale reports 1.3-1.4x (DP) and 1.2x (pipeline) on real hardware.")


if __name__ == "__main__":
    main()
