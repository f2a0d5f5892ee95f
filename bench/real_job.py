"""A real-size job's set-up: a Llama-style model from a local Hugging Face checkpoint on a mixed
emulated cluster, today's path against the meta-device path, side by side in one run.

What runs. ``transformers``' ``LlamaForCausalLM`` (``--hidden``, ``--layers``, ``--vocab``; untied
embeddings) is built once with seed 0 and written with its own ``save_pretrained`` into a temporary
directory: the local checkpoint. Four ranks on ``emulated-4`` (speeds 1, 1, 0.5, 0.25, emulation
on) run two plans made by ``planner.plan``: ``zero3`` (the whole model one ``replicate`` region,
``zero_stage=3``: FSDP2 shards) and ``pipeline`` (two ``replicate`` regions of half the layers
each, DDP in each stage). For each plan, each rank sets up twice:

* **today**: what a script without the meta path does (``examples/train.py`` until now, and most
  training scripts): ``from_pretrained`` builds the whole model on every rank, a ``deepcopy`` is
  handed to the Engine (train.py keeps the original for ``--compare-naive`` and its initial
  state), and the Engine builds its executor;
* **whalelike**: the model is built under ``whalelike.empty_weights()`` (no storage) and
  ``Engine(weights=<the directory>)`` gives each rank storage only for what it holds and reads
  only those slices from the files (``runtime.state.pretrained``).

Measured per rank: the peak bytes of set-up (the CPU meter ``runtime.training.memory_meter.LiveBytes``
over the whole path, from building the model to the Engine filled, plus any storage the rank still
holds that was made where the meter cannot see, e.g. read by safetensors), set-up seconds, and for
the whalelike side ``share + one layer``: the bytes of what the rank holds (its ``named_state()``,
plus DDP's gradient buckets where a stage runs DDP: they are allocated at construction) and the
largest captured layer's parameters. Then ``--steps`` training steps of the whalelike Engine on
random tokens: tokens per second and MFU per device kind (the captured FLOPs of the rank's stage
for its samples per step, over the measured step time, over the device's FP32 peak in the cluster
spec: emulated devices, so MFU reflects the emulated rates).

Target: whalelike's set-up peak <= 1.1x (share + one layer) on every rank; today's is at least the
whole model twice.

Run: ``python bench/real_job.py`` (a few minutes on 2 cores); ``--smoke`` runs it at tiny sizes.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.replicas.ddp_sync import DDPSync  # noqa: E402
from runtime.replicas.held_state import local  # noqa: E402
from runtime.training.memory_meter import LiveBytes  # noqa: E402
import smoke  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import Forked, free_port, process_group, spawn_ranks  # noqa: E402

WORLD = 4
WARMUP_STEPS = 2     # the trainer's (runtime.launch.trainer.WARMUP_STEPS): a job runs more steps than that
PLANS = ("zero3", "pipeline")
SEED = 0


def llama_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=max(1, args.heads // 2), intermediate_size=args.hidden * 8 // 3,
                       vocab_size=args.vocab, max_position_embeddings=args.seq_len, tie_word_embeddings=False,
                       use_cache=False)


def annotate(model, name: str, layers: int):
    if name == "zero3":
        region = wl.replicate()
        wl.annotate(model, {"model": region, "lm_head": region})
    else:
        half = layers // 2
        wl.annotate(model, {f"model.layers.0-{half - 1}": wl.replicate(), f"model.layers.{half}-{layers - 1}":
                            wl.replicate()})
    return model


def loss_fn(outputs, targets):
    return wl.token_cross_entropy(outputs.logits, targets)


def batch(args, generator):
    return ((torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator),),
            torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator))


def measured(build, resizes: bool = True):
    """(what ``build()`` returns, its peak bytes): storages made while it runs at their peak, plus
    storages the result holds that the meter did not see made (read by safetensors, say)."""
    counter = LiveBytes(resizes=resizes, inputs=False)
    try:
        with counter:
            result, held = build()
    finally:
        counter.close()
    return result, counter.peak + counter.uncounted_bytes(held())


def held_tensors(*modules):
    return lambda: [t for m in modules for t in (*m.parameters(), *m.buffers())]


def shape_model(config, name: str, layers: int):
    """The model of plan ``name`` built under ``wl.empty_weights()``: no storage."""
    from transformers import LlamaForCausalLM

    with wl.empty_weights():
        return annotate(LlamaForCausalLM(config), name, layers)


def whole_model(args, name: str):
    """The model of plan ``name`` as today's path builds it: whole, read from the checkpoint."""
    from transformers import LlamaForCausalLM

    return annotate(LlamaForCausalLM.from_pretrained(args.checkpoint), name, args.layers)


