"""BatchNorm under data parallelism: which stages run it, and the plan-time warning.

Under ``replicate`` a BatchNorm in training mode normalises each worker's samples with their own
statistics (DDP's behaviour), so the trained model differs from single-device training; nothing
fails, which is why the planner says so. ``Config.sync_batchnorm`` (``Plan.sync_batchnorm``)
makes the runtime take the statistics over the stage's data-parallel group instead
(``runtime.parallel.sync_batchnorm``), exact when each step is one micro-batch. The stages' BatchNorms come from
capture (``Layer.batchnorm``) and are kept in ``StagePlan.batchnorm``, so the warning is derived
from the plan alone (``Plan.summary`` prints it, :func:`log_batchnorm_warnings` logs it).
"""
from __future__ import annotations

import logging
from typing import Iterable

from whalelike.graphs.taskgraph import TaskGraphs, abbreviate_paths

from planner.plan_record import PlanRecord

log = logging.getLogger(__name__)


def stage_batchnorms(graphs: TaskGraphs, layers: Iterable[int]) -> list[str]:
    """Module paths of the BatchNorms in training mode that the given layers run, in order."""
    by_index = {layer.index: layer for layer in graphs.layers}
    return list(dict.fromkeys(path for i in layers for path in getattr(by_index[i], "batchnorm", ())))


def batchnorm_warnings(plan: PlanRecord) -> list[str]:
    """One line per stage whose BatchNorm statistics differ from single-device training."""
    out = []
    for stage in plan.stages:
        if not stage.batchnorm:
            continue
        slots = sum(w.tp_index == 0 for w in plan.stage_workers(stage.index))
        micro_batches = max(len(w.micro_batch_sizes) for w in plan.stage_workers(stage.index))
        what = f"stage {stage.index} runs BatchNorm in training mode ({abbreviate_paths(stage.batchnorm)})"
        if slots > 1 and not plan.sync_batchnorm:
            out.append(f"{what} on {slots} data-parallel workers: each normalises with the statistics of its own "
                       f"samples (as DDP does), so training differs from a single device; plan with "
                       f"wl.Config(sync_batchnorm=True) (whalelike plan --sync-batchnorm) to synchronise the "
                       f"statistics over the stage's workers")
        elif slots > 1 and micro_batches > 1:
            out.append(f"{what} with statistics synchronised over {slots} workers but taken per micro-batch "
                       f"({micro_batches} per step), so training differs from a single device normalising the "
                       f"whole batch; plan with num_micro_batch=1 for exact statistics")
    return out


def log_batchnorm_warnings(plan: PlanRecord) -> None:
    for line in batchnorm_warnings(plan):
        log.warning("%s", line)
