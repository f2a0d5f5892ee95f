"""What common GPUs compute per data type: the spec-sheet table behind a cluster spec's rates.

Why. The GPU generations users mix differ most in low precision: a V100 has fp16 tensor cores and
no bfloat16, an A100 runs bf16 at 16x its FP32 rate, a P100 has no tensor cores at all (fp16 at 2x
FP32, no bf16). A spec that gives only the FP32 ``peak_tflops`` of a known GPU would otherwise plan
bf16 on a V100, or price an A100's bf16 at its FP32 rate. :data:`KNOWN_GPUS` lists the dense
(no structured sparsity) peak TFLOPS of each GPU per data type it runs; a data type a GPU lacks is
absent: it cannot run it. :func:`known_gpu` recognises a device kind (``"V100-16GB"``,
``"NVIDIA-A100-SXM4-40GB"``, ``"RTX-3090"``), and :func:`fill_rates` completes a device's table
from it (:mod:`whalelike.cluster` calls it for every device).

Where the figures come from: NVIDIA's data sheets and architecture whitepapers, dense figures,
tensor-core rates with FP32 accumulation (what mixed-precision training uses), boost clocks:
Tesla P100 data sheet (SXM2: FP32 10.6, FP16 21.2; no tensor cores), Tesla V100 data sheet (SXM2:
FP32 15.7, tensor 125; PCIe: 14 / 112), V100S data sheet (16.4 / 130), Tesla T4 data sheet (FP32
8.1, FP16 tensor 65), A100 data sheet (FP32 19.5, TF32 156, BF16/FP16 312; A800 the same), A10
data sheet (31.2, TF32 62.5, 125), A40 data sheet (37.4, TF32 74.8, 149.7), L4 data sheet
(30.3, TF32 60, 121: half the sheet's with-sparsity figures), the GA102 whitepaper for the RTX
3090 (35.6, TF32 35.6, BF16/FP16 with FP32 accumulate 71), the Ada whitepaper for the RTX 4090
(82.6, TF32 82.6, 165.2), the H100 data sheet (SXM5: FP32 67, TF32 494.7, BF16/FP16 989.4; PCIe
51 / 378 / 756), the H200 data sheet (SXM: the H100 SXM5's rates). Memory bandwidth (:data:`KNOWN_MEMORY_GBPS`, GB/s), from the same sheets: P100 732 (12 GB:
549), V100 900, V100S 1134, T4 320, A100 40 GB 1555 (80 GB: 2039 SXM, 1935 PCIe; A800 alike), A10 600,
A40 696, L4 300, RTX 3090 936, RTX 4090 1008, H100 SXM5 3350 (PCIe 2000), H200 4800; the planner prices the
optimizer's update from it when nothing measured the update (:mod:`planner.devices.cost_model`).

Invariant. A device's table is the spec's figures where the spec gives them; a known GPU's missing
figures are the sheet's ratio to FP32 times the device's own FP32 figure (a V100 PCIe given as
``peak_tflops: 14.0`` gets fp16 ``14.0 * 125 / 15.7`` = 111.5, its sheet's 112), and a data type
the sheet lacks stays absent; an unknown kind given as one number runs every data type at that
rate (nothing is known, so nothing is assumed faster). ``fp32`` is always present.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

# Data types a spec may rate. tf32 is listed for the spec sheet (PyTorch runs float32 matmuls in
# true FP32 unless torch.backends.cuda.matmul.allow_tf32 is set); the training precisions are
# whalelike.config.PRECISIONS, each of which is one of these.
DTYPES = ("fp32", "tf32", "bf16", "fp16")

# name (lower-case tokens of the kind, joined by '-') -> dense peak TFLOPS per data type it runs
KNOWN_GPUS: dict[str, dict[str, float]] = {
    "p100": {"fp32": 10.6, "fp16": 21.2},
    "v100": {"fp32": 15.7, "fp16": 125.0},
    "v100s": {"fp32": 16.4, "fp16": 130.0},
    "t4": {"fp32": 8.1, "fp16": 65.0},
    "a100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "a800": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "a10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "a40": {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    "l4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "rtx-3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
    "rtx-4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    "h100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "h200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
}

# name -> the data sheet's memory bandwidth, GB/s, of the model's first memory size (P100 SXM2 and PCIe 16 GB,
# V100 SXM2 and PCIe, A100 40 GB, H100 SXM5); :func:`memory_gbps` reads the variants that differ from the kind
KNOWN_MEMORY_GBPS: dict[str, float] = {
    "p100": 732.0, "v100": 900.0, "v100s": 1134.0, "t4": 320.0, "a100": 1555.0, "a800": 1555.0, "a10": 600.0,
    "a40": 696.0, "l4": 300.0, "rtx-3090": 936.0, "rtx-4090": 1008.0, "h100": 3350.0, "h200": 4800.0,
}

# why a known GPU lacks a data type, for the planner's refusal ("V100-16GB cannot run bf16 (...)")
_LACKS = {"bf16": "no bf16 support", "tf32": "no TF32 tensor cores", "fp16": "no fp16 support"}


def _tokens(kind: str) -> list[str]:
    return [t for t in re.split(r"[^a-z0-9]+", kind.lower()) if t]


def known_gpu(kind: str) -> Optional[str]:
    """The :data:`KNOWN_GPUS` name a device kind names, or None: the kind's lower-case tokens
    (split at anything but letters and digits) contain the name's tokens in a row, so
    ``"V100-16GB"``, ``"Tesla V100"`` and ``"NVIDIA-V100-SXM2-32GB"`` are ``"v100"``, while
    ``"V100S-32GB"`` is ``"v100s"`` and ``"A10"`` is not ``"a100"``."""
    tokens = _tokens(kind)
    for name in KNOWN_GPUS:
        want = name.split("-")
        if any(tokens[i:i + len(want)] == want for i in range(len(tokens) - len(want) + 1)):
            return name
    return None


def memory_gbps(kind: str, memory_gib: Optional[float] = None) -> Optional[float]:
    """The data sheet's memory bandwidth (GB/s) of a known GPU kind, or None: :data:`KNOWN_MEMORY_GBPS`,
    with the variants that differ (the sheets: A100 and A800 80 GB 2039 SXM, 1935 PCIe, recognised by
    an ``80GB`` token in the kind or 80 GiB of memory; H100 PCIe 2000; P100 12 GB 549)."""
    name = known_gpu(kind)
    if name is None:
        return None
    tokens = set(_tokens(kind))
    if name in ("a100", "a800") and ("80gb" in tokens or (memory_gib or 0) > 48):
        return 1935.0 if "pcie" in tokens else 2039.0
    if name == "h100" and "pcie" in tokens:
        return 2000.0
    if name == "p100" and ("12gb" in tokens or (memory_gib is not None and memory_gib <= 12)):
        return 549.0
    return KNOWN_MEMORY_GBPS[name]


def lacks_reason(kind: str, dtype: str) -> str:
    """Why a device of ``kind`` cannot run ``dtype``, in a few words."""
    if known_gpu(kind) is not None:
        return _LACKS.get(dtype, f"no {dtype} support")
    return f"its spec lists no {dtype} rate"


def fill_rates(kind: str, fp32: float, given: Optional[Mapping[str, float]]) -> tuple[dict[str, float], Optional[str]]:
    """A device's complete per-dtype table (see the module's invariant) from its FP32 figure and
    the mapping the spec gave (None: a bare number), and, when the spec claims a data type the
    known GPU cannot run, that data type (the caller names it in its error); else None.

    The table lists data types in :data:`DTYPES` order."""
    name = known_gpu(kind)
    given = dict(given or {})
    if name is None:
        if given:
            return {d: float(given[d]) for d in DTYPES if d in given}, None
        return {d: float(fp32) for d in DTYPES}, None
    sheet = KNOWN_GPUS[name]
    for dtype in given:
        if dtype not in sheet:
            return {}, dtype
    out = {}
    for dtype in DTYPES:
        if dtype in given:
            out[dtype] = float(given[dtype])
        elif dtype == "fp32":
            out[dtype] = float(fp32)
        elif dtype in sheet:   # the sheet's own figure when the FP32 figures agree, else its ratio
            out[dtype] = sheet[dtype] if fp32 == sheet["fp32"] else float(fp32) * sheet[dtype] / sheet["fp32"]
    return out, None
