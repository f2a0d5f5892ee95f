"""Expert parallelism (issue 21 item 5): mixture-of-experts layers under ``split`` hold each rank's
own experts, as many as its speed earns, exact against a single process.

Three ``transformers``-style cases, planned by ``planner.plan`` onto ``emulated-4`` (speeds 1, 1,
0.5, 0.25; emulation off, so the run is quick) from the float32 model, trained on 4 gloo ranks in
float64 (one spawn) and compared with the single-process reference (losses of every step, every
final parameter; AdamW for the pipeline, SGD with momentum, whose updates scale with the gradient,
for the other two):

* **Mixtral in a pipeline**: two sparse-MoE decoder layers (6 experts, top-2, grouped-query
  attention), each under its own ``split(2)``: two pipeline stages of two ranks, two micro-batches.
  The planner puts layer 0 on the 0.5 and 0.25 devices and gives them 4 and 2 experts, layer 1's
  two full-speed devices 3 each; attention is cut by heads as before.
* **OLMoE with its router's auxiliary loss**: layer 1 (8 experts, top-2) under ``split(4)``, the
  loss the model's cross-entropy plus ``router_aux_loss_coef`` times its load-balancing loss
  (computed from every layer's router logits, which every rank of the group computes whole):
  3, 3, 1 and 1 experts.
* **A hand-written MoE** whose experts are a 3-D parameter but not a ``transformers`` experts
  class: capture names it and why in one warning line, the runtime logs it too, and it runs whole
  on every rank of its ``split(4)`` group (exact, nothing sharded but its MLP).

Each rank reports which experts its stage holds (the :class:`ExpertParallel` range and the rows of
each stacked weight it keeps); the test checks them against the plan's ``shard_sizes`` and that
the faster device of a group holds more. The models use the ``batched_mm`` experts implementation:
``grouped_mm``'s CPU kernel refuses float64, the dtype the comparison runs in (the runtime replaces
the experts' operators by its own either way). A warm-up (``run_ranks(warm=)``) captures each
float64 model once for all 4 ranks before they fork, so every rank's captures are capture-cache hits,
and works out the pipeline's fake node values (its first step's fake runs of the whole graph) once.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import planner
import whalelike as wl
from planner.devices.cost_model import device_tflops
from dist_utils import LogLines, run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference, case_batches, case_model, warm_capture
from runtime import Engine, checkpoint
from runtime.tensor.experts import ExpertParallel
from torch.testing import assert_close
from whalelike.cluster import Cluster

pytest.importorskip("transformers")  # a pinned test dependency (pyproject [dev]); never skipped in CI

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, vocab_size=VOCAB,
                           max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, experts_implementation="batched_mm")
    model = MixtralForCausalLM(config)
    wl.annotate(model, {"model.layers.0": wl.split(2), "model.layers.1": wl.split(2)})
    return model


def olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM
    config = OlmoeConfig(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=VOCAB,
                         max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         experts_implementation="batched_mm", output_router_logits=True, router_aux_loss_coef=0.5)
    model = OlmoeForCausalLM(config)
    wl.annotate(model, {"model.layers.1": wl.split(4)})
    return model


class DenseExperts(nn.Module):
    """Experts as one 3-D parameter, every expert run on every token, weighted by the top-k mask:
    a layout the expert-parallel pass does not know."""

    def __init__(self, d: int, experts: int, hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, hidden, d) * 0.3)
        self.w_out = nn.Parameter(torch.randn(experts, d, hidden) * 0.3)

    def forward(self, x, index, weights):
        mask = torch.zeros(x.shape[0], self.w_in.shape[0], dtype=x.dtype).scatter(1, index, weights)
        h = torch.einsum("td,efd->tef", x, self.w_in).relu()
        return torch.einsum("ted,te->td", torch.einsum("tef,edf->ted", h, self.w_out), mask)


class HandBlock(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4, k: int = 2):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 32), nn.Linear(32, d)
        self.router = nn.Parameter(torch.randn(experts, d) * 0.3)
        self.experts = DenseExperts(d, experts, 8)
        self.k, self.d = k, d

    def forward(self, x):
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        h = x.reshape(-1, self.d)
        weights, index = F.linear(h, self.router).softmax(-1).topk(self.k, -1)
        return x + self.experts(h, index, weights).view_as(x)


class HandMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = HandBlock(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(x))


def hand() -> nn.Module:
    model = HandMoE()
    wl.annotate(model, {"block": wl.split(4)})
    return model


def lm_loss(out, targets):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))


def lm_and_router_loss(out, targets):
    """What the model's own ``loss`` is with labels: cross-entropy plus the weighted load-balancing loss."""
    return lm_loss(out, targets) + 0.5 * out.aux_loss


def hand_loss(out, targets):
    return F.cross_entropy(out.reshape(-1, 3), targets.reshape(-1))


def _tokens(gen):
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _vectors(gen):
    return (torch.randn(BATCH, 6, 16, generator=gen),), torch.randint(0, 3, (BATCH, 6), generator=gen)


# name: (builder, batches, loss, micro-batches, optimizers)
CASES = {
    "mixtral-pipeline": (mixtral, _tokens, lm_loss, 2, ("adamw",)),
    "olmoe-aux-loss": (olmoe, _tokens, lm_and_router_loss, 1, ("sgd",)),
    "hand-written": (hand, _vectors, hand_loss, 1, ("sgd",)),
}


