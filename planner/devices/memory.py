"""The planner's one memory model: what a device holds for its pipeline stage, term by term.

Why. A worker's peak memory is four different things: the parameters, their gradients, the
optimizer state (all three per whole stage) and, per sample of every micro-batch in flight under
the pipeline schedule, the activations saved for the backward pass with the boundary buffers (the
input received, the output sent). Each has its own reason to be split: tensor parallelism
(``split``) shards all four today, a device holds its batch share of the activations, and the
features to come change one term each: ZeRO shards the optimizer state (stage 1), then the
gradients (stage 2), then the parameters (stage 3) over a data-parallel group; activation
checkpointing shrinks the activations (below). So every term carries its own fraction, and everything
that asks how much memory a device needs (the pipeline partitioner, Whale's Algorithm 1 and the
batch fitting, the shard-size caps, the plan's ``memory_gib`` the plan checks compare with the
device's capacity) asks :class:`MemoryTerms`, so that such a feature changes one fraction in one
place: :func:`worker_fractions`, the rule both :func:`stage_memory` (batch fitting, shard caps,
``memory_gib``) and the partitioner's :meth:`~planner.partition.problem.DeviceMemory.of_worker`
read.

Activation checkpointing (``recompute``, :func:`stage_memory`). A recomputing stage runs each of its
layers (the capture's Layers: one transformer block, one run of the model's own code) under torch's
non-reentrant checkpoint (:mod:`runtime.training.recompute`), which keeps each layer's input instead
of its activations; the executor also holds each micro-batch's output (the root of its backward,
the buffer it sends) until its gradient comes back. So per micro-batch in flight it keeps its
boundary buffers (received input and sent output) and the inputs of its layers after the first
(``StageCost.layer_input_bytes``), and once, not per micro-batch in flight, the activations of the
one layer being recomputed and back-propagated (``StageCost.max_layer_activation_bytes``): the
``transient_bytes_per_sample`` term. So it saves memory with one micro-batch in flight too (a
data-parallel plan, gradient accumulation, the last stage of 1F1B) whenever the stage has more than
one layer: the peak is (every layer's input) + (one layer's activations) instead of every layer's
activations. A stage priced as one block (no layer figures) is the one-layer case: its boundary
buffers per micro-batch in flight, its whole activations once.

The unit, per stage (:func:`recompute_unit`, recorded as ``StagePlan.recompute_unit``): ``"layer"``
unless checkpointing the whole stage at once holds less, which happens only with many micro-batches
in flight (GPipe with dozens of them: the layer inputs are kept per micro-batch in flight, the
whole stage's activations once); ``recompute=True`` prices the stage with that unit, and the runtime
runs the unit the plan says.

ZeRO (:class:`ZeroShards`, :func:`worker_fractions`). A stage whose data-parallel group (its workers
of one ``tp_index`` over all replicas, ``n`` of them) runs ZeRO on FSDP2 (``runtime.replicas.fsdp_sync``)
holds, at its peak, these shares of the whole stage's weights ``w``, gradients ``g`` and optimizer
state ``o`` (then times its tensor-parallel shard, as every term), with ``f = 1/n`` (FSDP2's even
shards: each parameter chunked on dim 0) and ``u`` the largest FSDP unit's share of the stage's
parameter bytes (:func:`fsdp_unit_share`):

* stage 0 (DDP): ``w = g = o = 1``;
* stage 1: ``w = 1 + f`` (the sharded parameters plus the unsharded ones held through forward and
  backward), ``g = 1 + f`` (gradients accumulate unsharded over the micro-batches, then are
  reduce-scattered into a sharded gradient), ``o = f``;
* stage 2: ``w = 1 + f``, ``g = f + u`` (each micro-batch reduce-scatters unit by unit: the sharded
  gradient plus one unit's full gradient), ``o = f``;
* stage 3: ``w = f + min(2u, 1)`` (the unit being computed plus the prefetched one, never more than
  the whole stage gathered), ``g = f + u``, ``o = f``.

So a ZeRO stage changes the three static fractions and nothing else; the activations are as without.

Ragged shards (Cephalo; ``StagePlan.replica_sync`` ``"ragged"``, ``runtime.replicas.ragged_sync``, ZeRO
stages 1-2 of a single-stage plan without ``split``): each worker ``r`` holds its own fraction ``f_r``
of the sharded state (``ZeroShards.share``, ``StagePlan.state_fractions``, chosen by
:mod:`planner.shares.state_fractions`) instead of ``1/n``, and the formulas above hold with ``f = f_r``.
The runtime reduce-scatters each parameter's gradient on its own (not an FSDP unit's), so at stage 2
``u`` is the largest single parameter's share of the stage's parameter bytes (:func:`parameter_share`).

Invariant. ``total(samples) = weight_fraction * weight_bytes + gradient_fraction * gradient_bytes
+ optimizer_fraction * optimizer_bytes + activation_fraction * samples * (in_flight *
activation_bytes_per_sample + transient_bytes_per_sample)``: each term scales with its own fraction
and nothing else (the transient bytes are activations: they take the activation fraction). Terms that
share a fraction are added before they are scaled, so when all four fractions are one shard
fraction ``f`` (data-parallel and pipeline plans) the total is ``f * (static + samples * per-sample
bytes)`` to the last bit, as the planner has always priced a shard, and :meth:`MemoryTerms.max_samples`
is the largest sample count whose total fits (the inverse, computed the same way). Without recompute
and off the last stage the transient term is 0 and is not even added, so every figure is what it
was before it existed.

What runs, term by term (checked against the measured peak per rank by ``bench/memory.py``, with
``Engine(measure_memory=True)``): the transient term also holds, on the stage that returns the model
outputs, one micro-batch's outputs and the loss's temporaries (``StageCost.loss_bytes``: the loss
of one micro-batch is computed, and back-propagated, at a time). A ``split`` stage's worker holds its
shard of what the shard groups divide (the projections' weights, the activations between a group's
projections, a class-sharded head's logits) and the rest whole (norms, residual stream, boundary
buffers, a column projection's input): so its activation fraction is not its shard fraction but
``1 - divided / whole * (1 - unit share)`` (:func:`activation_shard`, from
``StageCost.sharded_activation_bytes``), while its weights keep the shard fraction.

The byte fields may be numbers, numpy arrays (the partitioner prices every layer range at once) or
PuLP expressions (the partitioner's ILP states its memory rows with the same model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.devices.cost_model import StageCost

UNBOUNDED_SAMPLES = 2**62   # "any number of samples fits": far above any batch, still an exact integer
FIT_TOLERANCE = 1e-9        # relative overflow still counted as fitting (estimates are floating point)

TERMS = ("weight", "gradient", "optimizer", "activation")


@dataclass(frozen=True)
class MemoryTerms:
    """One device's memory for one pipeline stage: whole-stage bytes per term, and the fraction of
    each term the device holds.

    ``weight_bytes``, ``gradient_bytes`` and ``optimizer_bytes`` are the whole stage's parameters,
    gradients and optimizer state; ``activation_bytes_per_sample`` the whole stage's saved
    activations and boundary buffers per sample of one micro-batch, held for each of the
    ``in_flight`` micro-batches alive at once; ``transient_bytes_per_sample`` the whole stage's
    bytes per sample held once whatever ``in_flight`` is (a recomputing stage's largest layer's
    activations, alive for one layer of one micro-batch at a time). ``activation_fraction`` is the device's share of
    the activations of the samples :meth:`total` is given (its tensor-parallel shard of them, times
    its share of the micro-batch when the samples are the whole pipeline's).
    """

    weight_bytes: Any
    gradient_bytes: Any
    optimizer_bytes: Any
    activation_bytes_per_sample: Any
    in_flight: int = 1
    weight_fraction: float = 1.0
    gradient_fraction: float = 1.0
    optimizer_fraction: float = 1.0
    activation_fraction: float = 1.0
    transient_bytes_per_sample: Any = 0.0

    def __post_init__(self):
        if isinstance(self.in_flight, bool) or not isinstance(self.in_flight, int) or self.in_flight < 1:
            raise ValueError(f"MemoryTerms.in_flight must be an integer >= 1, got {self.in_flight!r}")
        for term in TERMS:
            f = getattr(self, f"{term}_fraction")
            if not (isinstance(f, (int, float)) and math.isfinite(f) and f >= 0):
                raise ValueError(f"MemoryTerms.{term}_fraction must be a finite number >= 0, got {f!r}")

    def _static(self) -> list[tuple[float, Any]]:
        return [(self.weight_fraction, self.weight_bytes), (self.gradient_fraction, self.gradient_bytes),
                (self.optimizer_fraction, self.optimizer_bytes)]

    def _per_sample(self) -> Any:
        """Whole-stage bytes one sample of a micro-batch keeps alive over the micro-batches in flight
        (plus the transient bytes, held once; a plain 0 is not added, so nothing changes without)."""
        kept = self.activation_bytes_per_sample * self.in_flight
        t = self.transient_bytes_per_sample
        if isinstance(t, (int, float)) and t == 0:
            return kept
        return kept + t

    def total(self, samples: Any = 0) -> Any:
        """Peak bytes with ``samples`` samples per micro-batch (see the module's invariant)."""
        groups: dict[float, Any] = {}
        for f, nbytes in self._static() + [(self.activation_fraction, samples * self._per_sample())]:
            groups[f] = groups[f] + nbytes if f in groups else nbytes
        return sum(f * nbytes for f, nbytes in groups.items())

    def static(self) -> Any:
        """Bytes held whatever the batch: this device's parameters, gradients and optimizer state."""
        return self.total(0)

    def activations(self, samples: Any = 1) -> Any:
        """This device's activation and boundary bytes for ``samples`` samples per micro-batch."""
        return self.activation_fraction * (samples * self._per_sample())

    def term_bytes(self, samples: Any = 0) -> dict[str, Any]:
        """Each term's bytes on this device (for reports; :meth:`total` is their sum)."""
        static = {term: f * nbytes for term, (f, nbytes) in zip(TERMS, self._static())}
        return {**static, "activation": self.activations(samples)}

    def max_samples(self, capacity_bytes: float) -> int:
        """Most samples per micro-batch whose :meth:`total` fits in ``capacity_bytes`` (-1: not even
        the static terms fit), at most :data:`UNBOUNDED_SAMPLES` (a device of 1e300 GiB holds any
        batch, not infinitely many)."""
        a, per_sample = self.activation_fraction, self._per_sample()
        if a <= 0:   # the samples cost this device nothing
            return UNBOUNDED_SAMPLES if self.static() <= capacity_bytes else -1
        # the activation term's group (static terms of the same fraction) against what the others leave
        same = other = 0.0   # adding to 0.0 is exact: equal fractions give today's bytes bit for bit
        for f, nbytes in self._static():
            if f == a:
                same = same + nbytes
            else:
                other = other + f * nbytes
        free = (capacity_bytes - other) / a - same
        if free < 0:
            return -1
        if per_sample <= 0 or free / per_sample >= UNBOUNDED_SAMPLES:
            return UNBOUNDED_SAMPLES
        return math.floor(free / per_sample)


def fits(need_bytes: float, capacity_bytes: float) -> bool:
    """Whether an estimate fits a capacity (any unit), within :data:`FIT_TOLERANCE`."""
    return need_bytes <= capacity_bytes * (1 + FIT_TOLERANCE)


@dataclass(frozen=True)
class ZeroShards:
    """What a stage's data-parallel group shards (ZeRO, run by FSDP2 in ``runtime.replicas.fsdp_sync``):
    ``stage`` 0-3 (``StagePlan.zero_stage``), ``group`` the workers of the group (the stage's workers of
    one ``tp_index`` over all replicas: each holds ``1 / group`` of what is sharded, FSDP2's even
    shards), ``unit`` the largest FSDP unit's share of the stage's parameter bytes
    (:func:`fsdp_unit_share`).

    ``share``: under ragged shards (module docstring, "Ragged shards"), the fraction of the sharded
    state this one worker holds (``StagePlan.state_fractions``, 0 to 1) instead of ``1 / group``, at
    ZeRO stage 1 or 2 only; ``unit`` is then the largest single parameter's share
    (:func:`parameter_share`). None: even shards."""

    stage: int = 0
    group: int = 1
    unit: float = 1.0
    share: float | None = None

    def __post_init__(self):
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroShards.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"ZeroShards.group must be an integer >= 1 (workers in the group), got {self.group!r}")
        if not (isinstance(self.unit, (int, float)) and 0 < self.unit <= 1):
            raise ValueError(f"ZeroShards.unit must be in (0, 1] (a share of the stage's parameters), got {self.unit!r}")
        if self.share is not None:
            if isinstance(self.share, bool) or not (isinstance(self.share, (int, float)) and 0 <= self.share <= 1):
                raise ValueError(f"ZeroShards.share must be None (even shards) or in [0, 1] (the worker's fraction "
                                 f"of the sharded state), got {self.share!r}")
            if self.stage not in (1, 2):
                raise ValueError(f"ZeroShards.share is {self.share!r} at ZeRO stage {self.stage}: ragged shards run "
                                 "at ZeRO stages 1 and 2 only (stage 3 keeps FSDP2's even shards)")

    @property
    def ragged(self) -> bool:
        """Whether the worker holds its own fraction (ragged shards) rather than ``1 / group``."""
        return self.share is not None

    @property
    def fraction(self) -> float:
        """``f``: the worker's fraction of the sharded state (``share``, else ``1 / group``)."""
        return 1.0 / self.group if self.share is None else float(self.share)

    def fractions(self) -> tuple[float, float, float]:
        """``(weights, gradients, optimizer state)``: the share of the whole stage's bytes of each a
        worker holds at its peak, before its tensor-parallel shard (module docstring, "ZeRO"; ``f`` the
        worker's :attr:`fraction`)."""
        f, u, z = self.fraction, self.unit, self.stage
        if z == 0:
            return 1.0, 1.0, 1.0
        if z == 1:
            return 1.0 + f, 1.0 + f, f
        if z == 2:
            return 1.0 + f, f + u, f
        return f + min(2.0 * u, 1.0), f + u, f


NO_ZERO = ZeroShards()


def fsdp_units(cost: "StageCost", whole_model: bool) -> tuple[float, ...]:
    """Parameter bytes of each FSDP unit of a stage, as the runtime wraps them
    (``runtime.replicas.fsdp_sync``): a single-stage plan (``whole_model``) wraps each capture Layer
    that is a module path as its own unit and the rest in the root unit (``StageCost.fsdp_unit_bytes``,
    the modules :func:`runtime.training.recompute.wrap_layers` picks); a stage of a pipeline is one
    unit, the whole stage module."""
    units = cost.fsdp_unit_bytes if whole_model else ()
    return tuple(units) if units else (float(cost.param_bytes),)


def fsdp_unit_share(cost: "StageCost", whole_model: bool) -> float:
    """``u``: the largest FSDP unit's share of the stage's parameter bytes (:func:`fsdp_units`); 1 for
    a pipeline stage (one unit) or a stage without parameters."""
    if cost.param_bytes <= 0:
        return 1.0
    return min(max(max(fsdp_units(cost, whole_model)) / cost.param_bytes, 1e-12), 1.0)


def parameter_share(cost: "StageCost") -> float:
    """``u`` under ragged shards: the largest single parameter's share of the stage's parameter bytes
    (``StageCost.max_param_bytes``; a stage priced by hand without it: the largest FSDP unit's share,
    which holds that parameter, so never less). The ragged runtime reduce-scatters and frees each
    parameter's full gradient on its own as soon as the backward produces it."""
    if cost.param_bytes <= 0:
        return 1.0
    largest = getattr(cost, "max_param_bytes", 0.0)
    if not largest or largest <= 0:
        return fsdp_unit_share(cost, True)
    return min(max(largest / cost.param_bytes, 1e-12), 1.0)


def worker_fractions(shard: float = 1.0, batch_share: float = 1.0,
                     activation_shard: float | None = None, zero: ZeroShards = NO_ZERO) -> dict[str, float]:
    """The fraction of each term a worker holds: its tensor-parallel ``shard`` of the stage (its
    :class:`~planner.shares.shard_sizes.ShardLayout` fraction) of the weights, gradients and
    optimizer state, each times what its ZeRO stage keeps of it (``zero``:
    :meth:`ZeroShards.fractions`), and of the activations its ``activation_shard`` (default:
    ``shard``; :func:`activation_shard`: what a ``split`` stage leaves whole counts whole) of its
    ``batch_share`` of the samples priced. The one rule of who holds what: a ZeRO stage or
    activation checkpointing changes one entry here; ragged shards change ``f`` in ``zero``
    (:attr:`ZeroShards.share`, the worker's own fraction instead of ``1 / n``)."""
    a = shard if activation_shard is None else activation_shard
    if zero.stage == 0:   # exactly the shard, as before ZeRO existed (equal fractions group bit for bit)
        return {"weight_fraction": shard, "gradient_fraction": shard, "optimizer_fraction": shard,
                "activation_fraction": a * batch_share}
    w, g, o = zero.fractions()
    return {"weight_fraction": shard * w, "gradient_fraction": shard * g, "optimizer_fraction": shard * o,
            "activation_fraction": a * batch_share}


def activation_shard(cost: "StageCost", in_flight: int, unit_share: float | None, recompute: bool = False,
                     shard: float = 1.0) -> float:
    """The share of a ``split`` stage's per-sample activation bytes (kept per micro-batch in flight
    plus held once, :func:`recompute_split`, plus the loss) a worker holds when it has ``unit_share``
    of the shard groups' units: the groups' divided bytes (``StageCost.sharded_activation_bytes``,
    ``sharded_loss_bytes``) at that share, everything else whole. ``shard`` (the old rule: all of it
    at the shard fraction) when the unit share is not given or the stage records nothing divided
    (a stage without groups, or TaskGraphs captured before the groups' bytes were)."""
    divided_loss = getattr(cost, "sharded_loss_bytes", 0.0)
    if unit_share is None or (cost.sharded_activation_bytes <= 0 and divided_loss <= 0):
        return shard
    kept, once = recompute_of(cost, in_flight, recompute)
    whole = in_flight * kept + once + cost.loss_bytes
    if whole <= 0:
        return shard
    # recomputing: the divided activations are alive for one micro-batch (the one recomputed); the
    # share of them held once is bounded by the transient bytes
    divided = min(cost.sharded_activation_bytes, once) if recompute else in_flight * cost.sharded_activation_bytes
    divided = min(divided + divided_loss, whole)
    return 1.0 - divided / whole * (1.0 - unit_share)


def recompute_split(activation_bytes: Any, boundary_bytes: Any, recompute: bool, layer_input_bytes: Any = 0.0,
                    max_layer_activation_bytes: Any = None) -> tuple[Any, Any]:
    """``(kept per micro-batch in flight, held once)`` bytes per sample of a stage with these
    activations and boundary buffers (numbers, arrays over layer ranges or ILP expressions): all
    kept without recompute; with it the boundary buffers and ``layer_input_bytes`` (its layers'
    inputs) kept, ``max_layer_activation_bytes`` (its largest layer's activations; None: all of
    them, the stage as one layer) held once (the module docstring). The one rule of what a
    recomputing stage holds."""
    if recompute:
        once = activation_bytes if max_layer_activation_bytes is None else max_layer_activation_bytes
        if isinstance(layer_input_bytes, (int, float)) and layer_input_bytes == 0:
            return boundary_bytes, once
        return boundary_bytes + layer_input_bytes, once
    return activation_bytes + boundary_bytes, 0.0


def recompute_unit(cost: "StageCost", in_flight: int) -> str:
    """What a recomputing stage checkpoints at once (module docstring): ``"layer"`` (each layer on
    its own) unless ``"stage"`` (the whole stage) holds fewer activation bytes per sample with
    ``in_flight`` micro-batches in flight; ties go to ``"layer"``."""
    layer = in_flight * (cost.boundary_bytes + cost.layer_input_bytes) + cost.max_layer_activation_bytes
    return "layer" if layer <= in_flight * cost.boundary_bytes + cost.activation_bytes else "stage"


def recompute_of(cost: "StageCost", in_flight: int, recompute: "bool | str") -> tuple[Any, Any]:
    """:func:`recompute_split` of ``cost``: ``recompute`` False (none), ``"layer"``, ``"stage"``, or
    True (the unit :func:`recompute_unit` picks)."""
    unit = recompute_unit(cost, in_flight) if recompute is True else recompute
    if unit == "layer":
        return recompute_split(cost.activation_bytes, cost.boundary_bytes, True, cost.layer_input_bytes,
                               cost.max_layer_activation_bytes)
    return recompute_split(cost.activation_bytes, cost.boundary_bytes, unit == "stage")


def stage_memory(cost: "StageCost", in_flight: int, shard: float = 1.0, batch_share: float = 1.0,
                 recompute: "bool | str" = False, unit_share: float | None = None,
                 zero: ZeroShards = NO_ZERO) -> MemoryTerms:
    """The memory of a worker that holds ``shard`` of stage ``cost`` with ``in_flight`` micro-batches
    alive at once and ``batch_share`` of the samples :meth:`MemoryTerms.total` is given (1: they
    are its own group's). Gradients are as large as the parameters; the boundary buffers count
    with the activations (:class:`~planner.devices.cost_model.StageCost`). ``recompute``: the stage
    runs under activation checkpointing, ``True`` in the unit :func:`recompute_unit` picks, or the
    one named, ``"layer"`` or ``"stage"`` (:func:`recompute_of`). ``unit_share``:
    the worker's share of a ``split`` stage's shard-group units (``ShardLayout.unit_shares``), for
    its activations (:func:`activation_shard`). ``zero``: what the stage's data-parallel group
    shards (:class:`ZeroShards`). The last stage's loss bytes are held once."""
    kept, once = recompute_of(cost, in_flight, recompute)
    if cost.loss_bytes:   # a plain 0 is not added: a stage without the loss prices as before, bit for bit
        once = once + cost.loss_bytes
    return MemoryTerms(
        weight_bytes=cost.param_bytes + cost.param_copy_bytes,
        gradient_bytes=cost.param_bytes,
        optimizer_bytes=cost.optimizer_bytes,
        activation_bytes_per_sample=kept,
        in_flight=in_flight,
        **worker_fractions(shard, batch_share, activation_shard(cost, in_flight, unit_share, recompute, shard), zero),
        transient_bytes_per_sample=once,
    )


def max_shard(cost: "StageCost", in_flight: int, samples: int, capacity_bytes: float, recompute: bool = False,
              zero: ZeroShards = NO_ZERO) -> float:
    """The largest tensor-parallel fraction of stage ``cost`` a device of ``capacity_bytes`` holds
    with ``samples`` samples per micro-batch (``recompute``: under activation checkpointing; ``zero``:
    its data-parallel group's ZeRO stage): every term scales with the shard (:func:`worker_fractions`),
    so it is the capacity over the whole stage's need (at least one byte: a stage that needs nothing
    fits any share)."""
    return capacity_bytes / max(stage_memory(cost, in_flight, recompute=recompute, zero=zero).total(samples), 1.0)
