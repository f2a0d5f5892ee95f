"""Measure per-node costs of a captured graph on fake tensors: FLOPs, saved activations, output shapes.

One forward and one backward of a *fake* copy of the graph (``FakeTensorMode``: tensors that know
their shape, dtype and device but own no memory, so no real compute and nothing allocated for a big
model) under ``torch.utils.flop_counter.FlopCounterMode``. Why fake and not meta tensors: a graph
from ``torch.export`` names real devices (``arange(..., device=cpu)``, ``.to(cpu)``, the CPU
attention kernel checks its inputs' device), and meta tensors are on device ``meta``, so such a
graph cannot run on them; fake tensors keep the recorded device.

FlopCounterMode has no formula for the CPU flash-attention kernels that
``F.scaled_dot_product_attention`` dispatches to on CPU (it counts only the CUDA ones), so a model
using fused attention would cost less than the same model written with explicit matmuls;
:data:`ATTENTION_FLOP_FORMULAS` adds them with torch's own shape formulas (two matmuls forward,
five backward: the kernel recomputes the scores). FlopCounterMode counts the whole run; we only
attribute its counts: a small dispatch mode reads the counter's total around every operator and
charges the difference to

* forward: the graph node the interpreter is running;
* backward: the graph node whose forward created the autograd node now executing
  (``torch._C._current_autograd_node()``; autograd sequence numbers grow in creation order, so the
  sequence number locates the creating graph node).

So the per-node numbers sum exactly to FlopCounterMode's totals. Activations are what autograd
saves for backward (``saved_tensors_hooks``), each storage counted once per group (TaskGraph: a
tensor saved in two TaskGraphs lives on two devices) and parameters/buffers never, charged to the
node that first saved it.

The user's model is never touched: the fake copy is a ``deepcopy`` whose memo maps every parameter
and buffer to a fake tensor of the same shape, dtype and device, so nothing real is copied.
"""
from __future__ import annotations

import bisect
import copy
import logging
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from whalelike.errors import CaptureError

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _attention_forward_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Fused attention kernels FlopCounterMode does not count (CPU), with torch's own shape formulas.
ATTENTION_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _attention_forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


@dataclass(frozen=True)
class NodeOutputSpec:
    """Shape and dtype of one tensor a node produces (the whole example batch, batch dimension
    included); :class:`runtime.parallel.stage_split.ValueSpec` is the runtime's per-sample spec of
    a value crossing a pipeline stage boundary."""

    shape: tuple[int, ...]
    dtype: str


@dataclass
class NodeCosts:
    """Totals over the example batch, keyed by node name."""

    forward_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    backward_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    saved_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    outputs: dict[str, tuple[NodeOutputSpec, ...]] = field(default_factory=dict)
    total_forward_flops: float = 0.0
    total_backward_flops: float = 0.0


def measure(gm: fx.GraphModule, inputs: list[Any], group: dict[str, int]) -> NodeCosts:
    """Run ``gm`` forward and backward on fake copies of itself and ``inputs``; attribute the costs.

    ``group`` maps node names to the unit (TaskGraph) within which a saved tensor is counted once.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_gm = fake_copy(gm, fake_mode)
    fake_inputs = tree_map(lambda x: _to_fake(x, fake_mode), inputs)
    with fake_mode:  # factory calls in the graph (arange, ones) make fake tensors too
        return _measure(fake_gm, fake_inputs, group)


def _measure(fake_gm: fx.GraphModule, fake_inputs: list[Any], group: dict[str, int]) -> NodeCosts:
    costs = NodeCosts()
    persistent = {id(t) for t in [*fake_gm.parameters(), *fake_gm.buffers()]}
    interp = _Recorder(fake_gm, costs)
    saved: dict[tuple[int, int], torch.Tensor] = {}

    def pack(t: torch.Tensor):
        root = t if t._base is None else t._base
        if interp.current is None or id(root) in persistent:
            return t
        key = (group.get(interp.current, -1), id(root))
        if key not in saved:
            saved[key] = root  # keep it alive so its id is not reused during the run
            costs.saved_bytes[interp.current] += root.numel() * root.element_size()
        return t

    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOP_FORMULAS)
    try:
        with counter, _Attribution(counter, interp, costs), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = interp.run(*fake_inputs, enable_io_processing=False)
            interp.current = None
            costs.total_forward_flops = counter.get_total_flops()
            roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            costs.total_backward_flops = counter.get_total_flops() - costs.total_forward_flops
    except Exception as e:  # noqa: BLE001 - name the node that failed
        where = interp.current or "backward"
        raise CaptureError(
            f"capture: measuring costs on fake tensors failed at node {where!r} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); operators that read tensor "
            "values (.item(), data-dependent shapes) cannot run without data, move them out of forward"
        ) from e
    return costs


def fake_copy(gm: fx.GraphModule, fake_mode: FakeTensorMode) -> fx.GraphModule:
    """A deep copy of ``gm`` whose parameters and buffers are fake tensors of ``fake_mode`` (same
    shape, dtype, device and ``requires_grad``; tying preserved; no memory)."""
    memo: dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = nn.Parameter(_to_fake(p.detach(), fake_mode), requires_grad=p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = _to_fake(b, fake_mode)
    with warnings.catch_warnings():  # torch's own pytree specs warn about deprecated checks when copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm, memo)


def _to_fake(x: Any, fake_mode: FakeTensorMode) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    return fake_mode.from_tensor(x.detach()).requires_grad_(x.requires_grad)


class _Recorder(fx.Interpreter):
    """Runs the graph, remembering the current node, each node's output specs and, for the
    backward attribution, the highest autograd sequence number each node created."""

    def __init__(self, gm: fx.GraphModule, costs: NodeCosts):
        super().__init__(gm)
        self.costs = costs
        self.current: Optional[str] = None
        self.seq_bounds: list[int] = []  # increasing: highest sequence number created up to node i
        self.seq_nodes: list[str] = []

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name if n.op not in ("placeholder", "output") else None
        result = super().run_node(n)
        tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        self.costs.outputs[n.name] = tuple(NodeOutputSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                           for t in tensors)
        seqs = [t.grad_fn._sequence_nr() for t in tensors if t.grad_fn is not None]
        if seqs and self.current is not None and (not self.seq_bounds or max(seqs) > self.seq_bounds[-1]):
            self.seq_bounds.append(max(seqs))
            self.seq_nodes.append(n.name)
        return result

    def creator(self, sequence_nr: int) -> Optional[str]:
        i = bisect.bisect_left(self.seq_bounds, sequence_nr)
        return self.seq_nodes[i] if i < len(self.seq_nodes) else None


class _Attribution(TorchDispatchMode):
    """Charges each operator's FLOPs (as FlopCounterMode counted them) to a graph node."""

    def __init__(self, counter: FlopCounterMode, interp: _Recorder, costs: NodeCosts):
        super().__init__()
        self.counter, self.interp, self.costs = counter, interp, costs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.counter.get_total_flops()
        out = func(*args, **(kwargs or {}))
        delta = self.counter.get_total_flops() - before
        if delta:
            autograd_node = torch._C._current_autograd_node()
            if autograd_node is not None:
                owner = self.interp.creator(autograd_node._sequence_nr())
                self.costs.backward_flops[owner or "<unattributed>"] += delta
            else:
                self.costs.forward_flops[self.interp.current or "<unattributed>"] += delta
        return out
