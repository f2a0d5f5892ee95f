"""State the captured forward never reads is still the model's: held, trained around, saved and loaded.

A parameter a model's forward uses only for some inputs (DINOv2's ``mask_token``, read only when
masked positions are passed) or never (a head left for later), and a persistent buffer nothing
reads, are in no captured node. Capture gives each to one layer (``Layer.idle_state``); the rank
holding that layer keeps it, no replica sync reduces it (DDP would wait for its gradient forever),
and ``engine.state_dict()`` and checkpoints carry it under the model's name.

One 4-rank spawn, float64, against the single-process reference (same weights, same batches,
losses and every entry of the full state dict, whose keys must be the model's own):

* ``Dinov2ForImageClassification`` (``transformers``) as a two-stage pipeline and as one
  data-parallel region (DDP);
* a hand model with an unused parameter at its root, an unused head module and an unused
  persistent buffer, at ZeRO 3 on FSDP2 and ragged ZeRO 2 in one data-parallel stage, and as a
  pipeline whose first stage runs ZeRO 1;
* a checkpoint of the DINOv2 pipeline, loaded by the data-parallel plan: ``mask_token`` comes back.

The warm-up (``run_ranks(warm=)``) captures each model once for all four ranks, and the pipelines'
fake node values (their first step's fake runs of the whole graph) with them. Plus, in one process: capture names the idle state and counts its parameter bytes with the layer
that holds it.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import planner
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from runtime import Engine, checkpoint
from whalelike.cluster import Cluster

BATCH, STEPS = 16, 2


def _dinov2(layout: str) -> nn.Module:
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(0)
    model = Dinov2ForImageClassification(Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
        patch_size=8, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if layout == "pipeline":
        wl.annotate(model, {"dinov2.encoder.layer.0": wl.replicate(2), "dinov2.encoder.layer.1": wl.replicate(2)})
    else:
        region = wl.replicate()
        wl.annotate(model, {"dinov2": region, "classifier": region})
    return model.double()


class Idle(nn.Module):
    """Two blocks and a classifier; ``spare`` (a root parameter), ``later`` (a head) and ``seen`` (a
    persistent buffer) are never read by ``forward``."""

    def __init__(self, layout: str):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        if layout == "pipeline":
            wl.annotate(self, {"a": wl.replicate(2), "b": wl.replicate(2)})
        else:
            region = wl.replicate()
            wl.annotate(self, {"a": region, "b": region, "head": region})
        self.later = nn.Linear(16, 3)
        self.spare = nn.Parameter(torch.randn(5, 2))
        self.register_buffer("seen", torch.arange(6.0))

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _idle(layout: str) -> nn.Module:
    torch.manual_seed(0)
    return Idle(layout).double()


def _logits_loss(out, targets):
    return F.cross_entropy(out.logits, targets)


MODELS = {   # name -> (model factory, loss, input shape)
    "dinov2": (_dinov2, _logits_loss, (3, 16, 16)),
    "idle": (_idle, F.cross_entropy, (8,)),
}
CASES = {    # case -> (model, layout, ZeRO stage, ragged fractions)
    "dinov2-pipeline": ("dinov2", "pipeline", None, None),
    "dinov2-ddp": ("dinov2", "whole", None, None),
    "idle-zero3": ("idle", "whole", 3, None),
    "idle-ragged2": ("idle", "whole", 2, [0.4, 0.3, 0.2, 0.1]),
    "idle-pipeline-zero1": ("idle", "pipeline", 1, None),
}


def _batches(name: str) -> list[tuple[tuple, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shape = MODELS[name][2]
    return [((torch.randn(BATCH, *shape, generator=gen, dtype=torch.float64),), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(STEPS)]


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def _plan(case: str):
    name, layout, zero, fractions = CASES[case]
    model = MODELS[name][0](layout)
    graphs = wl.capture(model, _batches(name)[0][0])
    plan = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=BATCH, num_micro_batch=2, zero_stage=zero))
    assert len(plan.stages) == (2 if layout == "pipeline" else 1), (case, plan.stages)
    if fractions is not None:
        plan.stages[0] = dataclasses.replace(plan.stages[0], replica_sync="ragged", state_fractions=fractions)
    return plan


def _ranks(rank: int, world_size: int, plans: dict, directory: str) -> dict:
    out = {}
    for case, plan in plans.items():
        name, layout, _, _ = CASES[case]
        factory, loss_fn, _ = MODELS[name]
        engine, got, final = assert_engine_trains_like_reference(factory(layout), plan, _batches(name),
                                                                 OPTIMIZERS["adamw"], loss_fn, _cluster(), case)
        out[case] = [float(v) for v in got]
        if case == "dinov2-pipeline":
            checkpoint.save(engine, directory)
            saved = final
    # the pipeline's checkpoint, loaded by the data-parallel plan onto other initial weights
    torch.manual_seed(5)
    other = _dinov2("whole")
    with torch.no_grad():
        other.dinov2.embeddings.mask_token.fill_(7.0)
    engine = Engine(copy.deepcopy(other), plans["dinov2-ddp"], optimizer=OPTIMIZERS["adamw"], loss_fn=_logits_loss,
                    cluster=_cluster(), timeout_s=120, example_args=_batches("dinov2")[0][0])
    checkpoint.load(engine, checkpoint.latest(directory))
    loaded = engine.state_dict()
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert_close(loaded[key], value, msg=lambda m: f"checkpoint: {key}: {m}")
    return out


def _warm() -> None:
    """Each model traced once before the ranks fork (dist_utils' ``warm``): their captures are cache hits,
    and so are the pipelines' fake node values (``reference.warm_capture``)."""
    for name, layout in sorted({CASES[case][:2] for case in CASES}):
        (warm_capture if layout == "pipeline" else wl.capture)(MODELS[name][0](layout), _batches(name)[0][0])


def test_state_the_forward_never_reads_is_held_trained_around_and_saved(tmp_path):
    plans = {case: _plan(case) for case in CASES}
    results = run_ranks(_ranks, 4, args=(plans, str(tmp_path / "ckpt")), init_process_group=False, timeout_s=600,
                        warm=_warm)
    for case in CASES:
        assert all(r[case] == results[0][case] for r in results), case


def test_capture_gives_idle_state_to_the_layer_that_holds_it():
    graphs = wl.capture(_idle("whole"), _batches("idle")[0][0])
    idle = {layer.name: layer.idle_state for layer in graphs.layers if layer.idle_state}
    assert sorted(n for names in idle.values() for n in names) == ["later.bias", "later.weight", "seen", "spare"]
    model = _idle("whole")
    held = sum(p.numel() for p in model.parameters())
    assert sum(layer.param_count for layer in graphs.layers) == held      # every parameter counted once
    dino = wl.capture(_dinov2("pipeline"), _batches("dinov2")[0][0])
    owner = next(layer for layer in dino.layers if "dinov2.embeddings.mask_token" in layer.idle_state)
    assert owner.name == "dinov2" and owner.index == 0, owner.name
    assert wl.TaskGraphs.from_dict(dino.to_dict()).layers[owner.index].idle_state == owner.idle_state
