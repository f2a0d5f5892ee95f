"""Checkpoint cost of the demo model: whalelike's sharded save/load next to DDP + DCP, in one run.

Workload: ``make demo``'s model (examples/hybrid_classifier.py: a replicated conv feature extractor
feeding a 20,000-class classifier) on the built-in emulated 4-device cluster, 4 gloo ranks on CPU.

* **whalelike**: ``runtime.Engine`` under the planner's hybrid plan (the classifier split over two
  devices), saved with :func:`runtime.checkpoint.save` (every piece written once, by the holder
  that has written least; atomic rename) and with :func:`runtime.checkpoint.save_async` (the
  stall: copying this rank's pieces; a thread writes them), loaded with :func:`runtime.checkpoint.load`.
* **peer**: the same model under DDP on the same 4 ranks, saved the way torch documents it:
  ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` then
  ``dcp.save`` (DCP deduplicates the replicas' identical tensors) and ``dcp.async_save`` (on a
  gloo group of its own, as torch recommends for CPU), loaded with ``dcp.load`` and ``set_state_dict``.

Both hold AdamW state after two training steps. The two alternate ``--repeats`` times (disk and
page-cache drift hit both alike); each save and load is timed on rank 0 from a barrier to the
barrier after it (the slowest rank decides: training resumes when every rank returns), median
reported, with the whalelike run's median step time, so the stall is also given as a share of a
step. Sizes are the bytes on disk.

Run (spawns 4 ranks itself, under a minute)::

    .venv/bin/python bench/checkpoint_cost.py [--repeats 5]
    .venv/bin/python bench/checkpoint_cost.py --smoke   # a small demo model, seconds: checks that it runs

The last line states the headline: whalelike's save, asynchronous stall and load time against the
peer's, and the stall in steps of training.
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import planner  # noqa: E402
import whalelike as wl  # noqa: E402
from runtime import Engine, checkpoint  # noqa: E402
from whalelike.cli import load_workload  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import process_group, spawn_ranks, timed  # noqa: E402

WORLD = 4
MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "hybrid_classifier.py") + ":build"
GLOBAL_BATCH, MICRO_BATCHES = 64, 4
SMOKE_DEMO = dict(num_classes=1000, width=4, image_size=8, feature_dim=32)   # --smoke: build()'s sizes


def demo_workload(sizes: dict):
    """The demo model's workload, loaded as ``whalelike`` loads a MODEL (``path.py:build``); with
    ``sizes`` (a smoke run), the same example's ``build(**sizes)``: a small demo model."""
    if not sizes:
        return load_workload(MODEL)
    sys.path.insert(0, os.path.dirname(MODEL.rpartition(":")[0]))
    from hybrid_classifier import build
    return build(**sizes)


