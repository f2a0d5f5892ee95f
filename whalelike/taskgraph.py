"""TaskGraphs: the captured, costed regions of a model, as plain data.

A model is captured (see :mod:`whalelike.capture`) into an ordered list of :class:`Layer` s (the
smallest units the pipeline partitioner may move between stages) grouped into
:class:`TaskGraph` s (one per annotation scope). All costs are *per sample* so the planner can
scale them to any batch share; parameter and optimizer bytes are per whole TaskGraph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import networkx as nx

from .strategy import Strategy


@dataclass(frozen=True)
class TensorSpec:
    """A tensor crossing a TaskGraph boundary. ``shape`` excludes the batch dimension when ``batched``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    batched: bool = True

    @property
    def bytes_per_sample(self) -> int:
        import torch

        numel = 1
        for d in self.shape:
            numel *= d
        return numel * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Boundary:
    """Tensors produced by TaskGraph ``src`` and consumed by TaskGraph ``dst`` (``dst`` > ``src``
    need not be ``src + 1``: skip connections and U-shaped models give non-adjacent edges)."""

    src: int
    dst: int
    tensors: tuple[TensorSpec, ...]

    @property
    def bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.tensors)


@dataclass(frozen=True)
class Layer:
    """The unit of pipeline partitioning: the graph nodes of one module (or one run of
    un-annotated code) in execution order. ``cut_bytes_per_sample`` is what a stage boundary placed
    right after this layer would have to send (every live value produced at or before it and used
    after it)."""

    index: int
    name: str
    taskgraph: int
    forward_flops: float
    backward_flops: float
    param_bytes: int
    param_count: int
    activation_bytes_per_sample: float
    cut_bytes_per_sample: float
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskGraph:
    """One annotated region. FLOPs and activation bytes are per sample; bytes are exact.

    ``shardable`` maps the module path of every operator a ``split`` strategy shards to the size of
    its sharded dimension (Linear output features, or classes of a classifier), so the planner can
    pick uneven shard sizes.
    """

    index: int
    strategy: Strategy
    module_paths: tuple[str, ...]
    layers: tuple[int, ...]
    forward_flops: float
    backward_flops: float
    param_bytes: int
    param_count: int
    optimizer_state_bytes: int
    activation_bytes_per_sample: float
    shardable: dict[str, int] = field(default_factory=dict)


@dataclass
class TaskGraphs:
    """The captured model: TaskGraphs, their layers and boundaries, and the dependency graph.

    ``graph_module`` and ``node_taskgraph`` are the live capture (an ``fx.GraphModule`` and the
    TaskGraph index of each of its nodes) that the runtime splits into stages; they are not part of
    the serialised form.
    """

    graphs: list[TaskGraph]
    layers: list[Layer]
    boundaries: list[Boundary]
    optimizer: str
    example_batch_size: int
    method: str  # "fx" or "export": how the model was captured
    graph_module: Any = field(default=None, repr=False, compare=False)
    node_taskgraph: Optional[dict[str, int]] = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)

    def __getitem__(self, i: int) -> TaskGraph:
        return self.graphs[i]

    @property
    def dependency_graph(self) -> nx.DiGraph:
        """TaskGraph indices as nodes; an edge per boundary, carrying its bytes per sample."""
        g = nx.DiGraph()
        g.add_nodes_from(tg.index for tg in self.graphs)
        for b in self.boundaries:
            g.add_edge(b.src, b.dst, bytes_per_sample=b.bytes_per_sample, tensors=b.tensors)
        return g
