"""Lab plans: real-size Llama-style models, built on the meta device, planned onto mixed lab clusters.

Each case is a ``transformers`` ``LlamaForCausalLM`` at real size built under
``whalelike.empty_weights()`` (no storage: the planner reads shapes and costs only), annotated by
module path as a user who cannot edit the model would (the blocks in two ``replicate()`` regions,
``lm_head`` under ``split()``; the embedding and the final norm join their neighbours), captured,
and planned by ``planner.plan`` at fp16, or bf16 where every device runs it, at 8 and at 16
micro-batches (``--micro-batches``), the plan predicted faster kept, as a user tries a few counts
(the planner keeps the count it is asked for when it fits). It never trains.

Per case, printed: the planning time (capture apart), the devices that compute (a device on a stage
with no FLOPs does not), the fullest device's memory and each device kind's most held at its peak, the
predicted tokens/s (global batch x
sequence / predicted step), against

* (a) the best plan that uses one device kind of the cluster: the same model planned on each kind's
  devices alone (their hosts and network as they are), the fastest that fits;
  Beside it, the ratio of all devices' FLOP/s to that kind's: what a plan of all devices gains over
  that kind at equal efficiency (a plan above it uses the devices better than the one-kind plan does);
* (b) the bound: every device's sustained FLOP/s at the plan's precision (the planner's
  ``device_tflops``: the spec sheet's peak times the cost model's efficiency) over the model's
  training FLOPs per token, the work split perfectly and nothing else costing time. The gap to it
  is the pipeline's bubble, the transfers and the all-reduces, and devices that wait on others.

Clusters: ``examples/clusters/lab-mixed.yaml`` (4x A100-40GB, 4x V100-16GB, one RTX 3090 on three
hosts), ``h100+a100`` (8x H100-80GB and 8x A100-40GB on two hosts: NVLink inside a host, 200 Gb/s
between) and ``a100+t4`` (4x A100-40GB on one host, 8x T4-16GB on two: PCIe inside, 25 Gb/s between).
Models: about 1B (d 2048, 22 layers, TinyLlama's shape), 7B (d 4096, 32 layers) and 13B (d 5120, 40
layers) parameters, sequence 2048, vocabulary 32000.

Run (a few minutes; capture of the 13B model takes the longest)::

    .venv/bin/python bench/lab_plans.py
    .venv/bin/python bench/lab_plans.py --models 1B --clusters lab-mixed
    .venv/bin/python bench/lab_plans.py --smoke      # a tiny model on two clusters: checks that it runs

The last line is the headline: the longest planning time, idle devices, whether 7B fits on
lab-mixed, and the plan against the best single-kind plan and the bound.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from smoke import parse_args  # noqa: E402

# name -> (hidden size, layers, attention heads, key/value heads, MLP width)
MODELS = {
    "1B": (2048, 22, 32, 4, 5632),
    "7B": (4096, 32, 32, 32, 11008),
    "13B": (5120, 40, 40, 40, 13824),
    "tiny": (64, 4, 4, 2, 176),   # the smoke run's
}
SEQ, VOCAB = 2048, 32000


def _host(name: str, kind: str, count: int, memory: float, fp32: float) -> dict:
    """A host of ``count`` devices; ``fp32``: the spec sheet's FP32 peak (the other data types' come from
    the kind's spec sheet, whalelike/hardware.py)."""
    return {"name": name, "devices": [{"kind": kind, "count": count, "memory_gib": memory, "peak_tflops": fp32}]}


CLUSTERS = {
    "lab-mixed": os.path.join(ROOT, "examples", "clusters", "lab-mixed.yaml"),
    "h100+a100": {"name": "h100+a100", "network": {"intra_host_gbps": 300.0, "inter_host_gbps": 25.0, "latency_us": 5.0},
                  "hosts": [_host("h100-node", "H100-SXM5-80GB", 8, 80, 67.0), _host("a100-node", "A100-SXM4-40GB", 8, 40, 19.5)]},
    "a100+t4": {"name": "a100+t4", "network": {"intra_host_gbps": 24.0, "inter_host_gbps": 3.125, "latency_us": 20.0},
                "hosts": [_host("a100-node", "A100-40GB", 4, 40, 19.5), _host("t4-node-0", "T4-16GB", 4, 16, 8.1),
                          _host("t4-node-1", "T4-16GB", 4, 16, 8.1)]},
}


# sequences per step on each cluster: at 16 micro-batches every data-parallel group gets a sample of each
BATCHES = {"lab-mixed": 64, "h100+a100": 128, "a100+t4": 128}


