"""Cluster specs: hosts, devices and network, from YAML or a built-in preset.

The *nominal* figures (``peak_tflops``, ``measured_tflops``) are what the planner may read. The
``emulated_speed`` of a device and the ``emulation`` block are the hidden truth of the emulated
"hardware" (docs/ARCHITECTURE.md section 4): only the runtime's emulator reads them.

A spec file looks like this (units: TFLOPS, GiB, GB/s, microseconds)::

    name: my-lab
    network: {intra_host_gbps: 150, inter_host_gbps: 12.5, latency_us: 5}
    hosts:
      - name: node-a
        devices:
          - {kind: V100-32GB, count: 8, peak_tflops: 15.7, memory_gib: 32}
      - name: node-b
        devices:
          - {kind: P100-16GB, count: 8, peak_tflops: 9.3, memory_gib: 16, measured_tflops: 6.1}

``peak_tflops`` is the FP32 peak as a bare number, or a mapping of data type to peak TFLOPS over
``fp32, tf32, bf16, fp16`` (fp32 required), e.g. ``{fp32: 15.7, fp16: 125}`` for a V100: a data
type a mapping leaves out cannot run on the device, except that a GPU whalelike knows
(:mod:`whalelike.hardware`: P100, V100, T4, A100, A10, A40, L4, RTX 3090/4090, H100, ...) gets its
missing figures from its spec sheet, and a bare number of an unknown kind runs every data type at
that rate. ``measured_tflops`` likewise (a bare number is measured at FP32; a mapping may list any
data types the device runs), and ``emulated_speed`` too (the same data types as ``peak_tflops``).
The planner prices a plan at its precision (``Device.tflops``) and refuses one a device cannot run.

Devices get ranks in the order they are listed (hosts in order; torchrun numbers ranks host by
host) and readable unique names: ``v100-0`` ... ``p100-7`` (the full kind, ``a100-80gb-0``, when
two kinds share a short name). An optional ``emulation`` block turns the cluster into emulated
hardware for testing; then *every* device needs an ``emulated_speed``, and ``emulated_speed`` is
an error without the block: a half-emulated cluster would pad some ranks and not others. Two more
device fields make an emulated device behave like a real one, both off by default and, like
``emulated_speed``, an error without the block: ``emulated_half_efficiency_batch`` (the micro-batch
at which this device's matmuls run at half their peak; default the block's
``half_efficiency_batch``) and ``emulated_memory_gbps`` (the bandwidth, GB/s, at which it moves the
bytes of its non-matmul operators). They let a spec sheet be wrong the ways real ones are:
``emulated-equal-peak`` (equal peaks, unequal bandwidth, memory and small-batch efficiency) and
``emulated-slow-bf16`` (a kind whose spec sheet claims fast bf16 that it does not have).

Membership (which devices of the spec a running job has; :mod:`runtime.elastic`): a torchrun node
stands for one host of the spec, and its worker of local rank ``i`` for that host's ``i``-th device.
The host is the one named by the environment variable ``WHALELIKE_HOST`` (set per agent, e.g. two
agents on one machine acting as two hosts), else the host whose name is the machine's host name or
its first label (``node-a`` for ``node-a.lab.org``), else a host named ``localhost``; with none of
these (a spec whose hosts are names only, all on one machine) the workers are the spec's devices
in rank order, as the plan's ranks are (:meth:`Cluster.device_of`). The devices present, in
torchrun's rank order, are :meth:`Cluster.present`, the cluster a new plan is made on.

The dataclass fields double as the file schema: each field carries a :class:`whalelike.spec.Rule`
(type, bounds, meaning), so a value is checked by the same rule whether it comes from a file (the
error names the file and the field path) or from Python code (the error names the object). Upper
bounds (``MAX_*`` below, each with its reason) keep absurd values from reaching the planner.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, Optional, Sequence

from whalelike.config import PRECISIONS
from whalelike.display import format_table
from whalelike.errors import SpecError
from whalelike.hardware import DTYPES, fill_rates, lacks_reason
from whalelike.hardware import memory_gbps as hardware_memory_gbps
from whalelike.spec import Reader, Rule, check_fields, load_yaml, required, rule, rule_of, rules

PRESET_PACKAGE = "whalelike.presets"


# -- limits (each an upper bound in a rule below; the error prints the reason) -------------------------
MAX_DEVICES = 16_384
MAX_DEVICES_WHY = ("16x the largest cluster the planner is benchmarked on (bench/plan_scale.py); each device becomes "
                   "a record and a planner variable")
MAX_MEMORY_GIB = float(1 << 20)
MAX_MEMORY_WHY = ("1 PiB, far above any accelerator (the largest have a few hundred GiB); the planner counts "
                  "bytes, and values like 1e300 GiB overflow to infinity there")
MAX_TFLOPS = 1e6
MAX_TFLOPS_WHY = ("an exaflop per device, hundreds of times the fastest accelerator; values like 1e300 overflow to "
                  "infinity in FLOP/s and every modeled time becomes zero")
MAX_GBPS = 1e6
MAX_GBPS_WHY = ("a petabyte per second, far above any link; values like 1e300 overflow to infinity in bytes/s and "
                "every transfer time becomes zero")
MAX_LATENCY_US = 1e6
MAX_LATENCY_WHY = "one second per message; the field is in microseconds, larger values are a unit mistake"
MAX_HALF_EFFICIENCY_BATCH = 1e6
MAX_HALF_EFFICIENCY_BATCH_WHY = ("a device that needs a million samples per micro-batch to reach half its speed "
                                 "runs every real micro-batch at almost zero speed: its emulated segments would "
                                 "sleep for hours (values like 1e300 sleep forever)")
# A spec of the most devices allowed, 8 per host, is about 250 KiB; parsing a 40 MiB spec took PyYAML
# (libyaml) 100 s and 3 GiB on the development machine. Larger files are refused before parsing.
MAX_FILE_BYTES = 1 << 20
MAX_FILE_WHY = "a real spec is a few KiB, and YAML this large takes minutes and GiBs to parse"


# -- the records -----------------------------------------------------------------------------------
_TFLOPS_RULE = dict(gt=0, le=MAX_TFLOPS, le_why=MAX_TFLOPS_WHY)


@dataclass(frozen=True)
class Device:
    """One device. ``peak_tflops``, ``measured_tflops`` and ``emulated_speed`` are the FP32 figures
    (what most code reads); the per-dtype figures beside them (data types of
    :data:`whalelike.hardware.DTYPES`) are what a spec gives as a mapping, fp32 left out (it is the
    scalar field, so ``dataclasses.replace`` of a scalar never contradicts a table):

    * ``dtype_tflops``: the peak mapping's other entries; None when ``peak_tflops`` was a bare
      number. :attr:`rates` completes it (:func:`whalelike.hardware.fill_rates`: a known GPU's
      spec-sheet ratios; an unknown kind given a bare number runs every dtype at ``peak_tflops``);
      a dtype absent from :attr:`rates` cannot run on the device (:meth:`runs`, :meth:`tflops`);
    * ``measured_dtype_tflops``: achieved TFLOPS measured at other dtypes (:meth:`measured`);
    * ``emulated_dtype_speed``: the emulator's hidden truth at other dtypes; None when
      ``emulated_speed`` was a bare number (every dtype the device runs at that speed). Given, it
      rates exactly the dtypes of :attr:`rates` (:attr:`emulated_rates`).

    A mapping given from Python may include ``fp32`` when it equals the scalar field (it is then
    dropped). The dict fields are left out of the hash (the hash reads a subset of what equality
    compares, so equal devices hash equal).

    Beside the speed, the emulator's hidden truth (None: off, today's behaviour):
    ``emulated_half_efficiency_batch`` is this device's efficiency curve, ``b / (b + h)`` at
    micro-batch ``b`` (None: the emulation block's ``half_efficiency_batch``), so small
    micro-batches run below peak differently on different devices; ``emulated_memory_gbps`` prices
    the bytes of a segment's non-matmul operators at ``bytes / bandwidth`` on top of its matmul
    FLOPs (None: those bytes cost nothing). Neither depends on the data type: a bf16 tensor has
    half the bytes of an fp32 one, so the same bandwidth moves it twice as fast.
    """

    name: str = rule(str, "unique device name, e.g. 'v100-0'")
    kind: str = rule(str, "device model, e.g. 'V100-32GB'")
    host: str = rule(str, "host name")
    peak_tflops: float = rule(float, "nominal FP32 peak TFLOPS from the spec sheet, e.g. 15.7", **_TFLOPS_RULE)
    memory_gib: float = rule(float, "device memory in GiB, e.g. 32", gt=0, le=MAX_MEMORY_GIB, le_why=MAX_MEMORY_WHY)
    # achieved TFLOPS from profiling, preferred by the planner
    measured_tflops: Optional[float] = rule(float, "achieved FP32 TFLOPS from profiling", **_TFLOPS_RULE,
                                            default=None)
    # relative speed of an emulated device (runtime only)
    emulated_speed: Optional[float] = rule(float, "relative FP32 speed of the emulated device, e.g. 0.5",
                                           gt=0, default=None)
    dtype_tflops: Optional[dict[str, float]] = field(default=None, hash=False)
    measured_dtype_tflops: dict[str, float] = field(default_factory=dict, hash=False)
    emulated_dtype_speed: Optional[dict[str, float]] = field(default=None, hash=False)
    # the emulated device's efficiency curve and memory bandwidth (runtime only; off when None)
    emulated_half_efficiency_batch: Optional[float] = rule(
        float, "micro-batch size at which the emulated device's matmuls run at half their peak speed, e.g. 8; "
        "default the emulation block's half_efficiency_batch", gt=0, le=MAX_HALF_EFFICIENCY_BATCH,
        le_why=MAX_HALF_EFFICIENCY_BATCH_WHY, default=None)
    emulated_memory_gbps: Optional[float] = rule(
        float, "GB/s at which the emulated device moves the bytes of non-matmul operators (element-wise, norms, "
        "softmax), e.g. 0.5 where speed 1 is 2 GFLOP/s", gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY, default=None)
    # the runtime's cost outside compute segments per forward or backward, measured (whalelike profile):
    # the planner adds it to every compute action of a worker on the device (None: not priced)
    measured_action_overhead_us: Optional[float] = rule(
        float, "measured time outside the compute segments per forward or backward (the step's Python, dispatch "
        "and bookkeeping), in microseconds (whalelike profile measures it), e.g. 300; default: not priced", ge=0,
        le=1e7, le_why="ten seconds of bookkeeping per forward is no runtime's", default=None)
    # the optimizer's update, measured (whalelike profile): the planner prices it after each worker's last
    # collective, per byte of the parameters the worker updates (None: not priced)
    measured_update_ns_per_byte: Optional[float] = rule(
        float, "measured optimizer update time per byte of parameters the device updates, in nanoseconds (whalelike "
        "profile measures it), e.g. 0.75; default: the update is not priced", ge=0, le=1e6,
        le_why="a millisecond per byte of parameters is no device's optimizer", default=None)
    # the memory's bandwidth from the spec sheet: without a measured update, the planner prices the update from it
    memory_gbps: Optional[float] = rule(
        float, "memory bandwidth from the spec sheet in GB/s, e.g. 1555; default: a known GPU's data sheet "
        "(whalelike.hardware), none for another kind; prices the optimizer's update when no measurement does",
        gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY, default=None)

    def __post_init__(self):
        check_fields(self, f"device {self.name!r}: ")
        _check_rates(self)

    @functools.cached_property
    def rates(self) -> dict[str, float]:
        """Nominal peak TFLOPS of every dtype the device runs, in :data:`~whalelike.hardware.DTYPES` order."""
        given = None if self.dtype_tflops is None else {"fp32": self.peak_tflops, **self.dtype_tflops}
        return fill_rates(self.kind, self.peak_tflops, given)[0]

    @property
    def bandwidth_gbps(self) -> Optional[float]:
        """The memory bandwidth (GB/s) the planner assumes: ``memory_gbps`` where the spec gives it, else a
        known GPU's data sheet (:func:`whalelike.hardware.memory_gbps`); None for an emulated device (its
        update runs on the host's memory, which no spec sheet describes) or an unknown kind."""
        if self.memory_gbps is not None:
            return self.memory_gbps
        if self.emulated_speed is not None:
            return None
        return hardware_memory_gbps(self.kind, self.memory_gib)

    @functools.cached_property
    def emulated_rates(self) -> dict[str, float]:
        """The emulated speed of every dtype the device runs ({} when not emulated)."""
        if self.emulated_speed is None:
            return {}
        if self.emulated_dtype_speed is None:
            return {dtype: self.emulated_speed for dtype in self.rates}
        given = {"fp32": self.emulated_speed, **self.emulated_dtype_speed}
        return {dtype: given[dtype] for dtype in DTYPES if dtype in given}

    @property
    def precisions(self) -> tuple[str, ...]:
        """The training precisions (:data:`whalelike.config.PRECISIONS`) this device runs."""
        return tuple(p for p in PRECISIONS if p in self.rates)

    def runs(self, precision: str) -> bool:
        """Whether the device runs ``precision`` (a dtype of :data:`whalelike.hardware.DTYPES`)."""
        return precision in self.rates

    def tflops(self, precision: str = "fp32") -> float:
        """Nominal peak TFLOPS at ``precision``; a SpecError naming the device, its kind and the
        precisions it runs when it cannot run it."""
        if precision not in self.rates:
            raise SpecError(cannot_run_message([self], precision, self.precisions))
        return self.rates[precision]

    def measured(self, precision: str = "fp32") -> Optional[float]:
        """Achieved TFLOPS at ``precision``: measured there, else measured at another dtype (fp32
        first) scaled by the ratio of the two peaks, else None (nothing measured)."""
        rate = self.tflops(precision)
        measured = {} if self.measured_tflops is None else {"fp32": self.measured_tflops}
        measured.update(self.measured_dtype_tflops)
        if precision in measured:
            return measured[precision]
        for dtype, value in measured.items():
            return value * rate / self.rates[dtype]
        return None

    def emulated(self, precision: str = "fp32") -> Optional[float]:
        """The emulated speed at ``precision`` (None: not emulated); a SpecError when the device
        cannot run it."""
        self.tflops(precision)   # the error for a precision the device cannot run
        return self.emulated_rates.get(precision)

    def with_measured(self, precision: str, tflops: float) -> "Device":
        """This device with ``tflops`` measured at ``precision``, the only measurement kept (one
        taken at another precision, at another time, would disagree with it)."""
        self.tflops(precision)
        if precision == "fp32":
            return dataclasses.replace(self, measured_tflops=tflops, measured_dtype_tflops={})
        return dataclasses.replace(self, measured_tflops=None, measured_dtype_tflops={precision: tflops})


def _check_table(prefix: str, table: Any, field_name: str, value_rule: Rule) -> dict[str, float]:
    """``table`` as a dict of dtype -> float in DTYPES order, or a SpecError naming the field, the
    bad key or value and the fix."""
    if not isinstance(table, dict):
        raise SpecError(f"{prefix}{field_name} must be a dict of data type -> number, got {table!r}")
    for key, value in table.items():
        if key not in DTYPES:
            close = difflib.get_close_matches(str(key), DTYPES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecError(f"{prefix}{field_name} has unknown data type {key!r}; {hint}the data types are "
                            f"{', '.join(DTYPES)}")
        problem = value_rule.problem(value)
        if problem:
            raise SpecError(f"{prefix}{field_name}[{key!r}] {problem}")
    return {d: float(table[d]) for d in DTYPES if d in table}


_RATE_RULE = Rule(float, "TFLOPS", **_TFLOPS_RULE)
_SPEED_RULE = Rule(float, "relative speed", gt=0)


def _without_fp32(d: "Device", prefix: str, table: dict[str, float], field_name: str, scalar: str) -> dict:
    """``table`` less its fp32 entry, which must equal the scalar field ``scalar`` (set from it when
    the scalar is None)."""
    if "fp32" in table:
        value = getattr(d, scalar)
        if value is None:
            object.__setattr__(d, scalar, table["fp32"])
        elif table["fp32"] != value:
            raise SpecError(f"{prefix}{field_name}['fp32'] is {table['fp32']:g} but {scalar} is {value:g}; they are "
                            "the same figure, give one value")
    return {k: v for k, v in table.items() if k != "fp32"}


def _check_rates(d: "Device") -> None:
    """Check a device's per-dtype figures (see :class:`Device`) and store them without fp32;
    SpecErrors name the device, the field, the bad value and the fix."""
    prefix = f"device {d.name!r}: "
    if d.dtype_tflops is not None:
        given = _without_fp32(d, prefix, _check_table(prefix, d.dtype_tflops, "dtype_tflops", _RATE_RULE),
                              "dtype_tflops", "peak_tflops")
        object.__setattr__(d, "dtype_tflops", given)
        lacking = fill_rates(d.kind, d.peak_tflops, {"fp32": d.peak_tflops, **given})[1]
        if lacking is not None:
            raise SpecError(f"{prefix}peak_tflops rates {lacking}, which a {d.kind} cannot run "
                            f"({lacks_reason(d.kind, lacking)}, by its spec sheet in whalelike.hardware); remove "
                            f"{lacking} from the mapping")
    measured = _without_fp32(d, prefix, _check_table(prefix, d.measured_dtype_tflops, "measured_dtype_tflops",
                                                     _RATE_RULE), "measured_dtype_tflops", "measured_tflops")
    object.__setattr__(d, "measured_dtype_tflops", measured)
    for dtype in measured:
        if dtype not in d.rates:
            raise SpecError(f"{prefix}measured_tflops rates {dtype}, which the device cannot run (its peak_tflops "
                            f"rates {', '.join(d.rates)}); remove {dtype} or add its peak to peak_tflops")
    if d.emulated_dtype_speed is None:
        return
    speeds = _without_fp32(d, prefix, _check_table(prefix, d.emulated_dtype_speed, "emulated_dtype_speed",
                                                   _SPEED_RULE), "emulated_dtype_speed", "emulated_speed")
    object.__setattr__(d, "emulated_dtype_speed", speeds)
    if d.emulated_speed is None:
        raise SpecError(f"{prefix}emulated_speed rates {', '.join(speeds) or 'nothing'} but not fp32; add fp32 (the "
                        "emulated FP32 speed) to the mapping")
    if {"fp32", *speeds} != set(d.rates):
        raise SpecError(f"{prefix}emulated_speed rates {', '.join(['fp32', *speeds])} but peak_tflops rates "
                        f"{', '.join(d.rates)}; the emulated truth and the spec sheet must agree on what the device "
                        "runs: give both as mappings over the same data types")


def cannot_run_message(devices: Sequence["Device"], precision: str, runnable: Sequence[str]) -> str:
    """'V100-16GB cannot run bf16 (no bf16 support): devices v100-0, v100-1; plan with precision fp16
    or fp32 (--precision, Config.precision)': the devices, by kind, that cannot run ``precision``,
    and the precisions ``runnable`` that every device in question runs."""
    kinds: dict[str, list[str]] = {}
    for d in devices:
        kinds.setdefault(d.kind, []).append(d.name)
    parts = []
    for kind, names in kinds.items():
        listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        parts.append(f"{kind} cannot run {precision} ({lacks_reason(kind, precision)}): "
                     f"device{'s' if len(names) > 1 else ''} {listed}")
    others = sorted((p for p in runnable if p != precision), key=lambda p: p == "fp32") or ["fp32"]
    return f"{'; '.join(parts)}; plan with precision {' or '.join(others)} (--precision, Config.precision)"


@dataclass(frozen=True)
class Network:
    """The cluster's links: GB/s between devices on one host and between hosts, and the latency of
    one message; ``collective_latency_us`` and ``collective_gbps``, when ``whalelike profile``
    measured them, are a floor under those figures for ring collectives."""

    intra_host_gbps: float = rule(float, "GB/s between devices on one host", gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY)
    inter_host_gbps: float = rule(float, "GB/s between hosts", gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY)
    latency_us: float = rule(float, "per-message latency in microseconds", ge=0, le=MAX_LATENCY_US,
                             le_why=MAX_LATENCY_WHY)
    # a ring collective's step as measured over the real transport (whalelike profile): a floor under the
    # figures above for collectives, where the transport (or, on emulated devices, the machine) is slower
    collective_latency_us: Optional[float] = rule(
        float, "measured latency of one step of a ring collective (whalelike profile), microseconds; the "
        "collectives' floor under latency_us; default none", ge=0, le=MAX_LATENCY_US, le_why=MAX_LATENCY_WHY,
        default=None)
    collective_gbps: Optional[float] = rule(
        float, "measured GB/s of one step of a ring collective (whalelike profile); the collectives' floor under "
        "the links' GB/s; default none", gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY, default=None)

    def __post_init__(self):
        check_fields(self, "network: ")


STRAGGLER_OPS = ("all", "matmul")


@dataclass(frozen=True)
class Straggler:
    """Multiply the modeled time of ``rank`` by ``factor`` for steps in [start_step, end_step).

    ``ops`` says which compute segments slow down: ``"all"`` (every segment), or ``"matmul"``
    (only segments tagged as matrix multiplications: the FlexTP paper's chi, a device whose matmuls
    are slower while the rest of its work is not). Stage-wide segments are modeled from their FLOPs,
    which are matmul-class FLOPs too, but a ``"matmul"`` straggler leaves them alone, so the
    tensor-parallel benchmarks can slow exactly the matmuls they pad one by one.
    """

    rank: int = rule(int, "rank of the slowed device", ge=0)
    factor: float = rule(float, "slow-down factor, e.g. 3 for three times slower", gt=0)
    start_step: int = rule(int, "first slowed step", ge=0, default=0)
    end_step: Optional[int] = rule(int, "first step at normal speed again", ge=1, default=None)
    ops: str = rule(str, "which segments slow down: 'all', or 'matmul' for matrix multiplications only",
                    choices=STRAGGLER_OPS, default="all")

    def applies(self, rank: int, step: int, kind: str) -> bool:
        """Whether this straggler slows a segment of ``kind`` ('stage' or 'matmul') on ``rank`` at ``step``."""
        in_range = self.start_step <= step and (self.end_step is None or step < self.end_step)
        return rank == self.rank and in_range and (self.ops == "all" or kind == self.ops)

    def __post_init__(self):
        check_fields(self, f"straggler of rank {self.rank!r}: ")
        if self.end_step is not None and self.end_step <= self.start_step:
            raise SpecError(f"straggler of rank {self.rank}: end_step must be > start_step "
                            f"({self.start_step}), got {self.end_step}")


@dataclass(frozen=True)
class Emulation:
    """How the runtime emulates unequal devices on homogeneous hardware.

    modeled time of a segment = (flops / (emulated_speed * base_gflops * 1e9) / efficiency(batch)
    + non-matmul bytes / (emulated_memory_gbps * 1e9)) x straggler factors, efficiency(b) =
    b / (b + h) where h is the device's ``emulated_half_efficiency_batch``, else
    ``half_efficiency_batch`` here, else efficiency is 1; the bytes term only where the device sets
    ``emulated_memory_gbps`` (:meth:`runtime.emulation.compute.Emulator.modeled_seconds`).
    """

    base_gflops: float = rule(float, "GFLOP/s of an emulated device of speed 1", gt=0)
    half_efficiency_batch: Optional[float] = rule(
        float, "batch size at which an emulated device runs at half efficiency (the default of each device's "
        "emulated_half_efficiency_batch)", gt=0, le=MAX_HALF_EFFICIENCY_BATCH, le_why=MAX_HALF_EFFICIENCY_BATCH_WHY,
        default=None)
    stragglers: tuple[Straggler, ...] = ()
    enforce_memory: bool = rule(bool, "each emulated device enforces its memory_gib: a rank whose measured peak "
                                "exceeds it raises an emulated out-of-memory error (memory is then measured on CPU)",
                                default=False)

    def __post_init__(self):
        object.__setattr__(self, "stragglers", tuple(self.stragglers))
        check_fields(self, "emulation: ")


def round_robin_stragglers(ranks: Sequence[int], factor: float, period: int, start_step: int = 0,
                           end_step: Optional[int] = None, ops: str = "all") -> tuple[Straggler, ...]:
    """The FlexTP paper's dynamic scenario: one straggler at a time, rotating over ``ranks``.

    ``ranks[0]`` is slowed by ``factor`` for ``period`` steps from ``start_step``, then ``ranks[1]``,
    and so on, wrapping around, until ``end_step`` (the last straggler is cut there); without
    ``end_step`` the rotation runs once, every rank slowed once. ``ops`` as in :class:`Straggler`.
    Put the result in ``Emulation(stragglers=...)``.
    """
    ranks = list(ranks)
    if not ranks:
        raise SpecError("round_robin_stragglers: ranks must list at least one rank to slow, got []")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise SpecError(f"round_robin_stragglers: period must be an integer >= 1 (steps each rank stays slow), "
                        f"got {period!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise SpecError(f"round_robin_stragglers: factor must be a number > 0 (e.g. 2 for twice slower), "
                        f"got {factor!r}")
    if end_step is None:
        end_step = start_step + period * len(ranks)
    elif end_step <= start_step:
        raise SpecError(f"round_robin_stragglers: end_step must be > start_step ({start_step}), got {end_step}; "
                        "or leave it out for one full rotation")
    stragglers = []
    for index, first in enumerate(range(start_step, end_step, period)):
        stragglers.append(Straggler(rank=ranks[index % len(ranks)], factor=float(factor), start_step=first,
                                    end_step=min(first + period, end_step), ops=ops))
    return tuple(stragglers)


HOST_ENV = "WHALELIKE_HOST"   # the spec host a torchrun agent stands for (membership rule, module docstring)


def member_host(cluster: "Cluster", declared: Optional[str], machine: str) -> Optional[str]:
    """The spec host a node stands for by the membership rule (module docstring): ``declared`` (the
    value of ``WHALELIKE_HOST``, which must name a host of the spec), else the host named ``machine``
    (the machine's host name) or its first label, else a host named ``localhost``; None when no
    host matches (the workers are then the spec's devices in rank order)."""
    hosts = cluster.hosts
    if declared:
        if declared not in hosts:
            close = difflib.get_close_matches(declared, hosts, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecError(f"{HOST_ENV}={declared!r} names no host of cluster {cluster.name!r}; {hint}its hosts are "
                            f"{', '.join(hosts)}")
        return declared
    for candidate in (machine, machine.split(".")[0], "localhost"):
        if candidate in hosts:
            return candidate
    return None


def _names(devices: Sequence["Device"]) -> str:
    return ", ".join(d.name for d in devices) or "none"


@dataclass(frozen=True)
class Cluster:
    """A cluster spec: its devices in rank order, its network and, for emulated hardware, its
    ``emulation`` block (see the module docstring for the file format). Made by
    :meth:`load` (a preset name or a spec file), :meth:`from_yaml`, :meth:`preset` or
    :meth:`from_dict`; checked when built. ``memory_reserved``: the fraction of each device's
    memory already set aside in this view of the cluster (0 as loaded; never written to a file)."""

    name: str
    devices: tuple[Device, ...]     # in rank order
    network: Network
    emulation: Optional[Emulation] = None
    # the planner's view of a cluster (planner.devices.memory.with_reserve): the fraction of each device's
    # memory already set aside, so that its devices' memory_gib are what a plan may fill; 0 as loaded, and
    # never written to a file
    memory_reserved: float = 0.0

    # whalelike.spec.validate: the records check their fields when built, the cluster its invariants
    spec_checks = {"self": lambda cluster: _check_cluster(cluster)}

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        _check_cluster(self)

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(d.host for d in self.devices))

    @functools.cached_property
    def positions(self) -> dict[str, int]:
        """Device name -> its index in the spec: the torchrun rank that runs it (torchrun numbers
        processes host by host, as the spec lists devices)."""
        return {d.name: i for i, d in enumerate(self.devices)}

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def precisions(self, names: Optional[Sequence[str]] = None) -> tuple[str, ...]:
        """The training precisions every device (of ``names``, default all) runs; fp32 always."""
        chosen = self.devices if names is None else [self.device(n) for n in names]
        return tuple(p for p in PRECISIONS if all(d.runs(p) for d in chosen))

    def check_precision(self, precision: str, names: Optional[Sequence[str]] = None) -> None:
        """A SpecError naming, by kind, every device (of ``names``, default all) that cannot run
        ``precision``, and the precisions they all run: ``V100-16GB cannot run bf16 (no bf16
        support): devices v100-0, v100-1; plan with precision fp16 or fp32 (...)``."""
        if precision not in PRECISIONS:
            raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        chosen = self.devices if names is None else [self.device(n) for n in names]
        lacking = [d for d in chosen if not d.runs(precision)]
        if lacking:
            raise SpecError(f"cluster {self.name!r}: " + cannot_run_message(
                lacking, precision, self.precisions([d.name for d in chosen])))

    def device_of(self, host: Optional[str], local_rank: int, rank: int) -> Device:
        """The device a torchrun worker runs, by the membership rule (module docstring): the
        ``local_rank``-th device of ``host`` (from :func:`member_host`), or with no host the device of
        ``rank`` in the spec's order. A SpecError names the host's devices when it has too few."""
        if host is None:
            if rank >= len(self.devices):
                raise SpecError(f"cluster {self.name!r} has {len(self.devices)} devices, and rank {rank} matched no "
                                f"host by name; set {HOST_ENV} on each torchrun agent to the spec host it runs")
            return self.devices[rank]
        mine = [d for d in self.devices if d.host == host]
        if local_rank >= len(mine):
            raise SpecError(f"cluster {self.name!r}: host {host!r} has {len(mine)} device(s) ({_names(mine)}) and a "
                            f"worker of local rank {local_rank} runs there; start at most {len(mine)} workers per "
                            "node (torchrun --nproc-per-node)")
        return mine[local_rank]

    def present(self, names: Sequence[str]) -> "Cluster":
        """The cluster of the devices ``names`` (one per torchrun rank, in rank order): their records,
        the network, and the emulation with its stragglers moved to the ranks their devices have now
        (a straggler of a device not present is dropped). Named ``<name>[k of n]`` when devices are
        missing, so a plan made on it is not taken for one of the whole cluster. A SpecError when a
        device is claimed twice or a host's devices are not consecutive ranks."""
        seen: dict[str, int] = {}
        for rank, name in enumerate(names):
            if name in seen:
                raise SpecError(f"cluster {self.name!r}: ranks {seen[name]} and {rank} both run device {name!r}; "
                                f"two torchrun agents stand for one host: set {HOST_ENV} on each agent to a "
                                f"different host of the spec ({', '.join(self.hosts)})")
            seen[name] = rank
        devices = [self.device(name) for name in names]
        emulation = self.emulation
        if emulation is not None:
            moved = tuple(dataclasses.replace(s, rank=seen[self.devices[s.rank].name])
                          for s in emulation.stragglers if self.devices[s.rank].name in seen)
            emulation = dataclasses.replace(emulation, stragglers=moved)
        name = self.name if len(devices) == len(self.devices) else \
            f"{self.name}[{len(devices)} of {len(self.devices)}]"
        return dataclasses.replace(self, name=name, devices=tuple(devices), emulation=emulation)

    def without_emulation(self) -> "Cluster":
        """The same cluster with emulation off: every device runs at the machine's real speed
        (for exactness tests and for profiling the real hardware)."""
        devices = tuple(dataclasses.replace(d, emulated_speed=None, emulated_dtype_speed=None,
                                            emulated_half_efficiency_batch=None, emulated_memory_gbps=None)
                        for d in self.devices)
        return dataclasses.replace(self, devices=devices, emulation=None)

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Cluster":
        """Load a spec file; errors name the file, the field path, the bad value and the fix."""
        data = load_yaml(path, what="cluster", limit=MAX_FILE_BYTES, limit_why=MAX_FILE_WHY,
                         missing=f"pass a YAML file or one of the presets: {', '.join(cls.preset_names())}")
        return cls.from_dict(data, origin=os.fspath(path))

    @classmethod
    def from_dict(cls, d: Any, origin: str = "<cluster spec>") -> "Cluster":
        """Build a cluster from the file schema (see the module docstring)."""
        return _parse_cluster(d, origin)

    @classmethod
    def preset_names(cls) -> list[str]:
        return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".yaml"))

    @classmethod
    def preset(cls, name: str) -> "Cluster":
        """A built-in cluster: the papers' testbeds and emulated CPU clusters (``preset_names()``)."""
        names = cls.preset_names()
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecError(f"unknown cluster preset {name!r}; {hint}presets: {', '.join(names)} "
                            "(or pass a path to a YAML file)")
        with resources.as_file(resources.files(PRESET_PACKAGE) / f"{name}.yaml") as path:
            return cls.from_yaml(path)

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> "Cluster":
        """A preset by name, or a spec file by path (anything ending in .yaml/.yml or that exists)."""
        text = os.fspath(name_or_path)
        if text.endswith((".yaml", ".yml")) or os.path.sep in text or os.path.exists(text):
            return cls.from_yaml(text)
        return cls.preset(text)

    def to_dict(self) -> dict:
        """The file schema; ``Cluster.from_dict(c.to_dict()) == c`` for every loaded cluster.

        A figure given per dtype is written as a mapping, one given as a number as a number.
        Consecutive identical devices on one host collapse into one entry with a ``count``. Device
        names are not stored: loading regenerates them from the kinds.
        """
        hosts: list[dict] = []
        for d in self.devices:
            if not hosts or hosts[-1]["name"] != d.host:
                hosts.append({"name": d.host, "devices": []})
            entry = {k: v for k, v in _record_dict(d).items() if k not in _GENERATED}
            for key, table_field in _PER_DTYPE.items():
                table = getattr(d, table_field)
                if table is not None and (table or key != "measured_tflops"):
                    entry[key] = {**({"fp32": entry[key]} if key in entry else {}), **table}
            entries = hosts[-1]["devices"]
            if entries and {k: v for k, v in entries[-1].items() if k != "count"} == entry:
                entries[-1]["count"] += 1
            else:
                entries.append({**entry, "count": 1})
        out: dict[str, Any] = {"name": self.name, "network": _record_dict(self.network), "hosts": hosts}
        if self.emulation is not None:
            em = _record_dict(self.emulation)
            em["stragglers"] = [_record_dict(s) for s in self.emulation.stragglers]
            if not em["stragglers"]:
                del em["stragglers"]
            out["emulation"] = em
        return out

    # -- display ---------------------------------------------------------------------------------
    def inventory(self) -> str:
        """One line: 'V100-32GB x8 + P100-16GB x8 on 2 hosts'."""
        counts: dict[str, int] = {}
        for d in self.devices:
            counts[d.kind] = counts.get(d.kind, 0) + 1
        hosts = len(self.hosts)
        kinds = " + ".join(f"{kind} x{n}" for kind, n in counts.items())
        return f"{kinds} on {hosts} host{'s' if hosts > 1 else ''}" + (" (emulated)" if self.emulation else "")

    def summary(self) -> str:
        """An aligned per-device table plus the network and, if any, the emulation settings."""
        emulated = self.emulation is not None
        # the efficiency curve and bandwidth columns only where a device sets them (older specs print as before)
        curves = emulated and any(d.emulated_half_efficiency_batch is not None for d in self.devices)
        bandwidths = emulated and any(d.emulated_memory_gbps is not None for d in self.devices)
        headers = ["rank", "device", "kind", "host", *(f"peak {dtype}" for dtype in DTYPES), "memory",
                   "measured TFLOPS"]
        headers += ["emulated speed"] if emulated else []
        headers += ["half-efficiency batch"] if curves else []
        headers += ["emulated GB/s"] if bandwidths else []
        rows = []
        for rank, d in enumerate(self.devices):
            measured = {**({} if d.measured_tflops is None else {"fp32": d.measured_tflops}), **d.measured_dtype_tflops}
            row = [rank, d.name, d.kind, d.host, *(f"{d.rates[t]:.4g}" if t in d.rates else "-" for t in DTYPES),
                   f"{d.memory_gib:g} GiB",
                   "-" if not measured else (f"{d.measured_tflops:g}" if list(measured) == ["fp32"]
                                             else ", ".join(f"{t} {v:g}" for t, v in measured.items()))]
            if emulated:
                row.append(f"{d.emulated_speed:g}x" if d.emulated_dtype_speed is None
                           else ", ".join(f"{t} {v:g}x" for t, v in d.emulated_rates.items()))
            if curves:
                batch = d.emulated_half_efficiency_batch
                if batch is None:
                    batch = self.emulation.half_efficiency_batch
                row.append("-" if batch is None else f"{batch:g}")
            if bandwidths:
                row.append("-" if d.emulated_memory_gbps is None else f"{d.emulated_memory_gbps:g}")
            rows.append(row)
        total_tflops = sum(d.peak_tflops for d in self.devices)
        total_gib = sum(d.memory_gib for d in self.devices)
        title = f"cluster {self.name}: {self.inventory()}, {total_tflops:.4g} peak TFLOPS, {total_gib:g} GiB"
        net = self.network
        lines = [format_table(headers, rows, title=title),
                 "peak TFLOPS per data type ('-': the device cannot run it; a known GPU's unlisted figures from its "
                 "spec sheet, whalelike.hardware)",
                 f"network: {net.intra_host_gbps:g} GB/s within a host, {net.inter_host_gbps:g} GB/s "
                 f"between hosts, {net.latency_us:g} us latency"
                 + ("" if net.collective_latency_us is None and net.collective_gbps is None else
                    "; a collective's ring step no faster than "
                    + " and ".join(x for x in (f"{net.collective_latency_us:g} us" if net.collective_latency_us
                                               is not None else "", f"{net.collective_gbps:g} GB/s"
                                               if net.collective_gbps is not None else "") if x)
                    + " (measured)")]
        if emulated:
            em = self.emulation
            curve = ("" if em.half_efficiency_batch is None
                     else f", half efficiency at batch {em.half_efficiency_batch:g}")
            curve += ("" if not bandwidths else
                      "; non-matmul bytes at each device's emulated GB/s ('-': free)")
            lines.append(f"emulation (testing): speed 1 = {em.base_gflops:g} GFLOP/s{curve}")
            lines.extend(f"  straggler: rank {s.rank} x{s.factor:g}" + (" (matmuls only)" if s.ops == "matmul" else "")
                         + f" from step {s.start_step}" + ("" if s.end_step is None else f" to {s.end_step}")
                         for s in em.stragglers)
        return "\n".join(lines)


