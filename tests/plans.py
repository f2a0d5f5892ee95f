"""Hand-built plans for tests: one builder, so a test spells out only what it is about.

Tests import it like the other helpers here (``from plans import make_plan, worker``).

:func:`make_plan` fills every field a test usually does not care about:

* ``global_batch_size``: the samples of one step, the micro-batch sizes of the stage-0 workers
  of tensor-parallel index 0 (every replica) summed;
* ``num_micro_batch``: the longest worker's micro-batch list;
* ``model_fingerprint`` and ``cluster``: ``"test"`` (pass the model's fingerprint and the
  cluster's name where the plan is validated against them or run by an Engine);
* ``schedule`` ``"1f1b"``, ``solver`` ``"greedy"``, no boundaries, zero predictions.

``stages`` is a list of :class:`StagePlan`, or a number ``n`` of single-layer stages in a chain
(:func:`chain_stages`). Any other :class:`Plan` field is a keyword override (``None`` for
``global_batch_size`` or ``num_micro_batch``: the default above).

:func:`worker` builds a :class:`Worker` on an emulated device, ``emu-<rank>`` on ``localhost``
(the device names of the tests' emulated clusters), by default replica 0, stage 0, no split.
"""
from __future__ import annotations

from typing import Any, Iterable, Union

from planner.plan import Plan, Prediction, StagePlan, Worker


def zero_prediction() -> Prediction:
    return Prediction(0.0, 0.0, 0.0)


def chain_stages(num_stages: int, strategy: str = "replicate") -> list[StagePlan]:
    """Stage ``s`` runs TaskGraph ``s`` and layer ``s``."""
    return [StagePlan(s, [s], [s], strategy) for s in range(num_stages)]


def worker(rank: int, stage: int = 0, dp_index: int = 0, tp_index: int = 0, tp_size: int = 1, *,
           sizes: Iterable[int], replica: int = 0, device: str | None = None, host: str = "localhost",
           **fields: Any) -> Worker:
    """A worker processing micro-batches of ``sizes`` samples; ``fields``: any other Worker field."""
    return Worker(rank, f"emu-{rank}" if device is None else device, host, replica, stage, dp_index, tp_index,
                  tp_size, micro_batch_sizes=list(sizes), **fields)


def make_plan(stages: Union[int, list[StagePlan]], workers: list[Worker], **overrides: Any) -> Plan:
    """A Plan of ``stages`` run by ``workers`` (rank = position); ``overrides``: any Plan field."""
    if isinstance(stages, int):
        stages = chain_stages(stages)
    fields: dict[str, Any] = dict(model_fingerprint="test", cluster="test", schedule="1f1b", solver="greedy",
                                  boundaries=[], prediction=zero_prediction(), naive_prediction=zero_prediction())
    fields.update(overrides)
    if fields.get("global_batch_size") is None:
        fields["global_batch_size"] = sum(w.batch_share for w in workers if w.stage == 0 and w.tp_index == 0)
    if fields.get("num_micro_batch") is None:
        fields["num_micro_batch"] = max(len(w.micro_batch_sizes) for w in workers)
    return Plan(stages=stages, workers=workers, **fields)
