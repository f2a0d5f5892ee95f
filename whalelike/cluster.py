"""Cluster specs: hosts, devices and network, from YAML or a built-in preset.

The *nominal* figures (``peak_tflops``, ``measured_tflops``) are what the planner may read. The
``emulated_speed`` of a device and the ``emulation`` block are the hidden truth of the emulated
"hardware" (DESIGN.md section 4): only the runtime's emulator reads them.

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

The dataclass fields double as the file schema: each field's metadata says its type, bound and
meaning, so a value is checked by the same rule whether it comes from a file (the error names the
file and the field path) or from Python code (the error names the object).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from importlib import resources
from typing import Any, Mapping, Optional, Sequence

import yaml

from .display import format_table
from .errors import SpecError

PRESET_PACKAGE = "whalelike.presets"


# -- field rules -----------------------------------------------------------------------------------
def _meta(kind: type, doc: str, gt: Optional[float] = None, ge: Optional[float] = None,
          choices: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    return {"type": kind, "gt": gt, "ge": ge, "doc": doc, "choices": choices}


def _rule(kind: type, doc: str, *, gt: Optional[float] = None, ge: Optional[float] = None,
          choices: Optional[tuple[str, ...]] = None, **kw) -> Any:
    """A dataclass field whose metadata holds its type (str, int or float), bound (or, for a
    string, its allowed values) and meaning."""
    return field(metadata=_meta(kind, doc, gt, ge, choices), **kw)


_KIND_TEXT = {str: "a non-empty string", int: "an integer", float: "a number"}


def _problem(value: Any, meta: Mapping[str, Any]) -> Optional[str]:
    """Why ``value`` breaks the rule in ``meta`` (as 'must be ..., got ...'), or None."""
    kind = meta["type"]
    if kind is str:
        ok = isinstance(value, str) and bool(value.strip())
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        return f"must be {_KIND_TEXT[kind]} ({meta['doc']}), got {value!r}"
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        return f"must be one of {allowed} ({meta['doc']}), got {value!r}"
    if meta["gt"] is not None and not value > meta["gt"]:
        return f"must be > {meta['gt']:g}, got {value!r}"
    if meta["ge"] is not None and not value >= meta["ge"]:
        return f"must be >= {meta['ge']:g}, got {value!r}"
    return None


def _check_fields(obj: Any, label: str) -> None:
    """Validate every field of a constructed record against its rule (None means 'not set')."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "type" in f.metadata and value is not None:
            problem = _problem(value, f.metadata)
            if problem:
                raise SpecError(f"{label}: {f.name} {problem}")


# -- the records -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str = _rule(str, "unique device name, e.g. 'v100-0'")
    kind: str = _rule(str, "device model, e.g. 'V100-32GB'")
    host: str = _rule(str, "host name")
    peak_tflops: float = _rule(float, "nominal peak TFLOPS from the spec sheet, e.g. 15.7", gt=0)
    memory_gib: float = _rule(float, "device memory in GiB, e.g. 32", gt=0)
    # achieved TFLOPS from profiling, preferred by the planner
    measured_tflops: Optional[float] = _rule(float, "achieved TFLOPS from profiling", gt=0, default=None)
    # relative speed of an emulated device (runtime only)
    emulated_speed: Optional[float] = _rule(float, "relative speed of the emulated device, e.g. 0.5",
                                            gt=0, default=None)

    def __post_init__(self):
        _check_fields(self, f"device {self.name!r}")


@dataclass(frozen=True)
class Network:
    intra_host_gbps: float = _rule(float, "GB/s between devices on one host", gt=0)
    inter_host_gbps: float = _rule(float, "GB/s between hosts", gt=0)
    latency_us: float = _rule(float, "per-message latency in microseconds", ge=0)

    def __post_init__(self):
        _check_fields(self, "network")


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

    rank: int = _rule(int, "rank of the slowed device", ge=0)
    factor: float = _rule(float, "slow-down factor, e.g. 3 for three times slower", gt=0)
    start_step: int = _rule(int, "first slowed step", ge=0, default=0)
    end_step: Optional[int] = _rule(int, "first step at normal speed again", ge=1, default=None)
    ops: str = _rule(str, "which segments slow down: 'all', or 'matmul' for matrix multiplications only",
                     choices=STRAGGLER_OPS, default="all")

    def applies(self, rank: int, step: int, kind: str) -> bool:
        """Whether this straggler slows a segment of ``kind`` ('stage' or 'matmul') on ``rank`` at ``step``."""
        in_range = self.start_step <= step and (self.end_step is None or step < self.end_step)
        return rank == self.rank and in_range and (self.ops == "all" or kind == self.ops)

    def __post_init__(self):
        _check_fields(self, f"straggler of rank {self.rank!r}")
        if self.end_step is not None and self.end_step <= self.start_step:
            raise SpecError(f"straggler of rank {self.rank}: end_step must be > start_step "
                            f"({self.start_step}), got {self.end_step}")


