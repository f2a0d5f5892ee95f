"""``Metrics``: a run's figures per step from rank 0, as JSON lines and, when asked, TensorBoard
scalars and Weights & Biases: loss, learning rate, gradient norm, samples and tokens per second,
MFU per device kind, peak memory per rank, and the run's events (re-plans, leaves, joins).

Why a controller (:mod:`runtime.control.protocol`) and not a callback after ``train_step``: the other
ranks' peak memory reaches rank 0 as the controller's share of the step-end exchange
(:mod:`runtime.control.exchange`), summed in the collective that ends the step anyway, so metrics
add no collective of their own (an executor with no such collective sums the exchange alone, as it
does for every controller); and the events are the plan changes the board applies, which a
controller is told of (:meth:`Controller.changed`). It reacts before every controller that may
change the plan (``order`` -1), so each step's line is written even at a step a change ends.

What a step's line holds (a key whose figure was not measured is left out, never a placeholder):

* ``step``, ``loss`` (the global mean), ``lr`` (the optimizer's first param group, as the step used
  it), ``grad_norm`` (the global norm before clipping: only with ``clip_grad_norm``, which computes
  it; none is computed here), ``skipped`` (an update dropped), ``plan_version``, ``world_size``;
* ``step_time_s`` (rank 0's measured step, ``StepStats.wall_s``: the step ends in a collective every
  rank takes part in, so it is the job's step), ``samples_per_s`` (the global batch over it) and
  ``tokens_per_s`` (times ``tokens_per_sample``: the constructor's, else the targets' elements per
  sample when they are token ids, an integer tensor ``[batch, positions]``; without either, samples
  only: a class label or a regression target is not a token);
* ``mfu``: per device kind of the plan, the ranks of that kind, the FLOPs they ran in the step, their
  achieved TFLOP/s (those FLOPs over the step time), their summed peak at the precision that runs
  (``Device.tflops``: the cluster spec's per-precision peak) and the ratio, ``mfu``; on an emulated
  cluster also ``emulated_peak_tflops`` and ``emulated_mfu``, against the emulated device's peak
  (its ``emulated_speed`` at the precision times ``base_gflops``), the figure that means something
  there (a CPU emulating an A100 runs at a millionth of the A100's spec sheet). A rank's FLOPs are the
  captured ones (``Layer.forward_flops + backward_flops`` per sample, summed over its stage's layers)
  times the samples its plan gives it per step, times its share of a tensor-parallel stage as the
  planner prices it (:func:`planner.shares.shard_sizes.layout_of_sizes`: the part a split region
  leaves unsharded runs whole on each member and counts on each); activation recompute's second
  forward is not counted (model FLOPs, not hardware FLOPs);
* ``peak_memory_bytes``: rank 0's measured peak of this step (``Engine(measure_memory=True)``, on
  by default on GPUs), and ``peak_memory_bytes_by_rank``: every measuring rank's peak of the step
  before (``{"step": n - 1, "ranks": {rank: bytes}}``; a step's own peak is known only after the
  collective that ends it, so it travels in the next step's exchange; the last step's other ranks
  are therefore never written).

Events are lines of their own, written when they happen: ``{"step", "event": "replan", "change",
"reason", "exact", "world_size"}`` for a plan change another controller made (a
re-plan, P-Reduce's switch, a migration), ``"leave"`` with the ``leavers`` and their ``reasons``, and
``"membership"`` (devices ``lost`` and ``gained`` at this start under torchrun's elastic agent: the
joins) when given the start's :class:`runtime.elastic.membership.MembershipChange`
(``membership=``), which no controller can see, since it happens before the Engine exists.

Why not torch's or torchtitan's metrics: torch has none beyond the writers; torchtitan computes one
MFU for the job, from the logging rank's own device (a table of bf16 peaks looked up by its name)
and the tokens each device would process were the work even, and logs that rank's memory only. On
unequal devices with uneven shares that one number mixes a fast kind idling at a slow one's pace
with the slow kind at full speed and hides which kind waits; and the ranks that run out of memory
are rarely the logging one. Here MFU is per device kind, from each rank's own work in the plan and
its kind's peak in the cluster spec, and memory is every rank's, at no collective of its own. TensorBoard's ``SummaryWriter`` is used as the writer
when asked (imported only then: ``tensorboard`` is an optional dependency, ``pip install
tensorboard`` or the ``metrics`` extra), and W&B only when installed *and* asked.

Invariant: every rank takes part in the exchange alike (the part's size is the world size, the same
on every rank); only rank 0 writes, each JSON line whole and flushed at once (a crash loses nothing
written) and each TensorBoard step flushed; the controller returns no change; every figure is a
measurement of the step it names or a function of the plan, capture and cluster spec.
"""
from __future__ import annotations

