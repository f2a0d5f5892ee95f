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
:class:`CommModel` is its device-record front end for the planner's assembly.

Memory. :class:`StageCost` records a stage's bytes: parameters, optimizer state (gradients are as
large as the parameters) and, per sample of a micro-batch, the activations saved for backward and
the boundary buffers (the received input and the output it sends). What a worker holds of them is
:mod:`planner.devices.memory`, the planner's one memory model: each term with its own fraction.
Under ``split`` every term scales with the worker's shard fraction
(:class:`~planner.shares.shard_sizes.ShardLayout`): its share of the sharded work (Megatron-style
sharding shards the weights and the activations of a block's projections and of the attention
between them) plus, whole, the part of the stage nothing shards (layer norms, embeddings,
residual adds), measured by FLOPs, so unsharded work is never predicted to speed up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from whalelike.cluster import Device, Network
from whalelike.graphs.taskgraph import TaskGraphs

from planner.devices.memory import UNBOUNDED_SAMPLES, stage_memory  # noqa: F401 (UNBOUNDED_SAMPLES: re-exported)
from planner.devices.network import NetworkModel, Ring

DEFAULT_EFFICIENCY = 0.4
GIB = float(2**30)


# bytes per element of the activations a training precision keeps (autocast's outputs); capture
# measures every tensor at float32, 4 bytes
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CAPTURED_BYTES = 4


def device_tflops(device: Device, precision: str = "fp32") -> float:
    """Sustained training TFLOPS the planner assumes for ``device`` at ``precision``."""
    measured = device.measured(precision)
    if measured is not None:
        return measured
    return device.tflops(precision) * DEFAULT_EFFICIENCY


def compute_ms(flops: float, device: Device, precision: str = "fp32") -> float:
    """Milliseconds ``device`` needs for ``flops`` floating-point operations at ``precision``."""
    return flops / (device_tflops(device, precision) * 1e9)


