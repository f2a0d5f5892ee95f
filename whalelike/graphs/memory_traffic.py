"""The bytes moved by the operators that FlopCounterMode does not count: a model's memory-bound work.

``torch.utils.flop_counter.FlopCounterMode`` counts only matmul-like operators (mm, addmm, bmm,
baddbmm, convolutions, fused attention; :mod:`whalelike.graphs.costs` adds the CPU attention
kernels). The rest of a model (element-wise operators, normalisations, softmax, casts, an
embedding's gather, and the same in backward) does little arithmetic but reads and writes every
element, so on real hardware it takes bytes / memory bandwidth, not FLOPs / peak: why two devices
of equal peak run one model at different speeds. :class:`MemoryTrafficMode` counts those bytes
operator by operator; a backward run inside the mode dispatches its operators through it, as
FlopCounterMode's does, so one mode counts both passes.

Why a dispatch mode and not the module's activations (``Layer.activation_bytes_per_sample``):
activations are what autograd saves for backward, another set. They include the matmul outputs
(whose time is their FLOPs), leave out every temporary an element-wise operator writes and the next
one reads back, count a tensor once however many operators read it, and say nothing of the
backward's traffic (about twice the forward's). The mode sees each operator's own inputs and
results, in both passes, on real or fake tensors: :mod:`whalelike.graphs.costs` can run it beside
FlopCounterMode on its fake copy, attributing its running ``total`` per node as it does FLOPs.

The traffic model (one pass over memory per operand, no reuse between operators, what a
bandwidth-bound kernel does):

* an operator reads each distinct tensor argument once and writes each tensor result once, each
  ``numel x element size`` (the tensor's elements, not its storage: a slice reads only the slice);
* matmul-like operators (those FlopCounterMode prices, and the CPU fused-attention kernels
  :data:`FUSED_ATTENTION` it misses, which :data:`whalelike.graphs.costs.ATTENTION_FLOP_FORMULAS`
  prices; listed here, below ``costs``, which imports this module) count 0: their time is their FLOPs, and an operator is priced by one or the other, never both;
* views (``OpOverload.is_view``: view, transpose, expand, detach, ...), ``_unsafe_view``,
  allocations without a write (``empty``, ``new_empty``, ...) and operators returning no tensor
  (size queries) count 0;
* gathers (embedding, index_select, gather, index) read the indices and what they gather, the size
  of their result, not the whole table: indices + 2 x result;
* write-only in-place operators (``zero_``, ``fill_``, ``copy_``, the random fills) write their
  first argument without reading it.

Invariant: the count depends only on the operators, shapes and dtypes, never on the device or the
time taken, so the emulator's modeled time (:mod:`runtime.emulation.compute`) never comes from
measured time; a model made only of matmuls counts 0 bytes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# the CPU fused-attention kernels FlopCounterMode does not count: (forward, backward)
FUSED_ATTENTION = (aten._scaled_dot_product_flash_attention_for_cpu,
                   aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _packet(op: Any) -> Any:
    return getattr(op, "overloadpacket", op)


# priced by their FLOPs (what the segment's FLOPs already count), so no bytes
MATMUL_OPERATORS = frozenset({*map(_packet, flop_registry), *map(_packet, FUSED_ATTENTION)})
# memory is allocated, not written
_ALLOCATIONS = frozenset({aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided})
# a view whose schema does not say so
_VIEWS = frozenset({aten._unsafe_view})
# read what they gather (the size of the result), not the whole source
_GATHERS = frozenset({aten.embedding, aten.index_select, aten.gather, aten.index})
# write their first argument without reading it
_WRITE_ONLY = frozenset({aten.zero_, aten.fill_, aten.copy_, aten.normal_, aten.uniform_, aten.bernoulli_,
                         aten.random_, aten.exponential_})


def _tensor_bytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _distinct_tensors(values: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(leaf)
    return out


def operator_bytes(func: Any, args: tuple, kwargs: Optional[dict], result: Any) -> int:
    """Bytes that the operator ``func`` (an ``OpOverload``), called on ``args``/``kwargs`` and
    returning ``result``, reads and writes, by the traffic model of the module docstring."""
    packet = _packet(func)
    if packet in MATMUL_OPERATORS or packet in _ALLOCATIONS or packet in _VIEWS or getattr(func, "is_view", False):
        return 0
    written = _distinct_tensors(result)
    if not written:
        return 0
    kwargs = {k: v for k, v in (kwargs or {}).items() if k != "out"}   # an out= tensor is written, not read
    written_bytes = sum(_tensor_bytes(t) for t in written)
    if packet in _GATHERS:
        indices = [t for t in _distinct_tensors((args, kwargs)) if not t.is_floating_point()]
        return sum(_tensor_bytes(t) for t in indices) + 2 * written_bytes
    read = _distinct_tensors((args[1:], kwargs) if packet in _WRITE_ONLY else (args, kwargs))
    return sum(_tensor_bytes(t) for t in read) + written_bytes


class MemoryTrafficMode(TorchDispatchMode):
    """Counts the bytes of the operators run inside it (:func:`operator_bytes`): ``total`` and
    ``by_operator`` (operator name -> bytes). Works on real and fake tensors alike."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_operator: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        moved = operator_bytes(func, args, kwargs, result)
        if moved:
            self.total += moved
            self.by_operator[str(_packet(func))] += moved
        return result


def forward_backward_bytes(module: nn.Module, args: tuple,
                           loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> tuple[int, int]:
    """(forward, backward) non-matmul bytes of one call of ``module`` on ``args`` and its backward.

    ``loss_fn`` turns the output into the scalar that is differentiated (its own operators count
    with the forward); without it, every floating-point output is back-propagated with a gradient
    of ones made outside the count (what a following stage would send back). Divide by the batch
    for bytes per sample. The module's gradients are left set; gradients already there are
    accumulated into, and that traffic counts (as it does in a step's later micro-batches)."""
    with MemoryTrafficMode() as forward:
        output = module(*args)
        loss = loss_fn(output) if loss_fn is not None else None
    if loss is not None:
        roots, grads = [loss], None
    else:
        roots = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.ones_like(t) for t in roots]
    if not roots:
        raise ValueError(f"forward_backward_bytes: the output of {type(module).__name__} has no tensor that requires "
                         "grad, so there is no backward to count; pass inputs or parameters that require grad")
    with MemoryTrafficMode() as backward:
        torch.autograd.backward(roots, grads)
    return forward.total, backward.total