import atexit
import importlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from planner.devices.stage_cost import StageCost
from planner.shares.shard_sizes import layout_of_sizes
from planner.shares.stage_shards import stage_shardable
from runtime.control.exchange import Part
from runtime.control.protocol import Controller, PlanChange, StepView
from runtime.parallel.stage_split import stage_flops_from_plan
from whalelike.errors import WhaleError
from whalelike.files import LineLog, check_output_paths

REPLANS = ("apply", "migrate", "end_migration")


# -- the pure parts: FLOPs per rank, MFU per device kind ---------------------------------------------
def tp_fractions(graphs, plan, stage) -> list[float]:
    """Each tensor-parallel index's share of ``stage``'s work, as the planner prices it (the part no
    shard group divides counts whole on every index); ``[1.0]`` for a stage without ``split``."""
    tp = plan.stage_workers(stage.index)[0].tp_size
    if tp == 1:
        return [1.0]
    layers = list(stage.layers)
    _, shardable, groups = stage_shardable(graphs, layers)
    flops = StageCost.of_layers(graphs, layers, plan.precision).flops_per_sample
    return list(layout_of_sizes(shardable, stage.shard_sizes, tp, groups, flops).fractions)


def rank_flops(graphs, plan) -> list[float]:
    """Per rank of ``plan``: the model FLOPs (forward and backward, recompute not counted) it runs in
    one step: its stage's captured FLOPs per sample times its samples per step times its
    tensor-parallel share (:func:`tp_fractions`)."""
    stages = sorted(plan.stages, key=lambda st: st.index)     # stage_flops_from_plan's order
    per_sample = {st.index: f + b for st, (f, b) in zip(stages, stage_flops_from_plan(graphs, plan))}
    fractions = {st.index: tp_fractions(graphs, plan, st) for st in stages}
    out = [0.0] * plan.world_size
    for w in plan.workers:
        share = fractions[w.stage][w.tp_index] if w.tp_size > 1 else 1.0
        out[w.rank] = per_sample[w.stage] * sum(w.micro_batch_sizes) * share
    return out


@dataclass(frozen=True)
class KindFigures:
    """One device kind's step: its ranks, the FLOPs they ran, their peaks (TFLOP/s, summed)."""

    ranks: tuple[int, ...]
    flops: float
    peak_tflops: float
    emulated_peak_tflops: Optional[float] = None

    def line(self, step_s: float) -> dict:
        achieved = self.flops / step_s / 1e12
        out = {"ranks": list(self.ranks), "flops": self.flops, "achieved_tflops": achieved,
               "peak_tflops": self.peak_tflops, "mfu": achieved / self.peak_tflops}
        if self.emulated_peak_tflops is not None:
            out["emulated_peak_tflops"] = self.emulated_peak_tflops
            out["emulated_mfu"] = achieved / self.emulated_peak_tflops
        return out


