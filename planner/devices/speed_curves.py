"""Speed curves: a device's time per sample against micro-batch size, through its measured points.

Poplar (seed paper 002, "Online Profiling" and its appendix) divides each measured step time by its
batch size and interpolates the points with a cubic spline, to find the batch range where each GPU
runs at its best. Here the points are a :class:`planner.devices.profile.DeviceProfile`'s: per
batch, the forward and backward seconds of every unit (TaskGraph or Layer), summed and divided by
the batch; the curve is scipy's :class:`~scipy.interpolate.PchipInterpolator` through them.

Why PCHIP and not :class:`scipy.interpolate.CubicSpline` (what Poplar names): a device's time per
sample falls steeply over small batches and flattens once the device is saturated, and a cubic
spline, which makes the second derivative continuous across every point, overshoots at such a
knee: between two measured batches it predicts a time per sample below both (a speed the device
never showed), it turns a monotone fall into a dip and a rise, and over a steep enough fall it
goes negative. PCHIP (piecewise cubic Hermite, Fritsch-Carlson slopes) sets each point's slope from
its neighbours so that on every interval the curve stays between the two measured values: it is
monotone wherever the points are, has no extremum that is not a measured point, and is positive
when the points are. It is only once continuously differentiable, which a planner comparing times
never notices. ``tests/test_profile.py`` shows points on which the cubic spline dips below zero
and PCHIP does not.

The x axis is ``log2(batch)``: profiles measure powers of two (then the out-of-memory edge), which
are evenly spaced there, and an efficiency curve ``b / (b + h)`` is smooth in it. Outside the
measured batches the curve is flat (the nearest measured value): below the smallest or above the
largest there is nothing to go by, and a planner must not read a trend into the unknown (above the
largest batch that fits, nothing runs anyway: ``DeviceProfile.max_batch``).

Invariant: a curve passes through every measured point, is finite and >= 0 everywhere, stays
between the adjacent measured values on every interval (so it is monotone wherever the points
are), and is flat outside them.
"""
from __future__ import annotations

import io
import math
import os
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from whalelike.files import write_atomic

PHASES = ("both", "forward", "backward")


class SpeedCurve:
    """Seconds per sample against batch size through ``points`` (batch -> seconds per sample)."""

    def __init__(self, points: Mapping[int, float], label: str = ""):
        self.label = label
        if not points:
            raise ValueError(f"speed curve{_of(label)}: no measured points; a curve needs at least one batch")
        for batch, seconds in points.items():
            if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
                raise ValueError(f"speed curve{_of(label)}: batch {batch!r} is not a positive integer")
            if not (isinstance(seconds, (int, float, np.floating)) and math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"speed curve{_of(label)}: batch {batch} has {seconds!r} seconds per sample; a "
                                 "measured time is a finite number >= 0")
        ordered = sorted(points.items())
        self.batches = tuple(int(b) for b, _ in ordered)
        self.seconds = tuple(float(s) for _, s in ordered)
        self._x = np.log2(np.array(self.batches, dtype=float))
        self._y = np.array(self.seconds, dtype=float)
        self._spline = None
        if len(self.batches) > 1:
            from scipy.interpolate import PchipInterpolator   # a fraction of a second: only measured curves
            self._spline = PchipInterpolator(self._x, self._y, extrapolate=False)

    def __call__(self, batch: Union[float, Sequence[float], np.ndarray]) -> Union[float, np.ndarray]:
        """Seconds per sample at ``batch`` (a number or an array of batches >= 1)."""
        scalar = np.ndim(batch) == 0
        b = np.asarray(batch, dtype=float)
        if np.any(~np.isfinite(b)) or np.any(b < 1):
            raise ValueError(f"speed curve{_of(self.label)}: batch sizes are >= 1, got {batch!r}")
        x = np.clip(np.log2(b), self._x[0], self._x[-1])
        y = np.full(x.shape, self._y[0]) if self._spline is None else self._spline(x)
        # PCHIP stays between adjacent points; the clip only removes rounding past the extreme ones
        y = np.clip(y, self._y.min(), self._y.max())
        # at and beyond the end points, their measured values exactly (flat outside)
        y = np.where(x <= self._x[0], self._y[0], np.where(x >= self._x[-1], self._y[-1], y))
        return float(y) if scalar else y

    def step_seconds(self, batch: float) -> float:
        """Seconds of one micro-batch of ``batch`` samples."""
        return float(batch) * float(self(batch))

    def samples_per_second(self, batch: float) -> float:
        """Throughput at ``batch`` (infinite where the measured time is 0)."""
        seconds = float(self(batch))
        return math.inf if seconds == 0 else 1.0 / seconds

    def __repr__(self) -> str:
        shown = ", ".join(f"{b}: {s * 1e3:.4g} ms" for b, s in zip(self.batches, self.seconds))
        return f"SpeedCurve({self.label or 'device'}: {shown} per sample)"


def _of(label: str) -> str:
    return f" of {label}" if label else ""


def device_curve(device, unit: Optional[int] = None, phase: str = "both") -> SpeedCurve:
    """The curve of one :class:`~planner.devices.profile.DeviceProfile`: at each measured batch,
    the seconds of ``phase`` (``"both"``, ``"forward"``, ``"backward"``) of ``unit`` (None: every
    unit, the whole model) divided by the batch."""
    if phase not in PHASES:
        raise ValueError(f"speed curve phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if unit is not None and unit not in device.times:
        raise KeyError(f"device {device.name!r} has no unit {unit} (units: {sorted(device.times)})")
    units = [unit] if unit is not None else sorted(device.times)
    pick = {"both": lambda fb: fb[0] + fb[1], "forward": lambda fb: fb[0], "backward": lambda fb: fb[1]}[phase]
    batches = sorted(device.times[units[0]])
    points = {b: sum(pick(device.times[u][b]) for u in units) / b for b in batches}
    return SpeedCurve(points, label=device.name)


def profile_curves(profile, unit: Optional[int] = None, phase: str = "both") -> dict[str, SpeedCurve]:
    """Device name -> its curve (see :func:`device_curve`), in rank order."""
    return {d.name: device_curve(d, unit, phase) for d in profile.devices}


def write_png(profile, path: str | os.PathLike) -> None:
    """Draw every device's curve (time per sample, whole model, against batch size on a log2 axis)
    with its measured points and its largest batch marked, to ``path`` (.png, atomically)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure   # no pyplot: no backend, no global state (as planner.schedule.timeline)

    fig = Figure(figsize=(8, 4.8))
    ax = fig.add_subplot(1, 1, 1)
    colours = colormaps["tab10"]
    for i, device in enumerate(profile.devices):
        curve = device_curve(device)
        colour = colours(i % 10)
        dense = np.exp2(np.linspace(math.log2(curve.batches[0]), math.log2(curve.batches[-1]), 200))
        ax.plot(dense, curve(dense) * 1e3, color=colour, linewidth=1.5,
                label=f"{device.name} ({device.kind}), largest batch {device.max_batch}"
                      + (" (cap)" if device.edge == "cap" else ""))
        ax.plot(curve.batches, np.array(curve.seconds) * 1e3, "o", color=colour, markersize=5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batch size (samples)")
    ax.set_ylabel("time per sample, forward + backward (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"speed curves on {profile.cluster}, {profile.precision} (points measured, lines PCHIP)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    picture = io.BytesIO()
    fig.savefig(picture, format="png", dpi=110)
    write_atomic(path, picture.getvalue(), kind="png")