@dataclass(frozen=True)
class Emulation:
    """How the runtime emulates unequal devices on homogeneous hardware.

    modeled time of a segment = flops / (emulated_speed * base_gflops * 1e9) / efficiency(batch),
    efficiency(b) = b / (b + half_efficiency_batch) when ``half_efficiency_batch`` is set, else 1.
    """

    base_gflops: float = _rule(float, "GFLOP/s of an emulated device of speed 1", gt=0)
    half_efficiency_batch: Optional[float] = _rule(
        float, "batch size at which an emulated device runs at half efficiency", gt=0, default=None)
    stragglers: tuple[Straggler, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stragglers", tuple(self.stragglers))
        _check_fields(self, "emulation")


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
        origin = os.fspath(path)
        try:
            with open(origin) as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            raise SpecError(f"{origin}: no such cluster file; pass a YAML file or one of the presets: "
                            f"{', '.join(cls.preset_names())}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise SpecError(f"{origin}: {where}malformed YAML ({problem}); check the indentation and "
                            "the brackets there") from None
        return cls.from_dict(data, origin=origin)

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
            if "type" in f.metadata and getattr(record, f.name) is not None}


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
def _rules(cls: type) -> dict[str, Optional[dict]]:
    """Field name -> rule of a record type; None for a field whose value is a nested record."""
    return {f.name: (dict(f.metadata) if "type" in f.metadata else None) for f in fields(cls)}


def _required(cls: type) -> set[str]:
    return {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}


_TOP_RULES = {"name": _meta(str, "cluster name"), "network": None, "hosts": None, "emulation": None}
_HOST_RULES = {"name": _meta(str, "host name"), "devices": None}
_GENERATED = ("name", "host")  # device fields a file does not set: from the kind and the enclosing host
_DEVICE_RULES = {**{k: v for k, v in _rules(Device).items() if k not in _GENERATED},
                 "count": _meta(int, "number of identical devices", gt=0)}
_DEVICE_REQUIRED = _required(Device) - set(_GENERATED)


class _Reader:
    """Walks a parsed spec file; every error names the file and the field path."""

    def __init__(self, origin: str):
        self.origin = origin

    def fail(self, message: str) -> SpecError:
        return SpecError(f"{self.origin}: {message}")

    def mapping(self, value: Any, path: str, rules: Mapping[str, Optional[dict]], required: set[str]) -> dict:
        """Check keys (unknown, missing) and the values that have a rule; return the mapping."""
        if not isinstance(value, dict):
            got = "an empty file" if value is None and not path else repr(value)
            where = path or "the top level"
            raise self.fail(f"{where} must be a mapping with keys {', '.join(rules)}, got {got}")
        for key in value:
            if key not in rules:
                close = difflib.get_close_matches(str(key), list(rules), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(rules)}"
                raise self.fail(f"{_join(path, key)}: unknown key; {hint}")
        for key in sorted(required - value.keys()):
            doc = f" ({rules[key]['doc']})" if rules[key] else ""
            raise self.fail(f"{path or 'the top level'}: missing required key {key!r}{doc}")
        for key, v in value.items():
            rule = rules[key]
            if rule is not None and (v is not None or key in required):
                problem = _problem(v, rule)
                if problem:
                    raise self.fail(f"{_join(path, key)} {problem}")
        return value

    def sequence(self, value: Any, path: str, what: str, allow_empty: bool = False) -> list:
        if not isinstance(value, list) or (not value and not allow_empty):
            raise self.fail(f"{path} must be a {'' if allow_empty else 'non-empty '}list of {what}, got {value!r}")
        return value

    def build(self, cls: type, values: Mapping[str, Any], path: str) -> Any:
        """Construct a record; its own cross-field checks get the file (and path) prefixed."""
        try:
            return cls(**values)
        except SpecError as e:
            raise self.fail(f"{path}: {e}" if path else str(e)) from None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _parse_cluster(data: Any, origin: str) -> Cluster:
    r = _Reader(origin)
    top = r.mapping(data, "", _TOP_RULES, {"name", "network", "hosts"})
    network = r.build(Network, r.mapping(top["network"], "network", _rules(Network), _required(Network)), "network")

    entries: list[tuple[str, dict]] = []
    host_index: dict[str, int] = {}
    for h, host in enumerate(r.sequence(top["hosts"], "hosts", "hosts ({name, devices})")):
        path = f"hosts[{h}]"
        host = r.mapping(host, path, _HOST_RULES, {"name", "devices"})
        if host["name"] in host_index:
            raise r.fail(f"{path}.name: duplicate host name {host['name']!r} (also hosts[{host_index[host['name']]}]); "
                         "host names must be unique, list all devices of a host under one entry")
        host_index[host["name"]] = h
        for i, dev in enumerate(r.sequence(host["devices"], f"{path}.devices", "devices ({kind, count, ...})")):
            entries.append((host["name"], r.mapping(dev, f"{path}.devices[{i}]", _DEVICE_RULES, _DEVICE_REQUIRED)))

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
        em = r.mapping(top["emulation"], "emulation", _rules(Emulation), _required(Emulation))
        stragglers = []
        listed = em.get("stragglers")
        for i, s in enumerate(r.sequence([] if listed is None else listed, "emulation.stragglers",
                                         "stragglers ({rank, factor, start_step, end_step, ops})", allow_empty=True)):
            path = f"emulation.stragglers[{i}]"
            stragglers.append(r.build(Straggler, r.mapping(s, path, _rules(Straggler), _required(Straggler)), path))
        emulation = r.build(Emulation, {**em, "stragglers": tuple(stragglers)}, "emulation")
    return r.build(Cluster, {"name": top["name"], "devices": devices, "network": network,
                             "emulation": emulation}, "")
