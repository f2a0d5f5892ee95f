"""Held-out evaluation while training: the mean loss and perplexity of a model on validation
batches, under any plan, logged.

:func:`evaluate` runs ``Engine.eval_step`` on each held-out global batch (every rank passes the
same whole batch; the executors take their part of it: a data-parallel rank its share, a pipeline
stage its micro-batches' forwards, a tensor-parallel rank its shard) and returns an
:class:`EvalResult`: the token-weighted mean loss (each batch's global-mean loss weighted by its
target tokens), the perplexity ``exp(loss)``, the tokens and batches read. Nothing is updated: no
gradient, no optimizer step, no batch counted as a training step, the modules back in training
mode afterwards. :func:`eval_batches` cuts a validation dataset into the same global batches on
every rank and every plan: the first ``max_batches`` whole global batches in dataset order, the
short tail left out (pipeline and tensor-parallel plans take whole global batches only, and every
plan must read the same windows for its loss to mean the same). :class:`Evaluator` runs it every
``every`` steps.

P-Reduce (``StagePlan.replica_sync == "partial"``): the replicas of a stage step apart and average
with small groups, so between averages they differ, and ``eval_step`` alone would give the mean of
each replica's loss on its own share. What P-Reduce trains is the replicas' average (its analysis
is about the mean of the replicas, and checkpoints store it), so :func:`evaluate` evaluates that:
:func:`replica_average` parks each P-Reduce sync (``drain``, as before any collective of the whole
group), puts the group's average of the stage's parameters in place (one all-reduce per dtype),
runs the evaluation, and puts every replica's own parameters back bit for bit, so training goes on
exactly as without the evaluation (unlike ``consensus``, which makes the average every replica's
and averages the optimizer state too). Buffers (BatchNorm's running statistics) stay each
replica's own, as P-Reduce keeps them.

Invariant: every rank of the plan calls :func:`evaluate` at the same step with the same batches
(its collectives are the Engine's ``eval_step`` and the averages of each stage's replicas), and
every rank returns the same result.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from runtime.replicas.partial_sync import PartialSync
from whalelike.errors import WhaleError

__all__ = ["EvalResult", "EvaluationError", "evaluate", "eval_batches", "replica_average", "Evaluator"]

log = logging.getLogger(__name__)


class EvaluationError(WhaleError, ValueError):
    """Held-out data that cannot be evaluated under the plan (a user-facing error)."""


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: ``loss`` (token-weighted mean over the batches), ``perplexity``
    (``exp(loss)``; inf past float range), ``tokens`` and ``batches`` read, after training step
    ``step`` (None: not given)."""

    loss: float
    perplexity: float
    tokens: int
    batches: int
    step: Optional[int] = None

    def line(self) -> str:
        at = f"step {self.step}: " if self.step is not None else ""
        return (f"eval {at}loss {self.loss:.4f}, perplexity {self.perplexity:.2f} "
                f"({self.tokens} tokens in {self.batches} batches)")


def eval_batches(dataset: Dataset, global_batch_size: int, max_batches: Optional[int] = None) -> Iterator[tuple]:
    """The held-out global batches of ``dataset`` (``(inputs, targets)`` items), the same on every
    rank and plan: batches of ``global_batch_size`` in dataset order, the short tail left out, at
    most ``max_batches`` (None: all). Each is ``((inputs,), targets)``, as ``Engine.eval_step`` takes it."""
    if max_batches is not None and max_batches < 1:
        raise EvaluationError(f"max_batches must be at least 1 (None: every whole batch), got {max_batches!r}")
    n = len(dataset)
    if n < global_batch_size:
        raise EvaluationError(f"{getattr(dataset, 'path', type(dataset).__name__)}: the held-out data holds {n} "
                              f"samples, fewer than one global batch of {global_batch_size} (evaluation reads whole "
                              "global batches); keep more data for validation or use a smaller global batch")
    return _whole_batches(DataLoader(dataset, batch_size=global_batch_size, shuffle=False, drop_last=True),
                          max_batches)


