"""TaskGraphs: the captured, costed regions of a model, as plain data.

A model is captured (see :mod:`whalelike.graphs.capture`) into an ordered list of :class:`Layer` s (the
smallest units the pipeline partitioner may move between stages) grouped into
:class:`TaskGraph` s (one per annotation scope). All costs are *per sample* so the planner can
scale them to any batch share; parameter and optimizer bytes are per whole TaskGraph.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from whalelike.display import format_table, human_bytes, human_count, human_flops
from whalelike.errors import SpecError
from whalelike.sharding.groups import ShardGroup
from whalelike.strategy import Strategy

if TYPE_CHECKING:
    import networkx as nx


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
class ModelOutputLeaf:
    """One leaf of what the model returns (``tree_flatten`` order, ``index``), as capture saw it:
    ``name`` its path in the output (``logits``, ``encoder_last_hidden_state``, ``[1]``), ``node``
    the captured node computing it, ``layer``/``layer_name`` the Layer of that node (None: a model
    input, a parameter or a constant, which no stage computes), ``shape`` per sample when
    ``batched`` (a tensor batched along dimension 0, the only kind that may cross pipeline stages),
    else whole, and ``dtype``. Where each leaf goes in a pipeline is decided by
    :func:`whalelike.graphs.output_tree.route_outputs`."""

    index: int
    name: str
    node: str = ""
    layer: Optional[int] = None
    layer_name: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    batched: bool = False


LAYER_META = "wl_layer"   # node.meta key: the node's Layer index (node names change when stages are cut)


@dataclass(frozen=True)
class Layer:
    """The unit of pipeline partitioning: the graph nodes of one module (or one run of
    un-annotated code) in execution order. ``cut_bytes_per_sample`` is what a stage boundary placed
    right after this layer would have to send (every live batched value produced at or before it
    and used after it), per sample; ``cut_bytes_unbatched`` the whole bytes of the live values
    without a batch dimension (a statistic of the batch), which cross whole once per micro-batch.
    ``batchnorm``: the BatchNorm modules the layer runs in training mode
    (:mod:`whalelike.graphs.batchnorm_layers`). ``borrowed_params``: ``(owner layer, name, bytes)`` of each
    parameter the layer uses that an earlier layer owns (tied weights); a stage that holds this
    layer but not the owner holds a copy of it, with its gradient and optimizer state.
    ``idle_state``: the names of the model's parameters and persistent buffers that the captured
    forward never reads and this layer holds (:mod:`whalelike.graphs.capture`: DINOv2's
    ``mask_token``); the stage holding the layer keeps them, untrained and unsynced, so the state
    dict, checkpoints and exports are the whole model's. Their parameters count in ``param_bytes``.
    ``outside_param_bytes``: of ``param_bytes``, the parameters registered outside the layer's module
    (a value computed from a parameter and constants alone is recomputed in the layer that reads it,
    GPT-2's position embedding in its first block): ZeRO's unit of that module does not hold them,
    the root unit does (:func:`planner.devices.cost_model.fsdp_unit_names`).

    Memory beyond the saved activations (:mod:`planner.devices.memory` reads them):
    ``input_activation_bytes_per_sample`` is the part of ``activation_bytes_per_sample`` made before
    this layer (a model input, an earlier layer's output), which a stage starting here holds anyway
    (its received boundary buffer, or the caller's batch); ``output_bytes_per_sample`` the model
    outputs this layer returns (the logits a loss reads). ``autocast`` holds the same figures
    measured under bf16/fp16 autocast (keys ``activation``, ``input_activation``, ``cut``, ``output``
    per sample, ``cut_unbatched`` whole, and ``param_copy``: the bytes of the 2-byte weight casts
    autocast makes in this layer), or None when not measured (then the planner scales the float32
    figures by 2/4).
    ``backward_temporary_bytes_per_sample``: the most the layer's backward holds above what it
    started with, once what the layer after it leaves is freed (its gradient temporaries, such as
    a float32 softmax's gradient, less the saved tensors it has freed by then), measured on the fake backward of capture
    (:mod:`whalelike.graphs.costs`); 0 in a layer made by hand or captured before it was
    (``autocast`` key ``backward_temporary`` under autocast).
    ``max_param_bytes``: the largest single parameter the layer owns (0: not recorded, a layer made
    by hand or captured before it was; the planner then takes ``param_bytes``), what ragged ZeRO
    shards hold of one full gradient at a time (:func:`planner.devices.memory.parameter_share`);
    ``param_tensors``: how many parameters it owns (0: not recorded), one collective each there.

    ``forward_memory_bytes`` / ``backward_memory_bytes``: per sample, the bytes the layer's
    non-matmul operators (element-wise, norms, softmax, casts, gathers) read and write in its
    forward and its backward (:class:`whalelike.graphs.memory_traffic.MemoryTrafficMode`, attributed
    per node as the FLOPs are); a layer of matmuls alone moves 0. The emulator prices them at a
    device's ``emulated_memory_gbps`` (:mod:`runtime.emulation.compute`); the planner does not read
    them. Measured costs like the FLOPs, so not in the fingerprint; 0 in a layer made by hand or
    captured before they were (such a capture file still loads, and its segments price no bytes).
    ``autocast``, when measured, holds them under bf16/fp16 autocast too (keys ``forward_memory``,
    ``backward_memory``)."""

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
    batchnorm: tuple[str, ...] = ()
    borrowed_params: tuple[tuple[int, str, int], ...] = ()
    idle_state: tuple[str, ...] = ()
    outside_param_bytes: int = 0
    input_activation_bytes_per_sample: float = 0.0
    output_bytes_per_sample: float = 0.0
    autocast: Optional[dict[str, float]] = None
    max_param_bytes: int = 0
    param_tensors: int = 0
    forward_memory_bytes: float = 0.0
    backward_memory_bytes: float = 0.0
    cut_bytes_unbatched: float = 0.0
    backward_temporary_bytes_per_sample: float = 0.0


@dataclass(frozen=True)
class TaskGraph:
    """One annotated region. FLOPs and activation bytes are per sample; bytes are exact.

    ``shardable`` maps the module path of every projection a ``split`` strategy shards to the size
    of its sharded dimension (output features of a column projection or classifier, input features
    of a row projection), so the planner can pick uneven shard sizes; ``shard_groups`` says which of
    them are cut together and into which units (attention heads, MLP features; see
    :mod:`whalelike.sharding.groups`). A TaskGraph with ``shardable`` but no ``shard_groups`` (made by
    hand) shards each entry on its own and all of its work.
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
    shard_groups: tuple[ShardGroup, ...] = ()


@dataclass
class TaskGraphs:
    """The captured model: TaskGraphs, their layers and boundaries, and the dependency graph.

    ``graph_module`` and ``node_taskgraph`` are the live capture (an ``fx.GraphModule`` and the
    TaskGraph index of each of its nodes) that the runtime splits into stages; they are not part of
    the serialised form.

    ``outputs``: the leaves of the model's output (:class:`ModelOutputLeaf`); ``loss_reads``: the
    indices of those the loss reads, when capture was given the loss
    (:func:`whalelike.graphs.output_tree.loss_reads`), else None (unknown: every leaf may be read).
    Both decide where model outputs computed before a pipeline's last stage go
    (:func:`whalelike.graphs.output_tree.route_outputs`, at plan time and at run time alike); they
    are not in the fingerprint (a plan does not depend on the loss, and its layers pin the model).
    """

    graphs: list[TaskGraph]
    layers: list[Layer]
    boundaries: list[Boundary]
    optimizer: str
    example_batch_size: int
    method: str  # "fx" or "export": how the model was captured
    graph_module: Any = field(default=None, repr=False, compare=False)
    node_taskgraph: Optional[dict[str, int]] = field(default=None, repr=False, compare=False)
    outputs: tuple[ModelOutputLeaf, ...] = ()
    loss_reads: Optional[tuple[int, ...]] = None

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)

    def __getitem__(self, i: int) -> TaskGraph:
        return self.graphs[i]

    @property
    def devices_asked(self) -> int:
        """The fewest devices the regions' counts take as written: each fixed count's devices
        (``Strategy.fixed_degrees``), one per region whose count the planner chooses."""
        return sum(dp * tp for dp, tp in (g.strategy.fixed_degrees or (1, 1) for g in self.graphs))

    @property
    def dependency_graph(self) -> nx.DiGraph:
        """TaskGraph indices as nodes; an edge per boundary, carrying its bytes per sample."""
        import networkx as nx   # a quarter of a second to import: only this view of the graphs needs it
        g = nx.DiGraph()
        g.add_nodes_from(tg.index for tg in self.graphs)
        for b in self.boundaries:
            g.add_edge(b.src, b.dst, bytes_per_sample=b.bytes_per_sample, tensors=b.tensors)
        return g

    # -- identity and serialisation ---------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 of the model's structure: strategies, module paths, parameter counts, layer names,
        boundary shapes. Stable across runs and processes (no ids, no node names, no costs), so a
        saved plan can check it is applied to the model it was made for. Floating-point dtypes count
        as one kind: a plan made from the float32 model runs the same model cast with ``.double()``
        or ``.bfloat16()`` (the plan's byte counts then scale with the element size; its shares
        and shards stay valid). Activation checkpointing (``Strategy.recompute``) is not structure
        either: the plan says which stages recompute (``StagePlan.recompute``), and
        :func:`planner.plan_checks.check_model` checks that it honours every region that asks."""
        payload = {
            "graphs": [[g.strategy.structure, list(g.module_paths), list(g.layers), g.param_count,
                        sorted(g.shardable.items()), [sg.structure() for sg in g.shard_groups]] for g in self.graphs],
            "layers": [[l.name, l.taskgraph, l.param_count] for l in self.layers],
            "boundaries": [[b.src, b.dst, [[list(t.shape), _dtype_kind(t.dtype), t.batched] for t in b.tensors]]
                           for b in self.boundaries],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict:
        """JSON-safe form of everything but the live ``graph_module``."""
        return {
            "method": self.method,
            "optimizer": self.optimizer,
            "example_batch_size": self.example_batch_size,
            "fingerprint": self.fingerprint,
            "graphs": [{**dataclasses.asdict(g), "strategy": _strategy_to_dict(g.strategy),
                        "shard_groups": [sg.to_dict() for sg in g.shard_groups]} for g in self.graphs],
            "layers": [dataclasses.asdict(l) for l in self.layers],
            "boundaries": [dataclasses.asdict(b) for b in self.boundaries],
            "node_taskgraph": self.node_taskgraph,
            "outputs": [dataclasses.asdict(leaf) for leaf in self.outputs],
            "loss_reads": None if self.loss_reads is None else list(self.loss_reads),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "TaskGraphs":
        """Inverse of :meth:`to_dict` (``graph_module`` is None: re-capture to train)."""
        try:
            graphs = [TaskGraph(**{**g, "strategy": _strategy_from_dict(g["strategy"]),
                                   "module_paths": tuple(g["module_paths"]), "layers": tuple(g["layers"]),
                                   "shardable": dict(g["shardable"]),
                                   "shard_groups": tuple(ShardGroup.from_dict(sg) for sg in g.get("shard_groups", ()))})
                      for g in data["graphs"]]
            layers = [Layer(**{**l, "nodes": tuple(l["nodes"]), "batchnorm": tuple(l.get("batchnorm", ())),
                                "borrowed_params": tuple(tuple(b) for b in l.get("borrowed_params", ())),
                                "idle_state": tuple(l.get("idle_state", ()))})
                      for l in data["layers"]]
            boundaries = [Boundary(b["src"], b["dst"], tuple(
                TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t["batched"]) for t in b["tensors"]))
                for b in data["boundaries"]]
            outputs = tuple(ModelOutputLeaf(**{**o, "shape": tuple(o["shape"])}) for o in data.get("outputs", ()))
            reads = data.get("loss_reads")
            out = cls(graphs, layers, boundaries, data["optimizer"], data["example_batch_size"], data["method"],
                      node_taskgraph=data.get("node_taskgraph"), outputs=outputs,
                      loss_reads=None if reads is None else tuple(reads))
        except (KeyError, TypeError) as e:
            raise SpecError(f"TaskGraphs.from_dict: malformed data ({type(e).__name__}: {e})") from None
        if "fingerprint" in data and data["fingerprint"] != out.fingerprint:
            raise SpecError("TaskGraphs.from_dict: fingerprint does not match the data; the file was edited or corrupted")
        return out

    # -- display ------------------------------------------------------------------------------------
    def table(self) -> str:
        """An aligned table, one row per TaskGraph, costs per sample, memory per whole TaskGraph."""
        rows = []
        for g in self.graphs:
            sends = [f"->{b.dst} {human_bytes(b.bytes_per_sample)}" for b in self.boundaries if b.src == g.index]
            rows.append([
                g.index, str(g.strategy), abbreviate_paths(g.module_paths), human_count(g.param_count),
                human_bytes(g.param_bytes), human_bytes(g.optimizer_state_bytes), human_flops(g.forward_flops),
                human_flops(g.backward_flops), human_bytes(g.activation_bytes_per_sample), ", ".join(sends) or "-",
            ])
        rows.append([
            "total", "", f"{len(self.layers)} layers", human_count(sum(g.param_count for g in self.graphs)),
            human_bytes(sum(g.param_bytes for g in self.graphs)),
            human_bytes(sum(g.optimizer_state_bytes for g in self.graphs)),
            human_flops(sum(g.forward_flops for g in self.graphs)),
            human_flops(sum(g.backward_flops for g in self.graphs)),
            human_bytes(sum(g.activation_bytes_per_sample for g in self.graphs)), "",
        ])
        title = (f"{len(self.graphs)} TaskGraph(s), captured with torch.{self.method}; FLOPs and activations per "
                 f"sample (example batch {self.example_batch_size}), optimizer state for {self.optimizer}")
        headers = ["#", "strategy", "modules", "params", "param mem", "optim mem", "fwd/sample", "bwd/sample",
                   "act/sample", "sends/sample"]
        return format_table(headers, rows, title=title)

    def __str__(self) -> str:
        return self.table()


def _strategy_to_dict(s: Strategy) -> dict:
    return {"kind": s.kind, "device_count": s.device_count,
            "inner": _strategy_to_dict(s.inner) if s.inner is not None else None, "recompute": s.recompute,
            "zero": s.zero, "sync": s.sync}


def _strategy_from_dict(d: dict) -> Strategy:
    inner = _strategy_from_dict(d["inner"]) if d.get("inner") else None
    return Strategy(d["kind"], d.get("device_count"), inner, recompute=d.get("recompute", False),
                    zero=d.get("zero"), sync=d.get("sync"))   # files from before P-Reduce have no sync: None


_NUMBERED = re.compile(r"^(.*\.)(\d+)$")


def abbreviate_paths(paths, width: int = 60) -> str:
    """``transformer.h.0, transformer.h.1, transformer.h.2`` -> ``transformer.h.0-2``; long lists end in ``(+N)``."""
    parts: list[list] = []  # [prefix, first, last] runs of consecutive numbered siblings, or [path]
    for p in paths:
        m = _NUMBERED.match(p)
        if m and parts and len(parts[-1]) == 3 and parts[-1][0] == m[1] and parts[-1][2] + 1 == int(m[2]):
            parts[-1][2] = int(m[2])
        elif m:
            parts.append([m[1], int(m[2]), int(m[2])])
        else:
            parts.append([p])
    names = [x[0] if len(x) == 1 else (f"{x[0]}{x[1]}" if x[1] == x[2] else f"{x[0]}{x[1]}-{x[2]}") for x in parts]
    text = ", ".join(names)
    if len(text) <= width:
        return text
    shown = []
    for k, n in enumerate(names):
        if len(", ".join(shown + [n])) > width - 8:
            return ", ".join(shown) + f" (+{len(names) - k})"
        shown.append(n)
    return text


def _dtype_kind(dtype: str) -> str:
    """``"floating"`` for every floating-point dtype name, else the name itself (integer and bool
    tensors, such as token ids and masks, keep their exact dtype)."""
    return "floating" if dtype in _FLOATING else dtype


_FLOATING = {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "half", "float", "double"}