def _record_dict(record: Any) -> dict:
    return {f.name: getattr(record, f.name) for f in fields(record)
            if rule_of(f) is not None and getattr(record, f.name) is not None}


def _device_stem(kind: str, kinds: set[str]) -> str:
    """Readable stem of device names: 'V100-32GB' -> 'v100', 'RTX-3090' -> 'rtx-3090' (the first
    part that names a model number), the full kind 'a100-80gb' when another kind shares the stem."""
    def slug(k: str) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", k.lower()).strip("-")

    def stem(k: str) -> str:
        parts = slug(k).split("-")
        for i, part in enumerate(parts):
            if any(ch.isdigit() for ch in part):
                return "-".join(parts[:i + 1])
        return slug(k)

    clash = any(stem(k) == stem(kind) and k != kind for k in kinds)
    return slug(kind) if clash else stem(kind)


def _check_cluster(c: Cluster) -> None:
    """Invariants across records: names, rank order by host, emulation all-or-nothing."""
    if not isinstance(c.name, str) or not c.name.strip():
        raise SpecError(f"cluster name must be a non-empty string, got {c.name!r}")
    if not c.devices:
        raise SpecError(f"cluster {c.name!r} has no devices; list at least one host with one device")
    if not (isinstance(c.memory_reserved, (int, float)) and 0 <= c.memory_reserved < 1):
        raise SpecError(f"cluster {c.name!r}: memory_reserved must be in [0, 1) (a fraction of each device's memory "
                        f"set aside), got {c.memory_reserved!r}")
    if len(c.devices) > MAX_DEVICES:
        raise SpecError(f"cluster {c.name!r} has {len(c.devices):,} devices, more than {MAX_DEVICES:,} "
                        f"({MAX_DEVICES_WHY})")
    seen: set[str] = set()
    for d in c.devices:
        if d.name in seen:
            raise SpecError(f"cluster {c.name!r}: device name {d.name!r} is used twice; device names must be unique")
        seen.add(d.name)
    finished: set[str] = set()
    for prev, d in zip(c.devices, c.devices[1:]):
        if d.host != prev.host:
            finished.add(prev.host)
            if d.host in finished:
                raise SpecError(f"cluster {c.name!r}: devices of host {d.host!r} are not consecutive (device "
                                f"{d.name!r}); list each host's devices together, torchrun numbers ranks host by host")
    if c.emulation is None:
        for d in c.devices:
            for name in _EMULATED_FIELDS:
                if getattr(d, name) is not None:
                    raise SpecError(f"cluster {c.name!r}: device {d.name!r} sets {name} but the cluster has no "
                                    "emulation block; add `emulation: {base_gflops: 2.0}` or remove "
                                    f"{name} ({getattr(d, name):g}, a figure of emulated hardware only)")
        return
    for d in c.devices:
        if d.emulated_speed is None:
            raise SpecError(f"cluster {c.name!r}: the cluster is emulated but device {d.name!r} has no emulated_speed; "
                            "give every device an emulated_speed (1.0 = base_gflops) or remove the emulation block")
    for s in c.emulation.stragglers:
        if s.rank >= len(c.devices):
            raise SpecError(f"cluster {c.name!r}: straggler rank {s.rank} does not exist; ranks are "
                            f"0..{len(c.devices) - 1}")


