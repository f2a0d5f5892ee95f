"""The three examples, planned onto the built-in emulated 4-device cluster and trained by
``runtime.Engine`` on 4 ranks, against a single-process reference (one 4-rank spawn).

The planner decides everything here (stages, shares, shard sizes): the hybrid classifier becomes a
``replicate`` feature extractor on two devices feeding a class-sharded ``split`` classifier on two,
the GPT decoder and the third-party (``torch.export``-captured) encoder become pipelines. The
emulation is switched off (exactness does not depend on it and the test stays fast); 3 steps with
SGD and with AdamW, then losses and final parameters are compared.
"""
from __future__ import annotations

import pytest
import torch

import planner
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference
from whalelike.cli import load_workload
from whalelike.cluster import Cluster

EXAMPLES = ("examples/hybrid_classifier.py:build", "examples/gpt.py:build", "examples/third_party.py:build",
            "examples/hf_gpt2.py:build")
GLOBAL_BATCH, MICRO_BATCHES, STEPS = 16, 2, 3


def _workload(spec: str):
    """The example in float64. AdamW divides by sqrt(v): in float32 a weight whose gradient nearly
    cancels (a rare token's embedding row) moves by ~1e-4 more or less depending on the summation
    order; in float64 such noise stays far below the comparison's tolerance."""
    torch.manual_seed(0)
    workload = load_workload(spec)
    workload.model.double()
    workload.example_args = _double(workload.example_args)
    return workload


def _double(inputs: tuple) -> tuple:
    return tuple(x.double() if x.is_floating_point() else x for x in inputs)


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def _ranks(rank: int, world_size: int, plans: dict) -> dict:
    shapes = {}
    for spec, plan in plans.items():
        workload = _workload(spec)
        g = torch.Generator().manual_seed(1)
        data = [(_double(inputs), targets) for inputs, targets in
                (workload.make_batch(GLOBAL_BATCH, g) for _ in range(STEPS))]
        for opt, make_opt in OPTIMIZERS.items():
            engine, _, _ = assert_engine_trains_like_reference(workload.model, plan, data, make_opt, workload.loss_fn,
                                                               _cluster(), f"{spec}/{opt}")
        shapes[spec] = {n: tuple(p.shape) for n, p in engine.executor.stage.module.named_parameters()}
    return shapes


@pytest.fixture(scope="module")
def plans() -> dict:
    out = {}
    for spec in EXAMPLES:
        workload = _workload(spec)
        graphs = wl.capture(workload.model, workload.example_args)
        out[spec] = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=GLOBAL_BATCH,
                                                               num_micro_batch=MICRO_BATCHES))
    return out


def test_examples_train_exactly_under_their_plans(plans):
    hybrid = plans[EXAMPLES[0]]
    assert [w.tp_size for w in hybrid.workers if w.stage == 1] == [2, 2], hybrid.summary()
    shapes = run_ranks(_ranks, 4, args=(plans,), init_process_group=False, timeout_s=600)
    # the classifier of the hybrid really is class-sharded on its two ranks
    sizes = hybrid.stages[1].shard_sizes["classifier"]
    tp_ranks = [w.rank for w in hybrid.workers if w.stage == 1]
    assert [shapes[r][EXAMPLES[0]]["classifier.weight"][0] for r in tp_ranks] == sizes
