"""Elastic membership under torchrun's elastic agent (``runtime.elastic.membership``, issue 23 items 1, 3).

Two torchrun agents on this machine act as two nodes of two ranks each (``--nnodes 1:2
--rdzv-backend c10d`` on localhost; ``WHALELIKE_HOST`` names the spec host each stands for), and
``examples/train.py --leave-on-sigterm`` trains a float64 MLP with checkpoints. After the first
checkpoint one of node B's workers receives SIGTERM (a preemption notice): it leaves at the step
boundary and the three others go on under a plan for their devices, no restart. Once they have
written a checkpoint, node B is killed for good (its agent and its other worker, SIGKILL): node A's
workers fail, its agent starts them again, they find only node A's devices, plan onto them by
themselves and resume the newest checkpoint. Once the two-rank run has written a checkpoint, node B
starts again (the two-rank run held at a step until node A's agent sees it, so it cannot finish
first): node A's agent stops its workers with SIGTERM for the next rendezvous, they stop at a step
boundary and checkpoint it (every rank got notice), and the four ranks resume exactly there (no step
lost) under the plan of all four devices and finish. The losses of every step and the final
parameters and optimizer state must be those of the single-process float64 reference
(``tests/reference.py``). A survivor set that cannot hold the model stops with one line naming the
memory missing and the devices present, and a non-zero exit.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time

import pytest
import torch
from torch.testing import assert_close

import planner
import whalelike as wl
from dist_utils import free_port
from reference import train_reference
import warm_python
from torchrun_jobs import ROOT, TRAIN, children, env, final_state, load_workload, torchrun, worker_of, workload_source
from whalelike.graphs.capture import capture

STEPS, EVERY, BATCH = 24, 3, 16

# node-a's devices are twice node-b's speed; base_gflops slows steps so the kill and the return of
# node B land mid-run (about 0.2 s a step on four ranks, 0.3 s on node A's two)
CLUSTER = """
name: elastic-test
network: {intra_host_gbps: 2.0, inter_host_gbps: 2.0, latency_us: 50.0}
emulation: {base_gflops: 0.0005}
hosts:
  - name: node-a
    devices:
      - {kind: emu-a, count: 2, peak_tflops: 0.000002, memory_gib: 4, emulated_speed: 2.0}
  - name: node-b
    devices:
      - {kind: emu-b, count: 2, peak_tflops: 0.000001, memory_gib: %s, emulated_speed: 1.0}
"""
# node-b's memory in the second spec: 50 KiB a device, less than the model's weights, gradients and
# AdamW state (135 KiB in float64) even sharded over both
TINY_GIB = 0.00005


# the workload's loss waits while the file HOLD exists: the test holds the two-rank run at a step until
# node A's agent has seen node B come back, however long node B takes to rejoin on a loaded machine
# (else the run can finish first and node B joins a job with nothing left to do)
HELD_LOSS = """
import dataclasses, os, time

_build = build


def build():
    workload = _build()
    loss_fn = workload.loss_fn

    def held(outputs, targets):
        while os.path.exists(%r):
            time.sleep(0.02)
        return loss_fn(outputs, targets)

    return dataclasses.replace(workload, loss_fn=held)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("elastic")
    (folder / "workload.py").write_text(workload_source("float64") + HELD_LOSS % str(folder / "hold"))
    (folder / "cluster.yaml").write_text(CLUSTER % 4)
    (folder / "small.yaml").write_text(CLUSTER % TINY_GIB)
    workload = load_workload(folder)
    graphs = capture(workload.model, workload.example_args)
    config = wl.Config(global_batch_size=BATCH)
    planner.plan(graphs, wl.Cluster.from_yaml(folder / "cluster.yaml"), config).to_yaml(folder / "plan.yaml")
    small = wl.Cluster.from_yaml(folder / "small.yaml")
    planner.plan(graphs, small.present(["emu-a-0", "emu-a-1"]), config).to_yaml(folder / "plan-a.yaml")
    return folder, workload


# torch 2.13's agents share their rendezvous store with the workers, and a node that joins a running
# job then waits forever for the store's address, which the other agents wrote in their first round
# only (torch.distributed.elastic.rendezvous.dynamic_rendezvous.next_rendezvous); README "Elastic"
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# torchrun's agent in a process that imports it, says so (a file READY) and starts it once the file
# TRIGGER exists: agents join a rendezvous together, and a node that comes back joins at once,
# rather than after seconds of imports on a busy machine
WAITING_AGENT = """
import os, sys, time
from torch.distributed.run import main
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.02)
main(sys.argv[3:])
"""