# the device fields that are the emulator's hidden truth, each an error on a cluster without emulation
_EMULATED_FIELDS = ("emulated_speed", "emulated_half_efficiency_batch", "emulated_memory_gbps")


# -- the file schema -------------------------------------------------------------------------------
_TOP_RULES = {"name": Rule(str, "cluster name"), "network": None, "hosts": None, "emulation": None}
_HOST_RULES = {"name": Rule(str, "host name"), "devices": None}
_GENERATED = ("name", "host")  # device fields a file does not set: from the kind and the enclosing host
# file key (a number: the FP32 figure, or a mapping of dtype -> figure) -> the Device field of the other dtypes
_PER_DTYPE = {"peak_tflops": "dtype_tflops", "measured_tflops": "measured_dtype_tflops",
              "emulated_speed": "emulated_dtype_speed"}
_DEVICE_RULES = {**{k: v for k, v in rules(Device).items() if k not in _GENERATED and k not in _PER_DTYPE.values()},
                 "count": Rule(int, "number of identical devices", gt=0, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)}
_DEVICE_REQUIRED = required(Device) - set(_GENERATED)
# what a mapping's entries must be: a peak's and a measurement's fp32 required in a peak mapping (the
# figure the rest of the code reads), optional in a measurement (taken at any precision)
_DTYPE_KEYS = {
    "peak_tflops": ({d: Rule(float, f"{d} peak TFLOPS", **_TFLOPS_RULE) for d in DTYPES}, {"fp32"}),
    "measured_tflops": ({d: Rule(float, f"achieved {d} TFLOPS", **_TFLOPS_RULE) for d in DTYPES}, set()),
    "emulated_speed": ({d: Rule(float, f"relative {d} speed", gt=0) for d in DTYPES}, {"fp32"}),
}