def build(name: str, seq: int, vocab: int):
    """The model of ``name`` on meta, annotated by path, and an example batch of one sequence."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import whalelike as wl
    from whalelike.workload import counting_tokens

    d, layers, heads, kv, inter = MODELS[name]
    config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
                         use_cache=False, tie_word_embeddings=False)
    with wl.empty_weights():
        model = LlamaForCausalLM(config)
    half = layers // 2
    wl.annotate(model, {f"model.layers.0-{half - 1}": wl.replicate(), f"model.layers.{half}-{layers - 1}": wl.replicate(),
                        "lm_head": wl.split()})
    (example,), _ = counting_tokens(vocab, seq)(1, torch.Generator().manual_seed(0))
    return model, (example,)


def workload(name: str):
    """The model of ``name`` as a ``whalelike.Workload`` (the factories below): for ``whalelike plan
    bench/lab_plans.py:llama_1b --cluster examples/clusters/lab-mixed.yaml ...``."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from hf_llama import causal_lm_loss

    from whalelike.workload import Workload, counting_tokens

    model, example = build(name, SEQ, VOCAB)
    return Workload(model=model, example_args=example, loss_fn=causal_lm_loss, make_batch=counting_tokens(VOCAB, SEQ),
                    vocab_size=VOCAB, seq_len=SEQ)


def llama_1b():
    return workload("1B")


def llama_7b():
    return workload("7B")


def llama_13b():
    return workload("13B")


def load_cluster(name: str):
    from whalelike.cluster import Cluster

    spec = CLUSTERS[name]
    return Cluster.load(spec) if isinstance(spec, str) else Cluster.from_dict(spec, origin=name)


def precision_of(cluster) -> str:
    """bf16 when every device runs it, else fp16."""
    return "bf16" if all("bf16" in d.precisions for d in cluster.devices) else "fp16"


def one_kind(cluster, kind: str):
    """``cluster`` with only its devices of ``kind``: the same device records (peaks and measured rates
    alike, so the one-kind plan is priced as the mixed one prices those devices), hosts and network."""
    devices = tuple(d for d in cluster.devices if d.kind == kind)
    return dataclasses.replace(cluster, name=f"{cluster.name}/{kind}", devices=devices)


@dataclasses.dataclass
class Planned:
    seconds: float
    plan: object = None
    error: str = ""


def plan_on(graphs, cluster, config) -> Planned:
    """``planner.plan`` timed; a plan the cluster cannot hold is the planner's reason, first clause."""
    import planner
    from planner.plan import PlanError

    start = time.perf_counter()
    try:
        plan = planner.plan(graphs, cluster, config)
    except PlanError as e:
        return Planned(time.perf_counter() - start, None, str(e).split(";")[0][:200])
    return Planned(time.perf_counter() - start, plan)


def plan_fastest(graphs, cluster, config, counts) -> Planned:
    """:func:`plan_on` at each micro-batch count of ``counts``, the plan predicted fastest kept (as a
    user tries a few counts: the planner keeps the count it is asked for when it fits); its planning
    time is that plan's. None fits: the first count's reason."""
    tried = [plan_on(graphs, cluster, dataclasses.replace(config, num_micro_batch=m)) for m in counts]
    fitting = [t for t in tried if t.plan is not None]
    if not fitting:
        return tried[0]
    return min(fitting, key=lambda t: t.plan.prediction.step_time_ms)


def tokens_per_s(plan, seq: int) -> float:
    return plan.global_batch_size * seq / (plan.prediction.step_time_ms / 1e3)


def computing(plan, graphs) -> int:
    """The workers whose stage has FLOPs to run."""
    flops = {st.index: sum(graphs.layers[i].forward_flops + graphs.layers[i].backward_flops for i in st.layers)
             for st in plan.stages}
    return sum(1 for w in plan.workers if flops[w.stage] > 0)


def fullest(plan) -> tuple[str, float]:
    """The device with the highest share of its memory held at its peak, and the share."""
    w = max(plan.workers, key=lambda w: w.memory_gib / w.capacity_gib)
    return w.device, w.memory_gib / w.capacity_gib


def memory_by_kind(plan, cluster) -> str:
    """Per device kind, the most a device of it holds at its peak over what a plan may fill (its memory less
    the plan's reserve): 'A100-40GB 30.9/36.0 GiB, ...'."""
    kind = {d.name: d.kind for d in cluster.devices}
    most: dict[str, tuple[float, float]] = {}
    for w in plan.workers:
        k = kind[w.device]
        if k not in most or w.memory_gib > most[k][0]:
            most[k] = (w.memory_gib, w.capacity_gib)
    return ", ".join(f"{k} {held:.1f}/{cap:.1f} GiB" for k, (held, cap) in most.items())


