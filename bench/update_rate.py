"""The optimizer's update against the planner's model of it: bytes moved over memory bandwidth.

Without a profile the planner prices a worker's update as :data:`planner.devices.cost_model.UPDATE_PASSES`
passes over the parameters it steps (the bytes torch's update kernels read and write per byte of
parameters, counted from their source) at the device's memory bandwidth
(:func:`planner.devices.cost_model.update_ns_per_byte`). This measures, on one device, each optimizer's
``step()`` over 64 MiB of float32 parameters (16 tensors, so no cache holds them), the foreach kernels
(torch's default on CUDA) and the per-parameter loop (its default on CPU), against the counted passes at
the device's own measured bandwidth: an in-place ``add_`` over the same bytes (3 passes: two reads, one
write), timed the same way. The ratio measured / counted says whether the update is as memory-bound as
the model assumes (1.0) or slower (arithmetic the device does slower than it moves memory). On CUDA the
data sheet's bandwidth at the planner's 80% is printed beside the measured one
(:func:`whalelike.hardware.memory_gbps`), and the headline compares the update the planner would
predict from the sheet with the measured one.

    .venv/bin/python bench/update_rate.py                 # this machine's CPU, one thread (as a rank)
    .venv/bin/python bench/update_rate.py --device cuda   # a GPU (make gpu-check)
    .venv/bin/python bench/update_rate.py --smoke         # 1 MiB: checks that it runs
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planner.devices.cost_model import UPDATE_BANDWIDTH_EFFICIENCY, UPDATE_PASSES  # noqa: E402
from whalelike.display import format_table  # noqa: E402
from whalelike.hardware import memory_gbps  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, **kw),
    "sgd_momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, **kw),
}


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one untimed call (a device synchronise around each on CUDA)."""
    fn()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mib", type=int, default=64, help="parameter MiB (float32), in 16 tensors")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.repeats = 1, 2
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)   # a rank's: torchrun's OMP_NUM_THREADS=1
    numel = (args.mib << 20) // 4
    nbytes = numel * 4
    a, b = torch.randn(numel, device=device), torch.randn(numel, device=device)
    add_s = timed(lambda: b.add_(a), device, args.repeats)
    gbps = 3 * nbytes / add_s / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    sheet = memory_gbps(name.replace(" ", "-")) if device.type == "cuda" else None
    print(f"{name}: {args.mib} MiB of float32 parameters; add_ moves {gbps:.1f} GB/s (3 passes)"
          + (f"; the data sheet {sheet:g} GB/s, the planner assumes {sheet * UPDATE_BANDWIDTH_EFFICIENCY:.0f}"
             if sheet else ""))
    rows, ratios, sheet_ratios = [], [], []
    for optimizer, make in OPTIMIZERS.items():
        for way, kwargs in (("foreach", dict(foreach=True)), ("per parameter", dict(foreach=False))):
            params = [torch.nn.Parameter(torch.randn(numel // 16, device=device)) for _ in range(16)]
            for p in params:
                p.grad = torch.randn_like(p)
            step = make(params, **kwargs)
            seconds = timed(step.step, device, args.repeats)
            passes = seconds * gbps * 1e9 / nbytes
            ratio = passes / UPDATE_PASSES[optimizer]
            ratios.append(ratio)
            row = [optimizer, way, f"{seconds * 1e3:.2f}", f"{passes:.1f}", UPDATE_PASSES[optimizer], f"{ratio:.2f}"]
            if sheet:
                predicted = nbytes * UPDATE_PASSES[optimizer] / (sheet * UPDATE_BANDWIDTH_EFFICIENCY * 1e9)
                sheet_ratios.append(seconds / predicted)
                row.append(f"{seconds / predicted:.2f}")
            rows.append(row)
            del step, params
    headers = ["optimizer", "kernels", "step ms", "passes at add_'s GB/s", "counted", "measured / counted"]
    print(format_table(headers + (["measured / from the sheet"] if sheet else []), rows))
    line = (f"update_rate: {name}, measured / counted passes {min(ratios):.2f}-{max(ratios):.2f} "
            f"(sgd {rows[0][5]}/{rows[1][5]}, sgd_momentum {rows[2][5]}/{rows[3][5]}, adam {rows[4][5]}/{rows[5][5]}, "
            f"adamw {rows[6][5]}/{rows[7][5]}: foreach/per parameter)")
    if sheet_ratios:
        line += f"; measured / predicted from the data sheet {min(sheet_ratios):.2f}-{max(sheet_ratios):.2f}"
    print(line)


if __name__ == "__main__":
    main()