def warm_captures(args) -> None:
    """A smoke run's warm-up before the ranks fork (``timing.spawn_ranks(warm=)``): captures what
    every rank captures, with the same models and example inputs (per plan the model on meta, which
    the whalelike side's Engine captures too, and the whole model on the CPU, which today's side's
    Engine captures), so that the ranks' captures are capture-cache hits. The ranks run the same code."""
    config, example = llama_config(args), batch(args, torch.Generator().manual_seed(1))
    for name in PLANS:
        wl.capture(shape_model(config, name, args.layers), example[0])
        wl.capture(whole_model(args, name), example[0])


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        cluster = emulated(args)
        config = llama_config(args)
        optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-3)   # noqa: E731
        example = batch(args, torch.Generator().manual_seed(1))
        out = {}
        for name in PLANS:
            shape = shape_model(config, name, args.layers)
            graphs = wl.capture(shape, example[0])       # on fake tensors: no weights needed
            plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=args.batch, num_micro_batch=args.micro,
                                                           zero_stage=3 if name == "zero3" else None))
            layer = max(layer.param_bytes for layer in graphs.layers)

            # today's path: the whole model on every rank, and a copy for the Engine. Its peak is measured
            # up to the copy (a lower bound: the Engine's build only adds)
            def whole_and_copy():
                model = whole_model(args, name)
                kept = copy.deepcopy(model)
                return (model, kept), held_tensors(model, kept)

            (model, kept), today_peak = measured(whole_and_copy, resizes=False)
            del model, kept
            gc.collect()

            # whalelike's: built without storage, each rank filled from its slices of the files
            def meta():
                model = shape_model(config, name, args.layers)
                return Engine(model, plan, optimizer=optimizer, loss_fn=loss_fn, cluster=cluster,
                              example_args=example[0], balance="off", weights=args.checkpoint)

            engine, meta_peak = measured(lambda: (lambda e: (e, lambda: [t for t, _ in
                                                                        e.executor.named_state().values()]))(meta()))
            held = sum(local(t).numel() * local(t).element_size() for t, _ in engine.executor.named_state().values())
            buckets = sum(p.numel() * p.element_size() for sync in engine.executor.syncs() if isinstance(sync, DDPSync)
                          for p in sync.ddp.parameters() if p.requires_grad)
            del engine
            gc.collect()

            # the seconds of each path to an Engine ready to train, without the meter (it slows every operator)
            dist.barrier()
            start = time.perf_counter()
            (model, kept), _ = whole_and_copy()
            Engine(kept, plan, optimizer=optimizer, loss_fn=loss_fn, cluster=cluster, example_args=example[0],
                   balance="off")
            today_s = time.perf_counter() - start
            del model, kept
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            meta()
            meta_s = time.perf_counter() - start
            gc.collect()
            worker_plan = plan.worker(rank)
            out[name] = dict(today_peak=int(today_peak), today_s=float(today_s), meta_peak=int(meta_peak),
                             meta_s=float(meta_s), share=int(held + buckets), layer=int(layer),
                             kind=str(cluster.device(worker_plan.device).kind), stage=int(worker_plan.stage),
                             whole=int(sum(p.numel() * 4 for p in shape.parameters())))
        results[rank] = out


def emulated(args) -> wl.Cluster:
    """``emulated-4`` with ``--base-gflops`` for a device of speed 1."""
    preset = wl.Cluster.preset("emulated-4")
    return dataclasses.replace(preset, emulation=dataclasses.replace(preset.emulation, base_gflops=args.base_gflops))


FACTORY = """import sys
sys.path.insert(0, {examples!r})
from hf_llama import build as _build


def build():
    return _build(vocab_size={vocab}, seq_len={seq_len}, n_layer={layers}, hidden_size={hidden}, n_head={heads},
                  n_kv_head={kv}, batch_size={batch})
"""


def first_devices(devices: list[dict], n: int) -> list[dict]:
    """The first ``n`` devices of a preset host's device list (entries with ``count`` cut short)."""
    kept = []
    for entry in devices:
        take = min(entry.get("count", 1), n - sum(e.get("count", 1) for e in kept))
        if take <= 0:
            break
        kept.append({**entry, "count": take})
    return kept


