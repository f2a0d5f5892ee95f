"""Each step's peak memory on this rank, measured, so the planner's predictions can be checked.

On a GPU the caching allocator counts every byte: ``torch.cuda.reset_peak_memory_stats`` before the
step and ``torch.cuda.max_memory_allocated`` after it, at no cost. A CPU has no such counter, so
the CPU meter is a ``TorchDispatchMode`` (:class:`LiveBytes`) that sees every tensor an operator
returns, forward and backward (the autograd engine runs a CPU backward on the calling thread, under
the same mode), and counts each storage once from its first appearance until it is freed (a weak
reference's finalizer). Fake tensors (``FakeTensorMode``'s, made when an executor is built inside
the first step: shape propagation of its graphs) report a CPU device and storage sizes but hold no
memory, so they are not counted. The step starts from what is alive then and is the model's state:
the parameters, buffers, gradients and optimizer state of the rank's module and optimizer.

Why not torch's ``torch.distributed._tools.mem_tracker.MemTracker``: it attributes memory to
modules through forward hooks and refuses a root module called twice in one tracked region, which
is every step of a pipeline stage or of gradient accumulation (one call per micro-batch); we need
only the peak, which a storage counter gives for any schedule. The mode slows each operator
(Python runs per operator), so on CPU it runs only when asked (``Engine(measure_memory=True)``,
``train.py --measure-memory``); on CUDA it is on by default.

What is measured is the peak of the bytes alive during the step, the quantity the planner's memory
model predicts (:mod:`planner.devices.memory`): the CPU figure counts tensor storages (no allocator
rounding, no communication library buffers), the CUDA figure the allocator's blocks: every tensor
allocated on the device, also those of another model or of a dropped Engine's model not yet
collected (an Engine goes when dropped, but the graph it captured sits in torch.fx's reference
cycles and keeps the parameters until the cyclic collector runs: ``gc.collect()``).

Invariant: measuring never changes what the step computes (the mode only observes), and a step's
figure is its own peak (counted afresh for every step).
"""
from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from runtime.replicas.held_state import is_dtensor, is_sharded, local

