"""Bad input and faults of runtime.Engine, on 3 gloo ranks (three spawns: a failed rank ends its world).

Spawn 1, on every rank: a plan for another world size, a plan for another model, a batch that
does not match the plan's shares (all clear errors raised before any collective, so no rank hangs);
then a rank that never arrives at step 1 while the others wait in its collective: they fail within
``timeout_s`` with an error naming themselves, the step and the missing rank (alive: its heartbeat
goes on).
Spawn 2: a rank dies during training; the survivors fail with an error naming the step and the
dead rank, and exit non-zero.
Spawn 3: two ranks hang inside the forward of step 1, one stopped (SIGSTOP), one alive in an
endless loop; rank 0's error names both and tells them apart. Rank 0 then resumes them.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import torch.distributed as dist

from dist_utils import spawn_ranks
from planner.plan import PlanError
from plans import worker
from runtime import DistributedStepError, Engine
from test_runtime_dp import Net, batches, make_cluster, make_plan
from whalelike.errors import WhaleError

WORLD = 3
TIMEOUT_S = 3.0
SHARES = [[4], [2], [1]]


def _engine(model, plan, **kwargs) -> Engine:
    cluster = dataclasses.replace(make_cluster(None), devices=make_cluster(None).devices[:WORLD])
    return Engine(copy.deepcopy(model), plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                  loss_fn=F.cross_entropy, cluster=cluster, timeout_s=TIMEOUT_S, **kwargs)


def _fault_setup(model_class=None):
    """A seeded model, its plan and data, and an Engine built for it (the start of every fault case)."""
    torch.manual_seed(0)
    model = (model_class or Net)()
    plan = make_plan(model, SHARES)
    data = batches(plan.global_batch_size, seed=0)
    return model, plan, data, _engine(model, plan)


def _bad_input_then_missing_rank(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = Net()
    plan = make_plan(model, SHARES)
    data = batches(plan.global_batch_size, seed=0)

    four = dataclasses.replace(plan, workers=plan.workers + [worker(3, 0, 3, sizes=[1])],
                               global_batch_size=plan.global_batch_size + 1)
    with pytest.raises(PlanError, match=r"the plan has 4 workers .* this run has 3 ranks; launch `torchrun --nproc_per_node 4"):
        _engine(model, four)

    other = dataclasses.replace(plan, model_fingerprint="0123456789abcdef" * 4)
    with pytest.raises(PlanError, match="plan was made for model 0123456789ab"):
        _engine(model, other).train_step(data[0])

    engine = _engine(model, plan)
    (x, z), y = data[0]
    with pytest.raises(WhaleError, match=r"the batch has 5 samples but the plan's shares \[4, 2, 1\] need global_batch_size=7"):
        engine.train_step(((x[:5], z[:5]), y[:5]))

    engine.train_step(data[0])
    if rank == 1:  # never arrives at step 1
        time.sleep(4 * TIMEOUT_S)
        return "absent"
    start = time.monotonic()
    with pytest.raises(DistributedStepError) as info:
        engine.train_step(data[1])
    waited = time.monotonic() - start
    message = str(info.value)
    assert message.startswith(f"rank {rank}, step 1: a collective failed or timed out (timeout_s=3 s)"), message
    assert re.search(r"rank 1 never reached step 1 \(last began: step 0\); it is alive \(heartbeat \d", message), message
    assert waited < 4 * TIMEOUT_S, f"failed after {waited:.1f} s"
    return message


def test_bad_input_and_missing_rank():
    outcomes = spawn_ranks(_bad_input_then_missing_rank, WORLD, init_process_group=False, timeout_s=240)
    for o in outcomes:
        assert o.ok, o.error
    assert outcomes[1].value == "absent"


def _rank_dies(rank: int, world_size: int) -> None:
    _, _, data, engine = _fault_setup()
    engine.train_step(data[0])
    if rank == 2:
        os._exit(17)  # dies without a word
    engine.train_step(data[1])


def test_dead_rank_fails_the_others_with_the_step():
    outcomes = spawn_ranks(_rank_dies, WORLD, init_process_group=False, timeout_s=240)
    assert outcomes[2].exitcode == 17
    for o in outcomes[:2]:
        assert o.exitcode == 1 and o.error_type == "DistributedStepError", o
        assert f"rank {o.rank}, step 1: a collective failed or timed out" in o.error, o.error
    # rank 0 holds the store; rank 1 may find it gone already (rank 0 exits as soon as it has failed)
    assert "rank 2 never reached step 1 (last began: step 0); it has died (its process, PID " in outcomes[0].error


class StallingNet(Net):
    """Net whose forward first calls ``stall`` when one is set (inside the step's compute segment)."""

    stall = None

    def forward(self, x, z):
        if self.stall is not None:
            self.stall()
        return super().forward(x, z)


def _ranks_hang(rank: int, world_size: int) -> str:
    _, _, data, engine = _fault_setup(StallingNet)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/pid{rank}", str(os.getpid()))
    engine.train_step(data[0])
    if rank == 1:
        engine.model.stall = lambda: os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 2:   # an endless loop until rank 0 has its error
        engine.model.stall = lambda: [time.sleep(0.05) for _ in iter(lambda: store.check(["test/release"]), True)]
    if rank > 0:
        engine.train_step(data[1])
        return "resumed"
    try:
        with pytest.raises(DistributedStepError) as info:
            engine.train_step(data[1])
    finally:
        os.kill(int(store.get("test/pid1")), signal.SIGCONT)
        store.set("test/release", "1")
    return str(info.value)


def test_hung_ranks_are_named_stopped_or_stuck_in_compute():
    outcomes = spawn_ranks(_ranks_hang, WORLD, init_process_group=False, timeout_s=240)
    assert outcomes[0].ok, outcomes[0].error
    message = outcomes[0].value
    assert message.startswith("rank 0, step 1: a collective failed or timed out (timeout_s=3 s); "), message
    assert re.search(r"rank 1 began step 1 but it is stopped \(PID \d+ on this machine, state T: SIGSTOP, ctrl-Z or "
                     r"a debugger; `kill -CONT \d+` resumes it\)", message), message
    assert re.search(r"rank 2 began step 1 but it has been inside one compute segment for [\d.]+ s although alive "
                     r"\(heartbeat [\d.]+ s ago\): its computation is stuck \(an endless loop", message), message
    for o in outcomes[1:]:   # resumed, they find rank 0 gone: they end (with an error), they do not hang
        assert o.exitcode is not None, o


def test_failure_lines_from_progress_and_heartbeat():
    """The survivors' lines for what a 3-rank spawn cannot stage cheaply (in-process, pure)."""
    from runtime.distributed import _diagnose, liveness

    now = time.time()
    alive = liveness({"time": now - 0.3, "pid": 1, "machine": "elsewhere -", "computing_s": None}, now, 1.5)
    assert alive == ("alive", "it is alive (heartbeat 0.3 s ago)")
    # began the step, then hung between two of the Engine's collectives (e.g. in its optimizer step)
    assert _diagnose(2, (5, 1), alive, step=5, entered=2, waited=40.0) == (
        "rank 2 began step 5 but has not entered its collective 2 of the step for 40.0 s (it entered 1); "
        "it is alive (heartbeat 0.3 s ago)")
    # a peer waiting in the same collective, alive, is no suspect
    assert _diagnose(2, (5, 2), alive, step=5, entered=2, waited=40.0) is None
    # another machine: no PID to ask, so a silent heartbeat says stopped, dead or hung
    silent = liveness({"time": now - 10.0, "pid": 77, "machine": "node7 pid:[1]", "computing_s": None}, now, 1.5)
    assert silent[0] == "silent" and silent[1].startswith(
        "its heartbeat stopped 10.0 s ago: it is hung in native code that holds the interpreter lock, stopped, "
        "or dead (PID 77 on node7)"), silent
    assert _diagnose(1, None, silent, step=0, entered=1, waited=3.0).startswith(
        "rank 1 never reached step 0 (last began: none); its heartbeat stopped")
    assert liveness(None, now, 1.5) == ("unknown", "")


def test_transport_messages_are_communication_failures():
    """gloo's words for a dead or hung peer make a DistributedStepError naming the rank, the model's own
    errors do not (pure: the messages as gloo prints them)."""
    from runtime.distributed import is_communication_failure

    for text in ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1234: Connection reset "
                 "by peer", "Timed out waiting 3000ms for recv operation to complete",
                 "Application timeout caused pair closure"):
        assert is_communication_failure(RuntimeError(text)), text
    assert not is_communication_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x3 and 4x5)"))