def _whole_batches(loader: DataLoader, max_batches: Optional[int]) -> Iterator[tuple]:
    for k, (inputs, targets) in enumerate(loader):
        if max_batches is not None and k >= max_batches:
            return
        yield (tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)), targets


def evaluate(engine, batches: Iterable, step: Optional[int] = None) -> EvalResult:
    """The token-weighted mean loss and perplexity of ``engine``'s model on ``batches`` (whole
    global batches, the same on every rank: :func:`eval_batches`), under any plan; P-Reduce's
    replicas evaluated at their average (see the module docstring). Logged on rank 0 (INFO);
    a collective."""
    total = 0.0
    tokens = count = 0
    with replica_average(engine):
        for batch in batches:
            weight = batch[1].numel()
            loss = engine.eval_step(batch)
            total += float(loss.detach().double()) * weight
            tokens += weight
            count += 1
    if count == 0:
        raise EvaluationError("evaluate: no held-out batch was given; give at least one whole global batch "
                              "(runtime.evaluation.eval_batches)")
    mean = total / tokens
    try:
        perplexity = math.exp(mean)
    except OverflowError:
        perplexity = math.inf
    result = EvalResult(mean, perplexity, tokens, count, step)
    if engine.rank == 0:
        log.info(result.line())
    return result


@contextlib.contextmanager
def replica_average(engine) -> Iterator[None]:
    """While inside: each P-Reduce stage's parameters are its replicas' average on every replica;
    afterwards each replica's own again, bit for bit (see the module docstring). Nothing to do for
    exact syncs (their replicas are equal) or before the engine has built its executor (a
    collective over each P-Reduce group)."""
    syncs = [s for s in engine.executor.syncs() if isinstance(s, PartialSync)] if engine.slot.built else []
    saved = []
    try:
        for sync in syncs:
            params = [p for p in sync.module.parameters() if p.requires_grad]
            saved.append((params, [p.detach().clone() for p in params]))
            engine.runtime.collective(lambda: _average(sync, params))
        yield
    finally:
        with torch.no_grad():
            for params, own in saved:
                for p, value in zip(params, own):
                    p.copy_(value)


@torch.no_grad()
def _average(sync: PartialSync, params: list[torch.nn.Parameter]) -> None:
    """Write the group's average of ``params`` into them: one all-reduce of a flat vector per dtype."""
    sync.drain()   # parked first: no P-Reduce group waits for this rank in the all-reduce
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.detach().reshape(-1) for p in group])
        dist.all_reduce(flat, group=sync.group)
        flat.div_(sync.size)
        for p, value in zip(group, flat.split([p.numel() for p in group])):
            p.copy_(value.view_as(p))


class Evaluator:
    """Evaluation every ``every`` training steps on ``dataset``'s held-out windows: call
    :meth:`after_step` after each ``Engine.train_step`` (every rank); it evaluates when the steps
    completed are a multiple of ``every`` and returns the :class:`EvalResult` (else None).
    ``max_batches``: at most this many global batches each time (None: all). The global batch is
    the plan in force's at each evaluation."""

    def __init__(self, dataset: Dataset, every: int, max_batches: Optional[int] = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise EvaluationError(f"evaluation every {every!r} steps: give a positive number of steps")
        if max_batches is not None and max_batches < 1:
            raise EvaluationError(f"max_batches must be at least 1 (None: every whole batch), got {max_batches!r}")
        self.dataset, self.every, self.max_batches = dataset, every, max_batches
        self.history: list[EvalResult] = []

    def after_step(self, engine) -> Optional[EvalResult]:
        if engine.step % self.every:
            return None
        return self.run(engine)

    def run(self, engine) -> EvalResult:
        """Evaluate now (every rank), after step ``engine.step``."""
        batches = eval_batches(self.dataset, engine.plan.global_batch_size, self.max_batches)
        result = evaluate(engine, batches, step=engine.step)
        self.history.append(result)
        return result