def _read_rates(r: Reader, entry: dict, path: str) -> dict:
    """A device entry's figures as Device fields: each of ``peak_tflops``, ``measured_tflops`` and
    ``emulated_speed`` a number (FP32) or a mapping of dtype -> number (the fp32 entry to the scalar
    field, the rest to the per-dtype field); errors name the file, the path and the fix."""
    out = dict(entry)
    for key, table_field in _PER_DTYPE.items():
        value = entry.get(key)
        where = f"{path}.{key}"
        scalar_rule = _DEVICE_RULES[key]
        if value is None and key not in _DEVICE_REQUIRED:
            continue
        if not isinstance(value, dict):
            out[key] = r.scalar(value, scalar_rule, where)
            continue
        keys, needed = _DTYPE_KEYS[key]
        if not value:
            raise r.fail(f"{where} is an empty mapping; give a number (the FP32 figure) or a mapping of "
                         f"{', '.join(DTYPES)} to figures")
        if needed - value.keys():
            raise r.fail(f"{where}: a mapping of rates needs fp32 (the FP32 figure the rest of whalelike reads, "
                         f"e.g. {{fp32: 19.5, bf16: 312}}); add fp32, or give a bare number for FP32 alone")
        table = r.mapping(value, where, keys, needed)
        out[key] = table.pop("fp32", None)
        out[table_field] = table
    return out