def test_progress_survives_the_store_host_exiting_after_the_last_collective():
    """Rank 0 hosts the store and may exit once the run's last collective is done while a peer still
    records the step's last hooks: recording is a diagnostic, so it must not raise; a collective that
    then fails says the store is unreachable (in-process: the store's host is a child process)."""
    import datetime
    import subprocess
    import sys

    from runtime.distributed import Progress, _progress_key

    host = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch.distributed as d\n"
         "s = d.TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False)\n"
         "print(s.port, flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=5))
        progress = Progress(1, 2, timeout_s=60.0, store=store)
        progress.enter(0)   # posted to the heartbeat's thread, which writes it at once
        # polled, not store.wait: a client's wait holds the client's lock, which the thread's set needs
        deadline = time.monotonic() + 10
        while not store.check([_progress_key(1)]):
            assert time.monotonic() < deadline, "the heartbeat's thread never wrote the progress record"
            time.sleep(0.01)
        assert store.get(_progress_key(1)) == b"0 1"
    finally:
        host.stdin.close()
        host.wait(timeout=30)
    progress.enter(0)   # the host is gone: dropped, not raised
    progress.enter(1)
    assert (progress.step, progress.entered) == (1, 1)
    error = progress.failure(1, 60.0, RuntimeError("Connection closed by peer"))
    assert "the progress store on rank 0 is unreachable" in str(error), error
