"""One training step of the captured model on one device: per-unit timing and whole-step memory.

A profile times each *unit* (a TaskGraph, or a Layer: the pieces the planner places and moves) on
its own, because the planner prices stages made of them. :class:`UnitStep` cuts the captured graph
into one stage module per unit with the pipeline's own cutter
(:func:`runtime.parallel.stage_split.split_stages`, as the pipeline executor builds a stage from a
range of layers) and runs a training step through them in one process: each unit's forward (the
last one's with the loss) and each backward is one compute segment of the device's
:class:`runtime.emulation.compute.Emulator` (``Emulator.segment`` with the unit's FLOPs and
non-matmul bytes, as :class:`runtime.parallel.stage_worker.StageWorker` pads a stage), and the
figure kept is the time the runtime records for that segment (``EmulationStats.padded_s``, what
the straggler monitor reads): the wall clock from its start to its end, ``max(real compute,
modeled time)`` on emulated hardware, the real compute on a real device (synchronised before the
segment ends). So on emulated hardware a unit takes whatever the emulation makes a stage take,
and on a real device what the device takes. Not in it: how late the process wakes from the
segment's sleep, which is the machine's scheduler (busy cores), not the device. Boundary
values are detached between units, as between pipeline stages, and their gradients handed back:
no collective runs inside a segment (Poplar subtracts the collectives from its step times).

Memory (:meth:`UnitStep.fits`) is the other question: does a whole training step at ``batch`` fit,
the model's parameters, gradients and optimizer state included? It runs the *uncut* graph (the
split's root: the computation the data-parallel executor runs on one device, with no boundary
gradient held between units), the loss, backward and an optimizer step under the runtime's
:class:`runtime.training.memory_meter.MemoryMeter`, and the answer is the one training would get:
a real ``torch.OutOfMemoryError`` on CUDA, :class:`runtime.emulation.compute.EmulatedOutOfMemoryError`
from :func:`runtime.emulation.compute.check_capacity` on an emulated device that enforces its
memory (``emulation.enforce_memory``). Memory trials are not padded: their time is not kept.

The optimizer (the capture's, ``TaskGraphs.optimizer``) runs at learning rate 0, so its state
exists and is counted while the parameters never change: profiling leaves the model as it was.

Why not ``torch.profiler`` or CUDA events alone: they time kernels, not the segments the emulator
pads, and on emulated hardware the kernels are the real CPU's; timing the runtime's own segments
measures the same thing on both.

Invariant: a timed step computes exactly what a training step of the model computes (same graph,
same loss, same autocast), and a memory trial leaves nothing allocated behind it, whether it fitted or not.
"""
from __future__ import annotations

import gc
import statistics
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_unflatten

from runtime.emulation.compute import EmulatedOutOfMemoryError, Emulator, check_capacity
from runtime.parallel.stage_split import ModelInput, split_stages, stage_memory_bytes_from_plan
from runtime.training.memory_meter import LiveBytes, MemoryMeter, state_tensors
from runtime.training.precision import Precision
from whalelike.graphs.capture import with_autocast
from whalelike.graphs.taskgraph import TaskGraphs

# the capture's optimizer names (whalelike.config.OPTIMIZERS), at learning rate 0: state made and
# counted, parameters unchanged (AdamW's decoupled weight decay is scaled by the learning rate too)
OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.0),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.0),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.0),
}
UNITS = ("taskgraph", "layer")


def _unit_memory_bytes(graphs: TaskGraphs, unit: str, emulator: Emulator, precision: str) -> list[tuple[float, float]]:
    """Per unit: (forward, backward) bytes per sample its non-matmul operators move, which the
    emulator prices at the device's memory bandwidth, taken as the Engine takes each stage's
    (:func:`runtime.parallel.stage_split.stage_memory_bytes_from_plan`, the one owner of which
    figures a precision reads; a unit is a stage of its own layers here): under bf16/fp16 on a
    device whose bandwidth is emulated, the bytes measured under autocast."""
    if precision != "fp32" and emulator.enabled and emulator.memory_gbps is not None:
        graphs = with_autocast(graphs)
    if unit == "taskgraph":
        stages = [SimpleNamespace(index=g.index, layers=list(g.layers)) for g in graphs.graphs]
    else:
        stages = [SimpleNamespace(index=l.index, layers=[l.index]) for l in graphs.layers]
    return stage_memory_bytes_from_plan(graphs, SimpleNamespace(stages=stages), precision)


