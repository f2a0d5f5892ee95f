"""The GPU check: what a CUDA device runs of the training recipe, measured, in one short run.

    make gpu-check                      # on a machine with one CUDA GPU (torch with CUDA)
    python -m torch.distributed.run --nproc_per_node 1 bench/gpu_check.py [--smoke]
    python bench/gpu_check.py --smoke   # without a GPU: the same code path on the CPU, tiny

CI has no GPU; the tests run every path on CPU (gloo, CPU autocast, the CPU memory counter), and
``tests/test_bench_smoke.py`` runs this script's ``--smoke`` on the CPU (gloo, the storage
counter, CPU autocast) so its code path stays working. On a GPU it runs, on one CUDA device
through ``runtime.Engine`` (nccl, world size 1; started by torchrun, or alone):

1. the device's matrix-product rate per dtype (fp32, tf32, bf16, fp16; 8192^3, CUDA events, the
   mean of ten after three warm-ups), against the spec-sheet figures the planner would assume;
2. a GPT-style decoder trained a few steps with each precision (fp32, bf16, fp16 with its loss
   scaler) and bf16 with activation checkpointing, all with global-norm clipping at 1.0 and a
   warm-up + cosine schedule: each step's loss against the same recipe in plain PyTorch on the same
   device (tolerances: fp32 1e-4, bf16/fp16 2e-2 relative), the step time, and the measured peak
   memory (``torch.cuda.max_memory_allocated``, reset before each step) against the plan's
   prediction (``Worker.memory_gib``).

The last line states the headline: bf16's speed-up over fp32 and measured / predicted memory of
each configuration. Exit status 1 if any loss disagrees with its reference or a step fails.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.training.schedules import lr_schedule  # noqa: E402
from whalelike.display import format_table  # noqa: E402

TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
GIB = 2.0 ** 30


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.out(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, d: int, heads: int, recompute: bool):
        super().__init__()
        with wl.replicate(recompute=recompute):
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _release(device: torch.device) -> None:
    """Free what the last configuration held before the next one is measured: the graph an Engine
    captured sits in torch.fx's reference cycles and keeps the model's parameters until the cyclic
    collector runs, and a CUDA peak counts every tensor allocated on the device, a dead model's too."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rates(n: int, device: torch.device) -> dict[str, float]:
    """TFLOP/s of an n^3 matrix product per dtype (tf32: float32 with TF32 tensor cores allowed),
    the mean of ten after three warm-ups."""
    out = {}
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        for _ in range(3):
            a @ b
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync(device)
        out[name] = 2 * n ** 3 * 10 / (time.perf_counter() - start) / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def cluster_file(directory: str, name: str, memory_gib: float) -> str:
    path = os.path.join(directory, "gpu.yaml")
    with open(path, "w") as f:
        f.write(f"name: gpu-check\nnetwork: {{intra_host_gbps: 450, inter_host_gbps: 50, latency_us: 5}}\n"
                f"hosts:\n  - name: local\n    devices:\n"
                f"      - {{kind: '{name}', peak_tflops: {{fp32: 67, tf32: 494.7, bf16: 989.4, fp16: 989.4}}, "
                f"memory_gib: {memory_gib:.1f}}}\n")
    return path


