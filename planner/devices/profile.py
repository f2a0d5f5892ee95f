"""A measured profile of a cluster for one model: what each device really does, as plain data.

``whalelike profile`` (:mod:`runtime.profiling`, Poplar's online profiling, seed paper 002) runs
one rank per device and measures, for one model at one precision: every unit's (TaskGraph's, or
Layer's) forward and backward seconds against micro-batch size, the largest micro-batch that fits
(Poplar's Algorithm 1) and the peak memory of a training step at each batch, and the latency and
bandwidth of the links within a host and between hosts (an alpha-beta fit of timed transfers).
The planner reads it here; nothing in this module measures.

The API the planner reads (every figure in seconds, bytes and samples; units are numbered as
``TaskGraphs.graphs`` or ``TaskGraphs.layers``, per ``Profile.unit``):

* ``profile.devices``: one :class:`DeviceProfile` per device, in rank order; ``profile.device(name)``;
* ``device.kind``, ``device.host``;
* ``device.times[unit][batch] == (forward_s, backward_s)``: medians of ``repeats`` timed steps after
  ``warmup`` steps, each the wall time of the unit's compute segment (collectives excluded, as
  Poplar subtracts them); the same batches for every unit: the powers of two that fit, and
  ``max_batch``;
* ``device.max_batch``: the largest micro-batch whose training step (forward, loss, backward,
  optimizer step, the whole model on the device) fits; ``device.edge`` says how it was found,
  ``"memory"`` (``max_batch + 1`` ran out of memory) or ``"cap"`` (the profiling cap fitted: the
  edge lies beyond); ``device.memory_bytes[batch]``: that step's measured peak;
  ``device.capacity_bytes``: the memory it was checked against (None: no limit was enforced);
* ``device.action_overhead_s``: a timed step's wall time outside its compute segments (the step's
  Python, autograd's dispatch, the loss's bookkeeping) per unit forward or backward, the median
  over the timed steps: what the planner adds to each compute action of a worker on the device
  (``Worker.action_overhead_ms``; 0: not measured);
* ``device.update_ns_per_byte``: the optimizer's update (``optimizer.step()`` over the whole model on
  the device, the median of ``repeats`` after a step's backward) per byte of parameters, the rate
  the planner prices each worker's update at (:func:`planner.assemble.update_ms`; 0: not measured);
* ``device.step_seconds(batch)``, ``device.curve(unit=None, phase="both")``: a
  :class:`planner.devices.speed_curves.SpeedCurve` of seconds per sample (PCHIP through the points);
* ``profile.links``: one :class:`LinkProfile` per kind of link measured (``"intra-host"``,
  ``"inter-host"``: :data:`planner.devices.network.INTRA_HOST`, ``INTER_HOST``), ``profile.link(kind)``:
  ``latency_s`` (alpha) and ``seconds_per_byte`` (beta), ``time_s(nbytes)``, ``gbps``, ``latency_us``
  (the cluster spec's units), and the timed ``points`` (bytes -> one-way seconds, the fastest of
  the repeats: :mod:`runtime.profiling.links`); and kind ``"collective"``: a ring all-reduce over every
  device, ``points`` its seconds per size, ``latency_s`` and ``seconds_per_byte`` one ring step's (a floor
  under every ring the planner prices: ``Network.collective_latency_us``, ``collective_gbps``).

A profile answers for one model (``model_fingerprint``, :attr:`whalelike.graphs.taskgraph.TaskGraphs.fingerprint`),
one cluster (its devices by name, kind and host) and one ``precision``: :meth:`Profile.validate`
(``graphs=``, ``cluster=``) and :meth:`Profile.check_precision` refuse any other with a
:class:`ProfileError` saying how to measure the right one; the rules live in
:mod:`whalelike.spec` (the one validation layer), the file is YAML written through
:mod:`whalelike.files` (the one writer) and read with :class:`whalelike.spec.Reader` (a corrupt
or edited file is an error naming the file and the field).

Invariant: a Profile is exactly what was measured (no figure is derived from the spec sheet or
the emulation block), and ``Profile.from_yaml(p.to_yaml(path)) == p``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from planner.devices.speed_curves import SpeedCurve, device_curve
from whalelike.config import OPTIMIZERS, PRECISIONS
from whalelike.display import format_table
from whalelike.files import write_yaml
from whalelike.spec import (PROFILE_EDGES, PROFILE_LINK_KINDS, PROFILE_UNITS, ProfileError, Reader, check_profile,
                            check_profile_cluster, check_profile_model, check_profile_precision, load_yaml, rule,
                            validate)

__all__ = ["DeviceProfile", "LinkProfile", "Profile", "ProfileError", "PROFILE_SCHEMA_VERSION"]

PROFILE_SCHEMA_VERSION = 1
# 1,000 devices x 50 units x 12 batches is about 20 MiB of YAML; larger files are refused before parsing
MAX_FILE_BYTES = 32 << 20
MAX_FILE_WHY = ("a profile of a thousand devices with fifty units each is about 20 MiB, and YAML this large takes "
                "minutes to parse")


@dataclass(frozen=True)
class DeviceProfile:
    """One device's measured figures (see the module docstring for each field)."""

    name: str = rule(str, "device name in the cluster spec, e.g. 'v100-0'")
    kind: str = rule(str, "device model, e.g. 'V100-32GB'")
    host: str = rule(str, "host name")
    max_batch: int = rule(int, "largest micro-batch whose training step fits", ge=1)
    edge: str = rule(str, "how max_batch was found: 'memory' (one more sample ran out of memory) or 'cap' (the "
                     "profiling cap fitted)", choices=PROFILE_EDGES)
    times: dict[int, dict[int, tuple[float, float]]] = rule(
        float, "unit -> batch -> [forward seconds, backward seconds]", ge=0)
    memory_bytes: dict[int, int] = rule(int, "batch -> measured peak bytes of a training step", ge=0)
    capacity_bytes: Optional[int] = rule(int, "memory the device was checked against, in bytes", ge=1, default=None)
    cached: bool = rule(bool, "the figures came from the profile cache, measured in an earlier run", default=False)
    action_overhead_s: float = rule(float, "a timed step's wall time outside its compute segments, per unit forward "
                                    "or backward (the median over the timed steps); 0: not measured (a profile or "
                                    "cache entry made before it was)", ge=0, default=0.0)
    update_ns_per_byte: float = rule(float, "the optimizer's update (the profile's optimizer, every parameter of the "
                                     "model on the device), nanoseconds per byte of parameters; 0: not measured "
                                     "(a profile or cache entry made before it was)", ge=0, default=0.0)

    @property
    def batches(self) -> list[int]:
        """The timed batch sizes, ascending (the same for every unit)."""
        return sorted(next(iter(self.times.values())))

    def step_seconds(self, batch: int) -> float:
        """Forward plus backward seconds of every unit at a timed ``batch``."""
        return sum(sum(points[batch]) for points in self.times.values())

    def curve(self, unit: Optional[int] = None, phase: str = "both") -> SpeedCurve:
        """Seconds per sample against batch size (:func:`planner.devices.speed_curves.device_curve`)."""
        return device_curve(self, unit, phase)