def build(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return case_model(CASES, name, dtype)


def batches(name: str, seed: int, dtype: torch.dtype = torch.float32) -> list:
    return case_batches(CASES, name, seed, STEPS, dtype)


def make_plan(name: str):
    (example, _), = batches(name, 0)[:1]
    graphs = wl.capture(build(name), example)
    return planner.plan(graphs, _cluster(), wl.Config(global_batch_size=BATCH, num_micro_batch=CASES[name][3]))


def _held(engine) -> list[tuple]:
    """(path, first expert, count, rows of each stacked weight) of every expert-parallel layer of this rank's stage."""
    stage = engine.executor.stage.module
    out = []
    for layer in stage.modules():
        if isinstance(layer, ExpertParallel):
            rows = sorted({stage.get_parameter(t).shape[0] for t in layer.targets.values()})
            out.append((layer.layout.path, layer.first, layer.counts[layer.tp_index], tuple(rows)))
    return out


def _warm() -> None:
    """Each case's float64 capture, once, before the ranks fork (dist_utils' ``warm``): the ranks' are cache hits,
    and so are the pipeline's fake node values (``reference.warm_capture``; the one-stage cases have none)."""
    for name in CASES:
        (example, _), = batches(name, 1, torch.float64)[:1]
        (warm_capture if name == "mixtral-pipeline" else wl.capture)(build(name, torch.float64), example)


def _ranks(rank: int, world_size: int, plans: dict, directory: str) -> dict:
    lines = LogLines.attach("runtime.tensor.experts")
    out = {}
    for name, (_, _, loss_fn, _, optimizers) in CASES.items():
        data = batches(name, 1, torch.float64)
        for opt in optimizers:
            engine, _, _ = assert_engine_trains_like_reference(build(name, torch.float64), plans[name], data,
                                                               OPTIMIZERS[opt], loss_fn, _cluster(), f"{name}/{opt}")
            out[name] = _held(engine)
        if name == "olmoe-aux-loss":
            # a checkpoint of uneven expert shards (3, 3, 1, 1) read back into a fresh engine: every
            # rank's experts come back, and both go on alike
            checkpoint.save(engine, directory)
            fresh = Engine(build(name, torch.float64), plans[name], optimizer=OPTIMIZERS[optimizers[-1]],
                           loss_fn=loss_fn, cluster=_cluster(), timeout_s=60, example_args=data[0][0])
            checkpoint.load(fresh, checkpoint.latest(directory))
            saved = engine.state_dict()
            for key, value in fresh.state_dict().items():
                assert_close(value, saved[key], msg=f"{name}: {key} after loading the checkpoint")
            assert_close(fresh.train_step(data[0]), engine.train_step(data[0]), msg=f"{name}: a step after loading")
        out[name + "/log"] = [line for line in lines.lines if "stays whole" in line]
        lines.lines.clear()
    return out


def _expected(plan, rank: int) -> list[tuple]:
    """What the plan says ``rank`` holds: per experts layer of its stage, its first expert and count."""
    worker = plan.workers[rank]
    sizes = plan.stages[worker.stage].shard_sizes
    return sorted((path, sum(counts[:worker.tp_index]), counts[worker.tp_index])
                  for path, counts in sizes.items() if path.endswith("mlp.experts"))


def test_experts_spread_by_speed_train_exactly_and_unrecognised_layers_fall_back(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="whalelike.sharding.experts"):
        plans = {name: make_plan(name) for name in CASES}
    # capture names the layout it does not recognise, and why, in one line
    (warning,) = {r.getMessage() for r in caplog.records if "block.experts" in r.getMessage()}
    assert "not recognised for expert parallelism" in warning and "DenseExperts is not a transformers experts class" \
        in warning and "\n" not in warning
    assert not plans["hand-written"].stages[0].shard_sizes.keys() - {"block.fc1", "block.fc2"}

    # the planner gives a faster device at least as many experts, within each split group
    speed = {d.name: device_tflops(d, "fp32") for d in _cluster().devices}
    for name in ("mixtral-pipeline", "olmoe-aux-loss"):
        plan = plans[name]
        for st in plan.stages:
            workers = sorted(plan.stage_workers(st.index), key=lambda w: w.tp_index)
            (counts,) = [v for p, v in st.shard_sizes.items() if p.endswith("mlp.experts")]
            for a in workers:
                for b in workers:
                    if speed[a.device] > speed[b.device]:
                        assert counts[a.tp_index] >= counts[b.tp_index], (name, st.index, counts)
    mixtral_sizes = sorted(tuple(v) for st in plans["mixtral-pipeline"].stages
                           for p, v in st.shard_sizes.items() if p.endswith("experts"))
    assert mixtral_sizes == [(3, 3), (4, 2)]          # 0.5 and 0.25 devices: 4 and 2; two full ones: 3 each
    assert plans["olmoe-aux-loss"].stages[0].shard_sizes["model.layers.1.mlp.experts"] == [3, 3, 1, 1]

    results = run_ranks(_ranks, 4, args=(plans, str(tmp_path / "ckpt")), init_process_group=False, timeout_s=600,
                        warm=_warm)
    for rank, got in enumerate(results):
        for name in ("mixtral-pipeline", "olmoe-aux-loss"):
            expected = _expected(plans[name], rank)
            assert expected, (name, rank)
            # which experts this rank holds, and each stacked weight cut to exactly those rows
            assert [(p, first, n) for p, first, n, _ in got[name]] == expected, (name, rank, got[name])
            assert all(rows == (n,) for _, _, n, rows in got[name])
            assert got[name + "/log"] == []
        assert got["hand-written"] == []
        (line,) = got["hand-written/log"]
        assert "block.experts stays whole on every rank" in line and "DenseExperts" in line