def reference(model, data, precision, steps, schedule, device):
    """The recipe in plain PyTorch on the device: losses per step."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = schedule(opt)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    losses = []
    for (idx,), targets in data[:steps]:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = wl.token_cross_entropy(model(idx.to(device)), targets.to(device))
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        losses.append(loss.item())
    del model, opt, sched, scaler
    _release(device)
    return losses


def run(config: str, args, cluster_path: str, device: torch.device) -> dict:
    precision, recompute = config.split("+")[0], config.endswith("+recompute")
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.seq, args.layers, args.d, args.heads, recompute)
    g = torch.Generator().manual_seed(1)
    data = [((torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)) for _ in range(args.steps)]
    schedule = lr_schedule("cosine", warmup_steps=2, total_steps=args.steps, min_ratio=0.1)
    expected = reference(model, data, precision, args.steps, schedule, device)
    cluster = wl.Cluster.from_yaml(cluster_path)
    graphs = wl.capture(model, data[0][0])
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=args.batch, num_micro_batch=2,
                                                   precision=precision))
    engine = Engine(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4), loss_fn=wl.token_cross_entropy,
                    cluster=cluster, clip_grad_norm=1.0, scheduler=schedule, measure_memory=True)
    losses, times = [], []
    for batch in data:
        _sync(device)
        start = time.perf_counter()
        losses.append(float(engine.train_step(batch)))
        _sync(device)
        times.append(time.perf_counter() - start)
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, expected))
    measured = max(s.peak_memory_bytes for s in engine.stats[1:])
    predicted = plan.workers[0].memory_gib * GIB
    result = {"config": config, "step_ms": statistics.median(times[2:]) * 1e3, "worst_rel": worst,
              "ok": worst <= TOLERANCE[precision], "measured": measured, "predicted": predicted,
              "recompute": [s.recompute for s in plan.stages], "norm": engine.stats[-1].grad_norm,
              "scale": engine.stats[-1].loss_scale}
    del engine, model, graphs
    _release(device)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny model and 4096^3 products (seconds)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); run it on a machine with a GPU and a "
              "CUDA build of torch (--smoke runs the same code path on the CPU, tiny)", file=sys.stderr)
        return 2
    big = not args.smoke
    args.vocab, args.seq, args.layers, args.d, args.heads = (32768, 1024, 12, 1024, 16) if big else (256, 32, 2, 32, 4)
    args.batch, args.steps = (16, 6) if big else (4, 3)
    if "RANK" not in os.environ:   # started alone, not by torchrun: a world of one
        from timing import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        props = torch.cuda.get_device_properties(device)
        name, memory_gib = torch.cuda.get_device_name(device), props.total_memory / GIB
        print(f"device: {name}, {memory_gib:.0f} GiB, compute capability {props.major}.{props.minor}, "
              f"{props.multi_processor_count} SMs; torch {torch.__version__}; bf16 supported: "
              f"{torch.cuda.is_bf16_supported()}", flush=True)
    else:
        device, name, memory_gib = torch.device("cpu"), "cpu (smoke: no CUDA device)", 8.0
        print(f"device: {name}; torch {torch.__version__}", flush=True)
    rates = matmul_rates(8192 if big else 256, device)
    print(format_table(["dtype", "measured TFLOP/s", "spec sheet (H100/H200 SXM)", "measured / sheet"],
                       [[k, f"{v:.1f}", f"{s:.1f}", f"{v / s:.2f}"] for (k, v), s in
                        zip(rates.items(), (67.0, 494.7, 989.4, 989.4))],
                       title="matrix products"), flush=True)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = cluster_file(tmp, name.replace("NVIDIA ", "").split(" ")[0], memory_gib)
        for config in ("fp32", "bf16", "fp16", "bf16+recompute"):
            try:
                r = run(config, args, path, device)
            except Exception as e:   # report every configuration, then fail
                print(f"{config}: FAILED: {type(e).__name__}: {e}", flush=True)
                results.append({"config": config, "ok": False})
                continue
            results.append(r)
            rows.append([config, f"{r['step_ms']:.1f}", f"{r['worst_rel']:.1e}", "yes" if r["ok"] else "NO",
                         f"{r['measured'] / GIB:.2f}", f"{r['predicted'] / GIB:.2f}",
                         f"{r['measured'] / r['predicted']:.2f}", r["recompute"], f"{r['norm']:.3f}",
                         r["scale"] if r["scale"] is not None else "-"])
    print(format_table(["config", "step ms", "worst loss rel. diff", "matches ref", "measured GiB", "predicted GiB",
                        "measured/predicted", "recompute", "last norm", "loss scale"], rows,
                       title=f"{args.layers}-layer decoder d={args.d}, batch {args.batch}x{args.seq}, 2 micro-batches, "
                             f"clip 1.0, cosine schedule"), flush=True)
    by = {r["config"]: r for r in results if "step_ms" in r}
    ok = all(r["ok"] for r in results)
    if {"fp32", "bf16"} <= by.keys():
        ratios = ", ".join(f"{c} {r['measured'] / r['predicted']:.2f}" for c, r in by.items())
        cut = (1 - by["bf16+recompute"]["measured"] / by["bf16"]["measured"]) if "bf16+recompute" in by else float("nan")
        print(f"gpu-check on {name}: bf16 {by['fp32']['step_ms'] / by['bf16']['step_ms']:.2f}x fp32's speed; "
              f"measured/predicted memory {ratios}; recompute cut bf16's measured peak by {cut:.0%}; "
              f"{'all losses match their references' if ok else 'SOME CHECKS FAILED'}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