def end_to_end(args, folder: str) -> dict:
    """``whalelike train`` under torchrun on ``--job-ranks`` ranks (the first devices of emulated-4; a
    smoke run two): ``examples/hf_llama.py``'s Llama at the bench's
    sizes, its weights from a local save_pretrained directory (``model.weights``: built on meta, each
    rank reading its slices), planned now on emulated-4, ``--steps`` steps on synthetic tokens,
    metrics to JSON lines. Returns the job's wall seconds and its steps.jsonl lines."""
    factory = os.path.join(folder, "llama_job.py")
    with open(factory, "w") as f:
        f.write(FACTORY.format(examples=os.path.join(ROOT, "examples"), vocab=args.vocab, seq_len=args.seq_len,
                               layers=args.layers, hidden=args.hidden, heads=args.heads, kv=max(1, args.heads // 2),
                               batch=args.batch))
    sys.path.insert(0, folder)
    from llama_job import build
    weights = os.path.join(folder, "job-weights")
    build().model.save_pretrained(weights)
    cluster_file = os.path.join(folder, "cluster.yaml")
    with open(os.path.join(ROOT, "whalelike", "presets", "emulated-4.yaml")) as f:
        spec = yaml.safe_load(f)
    spec["emulation"]["base_gflops"] = args.base_gflops
    spec["hosts"][0]["devices"] = first_devices(spec["hosts"][0]["devices"], args.job_ranks)
    with open(cluster_file, "w") as f:
        yaml.safe_dump(spec, f)
    metrics = os.path.join(folder, "metrics")
    job = {"model": {"factory": f"{factory}:build", "weights": weights}, "cluster": cluster_file,
           "plan": {"global_batch_size": args.batch, "num_micro_batch": args.micro},
           "train": {"steps": args.steps + WARMUP_STEPS}, "metrics": {"dir": metrics}}
    job_file = os.path.join(folder, "job.yaml")
    with open(job_file, "w") as f:
        yaml.safe_dump(job, f)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", str(args.job_ranks),
               "--master-port", str(free_port()), "-m", "whalelike.cli", "train", job_file]
    start = time.perf_counter()
    if smoke.active():   # the agent a fork of this process (timing.Forked): its workers start as always
        agent = Forked(command, env, cwd=ROOT)
        output = agent.stdout.read()
        returncode = agent.wait(timeout=1800)
        run = subprocess.CompletedProcess(command, returncode, output, "")
    else:
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"whalelike train exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    with open(os.path.join(metrics, "steps.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return {"seconds": seconds, "steps": [line for line in lines if "loss" in line]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--base-gflops", type=float, default=1.0,
                        help="GFLOP/s of an emulated device of speed 1 (low enough that 4 ranks on 2 cores never overrun)")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps of the whalelike train job")
    parser.add_argument("--job-ranks", type=int, default=WORLD, choices=range(2, WORLD + 1),
                        help="ranks of the whalelike train job: the first devices of emulated-4 (default 4)")
    args = parse_args(parser, smoke=dict(hidden=32, layers=2, heads=4, vocab=128, seq_len=16, steps=1, job_ranks=2))
    from transformers import LlamaForCausalLM
    folder = tempfile.mkdtemp(prefix="whalelike-real-job-")
    try:
        torch.manual_seed(SEED)
        LlamaForCausalLM(llama_config(args)).save_pretrained(os.path.join(folder, "weights"))
        args.checkpoint = os.path.join(folder, "weights")
        results = spawn_ranks(worker, args, WORLD, warm=lambda: warm_captures(args))
        job = end_to_end(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    worst, headline = 0.0, []
    for name in PLANS:
        rows = [results[r][name] for r in range(WORLD)]
        whole = rows[0]["whole"]
        print(f"\n{name}: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
              f"{whole / 2**20:.2f} MiB of fp32 weights, 4 ranks; set-up peak per rank (MiB) and seconds")
        print("rank  stage  kind          today peak  today s  whalelike peak  whalelike s  share+layer  "
              "whalelike/(share+layer)  today/whalelike")
        for r, row in enumerate(rows):
            bound = row["share"] + row["layer"]
            worst = max(worst, row["meta_peak"] / bound)
            print(f"{r:>4}  {row['stage']:>5}  {row['kind']:<12}  >={row['today_peak'] / 2**20:>8.2f}  "
                  f"{row['today_s']:>7.2f}  {row['meta_peak'] / 2**20:>14.2f}  {row['meta_s']:>11.2f}  "
                  f"{bound / 2**20:>11.2f}  {row['meta_peak'] / bound:>22.2f}x  "
                  f">={row['today_peak'] / row['meta_peak']:>13.2f}x")
        headline.append(f"{name} set-up peak today/whalelike >= "
                        f"{min(row['today_peak'] / row['meta_peak'] for row in rows):.2f}x, whalelike "
                        f"{max(row['meta_peak'] / (row['share'] + row['layer']) for row in rows):.2f}x of "
                        f"share+layer, set-up {statistics.median(row['today_s'] for row in rows) / statistics.median(row['meta_s'] for row in rows):.2f}x faster")
    steps = job["steps"][WARMUP_STEPS:]            # the trainer's warm-up steps are not timed
    tokens = statistics.median(line["tokens_per_s"] for line in steps)
    kinds = {}
    for line in steps:
        for kind, figures in line.get("mfu", {}).items():
            kinds.setdefault(kind, []).append(figures.get("emulated_mfu", figures["mfu"]))
    mfu = ", ".join(f"{kind} {100 * statistics.median(v):.1f}%" for kind, v in sorted(kinds.items()))
    print(f"\nwhalelike train (examples/hf_llama.py at these sizes, weights from a local save_pretrained directory, "
          f"planned on the first {args.job_ranks} devices of emulated-4 at {args.base_gflops:g} GFLOP/s for speed 1, "
          f"{args.job_ranks} ranks): {job['seconds']:.1f} s for the job, "
          f"{tokens:,.0f} tokens/s (median of {len(steps)} steps), MFU of the emulated peaks per device kind: {mfu}")
    print(f"\nreal_job: {'; '.join(headline)}; whalelike train {tokens:,.0f} tokens/s, MFU {mfu} "
          f"(target <= 1.10x share+layer: {'yes' if worst <= 1.1 else 'NO'})")


if __name__ == "__main__":
    main()
