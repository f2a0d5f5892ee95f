"""The GPU check: what one CUDA device runs of whalelike, measured, in one short run (under 5 minutes).

    make gpu-check                      # on a machine with one CUDA GPU (torch with CUDA)
    python -m torch.distributed.run --nproc_per_node 1 bench/gpu_check.py [--smoke] [--out DIR]
    python bench/gpu_check.py --smoke   # without a GPU: the same code path on the CPU, tiny

CI has no GPU; the tests run every path on CPU (gloo, CPU autocast, the CPU memory counter), and
``tests/test_bench_smoke.py`` runs this script's ``--smoke`` on the CPU (gloo, the storage
counter, CPU autocast, an emulated device's memory) so its code path stays working. On a GPU it
runs, on one CUDA device through ``runtime.Engine`` (nccl, world size 1; started by torchrun, or
alone), with nothing downloaded:

1. the device's matrix-product rate per dtype (fp32, tf32, bf16, fp16; 8192^3, CUDA events, the
   mean of ten after three warm-ups), against the spec-sheet figures the planner would assume;
2. a GPT-style decoder trained a few steps with each precision (fp32, bf16, fp16 with its loss
   scaler) and bf16 with activation checkpointing, all with global-norm clipping at 1.0 and a
   warm-up + cosine schedule: each step's loss against the same recipe in plain PyTorch on the same
   device (tolerances: fp32 1e-4, bf16/fp16 2e-2 relative), the step time, and the measured peak
   memory (``torch.cuda.max_memory_allocated``, reset before each step) against the plan's
   prediction (``Worker.memory_gib``);
3. the suite's tests that one GPU can run (:data:`SUITE_TESTS`: one process, or several ranks on
   one GPU over gloo with CPU tensors, where torch allows it; not the Engine's multi-rank tests,
   whose ranks would all take nccl on the one device), run by pytest in a child process with the
   CUDA device visible, among them ``tests/test_emulation_timing.py`` on real CUDA events. With
   ``--smoke`` the same list is only collected (``pytest --collect-only``), so a renamed or removed
   test breaks the smoke run;
4. ``whalelike profile`` of the examples on the device (:data:`PROFILED`:
   ``runtime.profiling.profile_cluster`` on a one-device cluster spec describing the local GPU: its
   name from ``torch.cuda.get_device_name``, its memory from ``torch.cuda.get_device_properties``,
   no emulation): the largest batch by Poplar's search to a real ``torch.OutOfMemoryError``
   (``examples/gpt.py`` at GPT-2 small's size, whose edge lies below the cap; the CPU-sized examples
   stop at their cap), the time per sample against batch size, the profile and its speed curves
   written under ``--out`` (``profile-NAME.yaml``, ``curves-NAME.png``);
5. predicted against measured step time on the device for the profiled models one device can plan
   (one region: ``examples/wide_mlp.py`` and this check's decoder): ``planner.plan(...,
   profile=)`` at a measured batch, then a few steps through the Engine, the error printed. On a
   CUDA device the Engine's compute segments are timed by CUDA events
   (``runtime.emulation.compute.DeviceEvents``), which the straggler monitor reads.

``--smoke`` takes every step's code path on the CPU with tiny sizes: parts 4 and 5 on an emulated
one-device cluster whose memory the emulation enforces (``emulation.enforce_memory``, a capacity
set between two batches' measured peaks, so the search ends at an emulated out-of-memory edge),
at fp32 (CPU bf16 is slow), with one timed repeat per batch instead of three, profiling
``examples/gpt.py`` and the decoder only (the same code as every other model: gpt's several
TaskGraphs, the decoder's plan and training). Its figures mean nothing (the emulated device's
modeled times, overrun by this machine's real ones). The GPU's python (``GPU_PY``) needs the project's dependencies and its ``dev`` extra
(pytest, hypothesis; transformers for the Hugging Face examples, which are reported as not run
without it).

The last line states the headline: bf16's speed-up over fp32 and measured / predicted memory of
each configuration; the line before it, parts 3-5. Exit status 1 if any loss disagrees with its
reference, a step fails, a suite test fails (or is not collected in --smoke), or a profile or a
prediction fails.
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib
import importlib.util
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

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
from whalelike.workload import Workload, counting_tokens  # noqa: E402

TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
GIB = 2.0 ** 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# -- 3. the suite's tests that one GPU runs -----------------------------------------------------------
# pytest node ids: tests of one process, or of several ranks over gloo with CPU tensors (the
# straggler exchange, the tensor-parallel layers), which one GPU's machine runs with the device
# visible. Left out: the Engine's multi-rank tests (distributed.init takes nccl when CUDA exists, and
# nccl refuses two ranks on one device) and the torchrun launches (the same).
SUITE_TESTS = (
    "tests/test_emulation_timing.py",
    "tests/test_emulation.py",
    "tests/test_straggler_monitor.py",
    "tests/test_tensor_parallel.py::test_uneven_tensor_parallel_matches_single_process",
    "tests/test_precision_model.py::test_the_emulator_runs_each_device_at_its_precisions_speed",
    "tests/test_training_recipe.py::test_the_cpu_memory_counter_sees_every_storage_once_until_it_is_freed",
    "tests/test_training_recipe.py::test_a_bad_clipping_norm_is_refused_before_any_rendezvous",
    "tests/test_training_recipe.py::test_an_unknown_precision_is_refused",
    "tests/test_profile.py::test_the_search_finds_the_largest_batch_that_fits_exactly",
    "tests/test_profile.py::test_the_search_grows_by_powers_of_two_then_bisects",
    "tests/test_profile.py::test_alpha_beta_fit_recovers_the_line_and_stays_non_negative",
    "tests/test_profile.py::test_curves_through_monotone_points_are_monotone_and_positive",
    "tests/test_profile.py::test_a_cubic_spline_overshoots_a_falling_curve_where_pchip_does_not",
    "tests/test_profile.py::test_a_profile_round_trips_through_its_file",
    "tests/test_profile.py::test_a_unit_cut_step_computes_the_plain_models_gradients_and_leaves_it_unchanged",
    "tests/test_plan_from_profile.py",
    "tests/test_capture.py",
)
# what a launcher's environment holds that would make a test believe it runs under torchrun
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def suite_tests(collect_only: bool, timeout_s: float) -> dict:
    """Run (or with ``collect_only`` collect) :data:`SUITE_TESTS` in a child pytest, the CUDA device
    visible: ``{"ok", "count", "summary"}``. The suite's own options (two xdist workers) are
    replaced: one process, so the ranks a test spawns share the one device in turn."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q",
               *(["--collect-only"] if collect_only else ["-rf"]), *SUITE_TESTS]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "count": 0, "summary": f"pytest did not finish within {timeout_s:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    last = lines[-1].strip("= ") if lines else (done.stderr.strip().splitlines() or ["no output"])[-1]
    if collect_only:
        found = re.search(r"(\d+) tests? collected", last)
        count = int(found.group(1)) if found else 0
    else:
        found = re.search(r"(\d+) passed", last)
        count = int(found.group(1)) if found else 0
    if done.returncode != 0:
        # pytest's reasons (a node id not found, a failed test) are in its output: show them
        print(f"suite tests: pytest exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}",
              flush=True)
    return {"ok": done.returncode == 0, "count": count, "summary": last}