def size_of(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def worker(rank: int, init_file: str, args, results) -> None:
    with process_group(rank, init_file, WORLD):
        workload = demo_workload(args.demo_sizes)
        cluster = wl.Cluster.preset("emulated-4")
        graphs = wl.capture(workload.model, workload.example_args)
        plan = planner.plan(graphs, cluster, wl.Config(global_batch_size=GLOBAL_BATCH, num_micro_batch=MICRO_BATCHES))
        generator = torch.Generator().manual_seed(0)
        batches = [workload.make_batch(GLOBAL_BATCH, generator) for _ in range(2)]
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731

        engine = Engine(copy.deepcopy(workload.model), plan, optimizer=make_opt, loss_fn=workload.loss_fn,
                        cluster=cluster, balance="off")
        step_s = []
        for batch in batches:
            step_s.append(timed(lambda: engine.train_step(batch)))

        ddp = DistributedDataParallel(copy.deepcopy(workload.model))
        optimizer = make_opt(ddp.parameters())
        local = GLOBAL_BATCH // WORLD
        for (x,), y in batches:
            optimizer.zero_grad()
            workload.loss_fn(ddp(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local]).backward()
            optimizer.step()

        root = tempfile.mkdtemp(prefix="whalelike-ckpt-bench-") if rank == 0 else None
        holder = [root]
        dist.broadcast_object_list(holder)
        root = holder[0]
        ours_save, ours_load, peer_save, peer_load, ours_stall, peer_stall = [], [], [], [], [], []
        peer_group = dist.new_group(backend="gloo")      # dcp.async_save's collectives run in its thread
        for repeat in range(args.repeats):
            ours = os.path.join(root, f"ours-{repeat}")
            peer = os.path.join(root, f"peer-{repeat}")
            ours_save.append(timed(lambda: checkpoint.save(engine, ours, keep=None)))
            ours_load.append(timed(lambda: checkpoint.load(engine, checkpoint.latest(ours))))

            def peer_saves():
                model_state, optim_state = get_state_dict(ddp, optimizer)
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=peer)

            def peer_loads():
                model_state, optim_state = get_state_dict(ddp, optimizer)
                state = {"model": model_state, "optim": optim_state}
                dcp.load(state, checkpoint_id=peer)
                set_state_dict(ddp, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

            peer_save.append(timed(peer_saves))
            peer_load.append(timed(peer_loads))

            # asynchronous: the stall is the call (the snapshot); the write completes in a thread
            pending = []
            ours_stall.append(timed(lambda: pending.append(
                checkpoint.save_async(engine, os.path.join(root, f"ours-async-{repeat}"), keep=None))))
            pending.pop().wait()

            def peer_async():
                model_state, optim_state = get_state_dict(ddp, optimizer)
                pending.append(dcp.async_save({"model": model_state, "optim": optim_state},
                                              checkpoint_id=os.path.join(root, f"peer-async-{repeat}"),
                                              process_group=peer_group))

            peer_stall.append(timed(peer_async))
            pending.pop().result()
        if rank == 0:
            results.update({
                "ours_save": ours_save, "ours_load": ours_load, "peer_save": peer_save, "peer_load": peer_load,
                "ours_stall": ours_stall, "peer_stall": peer_stall,
                "step": step_s[-1], "ours_bytes": size_of(checkpoint.latest(os.path.join(root, "ours-0")).path),
                "peer_bytes": size_of(os.path.join(root, "peer-0")),
                "plan": plan.summary(), "params": sum(p.numel() for p in workload.model.parameters())})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_args(parser, smoke=dict(repeats=1, demo_sizes=SMOKE_DEMO), normal=dict(demo_sizes={}))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    r = spawn_ranks(worker, args, WORLD)
    med = {k: statistics.median(r[k]) * 1e3
           for k in ("ours_save", "ours_load", "peer_save", "peer_load", "ours_stall", "peer_stall")}
    print(f"model: {r['params'] / 1e6:.2f} M parameters + AdamW state, 4 ranks; whalelike plan:\n{r['plan']}\n")
    print(f"{'':24}{'save ms':>10}{'async stall ms':>16}{'load ms':>10}{'on disk MiB':>14}")
    print(f"{'whalelike (plan shards)':24}{med['ours_save']:10.1f}{med['ours_stall']:16.1f}{med['ours_load']:10.1f}"
          f"{r['ours_bytes'] / 2**20:14.1f}")
    print(f"{'DDP + DCP (peer)':24}{med['peer_save']:10.1f}{med['peer_stall']:16.1f}{med['peer_load']:10.1f}"
          f"{r['peer_bytes'] / 2**20:14.1f}")
    print(f"\nmedian of {args.repeats}; whalelike training step (emulated devices): {r['step'] * 1e3:.1f} ms")
    print(f"checkpoint cost: whalelike save {med['ours_save']:.1f} ms = {med['ours_save'] / med['peer_save']:.2f}x "
          f"DDP+DCP's, async stall {med['ours_stall']:.1f} ms = {med['ours_stall'] / med['peer_stall']:.2f}x "
          f"dcp.async_save's ({med['ours_stall'] / (r['step'] * 1e3):.3f} steps), load "
          f"{med['ours_load'] / med['peer_load']:.2f}x")


if __name__ == "__main__":
    main()
