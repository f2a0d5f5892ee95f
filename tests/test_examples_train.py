"""The three examples, planned onto the built-in emulated 4-device cluster and trained by
``runtime.Engine`` on 4 ranks, against a single-process reference (one 4-rank spawn).

The planner decides everything here (stages, shares, shard sizes): the hybrid classifier becomes a
``replicate`` feature extractor on two devices feeding a class-sharded ``split`` classifier on two,
the GPT decoder and the third-party (``torch.export``-captured) encoder become pipelines. The
emulation is switched off (exactness does not depend on it and the test stays fast); 3 steps with
SGD and with AdamW, then losses and final parameters are compared. A warm-up captures each example
once for all ranks before they fork (``run_ranks(warm=)``), its pipeline's fake node values with it.

Real data through ``examples/train.py --data`` (two 2-rank ``torchrun`` launches of a small byte-level
language model on the shipped text): a run checkpointed at step 3 of 6 and resumed onto a plan with
other shares reads the same windows and trains to the same loss curve as the uninterrupted run.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import textwrap

import pytest
import torch

import planner
import whalelike as wl
import warm_python
from dist_utils import run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
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


def _warm() -> None:
    """Each example's capture as the ranks' Engines make it (their first global batch), once before
    they fork (dist_utils' ``warm``): every rank's is then a cache hit (``load_workload`` reuses the
    file it executed in the warm-up, so the ranks' models are of the warm-up's classes), and so are their
    pipelines' fake node values (``reference.warm_capture``)."""
    for spec in EXAMPLES:
        workload = _workload(spec)
        inputs, _ = workload.make_batch(GLOBAL_BATCH, torch.Generator().manual_seed(1))
        warm_capture(workload.model, _double(inputs))


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
    shapes = run_ranks(_ranks, 4, args=(plans,), init_process_group=False, timeout_s=600, warm=_warm)
    # the classifier of the hybrid really is class-sharded on its two ranks
    sizes = hybrid.stages[1].shard_sizes["classifier"]
    tp_ranks = [w.rank for w in hybrid.workers if w.stage == 1]
    assert [shapes[r][EXAMPLES[0]]["classifier.weight"][0] for r in tp_ranks] == sizes



# -- real data: train.py --data, checkpointed and resumed onto another plan ------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")
TEXT_STEPS, TEXT_EVERY, TEXT_BATCH = 6, 3, 8

BYTE_LM = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import whalelike as wl

    class ByteLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.mix, self.head = nn.Embedding(256, 16), nn.Linear(16, 16), nn.Linear(16, 256)

        def forward(self, ids):
            return self.head(torch.tanh(self.mix(self.embed(ids))))

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    def make_batch(n, generator):
        ids = torch.randint(0, 256, (n, 17), generator=generator)
        return (ids[:, :-1],), ids[:, 1:]

    def build():
        torch.manual_seed(0)
        (example,), _ = make_batch(4, torch.Generator().manual_seed(0))
        return wl.Workload(ByteLM(), (example,), loss_fn=loss_fn, make_batch=make_batch, vocab_size=256, seq_len=16)
""")


def _two_devices(name: str, speeds: tuple[float, float]) -> str:
    return textwrap.dedent(f"""
        name: {name}
        network: {{intra_host_gbps: 2.0, inter_host_gbps: 2.0, latency_us: 50.0}}
        hosts:
          - name: localhost
            devices:
              - {{kind: emu-a, count: 1, peak_tflops: {speeds[0]}, memory_gib: 4}}
              - {{kind: emu-b, count: 1, peak_tflops: {speeds[1]}, memory_gib: 4}}
    """)


@pytest.fixture(scope="module")
def text_job(tmp_path_factory):
    """The byte LM, and two data-parallel plans of it on two clusters whose speeds differ (other shares)."""
    folder = tmp_path_factory.mktemp("text")
    (folder / "byte_lm.py").write_text(BYTE_LM)
    workload = load_workload(f"{folder}/byte_lm.py:build")
    graphs = wl.capture(workload.model, workload.example_args)
    shares = {}
    for name, speeds in (("a", (1.0, 3.0)), ("b", (2.0, 1.0))):
        (folder / f"{name}.yaml").write_text(_two_devices(f"text-{name}", speeds))
        plan = planner.plan(graphs, Cluster.from_yaml(folder / f"{name}.yaml"), wl.Config(global_batch_size=TEXT_BATCH))
        plan.to_yaml(folder / f"plan-{name}.yaml")
        assert len(plan.stages) == 1 and all(w.tp_size == 1 for w in plan.workers)
        shares[name] = [w.batch_share for w in plan.workers]
    assert shares["a"] != shares["b"], shares
    return folder


def _train_text(folder, plan: str, checkpoints: str) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [warm_python.torchrun(), "--nproc_per_node", "2", "--master_port", str(port),
               os.path.join(ROOT, "examples", "train.py"), f"{folder}/byte_lm.py:build",
               "--plan", f"{folder}/plan-{plan}.yaml", "--cluster", f"{folder}/{plan}.yaml",
               "--data", TEXT, "--steps", str(TEXT_STEPS), "--checkpoint-dir", f"{folder}/{checkpoints}",
               "--checkpoint-every", str(TEXT_EVERY), "--balance", "off", "--timeout", "60", "--seed", "3",
               "--lr", "0.05"]
    env = warm_python.environment({**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   "OMP_NUM_THREADS": "1"})
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _extra(folder, checkpoints: str, step: int) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder / f"{checkpoints}-{step}.pt"
    dcp_to_torch_save(str(folder / checkpoints / f"step-{step:08d}"), str(out))
    return torch.load(out, weights_only=False)["meta"]["extra"]


def test_text_run_resumed_onto_other_shares_trains_like_the_uninterrupted_run(text_job):
    _train_text(text_job, "a", "whole")
    # the interrupted run: only the step-3 checkpoint of the same run survives; it resumes under plan b
    os.makedirs(text_job / "resumed")
    shutil.copytree(text_job / "whole" / f"step-{TEXT_EVERY:08d}", text_job / "resumed" / f"step-{TEXT_EVERY:08d}")
    out = _train_text(text_job, "b", "resumed")
    assert f"resumed at step {TEXT_EVERY}" in out, out
    whole, resumed = _extra(text_job, "whole", TEXT_STEPS), _extra(text_job, "resumed", TEXT_STEPS)
    # the data position is counted in windows: 6 global batches of 8 read, whatever the shares
    assert whole["data"] == resumed["data"] == {"epoch": 0, "sample": TEXT_STEPS * TEXT_BATCH, "seed": 3,
                                                 "num_samples": (round(os.path.getsize(TEXT) * 0.9) - 1) // 16}
    assert resumed["data_file"] == "tinyshakespeare.txt"
    # the same windows, split 2 ways differently: the loss curve to float32 rounding (the loss is a sum
    # of the ranks' weighted partial means, in another grouping), and falling on real text
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"]))
    assert resumed["losses"][:TEXT_EVERY] == whole["losses"][:TEXT_EVERY]
    assert whole["losses"][-1] < whole["losses"][0] - 0.1, whole["losses"]


# -- the training recipe's options: train.py --precision --clip-grad-norm --schedule --warmup-steps ---
RECIPE_STEPS, RECIPE_WARMUP, RECIPE_LR, RECIPE_MIN = 10, 3, 0.05, 0.1


def _train_py(*args: str, torchrun: bool = True) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ([warm_python.torchrun(), "--nproc_per_node", "2", "--master_port", str(port)] if torchrun
                else [warm_python.python()])
    env = warm_python.environment({**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   "OMP_NUM_THREADS": "1"})
    return subprocess.run([*launcher, os.path.join(ROOT, "examples", "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_train_py_runs_the_recipe_in_bf16_with_clipping_and_a_warm_cosine_schedule(text_job):
    from runtime.training.schedules import lr_factor

    # a bf16 plan of the byte LM on 2 ranks (the emulated kinds of a.yaml, bare numbers, run every dtype)
    workload = load_workload(f"{text_job}/byte_lm.py:build")
    plan = planner.plan(wl.capture(workload.model, workload.example_args), Cluster.from_yaml(text_job / "a.yaml"),
                        wl.Config(global_batch_size=TEXT_BATCH, precision="bf16"))
    plan.to_yaml(text_job / "plan-bf16.yaml")
    done = _train_py(f"{text_job}/byte_lm.py:build", "--plan", f"{text_job}/plan-bf16.yaml",
                     "--cluster", f"{text_job}/a.yaml", "--steps", str(RECIPE_STEPS), "--precision", "bf16",
                     "--clip-grad-norm", "0.5", "--schedule", "cosine", "--warmup-steps", str(RECIPE_WARMUP),
                     "--lr", str(RECIPE_LR), "--min-lr-ratio", str(RECIPE_MIN), "--balance", "off", "--timeout", "60")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # every fifth step is logged with the gradient norm before clipping and the learning rate it used:
    # the warm-up's last step is behind step 5, whose rate is on the cosine; step 10 ends near the floor
    logged = {}
    for line in done.stdout.splitlines():
        if "] step " in line:
            words = line.split()
            step = int(words[words.index("step") + 1].split("/")[0])
            logged[step] = (float(words[words.index("norm") + 1]), float(words[words.index("lr") + 1]))
    assert sorted(logged) == [5, 10], done.stdout
    for step, (norm, lr) in logged.items():
        assert 0 < norm < float("inf"), done.stdout
        expected = RECIPE_LR * lr_factor(step - 1, "cosine", RECIPE_WARMUP, RECIPE_STEPS, RECIPE_MIN)
        assert lr == pytest.approx(expected, rel=5e-3), (step, lr, expected, done.stdout)   # printed with 3 digits
    assert RECIPE_MIN * RECIPE_LR < logged[10][1] < logged[5][1] < RECIPE_LR


@pytest.mark.parametrize("bad, says", [(("--clip-grad-norm", "-1"), "--clip-grad-norm must be a positive finite"),
                                       (("--warmup-steps", "10"), "--warmup-steps must be in [0, --steps 10)")])
def test_train_py_refuses_a_bad_recipe_option_in_one_line(bad, says):
    # checked before the workload or plan is read: no torchrun needed to see the usage error
    done = _train_py("examples/hf_llama.py:build", "--plan", "no-such-plan.yaml", "--steps", "10", *bad,
                     torchrun=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr and done.stderr.startswith("train.py: error:"), \
        done.stderr