def agent(folder, host: str, port: int, *, is_host: bool, plan: str = "plan.yaml", cluster: str = "cluster.yaml",
          checkpoints: str = "ckpt", restarts: int = 3, trigger=None, last_call: int = 1) -> subprocess.Popen:
    """One torchrun agent standing for spec host ``host`` (its own session, so it dies with its workers);
    with ``trigger`` (a path), started once that file exists. ``last_call``: how long a round this agent
    opens alone waits for more nodes before it completes without them."""
    conf = (f"is_host={str(is_host).lower()},last_call_timeout={last_call},keep_alive_interval=1,"
            "keep_alive_max_attempt=5")
    path = folder / f"{host}-{time.monotonic_ns()}.log"
    launcher = [torchrun()] if trigger is None else \
        [warm_python.python(), "-c", WAITING_AGENT, str(path.with_suffix(".ready")), str(trigger)]
    command = [*launcher, "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"elastic-{port}", "--rdzv-conf", conf,
               "--max-restarts", str(restarts), "--monitor-interval", "0.2",
               TRAIN, f"{folder}/workload.py:build", "--plan", f"{folder}/{plan}", "--cluster", f"{folder}/{cluster}",
               "--steps", str(STEPS), "--checkpoint-dir", f"{folder}/{checkpoints}", "--checkpoint-every", str(EVERY),
               "--balance", "off", "--timeout", "10", "--lr", "0.01", "--leave-on-sigterm"]
    with open(path, "w") as log:
        run = subprocess.Popen(command, cwd=ROOT, env=env(WHALELIKE_HOST=host, **AGENT_ENV), stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    run.log_path = path
    return run


def output(run: subprocess.Popen) -> str:
    return run.log_path.read_text()


def kill_node(run: subprocess.Popen) -> None:
    """SIGKILL the agent and its workers (which torchrun starts in sessions of their own)."""
    for pid in [run.pid, *children(run.pid)]:
        os.kill(pid, signal.SIGKILL)
    run.wait(timeout=30)


def wait_for(condition, runs, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for run in runs:
            assert run.poll() is None, f"{what}: an agent exited ({run.returncode}):\n{output(run)[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: timed out:\n" + "\n".join(output(r)[-3000:] for r in runs)
        time.sleep(0.05)


def ready(folder, count: int) -> bool:
    """Whether ``count`` waiting agents have imported torchrun (each writes a ``.ready`` file)."""
    return len(list(folder.glob("*.ready"))) >= count


def saved_by(folder, world_size: int) -> list:
    """The complete checkpoints in ``folder`` written by a plan of ``world_size`` workers."""
    from runtime import checkpoint

    return [c for c in checkpoint.complete(folder) if c.world_size == world_size]


def test_a_lost_node_is_planned_around_and_taken_back_exactly(job):
    folder, workload = job
    port, go = free_port(), folder / "go"
    a = agent(folder, "node-a", port, is_host=True, trigger=go)
    b = agent(folder, "node-b", port, is_host=False, trigger=go)
    runs = [a, b]
    try:
        wait_for(lambda: ready(folder, 2), runs, "the agents")
        go.touch()
        # the first checkpoint of the four-rank plan, then a preemption notice to node B's second worker
        wait_for(lambda: saved_by(folder / "ckpt", 4), runs, "the first checkpoint")
        os.kill(worker_of(b.pid, local_rank=1), signal.SIGTERM)
        # it leaves at a step boundary and the three others go on, no restart; then node B is gone for good
        wait_for(lambda: saved_by(folder / "ckpt", 3), runs, "a checkpoint of the three-rank plan")
        # the leaver's own last line, before its node goes (it may still be exiting when the checkpoint lands)
        wait_for(lambda: "left the job after step" in output(b), runs, "the leaver's exit")
        kill_node(b)
        first_b = b
        # the returning agent waits long for node A in a round it opens: node A's agent leaves its round
        # before it joins the next, and node B, alone in between, would complete a round of node B only
        # after its last call (torch's rendezvous); on a loaded machine 1 s is not enough for node A
        b = agent(folder, "node-b", port, is_host=False, trigger=folder / "node-b-returns", last_call=60)
        runs = [a, b]
        wait_for(lambda: ready(folder, 3), runs, "node B's agent")
        # node A's workers fail, start again, plan onto node A alone and write a checkpoint there
        wait_for(lambda: saved_by(folder / "ckpt", 2), runs, "a checkpoint of the two-rank plan")
        two_rank = saved_by(folder / "ckpt", 2)[0].load_plan()   # before newer checkpoints replace it
        # node B returns while the two-rank run is held at a step; once node A's agent stops its workers
        # for the next rendezvous (it sends them SIGTERM), the step goes on and they stop after it
        stops = output(a).count("closing signal SIGTERM")
        (folder / "hold").touch()
        (folder / "node-b-returns").touch()
        wait_for(lambda: output(a).count("closing signal SIGTERM") > stops, runs, "node B's return")
        (folder / "hold").unlink()
        for run in runs:
            run.wait(timeout=180)
    finally:
        (folder / "hold").unlink(missing_ok=True)
        for run in runs:
            if run.poll() is None:
                kill_node(run)
    text = output(a) + output(first_b) + output(b)
    assert a.returncode == 0 and b.returncode == 0, text[-6000:]
    assert two_rank.world_size == 2 and {w.host for w in two_rank.workers} == {"node-a"}
    # each change logged once, by rank 0: the leave (by the leaver too), the loss, then the return
    assert text.count("[elastic] leave after step") == 1 and text.count("left the job after step") == 1, text[-6000:]
    assert text.count("[elastic] membership changed: devices lost: emu-b-0 (node-b); gained: none") == 1, text[-6000:]
    assert text.count("devices lost: none; gained: emu-b-0 (node-b), emu-b-1 (node-b)") == 1, text[-6000:]
    # node B's return: node A's workers stopped at a step boundary with a checkpoint of it, resumed there
    stopped = [int(line.split("stopped after step ")[1].split(":")[0]) for line in text.splitlines()
               if "[elastic] stopped after step" in line]
    resumed = [int(line.split("resumed at step ")[1].split()[0]) for line in text.splitlines()
               if "resumed at step" in line]
    assert stopped and max(resumed) == max(stopped), (stopped, resumed, text[-6000:])
    last = saved_by(folder / "ckpt", 4)[-1]
    assert last.step == STEPS and last.load_plan().world_size == 4, last
    final = final_state(last.path, folder / "final.pt")

    generator = torch.Generator().manual_seed(0)
    batches = [workload.make_batch(BATCH, generator) for _ in range(STEPS)]
    losses, state = train_reference(workload.model, batches, lambda ps: torch.optim.AdamW(ps, lr=0.01),
                                    workload.loss_fn)
    assert_close(torch.tensor(final["meta"]["extra"]["losses"], dtype=torch.float64), torch.stack(losses))
    for name, value in state.items():
        assert_close(final[f"model/{name}"], value, msg=lambda m: f"{name}: {m}")


def test_survivors_that_cannot_hold_the_model_stop_with_one_line(job):
    folder, _ = job
    # the job ran on node A (plan-a.yaml); only node B, whose devices are too small, is present
    run = agent(folder, "node-b", free_port(), is_host=True, plan="plan-a.yaml", cluster="small.yaml",
                checkpoints="small-ckpt", restarts=0)
    try:
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            kill_node(run)
    text = output(run)
    lines = [line for line in text.splitlines() if line.startswith("train.py")]
    assert run.returncode != 0, text[-4000:]
    assert len(lines) == 1, text[-4000:]
    assert "the 2 device(s) present cannot hold the model under any plan: emu-b-0" in lines[0], lines[0]
    assert "short by" in lines[0] and "lost since the plan: emu-a-0, emu-a-1" in lines[0], lines[0]
    assert 'train.py", line' not in text, text[-4000:]


def test_the_membership_rule_names_each_workers_device(job):
    """whalelike.cluster's rule: WHALELIKE_HOST, else the host name or its first label, else a host
    named localhost, else rank order; the devices present in rank order, stragglers following them."""
    from whalelike.cluster import Straggler, member_host
    from whalelike.errors import SpecError

    folder, _ = job
    spec = wl.Cluster.from_yaml(folder / "cluster.yaml")
    assert member_host(spec, "node-b", "anything") == "node-b"
    assert member_host(spec, None, "node-a") == member_host(spec, None, "node-a.lab.org") == "node-a"
    assert member_host(spec, None, "elsewhere") is None
    with pytest.raises(SpecError, match="WHALELIKE_HOST='node-c' names no host"):
        member_host(spec, "node-c", "x")
    assert spec.device_of("node-b", 1, rank=0).name == "emu-b-1"
    assert spec.device_of(None, 0, rank=2).name == "emu-b-0"
    with pytest.raises(SpecError, match="host 'node-a' has 2 device"):
        spec.device_of("node-a", 2, rank=2)
    slowed = dataclasses.replace(spec, emulation=dataclasses.replace(
        spec.emulation, stragglers=(Straggler(rank=3, factor=2.0), Straggler(rank=0, factor=3.0))))
    present = slowed.present(["emu-b-0", "emu-b-1", "emu-a-1"])
    assert [d.name for d in present.devices] == ["emu-b-0", "emu-b-1", "emu-a-1"]
    assert present.name == "elastic-test[3 of 4]"
    assert [(s.rank, s.factor) for s in present.emulation.stragglers] == [(1, 2.0)]   # emu-b-1's; emu-a-0 is gone
    with pytest.raises(SpecError, match="ranks 0 and 1 both run device 'emu-a-0'"):
        spec.present(["emu-a-0", "emu-a-0"])


def test_a_new_plan_keeps_the_old_plans_config(job):
    from runtime.elastic.membership import config_of

    folder, workload = job
    spec = wl.Cluster.from_yaml(folder / "cluster.yaml")
    graphs = capture(workload.model, workload.example_args)
    old = planner.plan(graphs, spec, wl.Config(global_batch_size=BATCH, num_micro_batch=2, zero_stage=2,
                                               schedule="gpipe"))
    config = config_of(old)
    assert (config.global_batch_size, config.num_micro_batch, config.zero_stage, config.schedule,
            config.precision) == (BATCH, 2, 2, "gpipe", "fp32")