# -- 4. whalelike profile of the examples on the device -----------------------------------------------
@dataclass(frozen=True)
class Profiled:
    """A model the check profiles: ``build(smoke)`` gives its workload at the run's size; ``cap`` the
    largest batch tried on the GPU; ``trains``: one region, so one device can plan and train it
    (part 5); ``smoke``: also profiled by --smoke; ``needs``: modules it imports."""

    name: str
    build: Callable[[bool], Workload]
    cap: int = 1024
    trains: bool = False
    smoke: bool = False
    needs: tuple = ()


def _example(module: str, **gpu_sizes) -> Callable[[bool], Workload]:
    """``examples/<module>.py``'s ``build``: its defaults in --smoke (CPU-sized), ``gpu_sizes`` on the GPU."""
    def build(smoke: bool) -> Workload:
        return importlib.import_module(f"examples.{module}").build(**({} if smoke else gpu_sizes))

    return build


def _decoder(smoke: bool) -> Workload:
    """This check's decoder as a workload (one ``replicate`` region: one device plans it)."""
    vocab, seq, layers, d, heads = (256, 32, 2, 32, 4) if smoke else (32768, 1024, 12, 1024, 16)
    torch.manual_seed(0)
    make_batch = counting_tokens(vocab, seq)
    (example,), _ = make_batch(4, torch.Generator().manual_seed(0))
    return Workload(model=Decoder(vocab, seq, layers, d, heads, recompute=False), example_args=(example,),
                    loss_fn=wl.token_cross_entropy, make_batch=make_batch)


