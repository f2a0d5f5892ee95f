"""The profile cache: what a device kind measured for a model, reused by the next run.

Profiling a model costs minutes on real clusters (Poplar reports 67-174 s), and most of it is the
same answer again: a device's times and largest batch depend on the model, the kind of device and
the precision, not on which of a kind's devices ran it nor on the rest of the cluster. So each
measurement is kept in a cache directory, one YAML file per key ``(model fingerprint, device kind,
precision)``, and a later run (another cluster of the same kinds, a second ``whalelike profile``)
takes a kind's figures from there instead of measuring. Links are not cached: they belong to the
cluster, and take a second to time.

An entry also records how it was measured (optimizer, unit, cap, warm-up, repeats); it answers a
run only when those match or it holds the whole answer (its largest batch was found by running
out of memory below the run's cap). An entry that does not answer is measured again and replaced.

The directory is ``--cache-dir``, else ``$WHALELIKE_CACHE``, else ``$XDG_CACHE_HOME/whalelike/profiles``
(``~/.cache/whalelike/profiles``). Rank 0 reads and writes it (the cache is a file system's, as the
output is), and tells the others what it found.

Invariant: an entry is used only for its own key, and only when it answers the run's question; a
corrupt, edited or mis-keyed entry is a :class:`CacheError` naming the file and the fix (remove it,
or ``--refresh``), never silently a wrong figure.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Optional

from planner.devices.profile import DeviceProfile, device_dict
from whalelike.config import OPTIMIZERS, PRECISIONS
from whalelike.files import write_yaml
from whalelike.spec import PROFILE_UNITS, ProfileError, Reader, load_yaml, rule

CACHE_ENV = "WHALELIKE_CACHE"
MAX_ENTRY_BYTES = 8 << 20
MAX_ENTRY_WHY = "one device's figures for a model of a thousand layers are well under a MiB"


class CacheError(ProfileError):
    """A cache entry that cannot be used (the message names the file and the fix)."""


@dataclass(frozen=True)
class Settings:
    """How a run measures: what a cache entry must have been measured with to answer it."""

    optimizer: str = rule(str, "optimizer whose state the memory trials hold", choices=OPTIMIZERS)
    unit: str = rule(str, "what a timed unit is", choices=PROFILE_UNITS)
    cap: int = rule(int, "largest batch tried", ge=1)
    warmup: int = rule(int, "untimed steps per batch", ge=0)
    repeats: int = rule(int, "timed steps per batch", ge=1)


@dataclass(frozen=True)
class Entry:
    """One cached measurement: its key, its settings and the device's figures (whose ``name``
    and ``host`` are the device that measured it)."""

    model_fingerprint: str = rule(str, "TaskGraphs.fingerprint of the model")
    kind: str = rule(str, "device kind")
    precision: str = rule(str, "training precision", choices=PRECISIONS)
    cluster: str = rule(str, "the cluster it was measured on")
    settings: Settings
    device: DeviceProfile

    def answers(self, settings: Settings) -> Optional[str]:
        """None when this entry answers a run measuring with ``settings``, else why not."""
        mine = self.settings
        for name in ("optimizer", "unit", "warmup", "repeats"):
            if getattr(mine, name) != getattr(settings, name):
                return f"it was measured with {name} {getattr(mine, name)!r}, this run asks {getattr(settings, name)!r}"
        whole = self.device.edge == "memory" and self.device.max_batch <= settings.cap
        if not whole and mine.cap != settings.cap:
            return (f"its largest batch {self.device.max_batch} is its cap {mine.cap}, this run's cap is "
                    f"{settings.cap}")
        return None

    def for_device(self, name: str, host: str) -> DeviceProfile:
        """The figures as ``name``'s (a device of the same kind on ``host``), marked cached."""
        return dataclasses.replace(self.device, name=name, host=host, cached=True)


def cache_dir(given: Optional[str] = None) -> str:
    """The cache directory (see the module docstring)."""
    if given:
        return given
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "whalelike", "profiles")


def entry_path(directory: str, fingerprint: str, kind: str, precision: str) -> str:
    """The file of key ``(fingerprint, kind, precision)``: readable, and unique per key (a kind's
    name is slugged, so a digest of the exact kind is added)."""
    slug = re.sub(r"[^a-z0-9.]+", "-", kind.lower()).strip("-")[:40] or "kind"
    digest = hashlib.sha256(kind.encode()).hexdigest()[:8]
    return os.path.join(directory, f"{fingerprint[:16]}-{slug}-{digest}-{precision}.yaml")


def load(directory: str, fingerprint: str, kind: str, precision: str) -> Optional[Entry]:
    """The entry of the key, None when there is none; a :class:`CacheError` when its file is
    corrupt or holds another key."""
    path = entry_path(directory, fingerprint, kind, precision)
    if not os.path.exists(path):
        return None
    fix = f"remove it (rm {path}) or profile with --refresh"
    try:
        data = load_yaml(path, what="profile cache entry", limit=MAX_ENTRY_BYTES, limit_why=MAX_ENTRY_WHY,
                         error=CacheError)
        entry = Reader(path, error=CacheError).record(Entry, data, "")
    except CacheError as e:
        raise CacheError(f"profile cache: {e}; {fix}") from None
    found = (entry.model_fingerprint, entry.kind, entry.precision)
    if found != (fingerprint, kind, precision) or entry.device.kind != kind:
        raise CacheError(f"profile cache: {path} holds model {entry.model_fingerprint[:12]}, kind {entry.kind!r}, "
                         f"{entry.precision}, not the key its name says (model {fingerprint[:12]}, kind {kind!r}, "
                         f"{precision}): it was renamed or edited; {fix}")
    return entry


def store(directory: str, entry: Entry) -> str:
    """Write ``entry`` (atomically, replacing an older one of its key); returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = entry_path(directory, entry.model_fingerprint, entry.kind, entry.precision)
    device = dataclasses.replace(entry.device, cached=False)
    write_yaml(path, {"model_fingerprint": entry.model_fingerprint, "kind": entry.kind, "precision": entry.precision,
                      "cluster": entry.cluster, "settings": dataclasses.asdict(entry.settings),
                      "device": device_dict(device)},
               header=f"whalelike profile cache: {entry.kind} at {entry.precision} for model "
                      f"{entry.model_fingerprint[:12]} (runtime.profiling.cache)")
    return path
