"""Restart after a lost rank, under real ``torchrun --max-restarts``, and train.py's one-line errors.

A small workload (a 4-layer MLP, two emulated unequal devices, steps slowed by the emulation so a
kill lands mid-run) is trained by ``examples/train.py`` twice for ``STEPS`` steps with checkpoints
every ``EVERY`` steps: once uninterrupted, once with rank 1 killed (SIGKILL, from outside, as an
OOM killer or a lost host would) right after the first checkpoint appears. torchrun sees the dead
worker, stops the survivor, restarts both (``--max-restarts 1``), and they resume from the newest
checkpoint. The two final checkpoints must hold the same parameters and optimizer state, bit for
bit (same plan, ``--balance off`` so timing noise cannot change shares, two ranks so every sum
has one order).

train.py's user errors (a missing plan file, no plan and nothing to resume, a bad argument) are one
line on stderr for the whole job, exit status 2, no traceback.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

import planner
import whalelike as wl
from dist_utils import free_port as _free_port
from torchrun_jobs import ROOT, env as _env, final_state, load_workload, processes, torchrun, workload_source
from whalelike.graphs.capture import capture

STEPS, EVERY = 24, 4

CLUSTER = """
name: restart-test
network: {intra_host_gbps: 2.0, inter_host_gbps: 2.0, latency_us: 50.0}
emulation: {base_gflops: 0.002}
hosts:
  - name: localhost
    devices:
      - {kind: emu-a, count: 1, peak_tflops: 0.000005, memory_gib: 4, emulated_speed: 1.0}
      - {kind: emu-b, count: 1, peak_tflops: 0.00001, memory_gib: 4, emulated_speed: 2.0}
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("restart")
    (folder / "workload.py").write_text(workload_source())
    (folder / "cluster.yaml").write_text(CLUSTER)
    workload = load_workload(folder)
    spec = wl.Cluster.from_yaml(folder / "cluster.yaml")
    plan = planner.plan(capture(workload.model, workload.example_args), spec, wl.Config(global_batch_size=16))
    plan.to_yaml(folder / "plan.yaml")
    return folder


def train_command(folder, checkpoints: str, *extra: str) -> list[str]:
    return [torchrun(), "--nproc_per_node", "2", "--master_port", str(_free_port()), *extra,
            os.path.join(ROOT, "examples", "train.py"), f"{folder}/workload.py:build", "--plan", f"{folder}/plan.yaml",
            "--cluster", f"{folder}/cluster.yaml", "--steps", str(STEPS), "--checkpoint-dir", f"{folder}/{checkpoints}",
            "--checkpoint-every", str(EVERY), "--balance", "off", "--timeout", "20"]


def _worker(marker: str, rank: int) -> int:
    """The pid of the train.py worker of ``rank`` whose command line contains ``marker``."""
    found = processes(lambda cmdline, environ: "train.py" in cmdline and marker in cmdline and
                      f"RANK={rank}" in environ and "torchrun" not in cmdline)
    assert found, f"no train.py worker of rank {rank} running for {marker}"
    return found[0]


def _final(folder, checkpoints: str) -> dict:
    return final_state(folder / checkpoints / f"step-{STEPS:08d}", folder / f"{checkpoints}.pt")


def test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_result(job):
    whole = subprocess.run(train_command(job, "whole"), cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = subprocess.Popen(train_command(job, "killed", "--max-restarts", "1"), cwd=ROOT, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = job / "killed" / f"step-{EVERY:08d}"
        deadline = time.monotonic() + 240
        while not first.exists():
            if run.poll() is not None:
                raise AssertionError(run.stdout.read())
            assert time.monotonic() < deadline, "the first checkpoint never appeared"
            time.sleep(0.05)
        os.kill(_worker(str(job / "killed"), rank=1), signal.SIGKILL)
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-4000:]
    assert "resumed at step" in output, output[-4000:]
    resumed_at = int(output.split("resumed at step ")[1].split()[0])
    assert EVERY <= resumed_at < STEPS, output[-4000:]
    expected, got = _final(job, "whole"), _final(job, "killed")
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("model/") for k in tensors) and any(k.startswith("optim/") for k in tensors)
    for key in tensors:
        assert torch.equal(expected[key], got[key]), f"{key} differs after the restart"
    assert expected["meta"]["extra"]["losses"] == got["meta"]["extra"]["losses"]


@pytest.mark.parametrize("argv, fragment", [
    (["--plan", "{folder}/missing.yaml"], "missing.yaml"),
    (["--checkpoint-dir", "{folder}/empty"], "--plan is required"),
    (["--plan", "{folder}/plan.yaml", "--steps", "two"], "--steps: invalid int value"),
    # planned at start: rank 0 plans for all (runtime.distributed.from_rank0), and its error is every rank's
    (["--global-batch", "1"], "global_batch_size 1 is smaller than"),
])
def test_user_errors_are_one_line_per_job(job, argv, fragment):
    command = [torchrun(), "--nproc_per_node", "2", "--master_port", str(_free_port()),
               os.path.join(ROOT, "examples", "train.py"), f"{job}/workload.py:build",
               "--cluster", f"{job}/cluster.yaml", *(a.format(folder=job) for a in argv)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("train.py")]
    assert done.returncode != 0
    assert len(lines) == 1 and fragment in lines[0], done.stdout + done.stderr
    # torchrun reports the failed worker (exit status 2) in its own summary; no worker printed a traceback
    assert "exitcode  : 2" in done.stderr or "exitcode: 2" in done.stderr, done.stderr
    assert 'train.py", line' not in done.stdout + done.stderr, done.stderr


def test_a_checkpoint_of_another_model_is_named_as_such(job):
    # without --plan the trainer resumes the newest checkpoint's plan; a checkpoint directory of another model
    # is then what is wrong (not the plan, which the user never gave): one line per job that says so
    checkpoints = job / "another"
    made = subprocess.run([torchrun(), "--nproc_per_node", "2", "--master_port", str(_free_port()),
                           os.path.join(ROOT, "examples", "train.py"), f"{job}/workload.py:build",
                           "--plan", f"{job}/plan.yaml", "--cluster", f"{job}/cluster.yaml", "--steps", "3",
                           "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", "--balance", "off"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and (checkpoints / f"step-{3:08d}").is_dir(), made.stdout + made.stderr
    (job / "other.py").write_text(workload_source().replace("for _ in range(4)", "for _ in range(3)"))
    done = subprocess.run([torchrun(), "--nproc_per_node", "2", "--master_port", str(_free_port()),
                           os.path.join(ROOT, "examples", "train.py"), f"{job}/other.py:build",
                           "--cluster", f"{job}/cluster.yaml", "--global-batch", "16", "--steps", "6",
                           "--checkpoint-dir", str(checkpoints)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("train.py")]
    assert done.returncode != 0
    assert len(lines) == 1, done.stdout + done.stderr
    assert f"--checkpoint-dir {checkpoints} holds a checkpoint of another model ({checkpoints}/step-00000003: " \
           "model " in lines[0] and "--no-resume" in lines[0], lines[0]
    assert 'train.py", line' not in done.stdout + done.stderr, done.stderr
