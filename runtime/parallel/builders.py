"""The executor builders by plan kind: which :class:`runtime.parallel.executor.StepExecutor` runs a
plan, made from an :class:`runtime.parallel.executor.ExecutorContext`.

=====================  =========================================  ==================================
``Plan.kind``          executor                                   module
=====================  =========================================  ==================================
``data_parallel``      :class:`DataParallelExecutor`              :mod:`runtime.parallel.data_parallel`
``pipeline``           :class:`PipelineExecutor`                  :mod:`runtime.parallel.pipeline`
``tensor_parallel``    ``PipelineExecutor`` with sharded stages   :mod:`runtime.tensor.shard_pass`
=====================  =========================================  ==================================

A plan with ``split`` runs as a pipeline (of one stage or more) whose tensor-parallel stages have
their Linears swapped for uneven parallel ones. :func:`register_executor` adds or replaces the
builder of a kind; a builder must return a ``StepExecutor``.

Invariant: every rank builds its executor with the builder registered for the plan's kind, so every
rank of a plan runs the same kind of executor.
"""
from __future__ import annotations

from typing import Callable

from runtime.parallel.executor import ExecutorContext, StepExecutor
from whalelike.errors import WhaleError

KINDS = ("data_parallel", "pipeline", "tensor_parallel")


def stage_memory_bytes(ctx: ExecutorContext) -> list[tuple[float, float]]:
    """Per stage of ``ctx.plan``: (forward, backward) non-matmul bytes per sample, which the
    emulator prices at the device's memory bandwidth
    (:func:`runtime.parallel.stage_split.stage_memory_bytes_from_plan`). At bf16/fp16 on a device
    whose bandwidth is emulated, the bytes measured under autocast (the capture's graph run again
    on fake tensors once, :func:`whalelike.graphs.capture.with_autocast`); elsewhere no bytes are
    priced and the float32 figures serve."""
    from runtime.parallel.stage_split import stage_memory_bytes_from_plan
    from whalelike.graphs.capture import with_autocast

    graphs = ctx.graphs
    if ctx.precision != "fp32" and ctx.emulator.enabled and ctx.emulator.memory_gbps is not None:
        graphs = with_autocast(graphs)
    return stage_memory_bytes_from_plan(graphs, ctx.plan, ctx.precision)


def _data_parallel(ctx: ExecutorContext) -> StepExecutor:
    from planner.devices.cost_model import fsdp_unit_names
    from runtime.parallel.data_parallel import DataParallelExecutor

    flops = (sum(g.forward_flops for g in ctx.graphs), sum(g.backward_flops for g in ctx.graphs))
    idle = [n for layer in ctx.graphs.layers for n in layer.idle_state]
    return DataParallelExecutor(ctx.model, ctx.plan, ctx.rank, ctx.groups.dp, ctx.loss_fn, ctx.emulator, flops,
                                recompute_layers=[layer.name for layer in ctx.graphs.layers],
                                zero_layers=fsdp_unit_names(ctx.graphs.layers), idle=idle,
                                memory_bytes_per_sample=stage_memory_bytes(ctx)[0],
                                scaler=ctx.scaler, reduce_dtype=ctx.reduce_dtype, device=ctx.device)


def _pipeline(ctx: ExecutorContext) -> StepExecutor:
    from planner.devices.network import NetworkModel
    from runtime.parallel.pipeline import PipelineExecutor, idle_state_of
    from runtime.parallel.stage_split import node_stages_from_plan, stage_flops_from_plan
    from runtime.tensor.shard_pass import StageSharding

    return PipelineExecutor(ctx.graphs.graph_module, node_stages_from_plan(ctx.graphs, ctx.plan), ctx.plan,
                            ctx.loss_fn, emulator=ctx.emulator, stage_flops=stage_flops_from_plan(ctx.graphs, ctx.plan),
                            stage_memory_bytes=stage_memory_bytes(ctx),
                            dp_group=ctx.groups.dp.group, sharding=StageSharding.from_graphs(ctx.graphs, ctx.groups.tp.group),
                            network=NetworkModel.of_cluster(ctx.cluster) if ctx.cluster is not None else None,
                            scaler=ctx.scaler, reduce_dtype=ctx.reduce_dtype, device=ctx.device,
                            idle_state=idle_state_of(ctx.graphs, ctx.plan, ctx.model))


_BUILDERS: dict[str, Callable[[ExecutorContext], StepExecutor]] = {
    "data_parallel": _data_parallel,
    "pipeline": _pipeline,
    "tensor_parallel": _pipeline,
}


def register_executor(kind: str, builder: Callable[[ExecutorContext], StepExecutor]) -> Callable:
    """Make ``builder`` the executor of plans of ``kind`` (:attr:`planner.plan.Plan.kind`); returns the
    builder it replaces (to put it back)."""
    if kind not in KINDS:
        raise WhaleError(f"register_executor: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    previous = _BUILDERS[kind]
    _BUILDERS[kind] = builder
    return previous


def builder_of(kind: str) -> Callable[[ExecutorContext], StepExecutor]:
    """The builder registered for plans of ``kind``."""
    if kind not in _BUILDERS:
        raise WhaleError(f"no step executor for {kind.replace('_', ' ')} plans is registered "
                         f"(runtime.parallel.executor.register_executor); the kinds are {', '.join(KINDS)}")
    return _BUILDERS[kind]


def build_executor(ctx: ExecutorContext) -> StepExecutor:
    """This rank's executor for ``ctx.plan``, made by the builder of its kind; collective."""
    executor = builder_of(ctx.plan.kind)(ctx)
    if not isinstance(executor, StepExecutor):
        raise WhaleError(f"the executor builder for {ctx.plan.kind} plans returned a {type(executor).__name__}; "
                         "a builder must return a runtime.parallel.executor.StepExecutor (subclass it)")
    return executor
