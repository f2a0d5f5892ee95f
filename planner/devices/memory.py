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
of one ``tp_index`` over all replicas, ``n`` of them) runs ZeRO holds, at its peak, these shares of the
whole stage's weights ``w``, gradients ``g`` and optimizer state ``o`` (then times its tensor-parallel
shard, as every term). They are what the runtime holds at the moment of its peak, read off
``runtime.replicas.fsdp_sync`` and ``runtime.replicas.ragged_sync`` and checked against the measured
peak per rank (``tests/test_zero_memory.py``, ``bench/zero_hetero.py``): the collectives' buffers
count with the term they move (all-gathers with the weights, reduce-scatters with the gradients), and
a worker that runs one micro-batch per step (``ZeroShards.single``, known once its micro-batches are)
holds less than one that accumulates over several, which is the figure used while they are not
known (the batch fitting): an upper bound. ``c`` (:data:`REDUCE_SCATTER_COPIES`) is the collective
backend's copy of a reduce-scatter's input: gloo, which the CPU tests and benches run, copies it (1);
NCCL reduces in place, so on GPUs the figures below are high by that one buffer.

Even shards (FSDP2, replica sync ``fsdp``): ``f = 1/n`` (each parameter chunked on dim 0) and ``u`` the
largest FSDP unit's share of the stage's parameter bytes (:func:`fsdp_unit_share`). With one unit
being computed at a time, the unit's own buffers come on top of what is held: in the forward its
all-gather output besides its gathered parameters, in the backward its unsharded gradients and the
reduce-scatter input they are copied into (FSDP2 frees the unit's gathered parameters first), each
``u``, plus gloo's copy: ``(1 + c) u``.

* stage 0 (DDP): ``w = g = o = 1``: the gradients are views of DDP's buckets
  (``runtime.replicas.ddp_sync``, ``gradient_as_bucket_view``, zeroed in place between steps), one
  copy; measured 1.02-1.03 of the prediction on every rank, with one micro-batch and accumulating
  (``tests/test_zero_memory.py``; 1.27-1.28 while the buckets were a second copy). The second step,
  whose forward rebuilds DDP's buckets, peaks no higher than the later ones, with one micro-batch and
  accumulating (``tests/test_recompute.py``; accumulating, it held a gradient copy more, +24% there,
  until the executor zeroed such gradients in place from the first step: ``runtime.replicas.ddp_sync``);
* stage 1: ``w = 1 + f`` (the sharded parameters plus every unit gathered from the first forward to
  the last backward), ``o = f``; ``g = 1 + c u`` when accumulating (the whole gradients accumulate over
  the micro-batches; the last backward reduce-scatters them unit by unit, each unit's input taking the
  place of its freed parameters), ``g = (1 + c) u`` with one micro-batch (the only backward frees each
  unit's parameters as it reduce-scatters it, which pays for the sharded gradient it adds; the
  forward's all-gathers hold as much);
* stage 2: as stage 1, but ``g = f + (1 + c) u`` when accumulating (the sharded gradient of the
  earlier micro-batches is held through the later ones' backward);
* stage 3: ``w = f + min(2u, 1)`` (the unit being computed plus the one FSDP2 prefetches, never more
  than the whole stage), ``g = f + (1 + c) u``, ``o = f``.

Ragged shards (Cephalo; replica sync ``ragged``, ``runtime.replicas.ragged_sync``, any stage without
``split``): worker ``r`` holds its own fraction ``f = f_r`` of the sharded state (``ZeroShards.share``,
``StagePlan.state_fractions``, chosen by :mod:`planner.shares.state_fractions`). Every collective moves
one bucket in a flat buffer padded to the largest rank's rows, so every rank, the smallest included,
holds while it reduce-scatters ``T = (1 + c) p + p / n`` times the bucket (the padded input, gloo's
copy, its own segment of the output), ``p = n max(f)`` (``ZeroShards.padding``,
:func:`planner.shares.state_fractions.padded_scale`); ``u`` is the largest bucket's share:

* stages 1 and 2: the parameters stay whole, ``w = 1 + f``, ``o = f``. Stage 1's buckets are 1 MiB of
  parameters in reverse order (:data:`RAGGED_BUCKET_BYTES`; :func:`ragged_bucket_bytes` bounds the
  largest from the stage's layers): ``g = 1 + T u`` when accumulating (the whole gradients; each
  bucket's are freed as it is reduce-scattered), ``g = f (1 - u) + (1 + T) u`` with one micro-batch
  (the rank's rows of every other bucket, the last bucket's whole gradients and its buffers). Stage 2's
  bucket is one parameter (``u``: the largest, :func:`parameter_share`) reduce-scattered in every
  backward: ``g = f + (1 + T) u``.
* stage 3: the rows are all the rank holds between uses; each layer unit (FSDP2's units: ``u`` the
  largest layer unit's share) is gathered whole for its forward and again for its backward and freed
  after its reduce-scatter, while the root unit (the parameters in no layer, ``ZeroShards.root``)
  stays gathered from the module's forward to the end of its backward, its gradients held whole till
  then; no prefetch. ``w = f + root + u``, ``g = f + root + u + T max(u, root)``, ``o = f``.

So a ZeRO stage changes the three static fractions and nothing else; the activations are as without.
What is not priced exactly: the all-gathers' buffers of ragged stages 1-2 (at the first forward after
the optimizer step, when no gradient is held: below the backward's peak); the gathered weights freed
unit by unit in the backward at ZeRO 1-2 (``w`` counts them all, so with a long backward the figure is
high by up to the activations); the activations freed by the time the last buckets are reduced (the
activations term counts them whole); FSDP2's padding of each parameter to ``n`` rows; weights tied
across pipeline stages, which ragged shards keep whole outside the rows (priced as sharded). Checked
(test and bench, gloo): within 10% of the measured peak on every rank for even ZeRO 1-3 and ragged
ZeRO 1-3 of single-stage plans (0.94-1.01 in ``tests/test_zero_memory.py``), and for even ZeRO 1-3 of
a two-stage pipeline whose stages are cut into layer units (``runtime.parallel.stage_units``; u the
largest layer's share, :attr:`StageCost.stage_unit_bytes`) with two micro-batches (0.95-1.05, same
test). With one micro-batch a pipeline stage at ZeRO 3 measured 0.82-0.93 of the prediction (high:
the prefetched unit is not always held at the peak). A stage of one unit (ragged shards in a
pipeline), measured once on a two-stage WideMLP: ragged 0.99-1.01.

Boundary values without a batch dimension (a statistic of the micro-batch,
``StageCost.unbatched_boundary_bytes``) cross whole: every worker of the stage holds their buffers
whole for each micro-batch in flight, whatever its samples and shard, the ``whole_bytes`` term (no
fraction), reported with the activations.

Invariant. ``total(samples) = weight_fraction * weight_bytes + gradient_fraction * gradient_bytes
+ optimizer_fraction * optimizer_bytes + activation_fraction * samples * (in_flight *
activation_bytes_per_sample + transient_bytes_per_sample) + whole_bytes``: each term scales with its
own fraction and nothing else (the transient bytes are activations: they take the activation
fraction; the whole bytes none, and a plain 0 of them is not even added). Terms that
share a fraction are added before they are scaled, so when all four fractions are one shard
fraction ``f`` (data-parallel and pipeline plans) the total is ``f * (static + samples * per-sample
bytes)`` to the last bit, as the planner has always priced a shard, and :meth:`MemoryTerms.max_samples`
is the largest sample count whose total fits (the inverse, computed the same way). Without recompute
and off the last stage the transient term is 0 and is not even added, so every figure is what it
was before it existed.

What runs, term by term (checked against the measured peak per rank by ``bench/memory.py``, with
``Engine(measure_memory=True)``): the transient term also holds one micro-batch's backward
temporaries, those of the stage's layer whose backward holds the most above its start
(``StageCost.max_layer_backward_bytes``, measured by capture on its fake backward: a float32
softmax's gradient in attention, an MLP's hidden-wide gradients), or, on the stage that returns the
model outputs, one micro-batch's outputs and the loss's temporaries (``StageCost.loss_bytes``: the
loss of one micro-batch is computed, and back-propagated, at a time), the larger
(:func:`held_once`; a recomputing stage holds the larger of the loss's and of its recomputed
layer with that layer's backward temporaries, not both). Measured on ``bench/memory.py``'s Llama:
fp32 1.01-1.06 before it, 1.01-1.04 after; a recomputing stage 1.18 before, 1.14 after (the recomputed layer's backward holds
more than capture's graph measures for it at bf16: 12 KiB a sample captured, 44-60 KiB measured on
the same layer run eagerly, not yet explained). A ``split`` stage's worker holds its
shard of what the shard groups divide (the projections' weights, the activations between a group's
projections, a class-sharded head's logits) and the rest whole (norms, residual stream, boundary
buffers, a column projection's input): so its activation fraction is not its shard fraction but
``1 - divided / whole * (1 - unit share)`` (:func:`activation_shard`, from
``StageCost.sharded_activation_bytes``), while its weights keep the shard fraction.

Reserve (:func:`with_reserve`, ``Config.memory_reserve``, default 10%). A plan fits every worker's
prediction into its device's memory less a reserve: the planner plans on a view of the cluster whose
devices' ``memory_gib`` are what a plan may fill (``Worker.capacity_gib``; ``Plan.memory_reserve``
records the fraction, and re-plans of the plan keep it). The default covers the misses this model is
measured to make on the paths it prices without recompute: measured / predicted 0.98-1.06 on CPU
(``bench/memory.py``, ``tests/test_zero_memory.py``) and 1.08-1.12 on an H200 at fp32 and bf16
(``bench/gpu_check.py``: what it leaves out on CUDA is the caching allocator's blocks, cuBLAS
workspaces and the optimizer's foreach temporaries); 1/(1 - 0.1) = 1.11. It does not cover the
misses above that, which ``bench/memory.py`` prints: a raised reserve (``whalelike plan
--memory-reserve``) does, at the cost of batch.

The byte fields may be numbers, numpy arrays (the partitioner prices every layer range at once) or
PuLP expressions (the partitioner's ILP states its memory rows with the same model).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from whalelike.cluster import Cluster
from whalelike.hardware import known_gpu

from planner.devices.stage_cost import StageCost

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
    activations, alive for one layer of one micro-batch at a time); ``whole_bytes`` what it holds
    whole whatever its samples and shard (the buffers of boundary values without a batch dimension,
    for every micro-batch in flight). ``activation_fraction`` is the device's share of
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
    whole_bytes: Any = 0.0
    update_bytes: Any = 0.0
    join_bytes: float = 0.0

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
        """Peak bytes with ``samples`` samples per micro-batch (see the module's invariant): the larger
        of :meth:`peaks` (numbers, or arrays element by element; an ILP states each of them as a row)."""
        during, *after = self.peaks(samples)
        if not after:
            return during
        if isinstance(during, (int, float)) and isinstance(after[0], (int, float)):
            return max(during, after[0])
        if isinstance(during, np.ndarray) or isinstance(after[0], np.ndarray):
            return np.maximum(during, after[0])
        raise TypeError("MemoryTerms.total: the larger of two ILP expressions is no expression; state each of "
                        "MemoryTerms.peaks as a row")

    def peaks(self, samples: Any = 0) -> list[Any]:
        """The candidate peaks, whose larger :meth:`total` is: while the micro-batches run (the static
        terms and the activations), and, when the optimizer's update makes temporaries
        (``update_bytes``), at the update, after the backward has freed the activations (the static
        terms and the temporaries, which are the optimizer state's fraction of the stage's; or DDP's
        last bucket joined with the step's exchange, ``join_bytes``, this worker's own bytes, when
        more: it is freed before the update)."""
        groups: dict[float, Any] = {}
        for f, nbytes in self._static() + [(self.activation_fraction, samples * self._per_sample())]:
            groups[f] = groups[f] + nbytes if f in groups else nbytes
        total = sum(f * nbytes for f, nbytes in groups.items())
        during = total if _zero(self.whole_bytes) else total + self.whole_bytes
        if _zero(self.update_bytes) and not self.join_bytes:
            return [during]
        after = self.optimizer_fraction * self.update_bytes
        if self.join_bytes:   # a number: DDP's last bucket joined with the passenger, before the update
            after = max(after, self.join_bytes) if isinstance(after, (int, float)) else np.maximum(after, self.join_bytes)
        return [during, self.static_terms() + after]

    def static_terms(self) -> Any:
        """This device's parameters, gradients and optimizer state alone."""
        return sum(f * nbytes for f, nbytes in self._static())

    def static(self) -> Any:
        """Bytes held whatever the batch: this device's parameters, gradients and optimizer state (and
        the update's temporaries, or the buffers held whole, whichever is more)."""
        return self.total(0)

    def activations(self, samples: Any = 1) -> Any:
        """This device's activation and boundary bytes for ``samples`` samples per micro-batch."""
        return self.activation_fraction * (samples * self._per_sample())

    def term_bytes(self, samples: Any = 0) -> dict[str, Any]:
        """Each term's bytes on this device (for reports): :meth:`total` is the static terms plus the
        larger of ``"activation"`` and ``"update"`` (the optimizer update's temporaries)."""
        static = {term: f * nbytes for term, (f, nbytes) in zip(TERMS, self._static())}
        activation = self.activations(samples)
        return {**static, "activation": activation if _zero(self.whole_bytes) else activation + self.whole_bytes,
                "update": 0.0 if _zero(self.update_bytes) else self.optimizer_fraction * self.update_bytes}

    def max_samples(self, capacity_bytes: float) -> int:
        """Most samples per micro-batch whose :meth:`total` fits in ``capacity_bytes`` (-1: not even
        the static terms fit), at most :data:`UNBOUNDED_SAMPLES` (a device of 1e300 GiB holds any
        batch, not infinitely many)."""
        if not _zero(self.update_bytes) and not fits(self.peaks(0)[1], capacity_bytes):
            return -1   # not even the update after the backward fits
        a, per_sample = self.activation_fraction, self._per_sample()
        if a <= 0:   # the samples cost this device nothing
            return UNBOUNDED_SAMPLES if self.static() <= capacity_bytes else -1
        if not _zero(self.whole_bytes):   # held whatever the samples: less room for them
            capacity_bytes = capacity_bytes - self.whole_bytes
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


def _zero(value: Any) -> bool:
    """A plain 0 (not an array or an ILP expression): a term that is not added at all."""
    return isinstance(value, (int, float)) and value == 0


def fits(need_bytes: float, capacity_bytes: float) -> bool:
    """Whether an estimate fits a capacity (any unit), within :data:`FIT_TOLERANCE`."""
    return need_bytes <= capacity_bytes * (1 + FIT_TOLERANCE)


# the collective backend's copies of a reduce-scatter's input (module docstring, ``c``): gloo copies it
REDUCE_SCATTER_COPIES = 1
# DDP's last gradient bucket is copied to carry the step's exchange with it when it is at most this many bytes
# (runtime.replicas.ddp_sync.JOIN_BYTES; tests/test_memory_model.py checks the two agree)
DDP_JOIN_BYTES = 2**20
# ragged ZeRO 1's buckets: whole parameters per reduce-scatter (runtime.replicas.ragged_sync.BUCKET_BYTES;
# the planner does not import the runtime, tests/test_zero_memory.py checks the two agree)
RAGGED_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class ZeroShards:
    """What a stage's data-parallel group shards under ZeRO (module docstring, "ZeRO"): ``stage`` 0-3
    (``StagePlan.zero_stage``), ``group`` the workers of the group (the stage's workers of one
    ``tp_index`` over all replicas: each holds ``1 / group`` of what is sharded, FSDP2's even shards),
    ``unit`` the largest unit's share of the stage's parameter bytes (even shards: the largest FSDP
    unit, :func:`fsdp_unit_share`; ragged ones: the largest bucket, :func:`ragged_unit`).

    ``share``: under ragged shards, the fraction of the sharded state this one worker holds
    (``StagePlan.state_fractions``, 0 to 1) instead of ``1 / group``; None: even shards. ``padding``:
    under ragged shards, ``n * max(f)`` of the group (every collective's buffer is padded to the
    largest rank's rows; 0 leaves the buffers out, to tell them apart). ``root``: ragged ZeRO 3's
    root unit, the share of the parameters in no layer unit. ``single``: the worker runs one
    micro-batch per step (False: one or more, the upper bound)."""

    stage: int = 0
    group: int = 1
    unit: float = 1.0
    share: float | None = None
    padding: float = 1.0
    root: float = 0.0
    single: bool = False

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
            if self.stage == 0:
                raise ValueError(f"ZeroShards.share is {self.share!r} at ZeRO stage 0: ragged shards run at ZeRO "
                                 "stages 1-3 (stage 0 shards nothing)")
        for name, low, high in (("padding", 0.0, float(self.group)), ("root", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and low <= value <= high):
                raise ValueError(f"ZeroShards.{name} must be in [{low:g}, {high:g}], got {value!r}")
        if not isinstance(self.single, bool):
            raise ValueError(f"ZeroShards.single must be True or False, got {self.single!r}")

    @property
    def ragged(self) -> bool:
        """Whether the worker holds its own fraction (ragged shards) rather than ``1 / group``."""
        return self.share is not None

    @property
    def fraction(self) -> float:
        """``f``: the worker's fraction of the sharded state (``share``, else ``1 / group``)."""
        return 1.0 / self.group if self.share is None else float(self.share)

    @property
    def buffers(self) -> float:
        """``T``: a ragged rank's reduce-scatter buffers per byte of its bucket (module docstring)."""
        return (1 + REDUCE_SCATTER_COPIES) * self.padding + self.padding / self.group

    def fractions(self) -> tuple[float, float, float]:
        """``(weights, gradients, optimizer state)``: the share of the whole stage's bytes of each a
        worker holds at its peak, before its tensor-parallel shard (module docstring, "ZeRO"; ``f`` the
        worker's :attr:`fraction`)."""
        f, u, z, c = self.fraction, self.unit, self.stage, REDUCE_SCATTER_COPIES
        if z == 0:
            return 1.0, 1.0, 1.0
        if not self.ragged:
            if z == 3:
                return f + min(2.0 * u, 1.0), f + (1 + c) * u, f
            if self.single:
                return 1.0 + f, (1 + c) * u, f
            return 1.0 + f, (1.0 + c * u if z == 1 else f + (1 + c) * u), f
        t = self.buffers
        if z == 1:
            return 1.0 + f, (f * (1.0 - u) + (1.0 + t) * u if self.single else 1.0 + t * u), f
        if z == 2:
            return 1.0 + f, f + (1.0 + t) * u, f
        r = self.root
        return f + r + u, f + r + u + t * max(u, r), f


NO_ZERO = ZeroShards()


def fsdp_units(cost: "StageCost", whole_model: bool, cut: bool = False) -> tuple[float, ...]:
    """Parameter bytes of each FSDP unit of a stage, as the runtime wraps them
    (``runtime.replicas.fsdp_sync``): a single-stage plan (``whole_model``) wraps each capture Layer
    that is a module path as its own unit and the rest in the root unit (``StageCost.fsdp_unit_bytes``,
    the modules :func:`runtime.training.recompute.wrap_layers` picks); a stage of a pipeline sharded
    evenly (``cut``: FSDP2 over a group of workers without tensor-parallel slices) is cut into one
    unit per layer plus the root unit (``StageCost.stage_unit_bytes``,
    ``runtime.parallel.stage_units``); any other stage of a pipeline is one unit, the whole stage
    module (ragged shards, a tensor-parallel stage)."""
    units = cost.fsdp_unit_bytes if whole_model else (getattr(cost, "stage_unit_bytes", ()) if cut else ())
    return tuple(units) if units else (float(cost.param_bytes),)


def fsdp_unit_share(cost: "StageCost", whole_model: bool, cut: bool = False) -> float:
    """``u``: the largest FSDP unit's share of the stage's parameter bytes (:func:`fsdp_units`); 1 for
    a pipeline stage of one unit or a stage without parameters."""
    if cost.param_bytes <= 0:
        return 1.0
    return min(max(max(fsdp_units(cost, whole_model, cut)) / cost.param_bytes, 1e-12), 1.0)


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


def ragged_bucket_bytes(cost: "StageCost", cap: float = RAGGED_BUCKET_BYTES) -> float:
    """The largest bucket ragged ZeRO 1 reduce-scatters (``runtime.replicas.ragged_sync``: parameters in
    reverse order, a bucket closed as soon as it holds ``cap`` bytes or more), bounded from the stage's
    layers in reverse (``StageCost.param_layers``: each layer's parameter bytes and largest parameter),
    the layers' parameters taken in the order they run: a bucket that closes inside a layer holds less
    than ``cap`` plus the parameter that closed it, and no more than what was open plus the layer; what a
    layer leaves open is at most what it brought beyond the bucket it closed. Exact when every
    layer ends a bucket; never below the true largest when the parameters are registered in the order
    the layers run. Without the layers' figures: ``cap`` plus the largest parameter."""
    whole = float(cost.param_bytes)
    layers = getattr(cost, "param_layers", ())
    largest_param = float(getattr(cost, "max_param_bytes", 0.0) or whole)
    if not layers:
        return min(whole, cap + largest_param)
    largest, low, high = 0.0, 0.0, 0.0    # the open bucket's bytes lie in [low, high]
    for nbytes, top in reversed(layers):
        if nbytes <= 0:
            continue
        top = top or nbytes
        if high + nbytes < cap:             # no bucket closes inside this layer
            low, high = low + nbytes, high + nbytes
            continue
        largest = max(largest, min(high + nbytes, cap + top))
        if low + nbytes >= cap:             # one closes for sure: what stays open came after it
            low, high = 0.0, min(high + nbytes - cap, cap)
        else:                               # it may not close: all of it may still be open
            low, high = 0.0, min(high + nbytes, cap)
    return min(max(largest, high), whole)


def ragged_unit(cost: "StageCost", stage: int, whole_model: bool) -> tuple[float, float]:
    """``(unit, root)`` of :class:`ZeroShards` under ragged shards at ZeRO ``stage``: the largest
    bucket's share of the stage's parameter bytes (stage 1: :func:`ragged_bucket_bytes`; stage 2: the
    largest parameter, :func:`parameter_share`; stage 3: the largest layer unit, FSDP2's units of a
    single-stage plan, the whole stage module in a pipeline) and, at stage 3, the root unit's share."""
    if cost.param_bytes <= 0:
        return 1.0, 0.0
    if stage == 1:
        return min(max(ragged_bucket_bytes(cost) / cost.param_bytes, 1e-12), 1.0), 0.0
    if stage == 2:
        return parameter_share(cost), 0.0
    root = float(getattr(cost, "root_param_bytes", 0.0)) if whole_model else 0.0
    layer_units = [b for b in fsdp_units(cost, whole_model)]
    if whole_model and root > 0 and len(layer_units) > 1:
        layer_units = layer_units[:-1]     # fsdp_units ends with the root unit when it holds anything
    else:
        root = 0.0                         # one unit: the stage module, gathered whole
    unit = min(max(max(layer_units) / cost.param_bytes, 1e-12), 1.0)
    return unit, min(max(root / cost.param_bytes, 0.0), 1.0)


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
    whole = in_flight * kept + held_once(cost, once, recompute)
    if whole <= 0:
        return shard
    if not recompute:
        divided = min(in_flight * cost.sharded_activation_bytes + divided_loss, whole)
        return 1.0 - divided / whole * (1.0 - unit_share)
    # recomputing: the divided activations are alive for one micro-batch, the layer recomputed (the whole
    # stage's, recomputed as one; else its largest layer's own groups' part); held once like the layer
    unit = recompute_unit(cost, in_flight) if recompute is True else recompute
    layer_divided = getattr(cost, "max_layer_sharded_activation_bytes", None)
    divided_once = min(cost.sharded_activation_bytes if unit == "stage" or layer_divided is None else layer_divided,
                       once)
    cut = 1.0 - unit_share
    mine = in_flight * kept + held_once(cost, once - divided_once * cut, recompute, cost.loss_bytes - divided_loss * cut)
    return min(1.0, mine / whole)


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


def held_once(cost: "StageCost", once: Any, recompute: "bool | str", loss: Any = None) -> Any:
    """Per sample, what a stage holds once beside the activations it keeps per micro-batch in flight:
    ``once`` (:func:`recompute_split`'s: a recomputing stage's layer recomputed at a time) and
    the transient bytes: the loss's outputs and temporaries on the stage that computes it, or one
    layer's backward temporaries (``StageCost.max_layer_backward_bytes``), the larger (the loss's are
    freed as the backward begins, the layers' made after; one micro-batch is in its backward at a
    time). Without recompute they add up (the loss runs, and a layer's backward begins, with every
    activation alive). A recomputing stage holds no layer's activations when the
    loss runs and recomputes a layer only after the loss's tensors are freed: the larger of the loss
    (``loss``, default ``cost.loss_bytes``) and the layer recomputed plus its backward's temporaries
    (measured: at the peak of a recomputing Llama stage no logits or loss tensor is alive)."""
    loss = cost.loss_bytes if loss is None else loss
    backward = getattr(cost, "max_layer_backward_bytes", 0.0)
    if recompute and loss > 0:
        return max(loss, once + backward)
    transient = max(loss, backward)
    if transient == 0:   # a plain 0 is not added: such a stage prices as before, bit for bit
        return once
    return once + transient


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


# The optimizer update's temporaries, in parameters' bytes (torch 2.x's optimizers, measured by
# tests/test_memory_model.py): (copies of its largest parameter, stepping parameter by parameter, torch's
# default on CPU; copies of all its parameters, stepping them at once with the foreach kernels, its
# default on CUDA). Adam and AdamW compute the denominator as sqrt(v) / c (two tensors alive at once, one
# when foreach divides in place); SGD, with or without momentum, updates in place.
UPDATE_COPIES = {"adam": (2, 1), "adamw": (2, 1), "sgd": (0, 0), "sgd_momentum": (0, 0)}


def runs_foreach(device) -> bool:
    """Whether torch's optimizers step the parameters on ``device`` with their foreach kernels (one
    temporary per parameter of the whole step at once, :data:`UPDATE_COPIES`): their default on
    CUDA devices (a GPU kind :func:`whalelike.hardware.known_gpu` knows, not emulated); elsewhere
    (an emulated device runs on CPU) parameter by parameter."""
    return getattr(device, "emulated_speed", None) is None and known_gpu(getattr(device, "kind", "")) is not None


def update_bytes(cost: "StageCost", foreach: bool = False) -> float:
    """Whole-stage bytes of the optimizer update's temporaries (:data:`UPDATE_COPIES`; 0 for a stage
    whose optimizer is not known): the largest parameter's copies parameter by parameter, all the
    parameters' with ``foreach``. A worker holds its optimizer state's fraction of them (it steps
    its shard: FSDP2 and ragged shards cut each parameter, tensor parallelism slices it)."""
    copies = UPDATE_COPIES.get(getattr(cost, "optimizer", ""), (0, 0))
    if foreach:
        return copies[1] * float(cost.param_bytes)
    largest = float(getattr(cost, "max_param_bytes", 0.0) or cost.param_bytes)
    return copies[0] * largest


def stage_memory(cost: "StageCost", in_flight: int, shard: float = 1.0, batch_share: float = 1.0,
                 recompute: "bool | str" = False, unit_share: float | None = None,
                 zero: ZeroShards = NO_ZERO, foreach: bool = False) -> MemoryTerms:
    """The memory of a worker that holds ``shard`` of stage ``cost`` with ``in_flight`` micro-batches
    alive at once and ``batch_share`` of the samples :meth:`MemoryTerms.total` is given (1: they
    are its own group's). Gradients are as large as the parameters; the boundary buffers count
    with the activations (:class:`~planner.devices.stage_cost.StageCost`). ``recompute``: the stage
    runs under activation checkpointing, ``True`` in the unit :func:`recompute_unit` picks, or the
    one named, ``"layer"`` or ``"stage"`` (:func:`recompute_of`). ``unit_share``:
    the worker's share of a ``split`` stage's shard-group units (``ShardLayout.unit_shares``), for
    its activations (:func:`activation_shard`). ``zero``: what the stage's data-parallel group
    shards (:class:`ZeroShards`). The last stage's loss bytes are held once. ``foreach``: the
    optimizer steps with its foreach kernels (:func:`runs_foreach` of the worker's device), which
    sizes its update's temporaries (:func:`update_bytes`)."""
    kept, once = recompute_of(cost, in_flight, recompute)
    once = held_once(cost, once, recompute)
    return MemoryTerms(
        weight_bytes=cost.param_bytes + cost.param_copy_bytes,
        gradient_bytes=cost.param_bytes,
        optimizer_bytes=cost.optimizer_bytes,
        activation_bytes_per_sample=kept,
        in_flight=in_flight,
        **worker_fractions(shard, batch_share, activation_shard(cost, in_flight, unit_share, recompute, shard), zero),
        transient_bytes_per_sample=once,
        # boundary values without a batch dimension: whole on every worker, per micro-batch in flight
        whole_bytes=in_flight * whole if (whole := getattr(cost, "unbatched_boundary_bytes", 0.0)) else 0.0,
        update_bytes=update_bytes(cost, foreach),
        # DDP over two workers or more: the last bucket joined with the exchange (at most DDP_JOIN_BYTES of its
        # gradients, an upper bound: a larger last bucket is not copied)
        join_bytes=min(shard * cost.param_bytes, DDP_JOIN_BYTES) if zero.stage == 0 and zero.group > 1 else 0.0,
    )


def max_shard(cost: "StageCost", in_flight: int, samples: int, capacity_bytes: float, recompute: bool = False,
              zero: ZeroShards = NO_ZERO, foreach: bool = False) -> float:
    """The largest tensor-parallel fraction of stage ``cost`` a device of ``capacity_bytes`` holds
    with ``samples`` samples per micro-batch (``recompute``: under activation checkpointing; ``zero``:
    its data-parallel group's ZeRO stage): every term scales with the shard (:func:`worker_fractions`),
    so it is the capacity over the whole stage's need (at least one byte: a stage that needs nothing
    fits any share)."""
    return capacity_bytes / max(stage_memory(cost, in_flight, recompute=recompute, zero=zero,
                                             foreach=foreach).total(samples), 1.0)


def with_reserve(cluster: Cluster, reserve: float) -> Cluster:
    """The planner's view of ``cluster`` with ``reserve`` of every device's memory set aside (module
    docstring, "Reserve"): each device's ``memory_gib`` is what a plan may fill. Idempotent, and from
    a view of another reserve it re-scales from the devices' whole memory (``Cluster.memory_reserved``
    says what was set aside), so any entry point of the planner may take a cluster as loaded or a view."""
    if not (isinstance(reserve, (int, float)) and 0 <= reserve < 1):
        raise ValueError(f"with_reserve: reserve must be a fraction in [0, 1) of each device's memory, got {reserve!r}")
    if reserve == cluster.memory_reserved:
        return cluster
    scale = (1.0 - reserve) / (1.0 - cluster.memory_reserved)
    devices = tuple(dataclasses.replace(d, memory_gib=d.memory_gib * scale) for d in cluster.devices)
    return dataclasses.replace(cluster, devices=devices, memory_reserved=float(reserve))


def derated(cluster: Cluster, scale: dict[str, float]) -> Cluster:
    """``cluster`` with each named device's ``memory_gib`` multiplied by its factor in ``scale``
    (device name -> factor in (0, 1]): what the memory check while training
    (:mod:`runtime.balance.memory_check`) sets where a device's measured peak ran above the
    prediction, so the model's figure is fitted into the memory over the measured ratio.
    ``cluster`` itself when ``scale`` is empty."""
    if not scale:
        return cluster
    names = {d.name for d in cluster.devices}
    unknown = sorted(set(scale) - names)
    if unknown:
        raise ValueError(f"derated: no device named {', '.join(map(repr, unknown))} in cluster "
                         f"{cluster.name!r} (its devices: {', '.join(sorted(names))})")
    bad = {n: f for n, f in scale.items() if not (isinstance(f, (int, float)) and 0 < f <= 1)}
    if bad:
        raise ValueError(f"derated: each scale factor must be in (0, 1] (a share of the device's memory), "
                         f"got {bad}")
    devices = tuple(dataclasses.replace(d, memory_gib=d.memory_gib * scale[d.name]) if d.name in scale else d
                    for d in cluster.devices)
    return dataclasses.replace(cluster, devices=devices)
