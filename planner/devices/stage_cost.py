"""What a pipeline stage costs, per sample, as captured: :class:`StageCost`, the record both models read.

A stage's FLOPs and bytes come from its Layers' captured figures (:meth:`StageCost.of_layers`):
parameters, optimizer state (gradients are as large as the parameters) and, per sample of a
micro-batch, the activations saved for backward and the boundary buffers (the received input and
the output it sends), at the training precision's bytes per element; and which of a stage's layers
are FSDP units of their own (:func:`fsdp_unit_names`), the one answer the runtime's ZeRO wrapping
and the memory model share.

Why a module of its own: :mod:`planner.devices.cost_model` prices a StageCost's time and
:mod:`planner.devices.memory` what a worker holds of its bytes (each term with its own fraction), and
the cost model reads the memory model (a ZeRO stage's buckets and units); the record both read sits
below both, so neither imports the other back.

Invariant: a StageCost is plain data derived from TaskGraphs alone (no device, no fraction, no
memory rule): what a worker of the stage holds is :func:`planner.devices.memory.stage_memory`'s, and
how long it takes is :mod:`planner.devices.cost_model`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from whalelike.graphs.regions import ROOT_LAYER
from whalelike.graphs.taskgraph import TaskGraphs


# bytes per element of the activations a training precision keeps (autocast's outputs); capture
# measures every tensor at float32, 4 bytes, and again under autocast (Layer.autocast); the ratio is
# the fallback for TaskGraphs without the autocast figures
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CAPTURED_BYTES = 4
# the loss's temporaries per element of the model outputs it reads (logits), held while one
# micro-batch's loss and its gradient are computed: a float32 shifted copy and its exponentials
# (cross-entropy's log-softmax, forward then backward), plus under autocast the float32 copy of
# the 2-byte logits the loss upcasts first; measured on the runtime's losses (bench/memory.py)
LOSS_TEMPORARY_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}
# the all-reduces a class-sharded head's cross-entropy runs in each forward across its tensor-parallel group
# (runtime.tensor.layers._ShardedCrossEntropy): the row maxima (4 bytes a row), then each row's sum of
# exponentials and target logit (8); its backward runs none. Priced as one row per sample: a sequence model
# has a row per position, but these are latency-bound (a few KiB against each collective's fixed cost)
SHARDED_LOSS_ALLREDUCE_BYTES = (4.0, 8.0)


@dataclass(frozen=True)
class StageCost:
    """Per-sample compute and memory of a contiguous range of layers (one pipeline stage).

    ``static_bytes`` (parameters + gradients + optimizer state) and ``optimizer_bytes`` are per
    whole stage; ``activation_bytes`` and ``boundary_bytes`` are per sample of one micro-batch in
    flight; ``loss_bytes`` per sample of the one micro-batch whose loss is computed (the last
    stage's model outputs and the loss's temporaries, ``LOSS_TEMPORARY_BYTES`` per output element).
    ``unbatched_boundary_bytes`` are the whole bytes of the boundary values without a batch dimension
    (``Layer.cut_bytes_unbatched``, received and sent), which every worker holds whole per
    micro-batch in flight, whatever its samples or shard.
    ``activation_bytes`` leaves out what the first layer saves of the stage's input (capture's
    ``Layer.input_activation_bytes_per_sample``): the received boundary buffer, counted in
    ``boundary_bytes``, or the caller's batch, held whether or not the stage saves it.
    ``sharded_activation_bytes`` and ``sharded_loss_bytes`` are the parts of those a ``split``
    stage's shard groups divide (``ShardGroup.activation_bytes_per_sample``; the loss when the
    head is class-sharded); the rest every tensor-parallel rank holds whole.
    ``max_layer_sharded_activation_bytes`` is the part of ``max_layer_activation_bytes`` (the layer
    recomputed at once) its own groups divide (None: not known, a stage priced by hand).
    A worker's share of them: :func:`planner.devices.memory.stage_memory`.

    For activation checkpointing, which recomputes one layer at a time
    (:mod:`runtime.training.recompute`), per sample: ``layer_input_bytes``, the inputs of the
    stage's layers after its first (the cut after each layer but the last: every value crossing it,
    so a long skip connection counts at every cut it crosses, an upper bound), and
    ``max_layer_activation_bytes``, the largest single layer's saved activations less what it saves
    of its input (kept anyway; None, for a stage priced by hand as one block: all of
    ``activation_bytes``, no layer inputs of its own). With or without it, one layer's backward holds
    its gradient temporaries above what it started with, ``max_layer_backward_bytes`` at the most
    (held once: one micro-batch is in its backward at a time).

    ``precision`` is the training precision the stage is priced at: its FLOPs run at each device's
    rate for it (:func:`planner.devices.cost_model.compute_ms`), and bytes per element follow it
    (:meth:`of_layers`). Under ``fp32`` everything is as captured (float32). Under ``bf16``/``fp16`` mixed precision (torch autocast) the
    parameters stay float32 (the master weights), so do their gradients and the optimizer state:
    ``param_bytes``, ``static_bytes`` and ``optimizer_bytes`` are unchanged; autocast casts each
    weight it casts once per step and keeps the low-precision copy while the step's forward and
    backward run, ``param_copy_bytes``, counted with the weights: the casts capture saw autocast make
    (``Layer.autocast["param_copy"]``: the projections' weights, not an embedding's or a norm's);
    and the activations, boundary buffers, layer outputs and model outputs are the bytes capture
    measured under autocast (``Layer.autocast``): 2 bytes for what autocast casts, 4 for what it
    leaves float32 (a residual stream, normalisations, softmax). A TaskGraph captured without those
    figures falls back to 2 bytes per parameter for the casts and 2/4 of the float32 bytes
    (``ACTIVATION_BYTES``). Gradient all-reduces stay float32 (``param_bytes``).
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
    loss_bytes: float = 0.0                  # per sample, held once: model outputs and the loss's temporaries
    sharded_activation_bytes: float = 0.0    # of activation_bytes: what a split stage's groups divide
    sharded_loss_bytes: float = 0.0          # of loss_bytes: what a class-sharded head divides
    # per sample, each all-reduce a class-sharded head's cross-entropy runs per forward on a split stage
    # (SHARDED_LOSS_ALLREDUCE_BYTES; () without such a head): priced by planner.assemble beside the layers'
    loss_allreduce_bytes: tuple[float, ...] = ()
    # per sample, each all-reduce a split stage's forward runs (and its backward once more, for the inputs'
    # gradients): one per shard group with a row projection (Megatron: an attention block's output projection,
    # an MLP's down projection), of its layer's output bytes; None: one per layer (TaskGraphs without groups)
    tp_allreduce_bytes: Optional[tuple[float, ...]] = None
    layer_input_bytes: float = 0.0           # per sample: inputs of its layers after the first (recompute keeps them)
    max_layer_activation_bytes: Optional[float] = None   # per sample: its largest layer's activations (None: all)
    # per sample: the most one of its layers' backward holds above what it started with (its gradient temporaries;
    # Layer.backward_temporary_bytes_per_sample), held once, beside the activations (planner.devices.memory)
    max_layer_backward_bytes: float = 0.0
    # per sample: what the largest layer's groups divide of its recompute bytes (None: not known)
    max_layer_sharded_activation_bytes: Optional[float] = None
    fsdp_unit_bytes: tuple[float, ...] = ()  # parameter bytes of each FSDP unit of the stage run as a whole model
    max_param_bytes: float = 0.0             # its largest single parameter (0: unknown; memory.parameter_share)
    param_tensors: int = 0                   # how many parameters it holds (0: unknown; ragged: a collective each)
    # per layer in order: (its parameter bytes, its largest parameter's; 0: unknown): ragged ZeRO 1's buckets
    param_layers: tuple[tuple[float, float], ...] = ()
    root_param_bytes: float = 0.0            # parameter bytes in no FSDP layer unit (ragged ZeRO 3's root unit)
    # parameter bytes of each FSDP unit of the stage run as a pipeline stage cut into layers
    # (runtime.parallel.stage_units), the root unit (parameters several layers read) last when it holds any
    stage_unit_bytes: tuple[float, ...] = ()
    unbatched_boundary_bytes: float = 0.0    # whole, per micro-batch in flight: boundary values without a batch dim
    # the optimizer the state is priced for (TaskGraphs.optimizer; "": not known, its update's temporaries not
    # priced): planner.devices.memory.update_bytes
    optimizer: str = ""

    def __post_init__(self):
        if self.optimizer_bytes is None:
            object.__setattr__(self, "optimizer_bytes", self.static_bytes - 2 * self.param_bytes)
        if self.max_layer_activation_bytes is None:
            object.__setattr__(self, "max_layer_activation_bytes", self.activation_bytes)
        if self.tp_allreduce_bytes is None:
            object.__setattr__(self, "tp_allreduce_bytes", self.layer_output_bytes)

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
        if precision not in ACTIVATION_BYTES:
            raise ValueError(f"precision must be one of {', '.join(ACTIVATION_BYTES)}, got {precision!r}")
        scale = ACTIVATION_BYTES[precision] / CAPTURED_BYTES   # 1.0 at fp32: the bytes as captured, exactly
        # under autocast, the bytes capture measured there (Layer.autocast); else the float32 ones scaled
        measured = precision != "fp32" and all(l.autocast is not None for l in graphs.layers)

        def at_precision(layer, key: str, captured: float) -> float:
            return layer.autocast[key] if measured else captured * scale

        before = graphs.layers[first - 1] if first > 0 else None
        received = at_precision(before, "cut", before.cut_bytes_per_sample) if before is not None else 0.0
        sent = at_precision(chosen[-1], "cut", chosen[-1].cut_bytes_per_sample) if last < len(graphs.layers) - 1 else 0.0

        def whole(layer) -> float:   # boundary values without a batch dimension, whole bytes
            if measured and "cut_unbatched" in layer.autocast:
                return layer.autocast["cut_unbatched"]
            return layer.cut_bytes_unbatched * scale

        unbatched = (whole(before) if before is not None else 0.0) + \
            (whole(chosen[-1]) if last < len(graphs.layers) - 1 else 0.0)
        saved = sum(at_precision(l, "activation", l.activation_bytes_per_sample) for l in chosen)
        saved -= at_precision(chosen[0], "input_activation", chosen[0].input_activation_bytes_per_sample)
        outputs = sum(at_precision(l, "output", l.output_bytes_per_sample) for l in chosen)
        elements = sum(l.output_bytes_per_sample for l in chosen) / CAPTURED_BYTES
        loss = outputs + elements * LOSS_TEMPORARY_BYTES[precision] if elements else 0.0
        divided, head = _divided(graphs, chosen, measured, scale)
        # what recomputing one layer makes anew: its activations less what it saves of its input; the layer
        # recomputed at the most, and what its own shard groups divide of it
        recomputed = [at_precision(l, "activation", l.activation_bytes_per_sample)
                      - at_precision(l, "input_activation", l.input_activation_bytes_per_sample) for l in chosen]
        largest = max(range(len(chosen)), key=lambda k: (recomputed[k], -k))
        if precision == "fp32":
            copy_bytes = 0.0
        elif measured:
            copy_bytes = float(sum(l.autocast["param_copy"] for l in chosen))
        else:
            copy_bytes = params * ACTIVATION_BYTES[precision] / CAPTURED_BYTES
        return cls(
            forward_flops=sum(l.forward_flops for l in chosen),
            backward_flops=sum(l.backward_flops for l in chosen),
            param_bytes=params,
            static_bytes=2 * params + opt,
            activation_bytes=saved,
            boundary_bytes=received + sent,
            layer_output_bytes=tuple(at_precision(l, "cut", l.cut_bytes_per_sample) for l in chosen),
            tp_allreduce_bytes=tuple(at_precision(l, "cut", l.cut_bytes_per_sample)
                                     for l in chosen for _ in range(_row_groups(graphs, l))),
            optimizer_bytes=opt,
            param_copy_bytes=copy_bytes,
            precision=precision,
            loss_bytes=loss,
            sharded_activation_bytes=divided,
            sharded_loss_bytes=loss if head else 0.0,
            loss_allreduce_bytes=SHARDED_LOSS_ALLREDUCE_BYTES if head else (),
            layer_input_bytes=sum(at_precision(graphs.layers[i - 1], "cut", graphs.layers[i - 1].cut_bytes_per_sample)
                                  for i in layers[1:]),
            max_layer_activation_bytes=recomputed[largest],
            max_layer_sharded_activation_bytes=min(recomputed[largest],
                                                   _divided(graphs, chosen, measured, scale, of=chosen[largest])[0]),
            max_layer_backward_bytes=max(l.autocast.get("backward_temporary", l.backward_temporary_bytes_per_sample * scale)
                                         if measured else l.backward_temporary_bytes_per_sample * scale for l in chosen),
            fsdp_unit_bytes=fsdp_unit_bytes(chosen, params),
            # a layer without the figure (made by hand) counts as one parameter: an upper bound
            max_param_bytes=float(max([l.max_param_bytes or l.param_bytes for l in chosen]
                                      + [size for _, size in copies.values()])),
            param_tensors=sum(l.param_tensors for l in chosen) + len(copies)
            if all(l.param_tensors or not l.param_bytes for l in chosen) else 0,
            param_layers=tuple((float(l.param_bytes), float(l.max_param_bytes)) for l in chosen),
            root_param_bytes=params - sum(fsdp_layer_unit_bytes(chosen)),
            stage_unit_bytes=stage_unit_bytes(chosen, params),
            unbatched_boundary_bytes=float(unbatched),
            optimizer=graphs.optimizer,
        )

    @property
    def flops_per_sample(self) -> float:
        return self.forward_flops + self.backward_flops

    def bytes_per_sample(self, in_flight: int) -> float:
        return (self.activation_bytes + self.boundary_bytes) * in_flight


def fsdp_unit_names(chosen) -> tuple[str, ...]:
    """The Layer names of ``chosen`` (a stage's Layers, run as the whole model) that are FSDP units of
    their own, in order: names that are module paths (not the model's own code, ``<root>``), leaving
    out a module whose subtree holds another such Layer (code around blocks), one whose module holds
    no parameter bytes the layer owns (the runtime wraps only modules with parameters; a tied weight
    counts with the Layer that owns it; ``Layer.outside_param_bytes`` are another module's), and one
    that shares a parameter with a Layer of another name (tied weights:
    the owner of a weight another Layer borrows, and the borrower; ``Layer.borrowed_params``). A
    shared parameter lives in the root unit, whose gather spans every use of it: a unit of its own
    would free it between uses, and FSDP2 refuses a parameter in two units. The one answer to
    "which of a single stage's layers are ZeRO units", which the runtime's syncs wrap
    (``runtime.replicas``) and the memory model prices."""
    names_of = {l.index: l.name for l in chosen}
    shared: set[str] = set()
    for layer in chosen:
        for owner, _, _ in layer.borrowed_params:
            owner_name = names_of.get(owner)
            if owner_name != layer.name:
                shared.add(layer.name)
                if owner_name is not None:
                    shared.add(owner_name)
    by_name: dict[str, float] = {}
    for layer in chosen:
        if layer.name and layer.name != ROOT_LAYER:
            inside = float(layer.param_bytes) - float(getattr(layer, "outside_param_bytes", 0))
            by_name[layer.name] = by_name.get(layer.name, 0.0) + inside
    names = [n for n in by_name if not any(q.startswith(n + ".") for q in by_name)]
    return tuple(n for n in names if by_name[n] > 0 and n not in shared)


def fsdp_layer_unit_bytes(chosen) -> tuple[float, ...]:
    """Parameter bytes of each layer unit of :func:`fsdp_unit_bytes` (the root unit left out): the
    parameters its module holds (a parameter a layer owns but another module registers,
    ``Layer.outside_param_bytes``, is the root unit's)."""
    units = fsdp_unit_names(chosen)
    return tuple(float(sum(l.param_bytes - getattr(l, "outside_param_bytes", 0) for l in chosen if l.name == n))
                 for n in units)


def fsdp_unit_bytes(chosen, param_bytes: float) -> tuple[float, ...]:
    """Parameter bytes of each FSDP unit when ``chosen`` (a stage's Layers) run as the whole model,
    wrapped as ``runtime.replicas.fsdp_sync`` wraps a single-stage plan and as
    :func:`runtime.training.recompute.wrap_layers` picks modules: one unit per name of
    :func:`fsdp_unit_names`, then the root unit with every other parameter (left out when it holds
    none). A model without module Layers is one unit."""
    units = fsdp_layer_unit_bytes(chosen)
    if not units:
        return (float(param_bytes),)
    root = float(param_bytes) - sum(units)
    return tuple(units) + ((root,) if root > 0 else ())


def stage_unit_bytes(chosen, param_bytes: float) -> tuple[float, ...]:
    """Parameter bytes of each FSDP unit when ``chosen`` (a stage's Layers) run as a pipeline stage
    cut into layers (``runtime.parallel.stage_units``): one unit per Layer with the parameters only
    it reads, then the root unit with every parameter read by several Layers of the stage (a weight
    tied inside it: the owner's and each borrower's reads) and the copies of weights owned by
    another stage (left out when it holds none). A stage of one Layer is one unit."""
    if len(chosen) < 2:
        return (float(param_bytes),)
    inside = {l.index for l in chosen}
    shared: dict[tuple[int, str], float] = {}   # (owner, name) -> bytes of a parameter several layers here read
    for layer in chosen:
        for owner, name, size in layer.borrowed_params:
            if owner in inside and owner != layer.index:
                shared[(owner, name)] = float(size)
    units = []
    for layer in chosen:
        own = float(layer.param_bytes) - sum(size for (owner, _), size in shared.items() if owner == layer.index)
        if own > 0:
            units.append(own)
    root = float(param_bytes) - sum(units)
    return tuple(units) + ((root,) if root > 0 else ())


def _row_groups(graphs: TaskGraphs, layer) -> int:
    """How many all-reduces of its output ``layer`` runs in a forward under ``split``: one per shard group
    of its own modules with a row projection (whose partial sums are all-reduced:
    :func:`runtime.tensor.layers.reduce_from_region`); one when its TaskGraph has shardable projections
    but no groups (made by hand: priced as before groups existed, one per layer)."""
    graph = next((tg for tg in graphs.graphs if layer.index in tg.layers), None)
    if graph is None or not graph.shard_groups:
        return 1

    def mine(path: str) -> bool:
        return path == layer.name or path.startswith(layer.name + ".")

    return sum(1 for g in graph.shard_groups
               if any(m.role == "row" for m in g.members) and any(mine(m.path) for m in g.members))


def _divided(graphs: TaskGraphs, chosen, measured: bool, scale: float, of=None) -> tuple[float, bool]:
    """Per sample, the activations the shard groups of the ``split`` TaskGraphs wholly inside
    ``chosen`` divide among their ranks, and whether the layer returning the model outputs is a
    class-sharded head (a lone group's member: its logits, so the loss's, are divided too). ``of``
    (a layer of ``chosen``): only the groups whose members are that layer's modules."""
    inside = {l.index for l in chosen}
    divided, head = 0.0, False
    names = {l.name for l in chosen if l.output_bytes_per_sample}

    def within(g) -> bool:
        return of is None or any(m.path == of.name or m.path.startswith(of.name + ".") for m in g.members)

    for tg in graphs.graphs:
        if not tg.shard_groups or not set(tg.layers) <= inside:
            continue
        for g in tg.shard_groups:
            if not within(g):
                continue
            divided += g.autocast_activation_bytes_per_sample if measured else g.activation_bytes_per_sample * scale
            head |= g.kind == "lone" and any(m.path in names for m in g.members)
    return divided, head
