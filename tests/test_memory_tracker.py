"""The memory figures against torch's own tracker (``torch.distributed._tools.mem_tracker.MemTracker``).

Every measured peak in the suite and the benches is the Engine's meter
(:mod:`runtime.training.memory_meter`, ``Engine(measure_memory=True)``), and the planner's memory model
(:mod:`planner.devices.memory`) is judged against it. Here both are checked against torch's tracker,
which counts the same live storages by dispatch and names what they hold (parameters, gradients,
activations, temporaries, optimizer state): `transformers` GPT-2 and Llama trained by the Engine on a
one-device plan, the tracker around the third step.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import planner
import runtime
import whalelike as wl
from dist_utils import run_ranks
from hf_models import build
from planner.devices.cost_model import GIB

BATCH = 16
MODELS = ("gpt2", "llama")
CLUSTER = {"name": "one", "network": {"intra_host_gbps": 100, "inter_host_gbps": 10, "latency_us": 5},
           "hosts": [{"name": "localhost", "devices": [{"kind": "cpu", "count": 1, "peak_tflops": 1, "memory_gib": 16}]}]}
TERMS = ("weights_gib", "gradients_gib", "optimizer_gib", "activations_gib", "update_gib", "memory_gib")


def _tracked(rank: int, world_size: int) -> dict:
    out = {}
    cluster = wl.Cluster.from_dict(CLUSTER)
    for name in MODELS:
        torch.manual_seed(0)
        real = build(name)
        (ids,), targets = real.make_batch(BATCH, torch.Generator().manual_seed(0))
        graphs = wl.capture(real.model, (ids,), loss_fn=real.loss_fn)
        plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=BATCH, memory_reserve=0.0))
        engine = runtime.Engine(real.model, plan, cluster=cluster, loss_fn=real.loss_fn, balance="off",
                                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4), measure_memory=True)
        for _ in range(2):   # the optimizer's state exists from the first step on
            engine.train_step(((ids,), targets))
        tracker = MemTracker()
        tracker.track_external(engine.slot.module, engine.slot.optimizer, ids, targets)
        with tracker:
            engine.train_step(((ids,), targets))
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        out[name] = dict(tracked={getattr(k, "name", str(k)): v for k, v in peak.items()},
                         meter=engine.stats[-1].peak_memory_bytes,
                         predicted={t: getattr(plan.workers[0], t) * GIB for t in TERMS},
                         micro_batches=len(plan.workers[0].micro_batch_sizes))
    return out


@pytest.fixture(scope="module")
def tracked() -> dict:
    (out,) = run_ranks(_tracked, 1, init_process_group=True, timeout_s=300)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_the_meter_counts_what_torch_s_tracker_counts(tracked, name):
    got = tracked[name]
    # the same live storages at the same moment; the tracker rounds each storage up to 512 bytes
    # (the CUDA caching allocator's granularity, which it applies on every device)
    assert got["meter"] == pytest.approx(got["tracked"]["Total"], rel=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_the_memory_model_s_terms_are_torch_s(tracked, name):
    got = tracked[name]
    tracked_bytes, predicted = got["tracked"], got["predicted"]
    assert got["micro_batches"] == 1
    # the state terms, exactly: parameters and AdamW's two moments per parameter
    assert tracked_bytes["PARAM"] == pytest.approx(predicted["weights_gib"], rel=2e-3)
    assert tracked_bytes["OPT"] == pytest.approx(predicted["optimizer_gib"], rel=2e-3)
    # at the peak (the backward's start on a worker of one micro-batch whose gradients are set to None
    # between steps) torch holds the activations and the backward's first temporaries, no gradient yet
    assert tracked_bytes["GRAD"] < 0.05 * predicted["gradients_gib"]
    activations = tracked_bytes["ACT"] + tracked_bytes["TEMP"]
    assert 0.9 * predicted["activations_gib"] <= activations <= 1.02 * predicted["activations_gib"]
    # so the prediction is never below the peak; it is above it by about the gradients it prices beside
    # the activations they replace (gradients appear as the backward frees its activations)
    total = tracked_bytes["Total"]
    assert total <= predicted["memory_gib"]
    assert predicted["memory_gib"] - total <= predicted["gradients_gib"] + 0.1 * predicted["activations_gib"]
