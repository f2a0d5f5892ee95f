"""Stage boundaries as cross-mesh reshardings (runtime.parallel.boundaries), exact against one process.

Four ranks on two hosts (ranks 0-1 on host ``a``, 2-3 on ``b``), trained through ``runtime.Engine``
for 3 steps against the single-process reference (same weights, same data, float64 losses and
final parameters compared with ``assert_close``):

* ``replicate -> split``: a data-parallel stage with uneven shares on host ``a`` feeding a
  tensor-parallel stage on host ``b`` (both of its members need every row);
* ``split -> replicate``: the reverse; every member of the tensor-parallel group needs the
  gradients coming back, and any member may send the forward values;
* ``shards->replicate``: a split stage ending in a lone projection whose output leaves as its
  uneven feature shards (no gather; the resharding assembles it) and whose gradient comes back as
  shards;
* ``skip``: three stages, the first stage's output consumed by the second and, across it, by the
  tensor-parallel third (a skip connection, as in the paper's U-Transformer);

each under every strategy (``broadcast``, ``allgather``, ``send_recv``) and ``auto``, under 1F1B
and eager-1F1B (with and without delayed weight gradients), and on the emulated network (stamped
messages, forwarding inside host ``b``).
The plans are checked too: a forced strategy is the one run, and under ``broadcast`` and
``allgather`` no slice enters host ``b`` twice. Each case's plan is made once, in the test process,
and travels to the ranks with the spawn; a warm-up (``_warm``) captures each layout's model once
before the ranks fork, so that their Engines' captures are capture-cache hits, and works out its
pipeline's fake node values (their first step's fake runs of the whole graph) once for all ranks.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

import test_runtime_tp as tp_case
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from whalelike.cluster import Cluster, Device, Emulation, Network

WORLD = 4
HOSTS = ("a", "a", "b", "b")


class SkipTP(nn.Module):
    """``h0`` leaves stage 0 for stage 1 and, skipping it, for the tensor-parallel stage 2."""

    def __init__(self):
        super().__init__()
        with wl.replicate(1):
            self.l0 = nn.Sequential(nn.Linear(tp_case.DIN, tp_case.HIDDEN), nn.Tanh())
        with wl.replicate(1):
            self.l1 = nn.Linear(tp_case.HIDDEN, tp_case.HIDDEN)
        with wl.split(2):
            self.l2 = nn.Linear(tp_case.HIDDEN, tp_case.HIDDEN)
            self.head = nn.Linear(tp_case.HIDDEN, tp_case.CLASSES)

    def forward(self, x):
        h0 = self.l0(x)
        h1 = torch.tanh(self.l1(h0))
        return self.head(torch.tanh(self.l2(h1)) + h0)


class ShardsLeave(nn.Module):
    """The split stage ends with a lone projection (``proj``): its output leaves as feature shards."""

    def __init__(self):
        super().__init__()
        with wl.split(2):
            self.fc, self.proj = nn.Linear(tp_case.DIN, tp_case.HIDDEN), nn.Linear(tp_case.HIDDEN, tp_case.HIDDEN)
        with wl.replicate(2):
            self.head = nn.Linear(tp_case.HIDDEN, tp_case.CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(F.layer_norm(self.fc(x), (tp_case.HIDDEN,)))))


# model, stages (TaskGraphs, strategy, shard sizes), workers (stage, dp_index, tp_index, tp_size, micro-batches)
LAYOUTS = {
    "replicate->split": (tp_case.Hybrid, tp_case.HYBRID_STAGES, tp_case.DP_THEN_TP_WORKERS),
    "split->replicate": (tp_case.SplitFirst, [([0], "split(2)", {"fc1": [8, 24], "fc2": [8, 24]}),
                                              ([1], "replicate(2)", {})],
                         [(0, 0, 0, 2, [4, 4]), (0, 0, 1, 2, [4, 4]), (1, 0, 0, 1, [3, 1]), (1, 1, 0, 1, [1, 3])]),
    "shards->replicate": (ShardsLeave, [([0], "split(2)", {"fc": [20, 12], "proj": [8, 24]}), ([1], "replicate(2)", {})],
                          [(0, 0, 0, 2, [4, 4]), (0, 0, 1, 2, [4, 4]), (1, 0, 0, 1, [3, 1]), (1, 1, 0, 1, [1, 3])]),
    "skip": (SkipTP, [([0], "replicate(1)", {}), ([1], "replicate(1)", {}),
                      ([2], "split(2)", {"l2": [20, 12], "head": [6, 4]})],
             [(0, 0, 0, 1, [4, 4]), (1, 0, 0, 1, [4, 4]), (2, 0, 0, 2, [4, 4]), (2, 0, 1, 2, [4, 4])]),
}
# (layout, schedule, strategy, emulated network, delayed weight gradients)
CASES = [(layout, schedule, strategy, False, False)
         for layout in LAYOUTS for schedule in ("1f1b", "eager-1f1b")
         for strategy in ("auto", "broadcast", "allgather", "send_recv")
         if schedule == "1f1b" or strategy == "auto"]
CASES += [(layout, "eager-1f1b", "auto", False, True) for layout in ("split->replicate", "skip")]
CASES += [("replicate->split", "1f1b", "broadcast", True, False), ("skip", "eager-1f1b", "auto", True, True)]


def make_cluster(emulated: bool) -> Cluster:
    """Two hosts; between them 10x slower than inside one, so broadcasting into host b pays."""
    devices = tuple(Device(f"emu-{i}", "emu", HOSTS[i], peak_tflops=1.0, memory_gib=4,
                           emulated_speed=1.0 if emulated else None) for i in range(WORLD))
    return Cluster("two-hosts", devices, Network(2.0, 0.2, 50.0), Emulation(base_gflops=0.005) if emulated else None)


def make_model(layout: str) -> nn.Module:
    torch.manual_seed(0)
    return LAYOUTS[layout][0]()


def make_plan(layout: str, schedule: str, strategy: str, delay: bool = False):
    _, stages, workers = LAYOUTS[layout]
    plan = tp_case.make_plan(make_model(layout), schedule, stages, workers)
    return dataclasses.replace(plan, cluster="two-hosts", resharding=strategy, delay_weight_gradients=delay,
                               workers=[dataclasses.replace(w, host=HOSTS[w.rank]) for w in plan.workers])


def _check(rank: int, layout: str, schedule: str, strategy: str, emulated: bool, delay: bool, plan) -> dict:
    label = f"{layout}/{schedule}/{strategy}" + ("/emulated" if emulated else "") + ("/delayed" if delay else "")
    model = make_model(layout)
    data = tp_case.batches(model, plan.global_batch_size, seed=1)
    engine, _, _ = assert_engine_trains_like_reference(model, plan, data, OPTIMIZERS["sgd"], F.cross_entropy,
                                                       make_cluster(emulated), label, timeout_s=60)
    boundaries = engine.executor.boundaries
    out = {str(crossing): (p.strategy, [(t.strategy, t.sender, t.receivers, t.box, t.hops, t.nbytes) for t in p.transfers])
           for crossing, p in boundaries.plans().items()}
    out["feature_shards"] = {str(v): sizes for v, sizes in boundaries.feature_shards.items()}
    out["programs"] = (boundaries.program_count, len(boundaries.plans()))
    return out


def _warm() -> None:
    """Each layout's model captured on its first global batch, as every rank's Engine captures it,
    once, before the ranks fork (dist_utils' ``warm``), with its pipeline's fake node values
    (``reference.warm_capture``)."""
    for layout, (_, _, workers) in LAYOUTS.items():
        model = make_model(layout)
        batch = sum(sum(mbs) for stage, _, tp, _, mbs in workers if stage == 0 and tp == 0)
        warm_capture(model, tp_case.batches(model, batch, seed=1)[0][0])


def _ranks(rank: int, world_size: int, plans: dict) -> dict:
    return {case: _check(rank, *case, plans[case]) for case in CASES}


def test_boundaries_reshard_exactly_between_differently_laid_out_stages():
    plans = {(layout, schedule, strategy, emulated, delay): make_plan(layout, schedule, strategy, delay)
             for layout, schedule, strategy, emulated, delay in CASES}
    results = run_ranks(_ranks, WORLD, args=(plans,), init_process_group=False, timeout_s=600, warm=_warm)
    shards = {case: [results[r][case].pop("feature_shards") for r in range(WORLD)] for case in CASES}
    programs = {case: [results[r][case].pop("programs") for r in range(WORLD)] for case in CASES}
    # the skip layout's two micro-batches have equal shares: they share one plan per crossing pair and
    # direction; the others' shares differ between micro-batches, so each crossing has its own
    assert all(2 * count == crossings for count, crossings in programs["skip", "1f1b", "auto", False, False])
    assert all(count == crossings for count, crossings in programs["replicate->split", "1f1b", "auto", False, False])
    hosts = {f"emu-{i}": host for i, host in enumerate(HOSTS)}
    for case in CASES:
        strategy = case[2]
        for rank in range(WORLD):
            for crossing, (chosen, transfers) in results[rank][case].items():
                if strategy != "auto":
                    assert chosen == strategy, (case, crossing, chosen)
                if chosen in ("broadcast", "allgather"):
                    # every unique slice enters a host at most once (an all-gather's parts add up to it once)
                    entering: dict = {}
                    for t in transfers:
                        for hop in t[4]:
                            if hosts[hop.src] != hosts[hop.dst]:
                                entering[t[3], hosts[hop.dst]] = entering.get((t[3], hosts[hop.dst]), 0) + hop.nbytes
                    slice_bytes = {t[3]: t[5] for t in transfers}
                    assert all(n <= slice_bytes[box] for (box, _), n in entering.items()), (case, crossing, entering)
    # the replicate -> split forward: both members of the split stage get every row; under broadcast
    # each slice crosses to host b once and is forwarded inside it
    forward = {c: t for c, t in results[2][("replicate->split", "1f1b", "broadcast", False, False)].items() if "'F'" in c}
    assert forward and all(len(t[2]) == 2 for _, transfers in forward.values() for t in transfers)
    # a split stage's lone projection leaves as shards (8 and 24 features), on every rank alike; the
    # forward slices come from both members of the split group, each with its features
    leaving = shards["shards->replicate", "1f1b", "auto", False, False]
    assert all(s == leaving[0] for s in leaving) and list(leaving[0].values()) == [[8, 24]], leaving
    assert all(not any(s) for case, ranks in shards.items() if case[0] != "shards->replicate" for s in ranks)
    forward = [t for c, (_, transfers) in results[2][("shards->replicate", "1f1b", "send_recv", False, False)].items()
               if "'F'" in c for t in transfers]
    assert {t[3][2] for t in forward} == {(0, 8), (8, 32)}, forward
    # the skip value reaches stage 2 (skipping stage 1) on both ranks of the tensor-parallel group
    skip = [c for c in results[3][("skip", "1f1b", "auto", False, False)] if "consumer=2" in c and "stage=0" in c]
    assert skip, results[3][("skip", "1f1b", "auto", False, False)].keys()