def kind_figures(graphs, plan, cluster, precision: str) -> dict[str, KindFigures]:
    """Per device kind of ``plan`` (in the order of their first rank): its ranks, the FLOPs they run
    in one step (:func:`rank_flops`), their summed peak at ``precision`` from the cluster spec
    (``Device.tflops``) and, on an emulated cluster, their summed emulated peak (``emulated_speed``
    at ``precision`` times ``base_gflops``)."""
    flops = rank_flops(graphs, plan)
    kinds: dict[str, list] = {}
    for w in sorted(plan.workers, key=lambda w: w.rank):
        kinds.setdefault(cluster.device(w.device).kind, []).append(w)
    out = {}
    for kind, workers in kinds.items():
        devices = [cluster.device(w.device) for w in workers]
        emulated = None
        if cluster.emulation is not None:
            speeds = [d.emulated(precision) for d in devices]
            if all(s is not None for s in speeds):
                emulated = sum(speeds) * cluster.emulation.base_gflops / 1e3
        out[kind] = KindFigures(tuple(w.rank for w in workers), sum(flops[w.rank] for w in workers),
                                sum(d.tflops(precision) for d in devices), emulated)
    return out


def tokens_per_sample_of(targets) -> Optional[int]:
    """The targets' elements per sample when they are token ids: an integer tensor with a sequence
    dimension (``[batch, positions]``, a language model's next tokens); else None (one class label
    per sample, or a float target of a regression, is not tokens)."""
    if (isinstance(targets, torch.Tensor) and targets.dim() >= 2 and targets.shape[0] > 0
            and not targets.is_floating_point() and not targets.is_complex() and targets.dtype != torch.bool):
        return int(targets[0].numel())
    return None


# -- the writers ---------------------------------------------------------------------------------------
def summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or a one-line WhaleError when tensorboard is missing."""
    try:
        return importlib.import_module("torch.utils.tensorboard").SummaryWriter
    except ImportError:
        raise WhaleError("Metrics(tensorboard=...) needs the tensorboard package: pip install tensorboard "
                         "(or the whalelike[metrics] extra)") from None


def wandb_module():
    """The ``wandb`` module, or a one-line WhaleError when it is missing."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise WhaleError("Metrics(wandb=True) needs the wandb package: pip install wandb "
                         "(or leave wandb off: JSON lines and TensorBoard need no account)") from None


def scalars(line: Mapping[str, Any]) -> dict[str, float]:
    """A step's line as flat scalar tags for TensorBoard and W&B."""
    out = {}
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("step_time_s", "throughput/step_time_s"), ("samples_per_s", "throughput/samples_per_s"),
                     ("tokens_per_s", "throughput/tokens_per_s"), ("peak_memory_bytes", "memory/peak_bytes/rank0")):
        if line.get(key) is not None:
            out[tag] = float(line[key])
    for kind, figures in line.get("mfu", {}).items():
        out[f"mfu/{kind}"] = figures["mfu"]
        out[f"achieved_tflops/{kind}"] = figures["achieved_tflops"]
        if "emulated_mfu" in figures:
            out[f"emulated_mfu/{kind}"] = figures["emulated_mfu"]
    return out