log = logging.getLogger(__name__)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive while it is active, and their peak."""

    def __init__(self, alive: Iterable[torch.Tensor] = (), resizes: bool = False, inputs: Optional[bool] = None):
        super().__init__()
        # resizes: storages may change size in place (FSDP2 frees and re-allocates its unsharded
        # parameters with ``untyped_storage().resize_``): every counted storage's size is read again
        # after each operator (slower; only for ZeRO's modules), and operator inputs are counted too
        # (``inputs``, default: as ``resizes``; a step starts with such storages made before it).
        # Set-up counts outputs only: an input made before it began (the source of the weights a
        # rank copies in) is not the rank's.
        self.resizes = resizes
        self.inputs = resizes if inputs is None else inputs
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}
        self._finalizers: list = []
        self.current = self.peak = 0
        for tensor in alive:
            self.track(tensor)

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage from now until it is freed (once, however many views share it)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if is_dtensor(tensor):    # a wrapper: its storage is its local shard's (ZeRO's parameters, states)
            tensor = tensor._local_tensor
        if type(tensor) is not torch.Tensor and is_fake(tensor):
            return   # a fake tensor (shape propagation while an executor is built) holds no memory
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):   # a tensor without storage (a subclass, sparse)
            return
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = size = storage.nbytes()
        if self.resizes:
            self._refs[key] = weakref.ref(storage)
        self.current += size
        self.peak = max(self.peak, self.current)
        self._finalizers.append(weakref.finalize(storage, self._free, key))

    def uncounted_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """The bytes of the storages of ``tensors`` this counter never counted (made before it began,
        or where no operator made them: read by safetensors), each once."""
        found = {}
        for tensor in tensors:
            tensor = local(tensor)
            if tensor.device.type != "meta" and not self.counts(tensor):
                storage = tensor.untyped_storage()
                found[storage._cdata] = storage.nbytes()
        return sum(found.values())

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is counted (made while the counter was active, or tracked)."""
        try:
            return tensor.untyped_storage()._cdata in self._sizes
        except (NotImplementedError, RuntimeError):   # no storage (a subclass, sparse): never counted
            return False

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _refresh(self) -> None:
        """Read every counted storage's size again (storages resized in place)."""
        for key, ref in list(self._refs.items()):
            storage = ref()
            if storage is None or key not in self._sizes:
                continue
            size = storage.nbytes()
            if size != self._sizes[key]:
                self.current += size - self._sizes[key]
                self._sizes[key] = size
        self.peak = max(self.peak, self.current)

    def close(self) -> None:
        """Stop counting: drop the finalizers on the storages still alive (the model's state)."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.resizes:
            self._refresh()        # what the Python code between operators resized
        if self.inputs:
            for tensor in tree_flatten((args, kwargs))[0]:
                self.track(tensor)
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self.track(tensor)
        if self.resizes:
            self._refresh()
        return out


def state_tensors(modules: Iterable[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors a step starts with: parameters, their gradients, buffers, the optimizer's
    parameters (a ragged sync's shards, which are not the module's) with their gradients, and its state."""
    out = []
    params = [p for module in modules for p in module.parameters()]
    if optimizer is not None:
        params += [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        out.append(local(param))
        if param.grad is not None:
            out.append(local(param.grad))
    for module in modules:
        out.extend(module.buffers())
    if optimizer is not None:
        out.extend(local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    return out


def frees_storage(module: nn.Module) -> bool:
    """Whether a sync frees and re-allocates ``module``'s parameters in place
    (``untyped_storage().resize_``): FSDP2's DTensor parameters, or a parameter whose storage is
    now smaller than the tensor (the ragged sync at ZeRO 3 between gathers)."""
    return is_sharded(module) or any(p.untyped_storage().nbytes() < p.numel() * p.element_size()
                                     for p in module.parameters() if not is_dtensor(p))


class MemoryMeter:
    """Peak bytes of each step on ``device``; :meth:`step` is a context around one step and
    :attr:`peak_bytes` its result (None when not measured)."""

    def __init__(self, device: torch.device, enabled: Optional[bool] = None):
        self.device = device
        self.enabled = device.type == "cuda" if enabled is None else bool(enabled)
        self.peak_bytes: Optional[int] = None
        self.setup_peak_bytes: Optional[int] = None

    @contextmanager
    def setup(self, held: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
        """The peak bytes of building an executor and filling it (:attr:`setup_peak_bytes`): every
        storage made until the block ends, at its peak, plus the storages ``held()`` (called at the
        end: the tensors the rank keeps) had before it began: a model built normally keeps its held
        tensors where they are, and what it does not hold is the caller's host memory, not this
        device's (as the CUDA figure, the allocator's peak on the device, does not count it)."""
        self.setup_peak_bytes = None
        with self._measured(lambda: LiveBytes(resizes=True, inputs=False),
                            lambda counter: counter.uncounted_bytes(held())) as peak:
            yield
        self.setup_peak_bytes = peak[0]

    @contextmanager
    def step(self, modules: list[nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> Iterator[None]:
        self.peak_bytes = None
        with self._measured(lambda: LiveBytes(state_tensors(modules, optimizer),
                                              resizes=any(frees_storage(m) for m in modules))) as peak:
            yield
        self.peak_bytes = peak[0]

    @contextmanager
    def _measured(self, counter: Callable[[], LiveBytes],
                  more: Optional[Callable[[LiveBytes], int]] = None) -> Iterator[list]:
        """The block's peak bytes, in the one-item list it yields once the block ends (None when not
        measuring): on CUDA the allocator's peak (it counts on the host, when a kernel's memory is
        allocated, in stream order, so its peak needs no device synchronisation: measuring costs
        nothing); on CPU ``counter()``'s peak, plus ``more(counter)``."""
        peak: list = [None]
        if not self.enabled:
            yield peak
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield peak
            peak[0] = int(torch.cuda.max_memory_allocated(self.device))
            return
        live = counter()
        try:
            with live:
                yield peak
        finally:
            live.close()
        peak[0] = int(live.peak) + (more(live) if more is not None else 0)