def _parse_cluster(data: Any, origin: str) -> Cluster:
    r = Reader(origin)
    top = r.mapping(data, "", _TOP_RULES, {"name", "network", "hosts"})
    network = r.record(Network, top["network"], "network")

    entries: list[tuple[str, dict]] = []
    host_index: dict[str, int] = {}
    total = 0
    for h, host in enumerate(r.sequence(top["hosts"], "hosts", "hosts ({name, devices})")):
        path = f"hosts[{h}]"
        host = r.mapping(host, path, _HOST_RULES, {"name", "devices"})
        if host["name"] in host_index:
            raise r.fail(f"{path}.name: duplicate host name {host['name']!r} (also hosts[{host_index[host['name']]}]); "
                         "host names must be unique, list all devices of a host under one entry")
        host_index[host["name"]] = h
        for i, dev in enumerate(r.sequence(host["devices"], f"{path}.devices", "devices ({kind, count, ...})")):
            where = f"{path}.devices[{i}]"
            entry = r.mapping(dev, where, _DEVICE_RULES, _DEVICE_REQUIRED, check_values=False)
            for key, item in entry.items():
                if key not in _PER_DTYPE and (item is not None or key in _DEVICE_REQUIRED):
                    entry[key] = r.scalar(item, _DEVICE_RULES[key], f"{where}.{key}")
            entry = _read_rates(r, entry, where)
            total += entry.get("count", 1)
            if total > MAX_DEVICES:
                raise r.fail(f"{where}: the cluster has more than {MAX_DEVICES:,} devices up to here, "
                             f"the most a spec may list ({MAX_DEVICES_WHY}); check the counts")
            entries.append((host["name"], where, entry))

    kinds = {dev["kind"] for _, _, dev in entries}
    counters: dict[str, int] = {}
    devices = []
    for host_name, where, dev in entries:
        base = _device_stem(dev["kind"], kinds)
        spec = {k: v for k, v in dev.items() if k != "count" and v is not None}
        for _ in range(dev.get("count", 1)):
            index = counters.get(base, 0)
            counters[base] = index + 1
            devices.append(r.build(Device, {"name": f"{base}-{index}", "host": host_name, **spec}, where))

    emulation = None
    if top.get("emulation") is not None:
        emulation = r.record(Emulation, top["emulation"], "emulation")
    return r.build(Cluster, {"name": top["name"], "devices": devices, "network": network,
                             "emulation": emulation}, "")