@dataclass(frozen=True)
class CommModel:
    """Communication times (ms) on one cluster network, for :class:`~whalelike.cluster.Device`
    records: each call prices its devices with :class:`planner.devices.network.NetworkModel` (rings in the
    order given, which the planner passes in rank order, as the runtime's process groups run)."""

    network: Network

    def _model(self, devices: Sequence[Device]) -> NetworkModel:
        net = self.network
        return NetworkModel(net.intra_host_gbps, net.inter_host_gbps, net.latency_us,
                            {d.name: d.host for d in devices})

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
        per-layer all-reduces of a tensor-parallel stage), in closed form (a ring's time is
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


@dataclass(frozen=True)
class StageCost:
    """Per-sample compute and memory of a contiguous range of layers (one pipeline stage).

    ``static_bytes`` (parameters + gradients + optimizer state) and ``optimizer_bytes`` are per
    whole stage; ``activation_bytes`` and ``boundary_bytes`` are per sample of one micro-batch in
    flight. A worker's share of them: :func:`planner.devices.memory.stage_memory`.

    ``precision`` is the training precision the stage is priced at: its FLOPs run at each device's
    rate for it (:func:`compute_ms`), and bytes per element follow it (:meth:`of_layers`). Under ``fp32`` everything
    is as captured (float32). Under ``bf16``/``fp16`` mixed precision (torch autocast) the
    parameters stay float32 (the master weights), so do their gradients and the optimizer state:
    ``param_bytes``, ``static_bytes`` and ``optimizer_bytes`` are unchanged; autocast casts each
    weight once per forward and keeps the low-precision copy while the step's forward and backward
    run, ``param_copy_bytes`` = 2 bytes per parameter (half of ``param_bytes``), counted with the
    weights; and the activations, boundary buffers and layer outputs, captured at float32, are
    mostly autocast outputs, so they scale by 2/4 (``ACTIVATION_BYTES``). Gradient all-reduces
    stay float32 (``param_bytes``).
    """

    forward_flops: float
    backward_flops: float
    param_bytes: float
    static_bytes: float
    activation_bytes: float
    boundary_bytes: float
    layer_output_bytes: tuple[float, ...]   # per layer: bytes per sample of its output (TP all-reduce)
    optimizer_bytes: Optional[float] = None  # None: static_bytes less parameters and gradients
    param_copy_bytes: float = 0.0            # low-precision copy of the weights under autocast (bf16/fp16)
    precision: str = "fp32"                  # the training precision: devices price this stage's FLOPs at it

    def __post_init__(self):
        if self.optimizer_bytes is None:
            object.__setattr__(self, "optimizer_bytes", self.static_bytes - 2 * self.param_bytes)

    @classmethod
    def of_layers(cls, graphs: TaskGraphs, layers: Sequence[int], precision: str = "fp32") -> "StageCost":
        """Costs of ``layers`` (contiguous indices into ``graphs.layers``) trained at ``precision``
        (``Config.precision``; the byte rule in the class docstring).

        Optimizer state is recorded per TaskGraph; a layer carries the share of it that matches
        its share of the TaskGraph's parameter bytes. A tied parameter whose owning layer is in
        another stage is a copy held here too (``Layer.borrowed_params``), counted once, with its
        gradient and optimizer state.
        """
        if not layers:
            raise ValueError("a stage needs at least one layer")
        chosen = [graphs.layers[i] for i in layers]
        inside = set(layers)
        copies = {name: (owner, size) for l in chosen for owner, name, size in l.borrowed_params if owner not in inside}
        opt = 0.0
        for layer, size in [(l, l.param_bytes) for l in chosen] + [(graphs.layers[o], s) for o, s in copies.values()]:
            tg = graphs.graphs[layer.taskgraph]
            if tg.param_bytes > 0:
                opt += tg.optimizer_state_bytes * size / tg.param_bytes
        params = float(sum(l.param_bytes for l in chosen) + sum(size for _, size in copies.values()))
        first, last = layers[0], layers[-1]
        received = graphs.layers[first - 1].cut_bytes_per_sample if first > 0 else 0.0
        sent = chosen[-1].cut_bytes_per_sample if last < len(graphs.layers) - 1 else 0.0
        if precision not in ACTIVATION_BYTES:
            raise ValueError(f"precision must be one of {', '.join(ACTIVATION_BYTES)}, got {precision!r}")
        scale = ACTIVATION_BYTES[precision] / CAPTURED_BYTES   # 1.0 at fp32: the bytes as captured, exactly
        return cls(
            forward_flops=sum(l.forward_flops for l in chosen),
            backward_flops=sum(l.backward_flops for l in chosen),
            param_bytes=params,
            static_bytes=2 * params + opt,
            activation_bytes=sum(l.activation_bytes_per_sample for l in chosen) * scale,
            boundary_bytes=(received + sent) * scale,
            layer_output_bytes=tuple(l.cut_bytes_per_sample * scale for l in chosen),
            optimizer_bytes=opt,
            param_copy_bytes=0.0 if precision == "fp32" else params * ACTIVATION_BYTES[precision] / CAPTURED_BYTES,
            precision=precision,
        )

    @property
    def flops_per_sample(self) -> float:
        return self.forward_flops + self.backward_flops

    def bytes_per_sample(self, in_flight: int) -> float:
        return (self.activation_bytes + self.boundary_bytes) * in_flight

    def memory_bytes(self, micro_batch: int, in_flight: int, shard: float = 1.0) -> float:
        """Peak bytes of a worker holding ``shard`` of the stage with ``micro_batch`` samples per
        micro-batch and ``in_flight`` micro-batches alive at once: shorthand for
        ``stage_memory(self, in_flight, shard).total(micro_batch)`` (:mod:`planner.devices.memory`)."""
        return stage_memory(self, in_flight, shard).total(micro_batch)

    def max_micro_batch(self, capacity_bytes: float, in_flight: int, shard: float = 1.0) -> int:
        """Most samples per micro-batch that fit in ``capacity_bytes`` (-1: not even the weights fit),
        at most :data:`UNBOUNDED_SAMPLES`: shorthand for
        ``stage_memory(self, in_flight, shard).max_samples(capacity_bytes)``."""
        return stage_memory(self, in_flight, shard).max_samples(capacity_bytes)


def backward_flops(cost: StageCost, recompute: bool = False) -> float:
    """FLOPs per sample of a stage's backward; a recomputing stage (activation checkpointing,
    :mod:`runtime.training.recompute`) runs its forward again inside it."""
    return cost.backward_flops + (cost.forward_flops if recompute else 0.0)


def training_flops(cost: StageCost, recompute: bool = False) -> float:
    """FLOPs per sample of a stage's forward and backward (:func:`backward_flops`)."""
    return cost.forward_flops + backward_flops(cost, recompute)
