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

Devices get ranks in the order they are listed (hosts in order; torchrun numbers ranks host by
host) and readable unique names: ``v100-0`` ... ``p100-7`` (the full kind, ``a100-80gb-0``, when
two kinds share a short name). An optional ``emulation`` block turns the cluster into emulated
hardware for testing; then *every* device needs an ``emulated_speed``, and ``emulated_speed`` is
an error without the block: a half-emulated cluster would pad some ranks and not others.

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
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any, Optional, Sequence

from whalelike.display import format_table
from whalelike.errors import SpecError
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
# A spec of the most devices allowed, 8 per host, is about 250 KiB; parsing a 40 MiB spec took PyYAML
# (libyaml) 100 s and 3 GiB on the development machine. Larger files are refused before parsing.
MAX_FILE_BYTES = 1 << 20
MAX_FILE_WHY = "a real spec is a few KiB, and YAML this large takes minutes and GiBs to parse"


# -- the records -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str = rule(str, "unique device name, e.g. 'v100-0'")
    kind: str = rule(str, "device model, e.g. 'V100-32GB'")
    host: str = rule(str, "host name")
    peak_tflops: float = rule(float, "nominal peak TFLOPS from the spec sheet, e.g. 15.7", gt=0,
                              le=MAX_TFLOPS, le_why=MAX_TFLOPS_WHY)
    memory_gib: float = rule(float, "device memory in GiB, e.g. 32", gt=0, le=MAX_MEMORY_GIB, le_why=MAX_MEMORY_WHY)
    # achieved TFLOPS from profiling, preferred by the planner
    measured_tflops: Optional[float] = rule(float, "achieved TFLOPS from profiling", gt=0, le=MAX_TFLOPS,
                                            le_why=MAX_TFLOPS_WHY, default=None)
    # relative speed of an emulated device (runtime only)
    emulated_speed: Optional[float] = rule(float, "relative speed of the emulated device, e.g. 0.5",
                                           gt=0, default=None)

    def __post_init__(self):
        check_fields(self, f"device {self.name!r}: ")


@dataclass(frozen=True)
class Network:
    intra_host_gbps: float = rule(float, "GB/s between devices on one host", gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY)
    inter_host_gbps: float = rule(float, "GB/s between hosts", gt=0, le=MAX_GBPS, le_why=MAX_GBPS_WHY)
    latency_us: float = rule(float, "per-message latency in microseconds", ge=0, le=MAX_LATENCY_US,
                             le_why=MAX_LATENCY_WHY)

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

    modeled time of a segment = flops / (emulated_speed * base_gflops * 1e9) / efficiency(batch),
    efficiency(b) = b / (b + half_efficiency_batch) when ``half_efficiency_batch`` is set, else 1.
    """

    base_gflops: float = rule(float, "GFLOP/s of an emulated device of speed 1", gt=0)
    half_efficiency_batch: Optional[float] = rule(
        float, "batch size at which an emulated device runs at half efficiency", gt=0, default=None)
    stragglers: tuple[Straggler, ...] = ()

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


@dataclass(frozen=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]     # in rank order
    network: Network
    emulation: Optional[Emulation] = None

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

    def without_emulation(self) -> "Cluster":
        """The same cluster with emulation off: every device runs at the machine's real speed
        (for exactness tests and for profiling the real hardware)."""
        devices = tuple(dataclasses.replace(d, emulated_speed=None) for d in self.devices)
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

        Consecutive identical devices on one host collapse into one entry with a ``count``. Device
        names are not stored: loading regenerates them from the kinds.
        """
        hosts: list[dict] = []
        for d in self.devices:
            if not hosts or hosts[-1]["name"] != d.host:
                hosts.append({"name": d.host, "devices": []})
            entry = {k: v for k, v in _record_dict(d).items() if k not in _GENERATED}
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
        headers = ["rank", "device", "kind", "host", "peak TFLOPS", "memory", "measured TFLOPS"]
        headers += ["emulated speed"] if emulated else []
        rows = []
        for rank, d in enumerate(self.devices):
            row = [rank, d.name, d.kind, d.host, f"{d.peak_tflops:g}", f"{d.memory_gib:g} GiB",
                   "-" if d.measured_tflops is None else f"{d.measured_tflops:g}"]
            rows.append(row + ([f"{d.emulated_speed:g}x"] if emulated else []))
        total_tflops = sum(d.peak_tflops for d in self.devices)
        total_gib = sum(d.memory_gib for d in self.devices)
        title = f"cluster {self.name}: {self.inventory()}, {total_tflops:.4g} peak TFLOPS, {total_gib:g} GiB"
        net = self.network
        lines = [format_table(headers, rows, title=title),
                 f"network: {net.intra_host_gbps:g} GB/s within a host, {net.inter_host_gbps:g} GB/s "
                 f"between hosts, {net.latency_us:g} us latency"]
        if emulated:
            em = self.emulation
            curve = ("" if em.half_efficiency_batch is None
                     else f", half efficiency at batch {em.half_efficiency_batch:g}")
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
            if d.emulated_speed is not None:
                raise SpecError(f"cluster {c.name!r}: device {d.name!r} sets emulated_speed but the cluster has no "
                                "emulation block; add `emulation: {base_gflops: 2.0}` or remove emulated_speed")
        return
    for d in c.devices:
        if d.emulated_speed is None:
            raise SpecError(f"cluster {c.name!r}: the cluster is emulated but device {d.name!r} has no emulated_speed; "
                            "give every device an emulated_speed (1.0 = base_gflops) or remove the emulation block")
    for s in c.emulation.stragglers:
        if s.rank >= len(c.devices):
            raise SpecError(f"cluster {c.name!r}: straggler rank {s.rank} does not exist; ranks are "
                            f"0..{len(c.devices) - 1}")


# -- the file schema -------------------------------------------------------------------------------
_TOP_RULES = {"name": Rule(str, "cluster name"), "network": None, "hosts": None, "emulation": None}
_HOST_RULES = {"name": Rule(str, "host name"), "devices": None}
_GENERATED = ("name", "host")  # device fields a file does not set: from the kind and the enclosing host
_DEVICE_RULES = {**{k: v for k, v in rules(Device).items() if k not in _GENERATED},
                 "count": Rule(int, "number of identical devices", gt=0, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)}
_DEVICE_REQUIRED = required(Device) - set(_GENERATED)


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
            entry = r.mapping(dev, f"{path}.devices[{i}]", _DEVICE_RULES, _DEVICE_REQUIRED)
            total += entry.get("count", 1)
            if total > MAX_DEVICES:
                raise r.fail(f"{path}.devices[{i}]: the cluster has more than {MAX_DEVICES:,} devices up to here, "
                             f"the most a spec may list ({MAX_DEVICES_WHY}); check the counts")
            entries.append((host["name"], entry))

    kinds = {dev["kind"] for _, dev in entries}
    counters: dict[str, int] = {}
    devices = []
    for host_name, dev in entries:
        base = _device_stem(dev["kind"], kinds)
        spec = {k: v for k, v in dev.items() if k != "count"}
        for _ in range(dev.get("count", 1)):
            index = counters.get(base, 0)
            counters[base] = index + 1
            devices.append(Device(name=f"{base}-{index}", host=host_name, **spec))

    emulation = None
    if top.get("emulation") is not None:
        emulation = r.record(Emulation, top["emulation"], "emulation")
    return r.build(Cluster, {"name": top["name"], "devices": devices, "network": network,
                             "emulation": emulation}, "")
