"""The optimizer's update timed on this machine at plan time (``whalelike plan --calibrate``).

Why. The planner prices each worker's update at its device's rate per byte of parameters
(:func:`planner.devices.cost_model.update_ns_per_byte`): measured by ``whalelike profile``, else from
the spec sheet's memory bandwidth. An emulated device has neither: its compute is padded to the
emulated speed, but its update runs unpadded on the host's cores, at a speed no spec sheet can give,
and a plan that leaves it out predicts every step short by it (the demo's classifier ranks update
10 MB of AdamW state a step: tens of milliseconds on two shared cores). A full profile measures it
with everything else, under torchrun, in half a minute; this measures only the update, in one
process, in well under a second, so that a plan from the spec sheet prices it too.

What. The workload's own trainable parameters (copies, at most :data:`MAX_BYTES` of them, taken in
order: beyond a few MiB the rate per byte no longer depends on the size), with gradients, stepped by
the configured optimizer at learning rate 0 (:data:`runtime.profiling.steps.OPTIMIZERS`, the
profile's) as the runtime steps on CPU, on one thread (:data:`RANK_THREADS`: what torchrun gives each
rank), once untimed and then ``repeats`` times; the median, per byte. Every emulated device of the cluster runs on this machine and the runtime's ranks update
together after their gradient sync, so the rate is scaled by the ranks per core, ``max(1, ranks /
cores)``, as :func:`runtime.emulation.compute.calibrate` scales real compute (``whalelike profile``
times every rank at once instead).

Invariant: it measures, and changes nothing but the cluster record it returns: the emulated devices
carry the rate as ``measured_update_ns_per_byte`` (what a profile would set), every other device is
as given (a real GPU's update runs elsewhere; its memory bandwidth prices it).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from torch import nn

from runtime.profiling.steps import OPTIMIZERS, timed_update
from whalelike.cluster import Cluster
from whalelike.errors import WhaleError

MAX_BYTES = 64 << 20
# the intra-op threads of a rank: torchrun starts every process with OMP_NUM_THREADS=1 unless told otherwise
RANK_THREADS = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)


@dataclasses.dataclass(frozen=True)
class UpdateCalibration:
    """What :func:`calibrate_update` measured: ``ns_per_byte`` the rate priced (the median alone
    ``alone_ns_per_byte`` times ``contention``, the emulated ranks over ``cores``), timed over ``nbytes``
    bytes of parameters stepped by ``optimizer``, priced on ``devices``."""

    ns_per_byte: float
    alone_ns_per_byte: float
    contention: float
    cores: int
    nbytes: int
    optimizer: str
    devices: tuple[str, ...]

    def line(self) -> str:
        return (f"calibrated the {self.optimizer} update on this machine: {self.alone_ns_per_byte:.3g} ns per byte "
                f"of parameters alone ({self.nbytes / 2**20:.1f} MiB timed), {self.ns_per_byte:.3g} with "
                f"{self.contention:g}x for {len(self.devices)} emulated rank(s) on {self.cores} core(s); priced on "
                f"{', '.join(self.devices)}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    """Copies of ``model``'s trainable parameters on CPU, in order, up to :data:`MAX_BYTES` (at least
    one), each with a gradient; parameters on the meta device become fresh tensors of their shape."""
    out, total = [], 0
    for p in model.parameters():
        if not p.requires_grad or not p.is_floating_point():
            continue
        nbytes = p.numel() * p.element_size()
        if out and total + nbytes > MAX_BYTES:
            break
        copy = torch.empty(p.shape, dtype=p.dtype) if p.is_meta else p.detach().to("cpu", copy=True)
        copy = nn.Parameter(copy.normal_() if p.is_meta else copy)
        copy.grad = torch.randn_like(copy)
        out.append(copy)
        total += nbytes
    return out


def calibrate_update(model: nn.Module, cluster: Cluster, optimizer: str = "adamw", repeats: int = 5,
                     cores: Optional[int] = None) -> tuple[Cluster, UpdateCalibration]:
    """``cluster`` with each emulated device's ``measured_update_ns_per_byte`` set to ``optimizer``'s
    update timed here on ``model``'s parameters (see the module), and what was measured. A
    :class:`~whalelike.errors.WhaleError` when the cluster has no emulated device (nothing of it runs
    here) or the model no trainable parameter."""
    if optimizer not in OPTIMIZERS:
        raise WhaleError(f"--calibrate: optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    here = [d for d in cluster.devices if d.emulated_speed is not None]
    if not here:
        raise WhaleError(f"--calibrate times the optimizer's update on this machine, where an emulated cluster's "
                         f"devices run; cluster {cluster.name!r} has no emulated device: its devices' update is priced "
                         f"from their memory bandwidth (memory_gbps); measure it on them with `whalelike profile`")
    params = _parameters(model)
    if not params:
        raise WhaleError("--calibrate: the model has no trainable floating-point parameter; there is no update to time")
    nbytes = sum(p.numel() * p.element_size() for p in params)
    step = OPTIMIZERS[optimizer](params)
    threads = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        step.step()   # the state made, untimed
        alone = timed_update(step, repeats, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    cores = cores or _cores()
    contention = max(1.0, len(here) / cores)
    rate = alone * contention
    calibrated = dataclasses.replace(cluster, devices=[
        dataclasses.replace(d, measured_update_ns_per_byte=rate) if d.emulated_speed is not None else d
        for d in cluster.devices])
    return calibrated, UpdateCalibration(rate, alone, contention, cores, nbytes, optimizer, tuple(d.name for d in here))