class Metrics(Controller):
    """Writes each step's figures on rank 0 (see the module docstring). Add it on every rank:
    ``engine.add_controller(Metrics("out/metrics.jsonl", tensorboard="out/tb"))``.

    ``path``: the JSON-lines file (None: none); ``tensorboard``: a log directory for
    ``SummaryWriter`` (None: off); ``wandb``: log to Weights & Biases too (``wandb_init``: the keyword
    arguments of ``wandb.init``); ``tokens_per_sample``: tokens in one sample (default: from the
    targets, see the module docstring); ``every``: write every that many steps; ``membership``: this
    start's :class:`runtime.elastic.membership.MembershipChange`, written as the first event."""

    name = "metrics"
    order = -1     # before every controller that may change the plan: each step's line is written

    def __init__(self, path: Optional[str] = None, *, tensorboard: Optional[str] = None, wandb: bool = False,
                 wandb_init: Optional[Mapping[str, Any]] = None, tokens_per_sample: Optional[int] = None,
                 every: int = 1, membership: Any = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise WhaleError(f"Metrics(every=...) must be a whole number of steps >= 1, got {every!r}")
        if tokens_per_sample is not None and (isinstance(tokens_per_sample, bool)
                                              or not isinstance(tokens_per_sample, int) or tokens_per_sample < 1):
            raise WhaleError(f"Metrics(tokens_per_sample=...) must be a whole number >= 1, got {tokens_per_sample!r}")
        if path is None and tensorboard is None and not wandb:
            raise WhaleError("Metrics writes nowhere: give a JSON-lines path, tensorboard=<log dir> or wandb=True")
        if path is not None:
            check_output_paths({"Metrics(path=...)": path}, kinds={"Metrics(path=...)": "jsonl"})
        # every rank checks what was asked for, so all fail alike before the first step
        self._writer_class = summary_writer_class() if tensorboard is not None else None
        self._wandb = wandb_module() if wandb else None
        self.path, self.tensorboard, self.every = path, tensorboard, every
        self.wandb_init = dict(wandb_init or {})
        self.tokens_per_sample = tokens_per_sample
        self.membership = membership
        self._seen_tokens: Optional[int] = None
        self._log: Optional[LineLog] = None
        self._writer = None
        self._run = None
        self._opened = False
        self._closed = False
        self._renumbered = False
        self._last_peak: Optional[int] = None
        self._by_rank: Optional[dict] = None
        self._kinds: Optional[tuple[Any, Any, dict]] = None    # (plan, graphs, figures) of the plan computing
        self.counts = {"replans": 0, "leaves": 0, "joins": 0}
        self.lines = 0

    # -- every rank -----------------------------------------------------------------------------------
    def on_batch(self, inputs: tuple, targets) -> None:
        if self.tokens_per_sample is None:
            self._seen_tokens = tokens_per_sample_of(targets)

    def exchange(self, step: int, runtime, so_far) -> Optional[Part]:
        if step % self.every:
            return None
        world, rank, last = runtime.world_size, runtime.rank, self._last_peak
        label = step - 1

        def fill() -> torch.Tensor:
            out = torch.zeros(world, dtype=torch.float64)
            out[rank] = math.nan if last is None else float(last)   # this rank's peak of the step before
            return out

        def arrived(values: torch.Tensor) -> None:
            ranks = {r: int(v) for r, v in enumerate(values.tolist()) if not math.isnan(v)}
            self._by_rank = {"step": label, "ranks": ranks} if ranks and label >= 0 else None

        return Part(world, fill, arrived)

    def react(self, view: StepView) -> Optional[PlanChange]:
        stats = view.stats
        if view.step % self.every == 0 and view.runtime.rank == 0 and not self._closed:
            self._open(view)
            line = self.line(view)
            self._write(line, view.step)
            self.lines += 1
        self._last_peak = stats.peak_memory_bytes
        self._by_rank = None
        return None

    def changed(self, view: StepView, change: PlanChange) -> None:
        if change.kind == "leave":
            self.counts["leaves"] += len(change.leavers)
            event = {"step": view.step, "event": "leave", "leavers": list(change.leavers),
                     "reasons": list(change.reasons), "world_size": view.plan.world_size}
            self._last_peak = None       # ranks are numbered anew: a peak of the old numbering means nothing
            self._renumbered = True      # a stayer that is rank 0 now appends to the old rank 0's file
        elif change.kind in REPLANS:
            self.counts["replans"] += 1
            event = {"step": view.step, "event": "replan", "change": change.kind, "reason": change.reason,
                     "exact": change.exact, "world_size": view.plan.world_size}
        else:
            return
        if view.runtime.rank == 0 and not self._closed:
            self._open(view)
            self._event(event, view.step)

    # -- rank 0 ---------------------------------------------------------------------------------------
    def line(self, view: StepView) -> dict:
        """The step's line (see the module docstring)."""
        stats, plan = view.stats, view.plan
        line: dict[str, Any] = {"step": view.step, "loss": view.loss}
        if stats.lr is not None:
            line["lr"] = stats.lr
        if stats.grad_norm is not None:
            line["grad_norm"] = stats.grad_norm
        if stats.skipped:
            line["skipped"] = True
        line.update(plan_version=stats.plan_version, world_size=plan.world_size)
        step_s = stats.wall_s
        if step_s > 0:
            line["step_time_s"] = step_s
            line["samples_per_s"] = plan.global_batch_size / step_s
            tokens = self.tokens_per_sample if self.tokens_per_sample is not None else self._seen_tokens
            if tokens is not None:
                line["tokens_per_sample"] = tokens
                line["tokens_per_s"] = plan.global_batch_size * tokens / step_s
            if view.graphs is not None:
                line["mfu"] = {kind: f.line(step_s) for kind, f in self._kind_figures(view).items()}
        if stats.peak_memory_bytes is not None:
            line["peak_memory_bytes"] = stats.peak_memory_bytes
        if self._by_rank is not None:
            line["peak_memory_bytes_by_rank"] = {"step": self._by_rank["step"],
                                                 "ranks": {str(r): b for r, b in self._by_rank["ranks"].items()}}
        return line

    def _kind_figures(self, view: StepView) -> dict[str, KindFigures]:
        computing = view.compute_plan if view.compute_plan is not None else view.plan
        if self._kinds is None or self._kinds[0] is not computing or self._kinds[1] is not view.graphs:
            figures = kind_figures(view.graphs, computing, view.runtime.cluster, view.runtime.precision)
            self._kinds = (computing, view.graphs, figures)
        return self._kinds[2]

    def _open(self, view: StepView) -> None:
        """Open the writers (once, on the rank that is rank 0; after a leave made this rank rank 0,
        the JSON lines are appended to what the old rank 0 wrote)."""
        if self._opened:
            return
        self._opened = True
        if self.path is not None:
            self._log = LineLog(self.path, label="Metrics(path=...)", append=self._renumbered)
        if self._writer_class is not None:
            self._writer = self._writer_class(log_dir=self.tensorboard)
        if self._wandb is not None:
            self._run = self._wandb.init(**self.wandb_init)
        atexit.register(self.close)
        if self.membership is not None:
            change = self.membership
            self.counts["joins"] += len(change.gained)
            self.counts["leaves"] += len(change.lost)
            self._event({"step": view.step, "event": "membership", "lost": list(change.lost),
                         "gained": list(change.gained), "renumbered": bool(change.renumbered),
                         "world_size_before": change.old.world_size, "world_size": change.new.world_size},
                        view.step)

    def _write(self, line: dict, step: int) -> None:
        if self._log is not None:
            self._log.write(json.dumps(line, default=float))
        tags = scalars(line)
        by_rank = line.get("peak_memory_bytes_by_rank")
        if self._writer is not None:
            for tag, value in tags.items():
                self._writer.add_scalar(tag, value, step)
            if by_rank is not None:
                for r, value in by_rank["ranks"].items():
                    if r != "0":   # rank 0's own of that step was written at it
                        self._writer.add_scalar(f"memory/peak_bytes/rank{r}", float(value), by_rank["step"])
            self._writer.flush()
        if self._run is not None:
            if by_rank is not None:
                tags.update({f"memory/peak_bytes_before/rank{r}": float(v) for r, v in by_rank["ranks"].items()})
            self._run.log(tags, step=step)

    def _event(self, event: dict, step: int) -> None:
        if self._log is not None:
            self._log.write(json.dumps(event, default=float))
        counts = {f"events/{name}": float(n) for name, n in self.counts.items()}
        if self._writer is not None:
            for tag, value in counts.items():
                self._writer.add_scalar(tag, value, step)
            self._writer.add_text("events", json.dumps(event), step)
            self._writer.flush()
        if self._run is not None:
            self._run.log(counts, step=step)

    def close(self) -> None:
        """Close the writers (also at interpreter exit); nothing is written afterwards."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._log is not None:
            self._log.close()
        if self._writer is not None:
            self._writer.close()
        if self._run is not None:
            self._run.finish()

