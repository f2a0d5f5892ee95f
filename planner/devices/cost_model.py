"""The planner's cost model: how long compute and communication take, and how much memory a
worker needs. Analytic on purpose: the planner must run in one process, in milliseconds, for
clusters the planning machine cannot see, so it prices work from the cluster spec's nominal figures.

Compute. A device runs at the plan's precision (``Config.precision``: fp32, bf16, fp16) at its
measured rate when the spec has one (from profiling, like Poplar's online profiling; a rate measured
at another precision scaled by the ratio of the two peaks, :meth:`whalelike.cluster.Device.measured`),
else at its peak for that precision (:meth:`whalelike.cluster.Device.tflops`: the spec's per-dtype
figures, a known GPU's spec sheet) times ``DEFAULT_EFFICIENCY``. A device that cannot run the
precision raises the SpecError naming it (the planner checks the whole cluster first). The efficiency factor is the share of
peak that dense training reaches in practice (0.4: typical model-FLOPs utilisation of transformer
training on V100/A100-class GPUs); it scales all devices alike, so it changes how compute compares
to communication, never which device gets more work. The planner never reads
``Device.emulated_speed`` or ``Cluster.emulation``: those are the emulator's hidden truth
(docs/ARCHITECTURE.md section 4).

Communication. Priced by :class:`planner.devices.network.NetworkModel`, the one link model the simulator
and the runtime's network emulation share: ``latency + bytes / bandwidth`` per message, intra-host
or inter-host link, ring collectives whose slowest hop (NIC sharing included) sets the pace.
:class:`CommModel` is its device-record front end for the planner's assembly; it also prices a ZeRO
stage's collectives per step (:meth:`CommModel.zero_ms`, counted by :func:`zero_collectives`, one per
FSDP unit: ``StageCost.fsdp_unit_bytes``).

Memory. What a stage holds per sample is :class:`planner.devices.stage_cost.StageCost` (re-exported
here, with the FSDP unit rule and the bytes per element of each precision); what a worker holds of
it is :mod:`planner.devices.memory`, the planner's one memory model: each term with its own fraction.
Under ``split`` every term scales with the worker's shard fraction
(:class:`~planner.shares.shard_sizes.ShardLayout`): its share of the sharded work (Megatron-style
sharding shards the weights and the activations of a block's projections and of the attention
between them) plus, whole, the part of the stage nothing shards (layer norms, embeddings,
residual adds), measured by FLOPs, so unsharded work is never predicted to speed up.

The optimizer's update. Element-wise over the parameters a worker steps, so bound by memory
bandwidth: at the rate ``whalelike profile`` measured on the device when there is one
(``Device.measured_update_ns_per_byte``), else the bytes torch's update kernels move per byte of
parameters (:data:`UPDATE_PASSES`) over the spec sheet's memory bandwidth (``Device.bandwidth_gbps``:
the spec's ``memory_gbps``, a known GPU's data sheet) at ``UPDATE_BANDWIDTH_EFFICIENCY``. Neither is
known for an emulated device (its update runs at the host's speed, which no spec describes): unpriced,
unless measured (``whalelike profile``, or ``whalelike plan --calibrate``, which times it on the host).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Sequence

from whalelike.cluster import Device, Network

from planner.devices.memory import (  # noqa: F401 (UNBOUNDED_SAMPLES: re-exported)
    RAGGED_BUCKET_BYTES, UNBOUNDED_SAMPLES, ZeroShards, fsdp_units,
)
from planner.devices.stage_cost import (  # noqa: F401 (the record and its unit rule: re-exported)
    LOSS_TEMPORARY_BYTES, StageCost, fsdp_unit_bytes, fsdp_unit_names,
)
from planner.devices.network import NetworkModel, Ring

DEFAULT_EFFICIENCY = 0.4
GIB = float(2**30)
# Bytes the update reads and writes per byte of the parameters it steps, counted from torch's foreach kernels
# (its default on CUDA; torch.optim.adam._multi_tensor_adam, torch.optim.sgd._multi_tensor_sgd), each pass a
# parameter-sized tensor read or written. AdamW: the decoupled weight decay (read and write the parameters: 2),
# the first moment's lerp (3), the second moment's scale (2) and addcmul (3), its square root into a new tensor
# (2), the bias correction's division and the epsilon (2 each), the addcdiv into the parameters (4): 20. Adam
# (weight decay 0, torch's default): 18. SGD: one add (3); with momentum the buffer's scale and add (2 + 3) and
# the parameters' add (3): 8. On this machine's CPU, one thread (bench/update_rate.py, 64 MiB of parameters, at
# the bandwidth of its own in-place add), torch's per-parameter kernels take 0.69-0.98 of the passes counted (AdamW
# 0.83, Adam 0.98, SGD 0.93); its foreach kernels for Adam and AdamW 1.67-1.87 (a CPU computes their square roots
# and divisions slower than it moves memory; a GPU's run at memory speed, which make gpu-check measures).
UPDATE_PASSES = {"adamw": 20, "adam": 18, "sgd": 3, "sgd_momentum": 8}
# the share of the data sheet's memory bandwidth torch's element-wise foreach kernels reach on large tensors
UPDATE_BANDWIDTH_EFFICIENCY = 0.8


def device_tflops(device: Device, precision: str = "fp32") -> float:
    """Sustained training TFLOPS the planner assumes for ``device`` at ``precision``."""
    measured = device.measured(precision)
    if measured is not None:
        return measured
    return device.tflops(precision) * DEFAULT_EFFICIENCY


def compute_ms(flops: float, device: Device, precision: str = "fp32") -> float:
    """Milliseconds ``device`` needs for ``flops`` floating-point operations at ``precision``."""
    return flops / (device_tflops(device, precision) * 1e9)


def update_ns_per_byte(device: Device, optimizer: str) -> float:
    """The nanoseconds ``device``'s update of ``optimizer`` takes per byte of parameters: measured
    (``Device.measured_update_ns_per_byte``: ``whalelike profile``, ``whalelike plan --calibrate``), else
    :data:`UPDATE_PASSES` bytes over the spec sheet's bandwidth (``Device.bandwidth_gbps``) at
    :data:`UPDATE_BANDWIDTH_EFFICIENCY`; 0 (not priced) when neither is known."""
    if device.measured_update_ns_per_byte is not None:
        return device.measured_update_ns_per_byte
    gbps, passes = device.bandwidth_gbps, UPDATE_PASSES.get(optimizer)
    if not gbps or passes is None:
        return 0.0
    return passes / (gbps * UPDATE_BANDWIDTH_EFFICIENCY)   # GB/s is bytes per ns


def update_ms(cost: StageCost, fraction: float, zero: ZeroShards, device: Device) -> float:
    """The optimizer's update on a worker, ms: the bytes of the parameters it updates (its tensor-parallel
    ``fraction`` of the stage's; under ZeRO 1-3 its share of the group's, the shards the optimizer steps)
    at the device's rate (:func:`update_ns_per_byte`: measured, else from its memory bandwidth); 0 when
    neither is known (the update is then not priced)."""
    rate = update_ns_per_byte(device, cost.optimizer)
    if not rate:
        return 0.0
    share = (zero.share if zero.share is not None else 1.0 / zero.group) if zero.stage else 1.0
    return cost.param_bytes * fraction * share * rate * 1e-6


@dataclass(frozen=True)
class CommModel:
    """Communication times (ms) on one cluster network, for :class:`~whalelike.cluster.Device`
    records: each call prices its devices with :class:`planner.devices.network.NetworkModel` (rings in the
    order given, which the planner passes in rank order, as the runtime's process groups run)."""

    network: Network

    def _model(self, devices: Sequence[Device]) -> NetworkModel:
        net = self.network
        return NetworkModel(net.intra_host_gbps, net.inter_host_gbps, net.latency_us,
                            {d.name: d.host for d in devices}, collective_latency_us=net.collective_latency_us,
                            collective_gbps=net.collective_gbps)

    def _ring(self, devices: Sequence[Device]) -> Ring:
        return self._model(devices).ring([d.name for d in devices])

    def p2p_ms(self, nbytes: float, src: Device, dst: Device) -> float:
        if nbytes <= 0:
            return 0.0
        return self._model((src, dst)).transfer_ms(nbytes, src.name, dst.name)

    def allreduce_ms(self, nbytes: float, devices: Sequence[Device]) -> float:
        if len(devices) <= 1 or nbytes <= 0:
            return 0.0
        return self._ring(devices).allreduce_ms(nbytes)

    def allreduce_each_ms(self, nbytes: Sequence[float], scale: float, devices: Sequence[Device]) -> float:
        """Total time of one all-reduce per entry of ``nbytes``, each scaled by ``scale`` (the
        all-reduces of a tensor-parallel stage), in closed form (a ring's time is
        linear in the bytes plus a latency per step): it runs per worker and micro-batch on plans
        of thousands of devices."""
        live = [b for b in nbytes if b > 0]
        if len(devices) <= 1 or scale <= 0 or not live:
            return 0.0
        ring = self._ring(devices)
        steps = 2 * (ring.size - 1)
        return steps * (ring.latency_ms * len(live) + scale * sum(live) / ring.size * ring.ms_per_byte)

    def allgather_ms(self, nbytes: float, devices: Sequence[Device]) -> float:
        """All-gather of a tensor of ``nbytes`` in total (each device holds ``nbytes / n``)."""
        if len(devices) <= 1 or nbytes <= 0:
            return 0.0
        return self._ring(devices).allgather_ms(nbytes)

    def zero_ms(self, zero_stage: int, nbytes: float, micro_batches: int, devices: Sequence[Device],
                units: int = 1) -> float:
        """Time per step of the collectives a ZeRO stage's data-parallel group runs over ``devices``
        (a ring in rank order) for parameters of ``nbytes`` (the worker's tensor-parallel shard of
        the stage's, float32 as the gradient all-reduces) with ``micro_batches`` micro-batches, in
        ``units`` FSDP units (one collective each: a latency per step each), counted by
        :func:`zero_collectives`; 0 for stage 0 (DDP's all-reduce is priced apart)."""
        gathers, scatters = zero_collectives(zero_stage, micro_batches)
        if len(devices) <= 1 or nbytes <= 0 or not (gathers or scatters):
            return 0.0
        ring = self._ring(devices)
        per_unit_latency = (max(units, 1) - 1) * (ring.size - 1) * ring.latency_ms
        return (gathers * (ring.allgather_ms(nbytes) + per_unit_latency)
                + scatters * (ring.reduce_scatter_ms(nbytes) + per_unit_latency))


def zero_collectives(zero_stage: int, micro_batches: int) -> tuple[int, int]:
    """``(all-gathers, reduce-scatters)`` of the stage's parameters per step under ZeRO stage
    ``zero_stage`` with ``micro_batches`` micro-batches, as FSDP2 runs them: stage 1 one
    reduce-scatter of the accumulated gradient and one all-gather of the updated parameters; stage 2
    a reduce-scatter per micro-batch and one all-gather; stage 3 per micro-batch two all-gathers
    (forward, then backward: the parameters are resharded after the forward) and one reduce-scatter;
    stage 0 none (DDP all-reduces instead)."""
    k = max(int(micro_batches), 1)
    return {0: (0, 0), 1: (1, 1), 2: (1, k), 3: (2 * k, k)}[zero_stage]


def ragged_collectives(cost: "StageCost", zero_stage: int, whole_model: bool) -> int:
    """How many collectives (buckets) ragged shards split one pass over stage ``cost``'s parameters
    into (``runtime.replicas.ragged_sync``): at ZeRO 1 buckets of at least
    :data:`planner.devices.memory.RAGGED_BUCKET_BYTES` (at most one per parameter), at ZeRO 2 one per
    parameter, at ZeRO 3 one per FSDP unit (:func:`planner.devices.memory.fsdp_units`)."""
    tensors = cost.param_tensors or len(fsdp_units(cost, whole_model))
    if zero_stage == 1:
        return max(1, min(tensors, math.ceil(cost.param_bytes / RAGGED_BUCKET_BYTES)))
    if zero_stage == 2:
        return max(1, tensors)
    return len(fsdp_units(cost, whole_model))


def backward_flops(cost: StageCost, recompute: bool = False) -> float:
    """FLOPs per sample of a stage's backward; a recomputing stage (activation checkpointing,
    :mod:`runtime.training.recompute`) runs its forward again inside it."""
    return cost.backward_flops + (cost.forward_flops if recompute else 0.0)


def training_flops(cost: StageCost, recompute: bool = False) -> float:
    """FLOPs per sample of a stage's forward and backward (:func:`backward_flops`)."""
    return cost.forward_flops + backward_flops(cost, recompute)