def bound(graphs, cluster, precision: str, seq: int) -> float:
    """Tokens/s of every device's sustained FLOP/s over the training FLOPs of a token."""
    from planner.devices.cost_model import device_tflops

    per_token = sum(tg.forward_flops + tg.backward_flops for tg in graphs) / seq
    return sum(device_tflops(d, precision) * 1e12 for d in cluster.devices) / per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1B,7B,13B", help="models, of " + ", ".join(MODELS) + " (default 1B,7B,13B)")
    parser.add_argument("--clusters", default=",".join(CLUSTERS), help=f"clusters (default {','.join(CLUSTERS)})")
    parser.add_argument("--global-batch", type=int, default=0,
                        help="sequences per step (default: each cluster's, BATCHES: 64 on lab-mixed, 128 on the others)")
    parser.add_argument("--micro-batches", default="8,16",
                        help="micro-batch counts per step asked of every plan, mixed and single-kind alike, the "
                             "fastest kept (default 8,16)")
    parser.add_argument("--seq", type=int, default=SEQ, help=f"sequence length (default {SEQ})")
    parser.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary (default {VOCAB})")
    args = parse_args(parser, smoke=dict(models="tiny", clusters="lab-mixed,a100+t4", seq=64, vocab=512, micro_batches="4"))
    logging.getLogger("planner").setLevel(logging.ERROR)
    logging.getLogger("whalelike").setLevel(logging.ERROR)

    from whalelike.config import Config
    from whalelike.graphs.capture import capture

    rows, cases = [], []
    for model_name in args.models.split(","):
        model, example = build(model_name, args.seq, args.vocab)
        start = time.perf_counter()
        graphs = capture(model, example)
        captured = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        print(f"{model_name}: {params / 1e9:.2f}B parameters, captured on meta in {captured:.1f} s", flush=True)
        for cluster_name in args.clusters.split(","):
            cluster = load_cluster(cluster_name)
            precision = precision_of(cluster)
            counts = [int(m) for m in str(args.micro_batches).split(",")]
            config = Config(global_batch_size=args.global_batch or BATCHES[cluster_name], num_micro_batch=counts[0],
                            precision=precision)
            mine = plan_fastest(graphs, cluster, config, counts)
            kinds = sorted({d.kind for d in cluster.devices})
            singles = {kind: plan_fastest(graphs, one_kind(cluster, kind), config, counts) for kind in kinds}
            fitting = {k: p for k, p in singles.items() if p.plan is not None}
            best_kind = max(fitting, key=lambda k: tokens_per_s(fitting[k].plan, args.seq)) if fitting else None
            single = tokens_per_s(fitting[best_kind].plan, args.seq) if best_kind else 0.0
            top = bound(graphs, cluster, precision, args.seq)
            # what all devices could gain over that kind's alone at equal efficiency: their FLOP/s' ratio
            gain = top / bound(graphs, one_kind(cluster, best_kind), precision, args.seq) if best_kind else 0.0
            case = dict(model=model_name, cluster=cluster_name, seconds=mine.seconds, fits=mine.plan is not None,
                        devices=len(cluster.devices), single=single, single_kind=best_kind, bound=top, gain=gain)
            if mine.plan is None:
                rows.append(f"{model_name:>4}  {cluster_name:<10} {precision}  plan {mine.seconds:5.2f} s  does not fit: "
                            f"{mine.error}")
            else:
                plan = mine.plan
                used = computing(plan, graphs)
                device, share = fullest(plan)
                tps = tokens_per_s(plan, args.seq)
                case.update(used=used, tps=tps, stages=len(plan.stages), micro=plan.num_micro_batch)
                versus = (f"{tps / single:5.2f}x best one kind ({best_kind} {single:,.0f}; all devices' FLOP/s are "
                          f"{gain:.2f}x its)") if single else "no single kind fits"
                rows.append(f"{model_name:>4}  {cluster_name:<10} {precision}  plan {mine.seconds:5.2f} s  "
                            f"devices computing {used}/{len(cluster.devices)}  {len(plan.stages)} stage(s), "
                            f"{plan.num_micro_batch} micro-batches  fullest {device} {share:.0%}  "
                            f"{tps:9,.0f} tokens/s = {versus}, {tps / top:.0%} of the bound {top:,.0f}; "
                            f"memory at the peak {memory_by_kind(plan, cluster)}")
            print(rows[-1], flush=True)
            cases.append(case)
    planned = [c for c in cases if c["fits"]]
    idle = sum(c["devices"] - c["used"] for c in planned)
    against = [c["tps"] / c["single"] for c in planned if c["single"]]
    lab = [(c["tps"] / c["single"], c["gain"]) for c in planned if c["cluster"] == "lab-mixed" and c["single"]]
    seven = next((c for c in cases if c["model"] == "7B" and c["cluster"] == "lab-mixed"), None)
    print(f"lab_plans: {len(planned)}/{len(cases)} cases planned, the longest in "
          f"{max(c['seconds'] for c in cases):.1f} s (target < 30 s); idle devices {idle}; 7B on lab-mixed "
          f"{'not run' if seven is None else ('fits' if seven['fits'] else 'does NOT fit')}; plan / best single kind "
          + (f"{min(against):.2f}-{max(against):.2f}x" if against else "n/a")
          + (f" (lab-mixed {min(lab)[0]:.2f}x, target >= 1.30x, where all its devices' FLOP/s are {min(lab)[1]:.2f}x the "
             "best kind's)" if lab else "")
          + "; plan / bound " + (f"{min(c['tps'] / c['bound'] for c in planned):.0%}-"
                                  f"{max(c['tps'] / c['bound'] for c in planned):.0%}" if planned else "n/a"), flush=True)


if __name__ == "__main__":
    main()