def timed_update(optimizer: torch.optim.Optimizer, repeats: int, device: torch.device,
                 before: Optional[Callable[[], Any]] = None) -> float:
    """Nanoseconds per byte of the parameters ``optimizer`` steps (those with a gradient): the median of
    ``repeats`` timed ``optimizer.step()`` calls (on CUDA between device synchronises), ``before`` run
    untimed ahead of each (:meth:`UnitStep.timed_update`); 0 when no parameter has a gradient. The one
    timing of the update, for ``whalelike profile`` and ``whalelike plan --calibrate``
    (:mod:`runtime.profiling.update_rate`)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    seconds = []
    for _ in range(max(repeats, 1)):
        if before is not None:   # run even with nothing to time: it may hold a collective every rank joins
            before()
        if not nbytes:
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) / nbytes * 1e9 if nbytes else 0.0


class UnitStep:
    """A training step of ``graphs``' model cut into units (``"taskgraph"`` or ``"layer"``), run on
    ``device`` under ``emulator`` at ``precision`` (see the module docstring)."""

    def __init__(self, graphs: TaskGraphs, unit: str, loss_fn: Optional[Callable], emulator: Emulator,
                 device: torch.device, precision: Precision):
        if unit not in UNITS:
            raise ValueError(f"UnitStep: unit must be one of {', '.join(UNITS)}, got {unit!r}")
        if graphs.graph_module is None:
            raise ValueError("UnitStep: the TaskGraphs hold no captured graph (loaded from a file?); capture the "
                             "model in this process with whalelike.capture")
        self.unit, self.loss_fn, self.emulator, self.device, self.precision = unit, loss_fn, emulator, device, precision
        index = (lambda layer: layer.taskgraph) if unit == "taskgraph" else (lambda layer: layer.index)
        self.split = split_stages(graphs.graph_module, {n: index(l) for l in graphs.layers for n in l.nodes})
        if unit == "taskgraph":
            self.flops = [(g.forward_flops, g.backward_flops) for g in graphs.graphs]
        else:
            self.flops = [(l.forward_flops, l.backward_flops) for l in graphs.layers]
        self.memory_bytes = _unit_memory_bytes(graphs, unit, emulator, precision.name)
        self.module: nn.Module = self.split.root
        self.optimizer = OPTIMIZERS[graphs.optimizer]([p for p in self.module.parameters() if p.requires_grad])
        self.trials = 0

    @property
    def units(self) -> int:
        return len(self.split.stages)

    # -- timing --------------------------------------------------------------------------------------
    def timed(self, inputs: tuple, targets: Optional[torch.Tensor], batch: int) -> list[tuple[float, float]]:
        """One training step, every unit's forward and backward a padded compute segment; returns
        ``(forward_s, backward_s)`` per unit, the time the runtime records for each segment. The parameters' ``.grad``
        hold the step's gradients afterwards, as after a training step's backward."""
        self.optimizer.zero_grad(set_to_none=True)
        forward, backward = [0.0] * self.units, [0.0] * self.units
        with self.precision.autocast(self.device):
            values: dict = {}
            saved: list[tuple[dict, dict]] = []
            for stage in self.split.stages:
                received, args = {}, []
                for source in stage.inputs:
                    if isinstance(source, ModelInput):
                        args.append(inputs[source.index])
                        continue
                    value = values[source]
                    if isinstance(value, torch.Tensor):
                        value = value.detach().requires_grad_(values[source].requires_grad)
                        if value.requires_grad:
                            received[source] = value
                    args.append(value)
                last = stage.index == self.split.num_stages - 1
                with self._segment(stage.index, 0, batch, forward):
                    outputs = stage.unpack(stage.module(*args))
                    roots, grads = (self._loss_roots(self.split.model_output(outputs), targets) if last
                                    else ([], []))
                values.update(outputs)
                saved.append((received, outputs if not last else {None: (roots, grads)}))
            incoming: dict = {}
            for stage in reversed(self.split.stages):
                received, outputs = saved[stage.index]
                if None in outputs:
                    roots, grads = outputs[None]
                else:
                    pairs = [(outputs[v], incoming[v]) for v in stage.outputs
                             if v in incoming and isinstance(outputs[v], torch.Tensor) and outputs[v].requires_grad]
                    roots, grads = [r for r, _ in pairs], [g for _, g in pairs]
                with self._segment(stage.index, 1, batch, backward):
                    if roots:
                        torch.autograd.backward(roots, grads)
                for source, tensor in received.items():
                    if tensor.grad is not None:
                        incoming[source] = tensor.grad if source not in incoming else incoming[source] + tensor.grad
        return list(zip(forward, backward))

    def timed_update(self, repeats: int, before: Optional[Callable[[], Any]] = None) -> float:
        """The optimizer's update after a step's backward (call it after :meth:`timed`: the gradients are
        there), nanoseconds per byte of the parameters it updates: the median of ``repeats`` timed
        ``optimizer.step()`` calls over the whole model (the update runs at the machine's own speed on
        emulated hardware too: the runtime does not pad it). At the profile's learning rate 0 the
        parameters stay as they are, and the update's arithmetic all runs.

        ``before`` (untimed) runs before each timed update: a step's forward and backward, and what
        else training does between its backward and its update (the profiler's: a barrier, as the
        gradient sync aligns every rank). The update then starts as in training, its gradients just
        made and the caches holding the backward's data; back to back, the updates ran warm (on this
        machine's emulated wide MLP 17-21 ms against the 27-34 ms training spends, BENCHMARKS)."""
        return timed_update(self.optimizer, repeats, self.device, before)

    @contextmanager
    def _segment(self, unit: int, phase: int, batch: int, into: list) -> Iterator[None]:
        """Unit ``unit``'s forward (``phase`` 0) or backward (1) on ``batch`` samples as one compute
        segment (the stage worker's ``Emulator.segment``: the unit's FLOPs and non-matmul bytes per
        sample times ``batch``); the time the runtime records for it is added to ``into[unit]``."""
        before = self.emulator.stats.padded_s
        with self.emulator.segment(**self._costs(unit, phase, batch)):
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # the kernels, not their launch
        into[unit] += self.emulator.stats.padded_s - before

    def _costs(self, unit: int, phase: int, batch: int) -> dict:
        return dict(flops=self.flops[unit][phase] * batch, samples=batch,
                    memory_bytes=self.memory_bytes[unit][phase] * batch)

    def modeled(self, batch: int) -> list[tuple[float, float]]:
        """What the emulator models each unit's forward and backward segment at ``batch`` to take
        (``Emulator.modeled_seconds`` of the same segments; 0 on real hardware)."""
        return [(self.emulator.modeled_seconds(**self._costs(u, 0, batch)),
                 self.emulator.modeled_seconds(**self._costs(u, 1, batch))) for u in range(self.units)]

    def _loss_roots(self, prediction: Any, targets: Optional[torch.Tensor]) -> tuple[list, list]:
        """What the backward starts from: the loss, or without a loss function (a workload that
        gives none) every floating output with a gradient of ones."""
        if self.loss_fn is not None and targets is not None:
            return [self.loss_fn(prediction, targets)], [None]
        leaves = [t for t in tree_leaves(prediction)
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        return leaves, [torch.ones_like(t) for t in leaves]

    # -- memory --------------------------------------------------------------------------------------
    def prepare(self, inputs: tuple, targets: Optional[torch.Tensor]) -> bool:
        """A first training step, neither timed nor measured: the optimizer makes its state (as in
        the first step of a training run), so every trial after it starts from the steady state.
        False when it ran out of (real) memory."""
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with self.precision.autocast(self.device):
                roots, grads = self._loss_roots(self._model_output(inputs), targets)
                torch.autograd.backward(roots, grads)
            del roots, grads
            self.optimizer.step()
        except torch.OutOfMemoryError:
            self.release()
            return False
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def fits(self, inputs: tuple, targets: Optional[torch.Tensor]) -> tuple[bool, Optional[int]]:
        """Whether a whole training step (forward, loss, backward, optimizer step) fits on the device
        at the batch of ``inputs``, and its measured peak bytes when it does (see the module docstring)."""
        self.trials += 1
        meter = MemoryMeter(self.device, enabled=True)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with meter.step([self.module], self.optimizer):
                with self.precision.autocast(self.device):
                    output = self._model_output(inputs)
                    roots, grads = self._loss_roots(output, targets)
                    del output
                    torch.autograd.backward(roots, grads)
                    del roots, grads
                self.optimizer.step()
            check_capacity(self.emulator, meter.peak_bytes, self.trials)
        except (torch.OutOfMemoryError, EmulatedOutOfMemoryError):
            self.release()
            return False, None
        self.optimizer.zero_grad(set_to_none=True)
        return True, meter.peak_bytes

    def _model_output(self, inputs: tuple) -> Any:
        """The model's output from the uncut graph (the split's root runs every unit in one graph)."""
        returned = self.module(*inputs)
        spec = self.split.output_spec   # an exported graph returns flat outputs
        return returned if spec is None else tree_unflatten(list(returned), spec)

    def release(self) -> None:
        """After an out-of-memory trial: drop what it allocated (gradients, cached blocks)."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def estimate(self, inputs: tuple, capacity: Optional[int]) -> Optional[int]:
        """Poplar's Algorithm 1, lines 1-8: the largest batch ``capacity`` holds if every sample
        costs what the forward of ``inputs`` (one sample) added to the memory in use before it; None
        without a capacity. The caller's search does not trust it (:mod:`runtime.profiling.search`)."""
        if capacity is None:
            return None
        batch = next(x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            with self.precision.autocast(self.device):
                output = self.module(*inputs)
            after = torch.cuda.memory_allocated(self.device)
        else:
            counter = LiveBytes(state_tensors([self.module], self.optimizer))
            try:
                before = counter.current
                with counter, self.precision.autocast(self.device):
                    output = self.module(*inputs)
                after = counter.current
            finally:
                counter.close()
        del output
        per_sample = max(after - before, 1) / batch
        return max(1, int((capacity - before) // per_sample))
