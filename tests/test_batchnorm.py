"""BatchNorm under ``replicate``: the plan-time warning, and synchronised statistics exact against
a single-process reference (``runtime.parallel.sync_batchnorm``).

In-process: capture records the BatchNorms a layer runs in training mode (fx leaves and the
``aten.batch_norm`` of an export capture), the plan keeps them per stage, and ``Plan.summary()``
and the log warn that per-worker statistics differ from single-device training unless
``sync_batchnorm`` is set; the flag survives YAML, and a plan file without it still loads.

One 4-rank gloo spawn, float64, one micro-batch per step, 3 steps of SGD (momentum) and AdamW from
the same weights on the same batches as the reference; losses, parameters and the running
statistics (the full state dict) are compared, and an evaluation with those statistics:

* a small CNN with ``BatchNorm2d`` in two pipeline stages of two workers each (shares 11:5 on one);
* Hugging Face's ``ResNetForImageClassification`` (captured with ``torch.export``, its BatchNorms
  inlined as ``aten.batch_norm``), stage 0 on three workers with shares 7:6:3;
* the CNN as one data-parallel stage on four workers with shares 6:5:3:2 (BatchNorm modules of the
  user's model swapped);
* ``sync_batch_norm`` itself with per-rank batches of 5, 3, 0 and 2 samples against ``F.batch_norm``
  on all 10: output, input and parameter gradients, running statistics.

The spawn's warm-up (dist_utils' ``warm``) captures both models once on their first batch, with their
pipelines' fake node values, so every rank's Engine captures, and its pipeline's first-step fake
runs, are cache hits.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import planner
import whalelike as wl
from dist_utils import run_ranks
from planner.plan import Plan
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from whalelike.cluster import Cluster
from whalelike.graphs.taskgraph import TaskGraphs

GLOBAL_BATCH, STEPS, CLASSES = 16, 3, 10
RESNET = "resnet"


class BNNet(nn.Module):
    """Conv, BatchNorm, ReLU twice, then a linear head; two ``replicate`` scopes."""

    def __init__(self):
        super().__init__()
        with wl.replicate(2):
            self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        with wl.replicate(2):
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=0.3)
            self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def _logits_loss(outputs, targets):
    return F.cross_entropy(outputs["logits"], targets)


def _workload(name: str):
    """(model, loss_fn, image size) in float64."""
    torch.manual_seed(0)
    if name == RESNET:
        from transformers import ResNetConfig, ResNetForImageClassification

        model = ResNetForImageClassification(ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                          num_labels=CLASSES))
        wl.annotate(model, {"resnet.encoder.stages.0": wl.replicate(), "resnet.encoder.stages.1": wl.replicate()})
        return model.double(), _logits_loss, 32
    return BNNet().double(), F.cross_entropy, 8


def _batches(size: int, n: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(n, 3, size, size, generator=g, dtype=torch.float64) * 2 + 0.5,),
             torch.randint(0, CLASSES, (n,), generator=g)) for _ in range(STEPS)]


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


@functools.lru_cache(maxsize=None)
def _captured(name: str) -> tuple[nn.Module, TaskGraphs]:
    """The model (training mode) and its capture, once per test process."""
    model, _, size = _workload(name)
    return model, wl.capture(model, _batches(size, 4)[0][0])


def _plan(name: str, sync: bool, num_micro_batch: int = 1) -> Plan:
    _, graphs = _captured(name)
    return planner.plan(graphs, _cluster(), wl.Config(global_batch_size=GLOBAL_BATCH, num_micro_batch=num_micro_batch,
                                                      sync_batchnorm=sync))


# -- in-process: capture, plan, warning ------------------------------------------------------------
def test_capture_records_training_batchnorms_per_layer():
    _, graphs = _captured("cnn")
    assert {layer.name: layer.batchnorm for layer in graphs.layers if layer.batchnorm} == {"bn1": ("bn1",),
                                                                                            "bn2": ("bn2",)}
    model, _, size = _workload("cnn")
    model.eval()
    assert not any(layer.batchnorm for layer in wl.capture(model, _batches(size, 4)[0][0]).layers)
    model, graphs = _captured(RESNET)
    assert graphs.method == "export"
    recorded = [path for layer in graphs.layers for path in layer.batchnorm]
    expected = [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert sorted(recorded) == sorted(expected) and len(expected) == 8


def test_batchnorm_warning_text(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="planner.shares.batchnorm_statistics"):
        plan = _plan("cnn", sync=False)
    [first, second] = [s for s in plan.stages]
    assert first.batchnorm == ["bn1"] and second.batchnorm == ["bn2"]
    expected = ("stage 0 runs BatchNorm in training mode (bn1) on 2 data-parallel workers: each normalises with "
                "the statistics of its own samples (as DDP does), so training differs from a single device; plan "
                "with wl.Config(sync_batchnorm=True) (whalelike plan --sync-batchnorm) to synchronise the statistics "
                "over the stage's workers")
    assert f"warning: {expected}" in plan.summary().splitlines()
    assert expected in caplog.messages and len(caplog.messages) == 2

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="planner.shares.batchnorm_statistics"):
        synced = _plan("cnn", sync=True)
    assert synced.sync_batchnorm and not caplog.messages and "warning" not in synced.summary()
    micro = _plan("cnn", sync=True, num_micro_batch=2)
    assert ("warning: stage 0 runs BatchNorm in training mode (bn1) with statistics synchronised over 2 workers but "
            "taken per micro-batch (2 per step)") in micro.summary()

    # the flag and the stages' BatchNorms survive YAML; a plan written before them still loads
    synced.to_yaml(tmp_path / "plan.yaml")
    assert Plan.from_yaml(tmp_path / "plan.yaml") == synced
    old = synced.to_dict()
    del old["sync_batchnorm"]
    for stage in old["stages"]:
        del stage["batchnorm"]
    loaded = Plan.from_dict(old)
    assert not loaded.sync_batchnorm and loaded.stages[0].batchnorm == []
    with pytest.raises(wl.SpecError, match=r"plan.sync_batchnorm must be true or false \(.*\), got 'yes'"):
        Plan.from_dict({**synced.to_dict(), "sync_batchnorm": "yes"})
    with pytest.raises(wl.SpecError, match=r"Config.sync_batchnorm must be True or False, got 1"):
        wl.Config(global_batch_size=4, sync_batchnorm=1)


# -- 4 ranks ----------------------------------------------------------------------------------------
def _check_sync_function(rank: int) -> None:
    """sync_batch_norm on uneven per-rank batches (one empty) equals F.batch_norm on their union, called
    directly and as the ``aten.batch_norm`` of an exported BatchNorm1d that synchronise_batchnorm swapped."""
    from runtime.parallel.sync_batchnorm import BatchNormOp, sync_batch_norm, synchronise_batchnorm

    sizes = [5, 3, 0, 2]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(sizes), 4, 3, generator=g, dtype=torch.float64) * 3 + 1
    dy = torch.randn(sum(sizes), 4, 3, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    lo = sum(sizes[:rank])
    mine = slice(lo, lo + sizes[rank])

    def function(inputs):
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        mean, var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        return sync_batch_norm(inputs, w, b, mean, var, 0.2, 1e-5, None), w, b, mean, var

    bn = nn.BatchNorm1d(4, momentum=0.2).double()
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    exported = torch.export.export(bn, (x[:2],), dynamic_shapes=({0: torch.export.Dim("batch", min=0)},)).module()
    assert len(synchronise_batchnorm(exported, None)) == 1
    [op] = [m for m in exported.modules() if isinstance(m, BatchNormOp)]

    def graph(inputs):
        return exported(inputs), bn.weight, bn.bias, bn.running_mean, bn.running_var

    x_ref = x.clone().requires_grad_()
    w_ref, b_ref = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    mean_ref, var_ref = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    y_ref = F.batch_norm(x_ref, mean_ref, var_ref, w_ref, b_ref, True, 0.2, 1e-5)
    (y_ref * dy).sum().backward()
    for label, normalise in (("function", function), ("exported", graph)):
        xs = x[mine].clone().requires_grad_()
        y, w, b, mean, var = normalise(xs)
        (y * dy[mine]).sum().backward()
        assert_close(y, y_ref[mine], msg=f"{label}: output")
        assert_close(xs.grad, x_ref.grad[mine], msg=f"{label}: input gradient")
        for local, reference in ((w.grad, w_ref.grad), (b.grad, b_ref.grad)):
            dist.all_reduce(local)   # the parameter gradients are local sums (DDP sums them)
            assert_close(local, reference, msg=f"{label}: parameter gradient")
        assert_close(mean, mean_ref, msg=f"{label}: running mean")
        assert_close(var, var_ref, msg=f"{label}: running variance")
    op.eval()   # the swapped operator follows its module's mode: running statistics, no sync
    with torch.no_grad():
        assert_close(exported(x[:3]), F.batch_norm(x[:3], mean_ref, var_ref, weight, bias, False, 0.2, 1e-5))


def _ranks(rank: int, world_size: int, plans: dict[str, Plan]) -> dict:
    seen = {}
    for label, plan in plans.items():
        name = label.split("/")[0]
        model, loss_fn, size = _workload(name)
        data = _batches(size)
        for opt, make_opt in OPTIMIZERS.items():
            where = f"{label}/{opt}"
            # the final state includes running_mean/var and num_batches_tracked
            engine, got, final = assert_engine_trains_like_reference(model, plan, data, make_opt, loss_fn, _cluster(),
                                                                     where)
            trained = copy.deepcopy(model)
            trained.load_state_dict(final)
            inputs, targets = data[0]
            with torch.no_grad():   # evaluation normalises with the running statistics
                assert_close(engine.eval_step(data[0]), loss_fn(trained.eval()(*inputs), targets),
                             msg=lambda m: f"{where}: eval_step: {m}")
            seen[where] = [float(v) for v in got]
    _check_sync_function(rank)   # the Engines initialised the default process group
    return seen


def _warm() -> None:
    """Each model's capture on its first training batch, once, before the ranks fork (dist_utils'
    ``warm``): every Engine's capture in the ranks is then a cache hit, and so are its pipeline's fake
    node values (``reference.warm_capture``)."""
    for name in ("cnn", RESNET):
        model, _, size = _workload(name)
        warm_capture(model, _batches(size)[0][0])


def _fractions(n: int) -> list[float]:
    """Uneven state fractions 1:2:...:n, for ragged shards."""
    return [(i + 1) / (n * (n + 1) / 2) for i in range(n)]


def test_synchronised_batchnorm_matches_single_process_reference():
    plans = {"cnn/pipeline": _plan("cnn", sync=True), f"{RESNET}/pipeline": _plan(RESNET, sync=True)}
    # the CNN is so small that the planner keeps the capacity-blind plan (even shares, predicted faster);
    # stage 1's shares are made uneven (11:5) here, since uneven shares are what the statistics must survive
    cnn = plans["cnn/pipeline"]
    shares = iter((11, 5))
    plans["cnn/pipeline"] = dataclasses.replace(cnn, workers=[
        dataclasses.replace(w, micro_batch_sizes=[next(shares)]) if w.stage == 1 else w for w in cnn.workers])
    assert sorted(w.batch_share for w in plans["cnn/pipeline"].workers if w.stage == 1) == [5, 11]
    assert len(plans[f"{RESNET}/pipeline"].stage_workers(0)) == 3
    # the CNN as one data-parallel stage on all four devices, uneven shares
    pipeline = plans["cnn/pipeline"]
    layers = [i for s in pipeline.stages for i in s.layers]
    single = dataclasses.replace(
        pipeline, stages=[dataclasses.replace(pipeline.stages[0], layers=layers, taskgraphs=[0, 1],
                                              batchnorm=["bn1", "bn2"], strategy="replicate(4)")],
        workers=[dataclasses.replace(w, stage=0, dp_index=w.rank, micro_batch_sizes=[n])
                 for w, n in zip(pipeline.workers, (6, 5, 3, 2))], boundaries=[])
    plans["cnn/data-parallel"] = single
    # under ZeRO (runtime.replicas): FSDP2's ZeRO 3 on the data-parallel stage, ragged ZeRO 2 in the pipeline
    plans["cnn/data-parallel-zero3"] = dataclasses.replace(
        single, stages=[dataclasses.replace(single.stages[0], replica_sync="fsdp", zero_stage=3)])
    plans["cnn/pipeline-ragged-zero2"] = dataclasses.replace(pipeline, stages=[
        dataclasses.replace(st, replica_sync="ragged", zero_stage=2,
                            state_fractions=_fractions(len(pipeline.stage_workers(st.index))))
        for st in pipeline.stages])
    results = run_ranks(_ranks, 4, args=(plans,), init_process_group=False, timeout_s=400, warm=_warm)
    for label, losses in results[0].items():
        assert len(losses) == STEPS and all(r[label] == losses for r in results), label