@dataclass(frozen=True)
class LinkProfile:
    """One kind of link, fitted from timed transfers between ``src`` and ``dst``: a message of
    ``b`` bytes takes ``latency_s + b * seconds_per_byte`` (the network model's alpha-beta)."""

    kind: str = rule(str, "which link: 'intra-host', 'inter-host', or 'collective' (a ring all-reduce over every "
                     "device from src to dst in rank order, fitted per ring step)", choices=PROFILE_LINK_KINDS)
    src: str = rule(str, "device that sent the timed messages")
    dst: str = rule(str, "device that received them")
    latency_s: float = rule(float, "fitted latency (alpha), seconds", ge=0)
    seconds_per_byte: float = rule(float, "fitted inverse bandwidth (beta), seconds per byte", gt=0)
    points: dict[int, float] = rule(float, "message bytes -> fastest one-way seconds of the repeats", gt=0)

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    @property
    def gbps(self) -> float:
        """Bandwidth in GB/s (10^9 bytes per second: the cluster spec's ``*_gbps`` unit)."""
        return 1e-9 / self.seconds_per_byte

    @property
    def latency_us(self) -> float:
        return self.latency_s * 1e6


@dataclass(frozen=True)
class Profile:
    """A cluster's measured profile for one model at one precision (see the module docstring)."""

    model_fingerprint: str = rule(str, "TaskGraphs.fingerprint of the model measured")
    cluster: str = rule(str, "name of the cluster measured")
    precision: str = rule(str, "training precision measured at", choices=PRECISIONS)
    optimizer: str = rule(str, "optimizer whose state the memory measurement held", choices=OPTIMIZERS)
    unit: str = rule(str, "what a timed unit is: 'taskgraph' or 'layer'", choices=PROFILE_UNITS)
    warmup: int = rule(int, "untimed steps before the timed ones at each batch", ge=0)
    repeats: int = rule(int, "timed steps at each batch (the median is kept)", ge=1)
    seconds: float = rule(float, "wall time the profiling took", ge=0)
    devices: tuple[DeviceProfile, ...] = ()
    links: tuple[LinkProfile, ...] = ()
    schema_version: int = rule(int, "profile file format version", choices=(PROFILE_SCHEMA_VERSION,),
                               default=PROFILE_SCHEMA_VERSION)

    # whalelike.spec.validate: field rules first (spec_path), then these
    spec_checks = {"self": check_profile, "graphs": check_profile_model, "cluster": check_profile_cluster}
    spec_path = "profile"
    spec_error = ProfileError

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))

    # -- lookup ------------------------------------------------------------------------------------
    def device(self, name: str) -> DeviceProfile:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"the profile has no device {name!r} (devices: {', '.join(d.name for d in self.devices)})")

    def link(self, kind: str) -> Optional[LinkProfile]:
        """The fitted link of ``kind`` ('intra-host' or 'inter-host'), None when the cluster has no
        such pair of devices."""
        return next((link for link in self.links if link.kind == kind), None)

    # -- checks ------------------------------------------------------------------------------------
    def validate(self, graphs=None, cluster=None) -> None:
        """Raise :class:`ProfileError` for a broken rule, or a profile of another model
        (``graphs``) or cluster (``cluster``)."""
        validate(self, graphs=graphs, cluster=cluster)

    def check_precision(self, precision: str) -> None:
        """Raise :class:`ProfileError` unless the profile was measured at ``precision``."""
        check_profile_precision(self, precision)

    # -- files -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version, "model_fingerprint": self.model_fingerprint,
            "cluster": self.cluster, "precision": self.precision, "optimizer": self.optimizer, "unit": self.unit,
            "warmup": self.warmup, "repeats": self.repeats, "seconds": self.seconds,
            "devices": [device_dict(d) for d in self.devices],
            "links": [{"kind": l.kind, "src": l.src, "dst": l.dst, "latency_s": l.latency_s,
                       "seconds_per_byte": l.seconds_per_byte, "points": dict(sorted(l.points.items()))}
                      for l in self.links],
        }

    @classmethod
    def from_dict(cls, data, origin: Optional[str] = None) -> "Profile":
        """Build and validate a profile from :meth:`to_dict`'s form; errors name ``origin`` and the field."""
        profile = Reader(origin, error=ProfileError).record(cls, data, "")
        try:
            profile.validate()
        except ProfileError as e:
            raise ProfileError(f"{origin}: {e}" if origin else str(e)) from None
        return profile

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write the profile to ``path`` (.yaml or .yml) atomically (:func:`whalelike.files.write_yaml`)."""
        write_yaml(path, self.to_dict(), header=f"whalelike profile of cluster {self.cluster} at {self.precision} "
                                                f"(planner.devices.profile; seconds, bytes, samples)")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, graphs=None, cluster=None,
                  precision: Optional[str] = None) -> "Profile":
        """Load a profile file and check it against ``graphs``, ``cluster`` and ``precision`` when
        given; every error is a :class:`ProfileError` starting with the file's path."""
        origin = os.fspath(path)
        data = load_yaml(origin, what="profile", limit=MAX_FILE_BYTES, limit_why=MAX_FILE_WHY, error=ProfileError,
                         missing="measure one with `whalelike profile MODEL --cluster C -o PROFILE.yaml` under "
                                 "torchrun")
        profile = cls.from_dict(data, origin=origin)
        try:
            profile.validate(graphs=graphs, cluster=cluster)
            if precision is not None:
                profile.check_precision(precision)
        except ProfileError as e:
            raise ProfileError(f"{origin}: {e}") from None
        return profile

    # -- display -----------------------------------------------------------------------------------
    def summary(self) -> str:
        """One row per device (largest batch, time per sample at 1 and at the largest batch, peak
        memory there), then the fitted links."""
        rows = []
        for d in self.devices:
            curve = d.curve()
            peak = d.memory_bytes.get(d.max_batch)
            rows.append([d.name, d.kind, f"{d.max_batch}" + (" (cap)" if d.edge == "cap" else ""),
                         f"{curve(curve.batches[0]) * 1e3:.4g} ms @ {curve.batches[0]}",
                         f"{curve(d.max_batch) * 1e3:.4g} ms @ {d.max_batch}",
                         "-" if peak is None else f"{peak / 2**20:.4g} MiB",
                         "cache" if d.cached else "measured"])
        lines = [format_table(["device", "kind", "largest batch", "time/sample (small)", "time/sample (largest)",
                               "peak memory", "source"], rows,
                              title=f"profile of cluster {self.cluster} at {self.precision}, per {self.unit}, "
                                    f"{self.warmup} warm-up + median of {self.repeats}, {self.seconds:.1f} s")]
        for link in self.links:
            if link.kind == "collective":
                lines.append(f"ring all-reduce over the {len(self.devices)} devices: a ring step {link.latency_us:.4g} us "
                             f"latency, {link.gbps:.4g} GB/s (a floor under the collectives' links)")
                continue
            lines.append(f"{link.kind} link ({link.src} -> {link.dst}): {link.latency_us:.4g} us latency, "
                         f"{link.gbps:.4g} GB/s")
        return "\n".join(lines)


def device_dict(d: DeviceProfile) -> dict:
    """The file form of one device's figures (also a cache entry's, :mod:`runtime.profiling.cache`)."""
    out = {"name": d.name, "kind": d.kind, "host": d.host, "max_batch": d.max_batch, "edge": d.edge,
           "times": {unit: {b: [fb[0], fb[1]] for b, fb in sorted(points.items())}
                     for unit, points in sorted(d.times.items())},
           "memory_bytes": dict(sorted(d.memory_bytes.items()))}
    if d.capacity_bytes is not None:
        out["capacity_bytes"] = d.capacity_bytes
    if d.cached:
        out["cached"] = True
    if d.action_overhead_s:
        out["action_overhead_s"] = d.action_overhead_s
    if d.update_ns_per_byte:
        out["update_ns_per_byte"] = d.update_ns_per_byte
    return out
