"""Training configuration that the planner and runtime share (typed, validated at construction).

Each field carries its :class:`whalelike.spec.Rule`; ``__post_init__`` checks them and the one
cross-field rule (a micro-batch needs a sample), and :func:`whalelike.spec.validate` runs the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from whalelike.errors import SpecError
from whalelike.spec import check_fields, rule

# The names a Config (and a Plan) may use, listed here once: whalelike/ imports nothing of planner/, so
# the planner takes its lists from here (planner.schedule.actions.SCHEDULES builds each schedule,
# planner.resharding.cost.STRATEGIES prices each strategy) and the CLI offers them.
Schedule = Literal["gpipe", "1f1b", "eager-1f1b", "zb-h1"]
Optimizer = Literal["sgd", "sgd_momentum", "adam", "adamw"]
SCHEDULES = get_args(Schedule)   # what a Plan runs (planner.schedule.actions builds each)
# Config.schedule "auto": the planner plans AUTO_SCHEDULES and keeps the fastest predicted that fits
# (planner.candidates.fastest_schedule); a Plan always names one schedule of SCHEDULES
AUTO_SCHEDULE = "auto"
AUTO_SCHEDULES = ("1f1b", "zb-h1")
SCHEDULE_CHOICES = (*SCHEDULES, AUTO_SCHEDULE)
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
RESHARDING_STRATEGIES = ("broadcast", "allgather", "send_recv")
RESHARDING = ("auto", *RESHARDING_STRATEGIES)   # "auto": the planner's fastest per boundary
# how a data-parallel group keeps its replicas in step (StagePlan.replica_sync; runtime.replicas.replica_sync
# builds each): "ddp" (ZeRO stage 0: every rank holds everything), "fsdp" (ZeRO stages 1-3 on torch's FSDP2,
# StagePlan.zero_stage says which), "ragged" (ZeRO stages 1-3 with memory-proportional shards,
# StagePlan.state_fractions), "partial" (Prague's P-Reduce: each replica steps on its own gradient, then
# averages its parameters with a small group; approximate, runtime.replicas.partial_sync)
REPLICA_SYNCS = ("ddp", "fsdp", "ragged", "partial")
# what a user asks of a data-parallel region (Config.dp_sync, replicate(n, sync=...), whalelike plan
# --dp-sync): "exact" (the gradient of the global-batch mean loss: ddp, fsdp or ragged, as the planner
# decides) or "partial" (P-Reduce, StagePlan.replica_sync "partial")
DP_SYNCS = ("exact", "partial")
# who forms P-Reduce's groups (StagePlan.partial_generator, runtime.replicas.group_generator): "static" (a
# fixed conflict-free schedule, alternating inter- and intra-host groups) or "smart" (randomized group
# divisions with Prague's threshold rule, served from the rendezvous store)
GROUP_GENERATORS = ("static", "smart")
ZERO_STAGES = (0, 1, 2, 3)   # StagePlan.zero_stage: 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters sharded
# training precision (runtime.training.precision runs it; planner.devices.cost_model prices it): float32, or
# autocast to bfloat16 / float16 with float32 master weights and optimizer state (fp16 with a loss scaler)
PRECISIONS = ("fp32", "bf16", "fp16")
# Config.memory_reserve: the default covers the memory model's measured misses (planner.devices.memory, "Reserve")
DEFAULT_MEMORY_RESERVE = 0.10
MAX_MEMORY_RESERVE = 0.9   # a plan that may fill a tenth of each device is already a mistake, not a reserve


@dataclass(frozen=True)
class Config:
    """What one optimizer step looks like.

    global_batch_size: samples per optimizer step, summed over every device.
    num_micro_batch:   micro-batches per step: pipeline depth for several TaskGraphs, gradient
                       accumulation for one.
    schedule:          pipeline schedule, ``"gpipe"``, ``"1f1b"`` (the default), ``"eager-1f1b"`` (1F1B with
                       more warm-up forwards so transfers overlap compute; more activations in flight),
                       ``"zb-h1"`` (zero-bubble H1: each backward split into its input-gradient half, sent
                       upstream at once, and its weight-gradient half, deferred into the bubbles; at most
                       1F1B's largest in-flight count on every stage; ``planner.schedule.actions``), or
                       ``"auto"``: the planner plans ``1f1b`` and ``zb-h1`` and keeps the faster predicted
                       that fits (``Plan.schedule_steps_ms`` records both). A named schedule is pinned: the
                       planner never swaps it. Not the default, as planning twice doubles the planning time.
    optimizer:         optimizer whose state the memory model counts.
    sync_batchnorm:    BatchNorm in training mode takes its batch statistics over each stage's
                       data-parallel group instead of each worker's own samples (the default, as
                       DDP does); exact against one device when ``num_micro_batch == 1``
                       (``runtime.parallel.sync_batchnorm``).
    resharding:        how values cross stage boundaries (``runtime.parallel.boundaries``): ``"auto"`` (the
                       planner's fastest per boundary), or always ``"broadcast"``, ``"allgather"`` or
                       ``"send_recv"`` (the cross-mesh resharding strategies).
    delay_weight_gradients: each backward computes its input gradients, sends them, and only then
                       its weight gradients, so the send overlaps compute (``runtime.parallel.split_backward``).
    precision:         ``"fp32"``, or ``"bf16"``/``"fp16"``: autocast with float32 master weights and
                       optimizer state; the planner prices each device at its rate for it and refuses a
                       device that cannot run it (``planner.devices.cost_model``).
    zero_stage:        None (the planner chooses each stage's ZeRO stage: the lowest that fits, Poplar's
                       escalation), or 0-3, fixed for every stage whose data-parallel group has more than
                       one worker (a region's ``replicate(n, zero=k)`` fixes its own stages instead);
                       0 DDP, 1 optimizer state, 2 and gradients, 3 and parameters sharded
                       (``StagePlan.zero_stage``, ``planner.devices.memory``).
    ragged_shards:     True (the default): at ZeRO stages 1-3 of a single-stage plan without ``split``,
                       the planner may give each data-parallel worker its own fraction of the sharded
                       state, in proportion to the memory it has left (Cephalo; ``StagePlan.replica_sync``
                       ``"ragged"``, ``planner.shares.state_fractions``) where FSDP2's even shards do not
                       fit; False: even shards only (``whalelike plan --even-shards``, for comparisons).
    dp_sync:           ``"exact"`` (the default: replicas sum gradients, exact against one device) or
                       ``"partial"``: every data-parallel stage of more than one worker without ``split``
                       runs Prague's partial all-reduce (P-Reduce, ``StagePlan.replica_sync`` ``"partial"``,
                       ``runtime.replicas.partial_sync``): each worker steps on its own gradient, then
                       averages its parameters with a group of ``partial_group_size`` workers that a
                       ``partial_generator`` (``"smart"`` or ``"static"``) forms; APPROXIMATE (not the
                       synchronous SGD of one device). A region's ``replicate(n, sync=...)`` overrides it.
    partial_generator, partial_group_size, partial_delta_c: P-Reduce's group generator, its groups'
                       size (at most the stage's data-parallel workers) and the smart generator's threshold
                       Δc (a worker ``w`` joins requester ``i``'s group only if ``c_w > c_i - Δc``, ``c``
                       counting each worker's requests; ``runtime.replicas.group_generator``).
    fold_stages:       False (the default): one pipeline stage per region, as annotated. True: the planner
                       also plans layouts with fewer stages, adjacent plain ``replicate`` regions of
                       automatic device count and equal options folded into one data-parallel stage on
                       the union of their devices (``StagePlan.folded``), and keeps the fastest predicted
                       that fits (``planner.candidates``; ``Plan.candidates`` lists the best fold). Off by
                       default: separate regions usually mean a pipeline on purpose, and each fold is a
                       plan to make and simulate.
    memory_reserve:    the fraction of every device's memory a plan leaves free (default
                       :data:`DEFAULT_MEMORY_RESERVE`): the planner fits each worker's predicted peak into
                       the rest (``Worker.capacity_gib``, ``Plan.memory_reserve``), so that what the memory
                       model misses (``planner.devices.memory``, "Reserve") does not run a device out of
                       memory. 0 plans to the last byte.
    """

    global_batch_size: int = rule(int, gt=0, says="a positive integer")
    num_micro_batch: int = rule(int, gt=0, says="a positive integer", default=1)
    schedule: str = rule(str, choices=SCHEDULE_CHOICES, says=f"one of {', '.join(SCHEDULE_CHOICES)}", default="1f1b")
    optimizer: str = rule(str, choices=OPTIMIZERS, says=f"one of {', '.join(OPTIMIZERS)}", default="adamw")
    sync_batchnorm: bool = rule(bool, default=False)
    resharding: str = rule(str, choices=RESHARDING, says=f"one of {', '.join(RESHARDING)}", default="auto")
    delay_weight_gradients: bool = rule(bool, default=False)
    precision: str = rule(str, choices=PRECISIONS, says=f"one of {', '.join(PRECISIONS)}", default="fp32")
    zero_stage: Optional[int] = rule(int, choices=ZERO_STAGES, default=None,
                                     says="None (the planner chooses) or one of 0, 1, 2, 3 (the ZeRO stage of "
                                          "every data-parallel stage)")
    ragged_shards: bool = rule(bool, default=True)
    dp_sync: str = rule(str, choices=DP_SYNCS, says=f"one of {', '.join(DP_SYNCS)}", default="exact")
    partial_generator: str = rule(str, choices=GROUP_GENERATORS, says=f"one of {', '.join(GROUP_GENERATORS)}",
                                  default="smart")
    partial_group_size: int = rule(int, ge=2, says="an integer >= 2 (workers per P-Reduce group)", default=2)
    partial_delta_c: int = rule(int, ge=1, says="an integer >= 1 (Prague's threshold: how many requests a worker "
                                "may lag the requester and still join its group)", default=2)
    fold_stages: bool = rule(bool, default=False)
    memory_reserve: float = rule(float, ge=0, le=MAX_MEMORY_RESERVE,
                                 says=f"a fraction in [0, {MAX_MEMORY_RESERVE:g}] of each device's memory kept free, "
                                      "e.g. 0.1", default=DEFAULT_MEMORY_RESERVE)

    # whalelike.spec.validate: the fields are checked when built, then the cross-field rule
    spec_checks = {"self": lambda config: _check_config(config)}

    def __post_init__(self):
        check_fields(self, "Config.")
        _check_config(self)


def _check_config(config: Config) -> None:
    if config.dp_sync == "partial" and config.zero_stage:
        raise SpecError(
            f"Config.dp_sync is 'partial' with zero_stage {config.zero_stage}: P-Reduce averages whole parameters, "
            "which ZeRO stages 1-3 shard; use zero_stage 0 or None with dp_sync 'partial', or dp_sync 'exact'"
        )
    if config.num_micro_batch > config.global_batch_size:
        raise SpecError(
            f"Config.num_micro_batch ({config.num_micro_batch}) exceeds global_batch_size "
            f"({config.global_batch_size}): every micro-batch needs at least one sample"
        )
