"""Checkpoints (runtime.checkpoint): resume onto the same plan, and onto other plans and world sizes.

Four models, each planned on two emulated unequal devices and trained for ``SAVE_AT`` steps, then
saved: data parallel, a two-stage pipeline, tensor parallel (a Megatron block under ``split``) and
a pipeline whose embedding is tied to the head across the stages. Checks:

* same plan: an Engine built from *other* initial weights loads the checkpoint and trains on; its
  losses and final state equal the uninterrupted run's bit for bit (``torch.equal``); two of the
  four checkpoints are written asynchronously (``save_async``) while the run trains on;
* other plans: a 3-rank run loads the 2-rank checkpoints onto 3-rank plans (three shares, three
  stages, three unequal tensor-parallel shards of the same weights), trains to ``RESAVE_AT`` and
  saves; a 1-rank run loads those and trains to the end. Every loss and the final state equal the
  uninterrupted single-process reference (``assert_close``, float64);
* a half-written checkpoint (a ``.partial`` directory, a ``step-N`` without its manifest) is never
  loaded, and the next save removes it; a checkpoint of another model is refused by name.

Three spawns: 2, 3 and 1 ranks.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import planner
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, train_reference
from whalelike.graphs.capture import capture
from whalelike.cluster import Cluster, Device, Emulation, Network

WIDTH, BATCH, STEPS, SAVE_AT, RESAVE_AT, VOCAB = 16, 12, 8, 3, 6, 20
MAKE_OPT = OPTIMIZERS["adamw"]


class Mlp(nn.Module):
    def __init__(self, stages: int = 1):
        super().__init__()
        torch.manual_seed(0)
        per_stage = 6 // stages
        layers = []
        for _ in range(stages):
            with wl.replicate(1) if stages > 1 else _Nothing():
                layers += [nn.Linear(WIDTH, WIDTH) for _ in range(per_stage)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Block(nn.Module):
    def __init__(self, ways: int = 2):
        super().__init__()
        torch.manual_seed(0)
        with wl.split(ways):
            self.up = nn.Linear(WIDTH, 6 * WIDTH)
            self.down = nn.Linear(6 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Tied(nn.Module):
    """An embedding tied to the head; ``stages`` 1, 2 or 3 regions (the head always after the embedding)."""

    def __init__(self, stages: int = 2):
        super().__init__()
        torch.manual_seed(0)
        scope = wl.replicate(1) if stages > 1 else _Nothing()
        with scope:
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.lower = nn.Linear(WIDTH, WIDTH)
        with wl.replicate(1) if stages > 2 else _Nothing():
            self.upper = nn.Linear(WIDTH, WIDTH)
        with wl.replicate(1) if stages > 1 else _Nothing():
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.upper(torch.tanh(self.lower(self.embed(tokens))))))


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def mse(out, target):
    return F.mse_loss(out, target)


def token_loss(out, target):
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def dense_batches():
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),),
             torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def token_batches():
    g = torch.Generator().manual_seed(2)
    return [((torch.randint(0, VOCAB, (BATCH, 3), generator=g),), torch.randint(0, VOCAB, (BATCH, 3), generator=g))
            for _ in range(STEPS)]


# name -> (model for n ranks, batches, loss, micro-batches)
SCENARIOS = {
    "dp": (lambda n: Mlp(1), dense_batches, mse, 1),
    "pp": (lambda n: Mlp(n if n > 1 else 1), dense_batches, mse, 2),
    "tp": (lambda n: Block(n), dense_batches, mse, 1),
    "tied": (lambda n: Tied(n if n > 1 else 1), token_batches, token_loss, 2),
}


def cluster(speeds) -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=0.01 * s / 1000 / 0.4, memory_gib=4,
                           emulated_speed=s) for i, s in enumerate(speeds))
    return Cluster("ckpt", devices, Network(2.0, 2.0, 50.0), Emulation(base_gflops=0.01))


SPEEDS = {1: [1.0], 2: [1.0, 2.0], 3: [1.0, 1.5, 3.0]}


def engine_for(name: str, ranks: int, perturb: bool = False, built: bool = True):
    """An Engine for scenario ``name`` planned on ``ranks`` unequal devices (``perturb``: other
    initial weights, so only a load can make it right; ``built``: given example inputs, so its
    executor exists before the first step)."""
    from runtime import Engine

    build, data, loss, micro = SCENARIOS[name]
    model = build(ranks).double()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    batches = data()
    spec = cluster(SPEEDS[ranks])
    graphs = capture(model, batches[0][0])
    plan = planner.plan(graphs, spec, wl.Config(global_batch_size=BATCH, num_micro_batch=micro if ranks > 1 else 1))
    engine = Engine(model, plan, optimizer=MAKE_OPT, loss_fn=loss, cluster=spec,
                    example_args=batches[0][0] if built else None, balance="off", timeout_s=120)
    return engine, batches


def _two_ranks(rank: int, world_size: int, root: str) -> dict:
    from runtime import checkpoint

    out = {}
    for name in SCENARIOS:
        engine, batches = engine_for(name, 2)
        for step in range(SAVE_AT):
            engine.train_step(batches[step])
        if name in ("pp", "tied"):      # written by a thread while the next steps change the parameters
            pending = checkpoint.save_async(engine, os.path.join(root, name), extra={"next_batch": SAVE_AT})
            continued = [engine.train_step(batches[step]) for step in range(SAVE_AT, STEPS)]
            info = pending.wait()
        else:
            info = checkpoint.save(engine, os.path.join(root, name), extra={"next_batch": SAVE_AT})
            continued = [engine.train_step(batches[step]) for step in range(SAVE_AT, STEPS)]
        final = engine.state_dict()
        # same plan, other initial weights: the load must make it the same run
        resumed, _ = engine_for(name, 2, perturb=True)
        found = checkpoint.latest(os.path.join(root, name))
        extra = checkpoint.load(resumed, found)
        losses = [resumed.train_step(batches[step]) for step in range(extra["next_batch"], STEPS)]
        out[name] = {"path": info.path, "found": found.path, "step": resumed.step, "extra": extra,
                     "continued": continued, "resumed": losses, "final": final, "resumed_final": resumed.state_dict()}
    return out


def _three_ranks(rank: int, world_size: int, root: str) -> dict:
    from runtime import checkpoint

    out = {}
    for name in SCENARIOS:
        engine, batches = engine_for(name, 3, perturb=True)
        extra = checkpoint.load(engine, checkpoint.latest(os.path.join(root, name)))
        losses = [engine.train_step(batches[step]) for step in range(extra["next_batch"], RESAVE_AT)]
        checkpoint.save(engine, os.path.join(root, name), extra={"next_batch": RESAVE_AT})
        out[name] = {"losses": losses, "workers": [(w.stage, w.tp_size) for w in engine.plan.workers]}
    return out


def _one_rank(rank: int, world_size: int, root: str) -> dict:
    from runtime import checkpoint

    out = {}
    for name in SCENARIOS:
        engine, batches = engine_for(name, 1, perturb=True)
        info = checkpoint.latest(os.path.join(root, name))
        extra = checkpoint.load(engine, info)
        losses = [engine.train_step(batches[step]) for step in range(extra["next_batch"], STEPS)]
        out[name] = {"losses": losses, "final": engine.state_dict(), "from_world": info.world_size}
    out["refused"] = _refuse(root)
    out["unbuilt"] = _unbuilt(root)
    return out


def _unbuilt(root: str) -> str:
    """Saving before the executor exists: the error says how to build it, naming only what exists."""
    import re

    from runtime import Engine, checkpoint
    from runtime.checkpoint import CheckpointError

    engine, _ = engine_for("dp", 1, built=False)
    try:
        checkpoint.save(engine, os.path.join(root, "unbuilt"))
    except CheckpointError as e:
        message = str(e)
    else:
        raise AssertionError("a checkpoint of an Engine without its executor was written")
    named = re.findall(r"(?:engine|Engine)\.(\w+)", message)
    assert all(hasattr(Engine, n) for n in named), (named, message)
    return message


def _refuse(root: str) -> bool:
    """A checkpoint of the data-parallel Mlp loaded into the tensor-parallel Block: refused by name."""
    from runtime import checkpoint
    from runtime.checkpoint import CheckpointError

    engine, _ = engine_for("tp", 1)
    try:
        checkpoint.load(engine, checkpoint.latest(os.path.join(root, "dp")))
    except CheckpointError as e:
        assert "not of this model" in str(e) and "up.weight is missing" in str(e), str(e)
        return True
    return False


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    two = run_ranks(_two_ranks, 2, args=(root,), timeout_s=600)[0]
    three = run_ranks(_three_ranks, 3, args=(root,), timeout_s=600)[0]
    one = run_ranks(_one_rank, 1, args=(root,), timeout_s=600)[0]
    return {"two": two, "three": three, "one": one, "root": root}


def reference(name: str):
    build, data, loss, _ = SCENARIOS[name]
    return train_reference(build(1).double(), data(), MAKE_OPT, loss)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_on_the_same_plan_is_the_same_run(runs, name):
    got = runs["two"][name]
    assert got["found"] == got["path"] and got["extra"] == {"next_batch": SAVE_AT} and got["step"] == STEPS
    for step, (a, b) in enumerate(zip(got["continued"], got["resumed"])):
        assert torch.equal(a, b), f"{name}: step {SAVE_AT + step}: resumed loss {b} != uninterrupted {a}"
    for key, value in got["final"].items():
        assert torch.equal(value, got["resumed_final"][key]), f"{name}: final {key} differs after the resume"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_onto_other_plans_and_world_sizes_matches_the_reference(runs, name):
    losses, final = reference(name)
    two, three, one = runs["two"][name], runs["three"][name], runs["one"][name]
    for step, loss in enumerate(two["continued"]):
        assert_close(loss, losses[SAVE_AT + step], msg=lambda m: f"{name}, 2 ranks, step {SAVE_AT + step}: {m}")
    for step, loss in enumerate(three["losses"]):
        assert_close(loss, losses[SAVE_AT + step], msg=lambda m: f"{name}, 3 ranks, step {SAVE_AT + step}: {m}")
    for step, loss in enumerate(one["losses"]):
        assert_close(loss, losses[RESAVE_AT + step], msg=lambda m: f"{name}, 1 rank, step {RESAVE_AT + step}: {m}")
    assert one["from_world"] == 3
    for key, value in final.items():
        assert_close(one["final"][key], value, msg=lambda m: f"{name}: final {key}: {m}")


def test_the_three_rank_plans_really_differ(runs):
    assert {stage for stage, _ in runs["three"]["pp"]["workers"]} == {0, 1, 2}
    assert {tp for _, tp in runs["three"]["tp"]["workers"]} == {3}


def test_a_half_written_checkpoint_is_never_loaded(runs, tmp_path):
    import shutil

    from runtime import checkpoint

    source = checkpoint.latest(os.path.join(runs["root"], "dp"))
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copytree(source.path, folder / "step-00000006")
    (folder / ".step-00000009.partial").mkdir()                  # a save that crashed in DCP
    (folder / ".step-00000009.partial" / "__0_0.distcp").write_bytes(b"half")
    broken = folder / "step-00000010"                             # a final name without its manifest
    shutil.copytree(source.path, broken)
    (broken / checkpoint.MANIFEST).unlink()
    assert checkpoint.latest(folder).step == 6
    assert [c.step for c in checkpoint.complete(folder)] == [6]
    assert checkpoint.latest(tmp_path / "nowhere") is None


def test_saving_before_the_executor_exists_says_how_to_build_it(runs):
    message = runs["one"]["unbuilt"]
    assert "example_args=" in message and "run a step" in message, message
    written = os.path.join(runs["root"], "unbuilt")
    assert not os.path.isdir(written) or not os.listdir(written), os.listdir(written)


def test_loading_a_checkpoint_of_another_model_is_refused(runs):
    assert runs["one"]["refused"] is True