PROFILED = (
    # GPT-2 small's size: its largest batch on an 80-140 GiB device lies below the cap, at a real
    # out-of-memory error
    Profiled("gpt", _example("gpt", n_layer=12, d_model=768, n_head=12, vocab_size=50_304, seq_len=1024), cap=4096,
             smoke=True),
    Profiled("hybrid_classifier", _example("hybrid_classifier")),
    Profiled("third_party", _example("third_party")),
    Profiled("hf_gpt2", _example("hf_gpt2"), needs=("transformers",)),
    Profiled("hf_llama", _example("hf_llama"), needs=("transformers",)),
    Profiled("wide_mlp", _example("wide_mlp", width=2048), trains=True),
    Profiled("decoder", _decoder, cap=64, trains=True, smoke=True),
)
SMOKE_EDGE = 12          # --smoke: the emulated capacity sits between this batch's peak and the next's
SMOKE_BASE_GFLOPS = 5.0  # --smoke: the emulated device's speed (tiny models: segments of milliseconds)


def _peaks(workload: Workload, batches: tuple) -> dict[int, int]:
    """Peak bytes of a plain training step (AdamW at learning rate 0, as the profile runs it, after
    a first step made its state) at each batch, by the runtime's CPU memory counter."""
    from runtime.training.memory_meter import MemoryMeter

    model = copy.deepcopy(workload.model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    meter = MemoryMeter(torch.device("cpu"), enabled=True)
    peaks = {}
    for batch in (1, *batches):
        inputs, targets = workload.make_batch(batch, torch.Generator().manual_seed(batch))
        optimizer.zero_grad(set_to_none=True)
        with meter.step([model], optimizer):
            workload.loss_fn(model(*inputs), targets).backward()
            optimizer.step()
        peaks[batch] = meter.peak_bytes
    return peaks


def profile_cluster_file(directory: str, name: str, kind: str, memory_gib: float, workload: Workload,
                         smoke: bool) -> str:
    """The one-device cluster a profile measures: the local GPU as it is (no emulation), or in
    --smoke an emulated CPU device whose memory holds a step of :data:`SMOKE_EDGE` samples and not one more."""
    if not smoke:
        return cluster_file(directory, kind, memory_gib)
    peaks = _peaks(workload, (SMOKE_EDGE, SMOKE_EDGE + 1))
    capacity = (peaks[SMOKE_EDGE] + peaks[SMOKE_EDGE + 1]) / 2
    path = os.path.join(directory, f"{name}-cluster.yaml")
    peak = SMOKE_BASE_GFLOPS / 1000 / 0.4
    with open(path, "w") as f:
        f.write(f"name: gpu-check-smoke\nnetwork: {{intra_host_gbps: 450, inter_host_gbps: 50, latency_us: 5}}\n"
                f"emulation: {{base_gflops: {SMOKE_BASE_GFLOPS}, enforce_memory: true}}\n"
                f"hosts:\n  - name: local\n    devices:\n"
                f"      - {{kind: cpu-smoke, peak_tflops: {{fp32: {peak}, bf16: {peak}}}, "
                f"memory_gib: {capacity / GIB!r}, emulated_speed: 1.0}}\n")
    return path


def profile_one(item: Profiled, args, directory: str, device_name: str, kind: str, memory_gib: float) -> dict:
    """Part 4 (and 5 where ``item.trains``) for one model: profile, write, and maybe plan and train."""
    from planner.devices.speed_curves import write_png
    from runtime.profiling import profile_cluster

    workload = item.build(args.smoke)
    cluster_path = profile_cluster_file(directory, item.name, kind, memory_gib, workload, args.smoke)
    cluster = wl.Cluster.from_yaml(cluster_path)
    started = time.perf_counter()
    profile = profile_cluster(workload, cluster, precision=args.precision, cap=64 if args.smoke else item.cap,
                              warmup=1, repeats=1 if args.smoke else 3, cache_directory=os.path.join(directory, "cache"),
                              refresh=True,
                              timeout_s=600.0, command=f"bench/gpu_check.py ({item.name})")
    seconds = time.perf_counter() - started
    yaml_path = os.path.join(args.out, f"profile-{item.name}.yaml")
    png_path = os.path.join(args.out, f"curves-{item.name}.png")
    profile.to_yaml(yaml_path)
    write_png(profile, png_path)
    with open(png_path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            raise RuntimeError(f"{png_path}: the speed curves were not written as a PNG")
    measured = profile.devices[0]
    curve = measured.curve()
    result = {"name": item.name, "max_batch": measured.max_batch, "edge": measured.edge,
              "points": len(measured.batches), "seconds": seconds,
              "small_ms": curve(curve.batches[0]) * 1e3, "large_ms": curve(measured.max_batch) * 1e3,
              "peak": measured.memory_bytes.get(measured.max_batch), "files": (yaml_path, png_path)}
    print(profile.summary(), flush=True)
    if item.trains:
        result.update(predict_and_train(workload, cluster, profile, args))
    del workload, profile
    _release(args.device)
    return result


def predict_and_train(workload: Workload, cluster, profile, args) -> dict:
    """Part 5: plan at a measured batch (half the largest, at most) from the profile, train a few
    steps through the Engine, and compare the median step time with the plan's prediction."""
    batches = profile.devices[0].batches
    batch = max([b for b in batches if b <= max(1, profile.devices[0].max_batch // 2)] or [batches[0]])
    # the profile left the model on the device: capture it there (fake tensors of one device)
    example = tuple(x.to(args.device) if isinstance(x, torch.Tensor) else x for x in workload.example_args)
    graphs = wl.capture(workload.model, example)
    plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=batch, num_micro_batch=1,
                                                   precision=args.precision), profile=profile)
    engine = Engine(workload.model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                    loss_fn=workload.loss_fn, cluster=cluster, profile=profile)
    times = []
    for step in range(args.predict_steps):
        inputs, targets = workload.make_batch(batch, torch.Generator().manual_seed(100 + step))
        _sync(args.device)
        start = time.perf_counter()
        engine.train_step((inputs, targets))
        _sync(args.device)
        times.append(time.perf_counter() - start)
    measured = statistics.median(times[2:]) * 1e3
    predicted = plan.prediction.step_time_ms
    segments = engine.stats[-1]
    result = {"batch": batch, "micro": plan.workers[0].micro_batch_sizes, "predicted_ms": predicted,
              "measured_ms": measured, "error": measured / predicted - 1 if predicted > 0 else math.nan,
              "compute_ms": segments.padded_s * 1e3, "device_timed": engine.emulator.device_timed}
    del engine, graphs
    return result


def checks_beyond_the_recipe(args, device_name: str, memory_gib: float) -> tuple[bool, str]:
    """Parts 3-5 (see the module docstring): their tables, and ``(all ok, one summary line)``."""
    _release(args.device)
    tests = suite_tests(collect_only=args.smoke, timeout_s=240.0)
    print(f"suite tests that one GPU runs ({len(SUITE_TESTS)} node ids): {tests['summary']}", flush=True)
    kind = device_name.replace("NVIDIA ", "").split(" ")[0]
    rows, profiled, failed, missing = [], [], [], []
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for item in PROFILED:
            if args.smoke and not item.smoke:
                continue
            absent = [m for m in item.needs if importlib.util.find_spec(m) is None]
            if absent:
                missing.append(f"{item.name} (needs {', '.join(absent)})")
                print(f"profile {item.name}: not run: {', '.join(absent)} is not installed in {sys.executable}",
                      flush=True)
                continue
            try:
                r = profile_one(item, args, tmp, device_name, kind, memory_gib)
            except Exception as e:   # report every model, then fail
                print(f"profile {item.name}: FAILED: {type(e).__name__}: {e}", flush=True)
                failed.append(item.name)
                _release(args.device)
                continue
            profiled.append(r)
            rows.append([r["name"], f"{r['max_batch']} ({r['edge']})", r["points"], f"{r['small_ms']:.4g}",
                         f"{r['large_ms']:.4g}", "-" if r["peak"] is None else f"{r['peak'] / GIB:.2f}",
                         f"{r['seconds']:.1f}",
                         "-" if "error" not in r else f"{r['predicted_ms']:.1f} / {r['measured_ms']:.1f} "
                                                      f"({r['error']:+.1%}) at {r['micro']}",
                         "-" if "error" not in r else f"{r['compute_ms']:.1f}"])
    print(format_table(["model", "largest batch (edge)", "points", "ms/sample @ smallest", "ms/sample @ largest",
                        "peak GiB", "profile s", "step ms predicted / measured (error) at micro-batches",
                        "segments ms (last step)"], rows,
                       title=f"whalelike profile on {device_name} at {args.precision} (profiles and curves in "
                             f"{args.out})"), flush=True)
    timed = [r for r in profiled if "error" in r]
    edges = ", ".join(f"{r['name']} {r['max_batch']} ({r['edge']})" for r in profiled)
    errors = ", ".join(f"{r['name']} {r['error']:+.1%}" for r in timed)
    clocks = {r["device_timed"] for r in timed}
    clock = "CUDA events" if clocks == {True} else "the host clock" if clocks == {False} else "mixed clocks"
    tests_word = "collected" if args.smoke else "passed"
    line = (f"gpu-check parts 3-5: suite tests {tests['count']} {tests_word} ({'ok' if tests['ok'] else 'FAILED'}); "
            f"profiled {len(profiled)} models, largest batch {edges or '-'}"
            f"{'; FAILED ' + ', '.join(failed) if failed else ''}{'; not run ' + ', '.join(missing) if missing else ''}; "
            f"step time measured vs predicted from the profile: {errors or '-'} (segments timed by {clock})")
    trained = {p.name for p in PROFILED if p.trains}
    ok = tests["ok"] and not failed and all("error" in r for r in profiled if r["name"] in trained)
    return ok, line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny model and 256^3 products, on the CPU if need be")
    p.add_argument("--out", metavar="DIR", help="where the profiles and speed curves go (default out/gpu-check; "
                                                "--smoke: a temporary directory)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False); run it on a machine with a GPU and a "
              "CUDA build of torch (--smoke runs the same code path on the CPU, tiny)", file=sys.stderr)
        return 2
    big = not args.smoke
    args.vocab, args.seq, args.layers, args.d, args.heads = (32768, 1024, 12, 1024, 16) if big else (256, 32, 2, 32, 4)
    args.batch, args.steps = (16, 6) if big else (4, 3)
    args.precision, args.predict_steps = ("bf16", 6) if big else ("fp32", 4)   # CPU bf16 is slow: fp32 in --smoke
    scratch = tempfile.TemporaryDirectory() if args.out is None and args.smoke else None
    args.out = args.out or (scratch.name if scratch is not None else os.path.join(ROOT, "out", "gpu-check"))
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
    args.device = device
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
    extra_ok, extra = checks_beyond_the_recipe(args, name, memory_gib)
    by = {r["config"]: r for r in results if "step_ms" in r}
    ok = all(r["ok"] for r in results) and extra_ok
    print(extra, flush=True)
    if {"fp32", "bf16"} <= by.keys():
        ratios = ", ".join(f"{c} {r['measured'] / r['predicted']:.2f}" for c, r in by.items())
        cut = (1 - by["bf16+recompute"]["measured"] / by["bf16"]["measured"]) if "bf16+recompute" in by else float("nan")
        print(f"gpu-check on {name}: bf16 {by['fp32']['step_ms'] / by['bf16']['step_ms']:.2f}x fp32's speed; "
              f"measured/predicted memory {ratios}; recompute cut bf16's measured peak by {cut:.0%}; "
              f"{'all losses match their references' if ok else 'SOME CHECKS FAILED'}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if scratch is not None:
        scratch.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
