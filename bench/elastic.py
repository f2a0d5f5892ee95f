"""Elastic: a 4-rank job loses one device for good mid-run; what each way of going on costs (issue 23).

The job: ``examples/train.py`` training ``examples/wide_mlp.py`` (a smaller width) on an emulated
cluster of two hosts, ``host-a`` with three devices (speeds 1, 1, 0.5) and ``host-b`` with one
(0.25), checkpoints every ``--every`` steps. After step ``--lose-at`` completes (for the paths that
resume, once a checkpoint is complete), ``host-b``'s device is gone for good (its worker, or its whole torchrun node, SIGKILL). The paths, side by side in one run:

* **(a) today's path** (docs/guides/multi-node-elastic.md, "The fallback by hand"): one torchrun agent of 4 ranks; the
  survivors' collectives fail, the job exits; a person writes the survivors' cluster spec, runs
  ``whalelike plan`` on it and starts torchrun again on 3 ranks with the new plan, which resumes
  the newest checkpoint resharded. The person's reaction time is not counted (zero here), only
  the machine's: the failure, the planner, the start.
* **(b) automatic re-plan on restart** (``runtime.elastic.membership``): two torchrun agents
  (``--nnodes 1:2 --rdzv-backend c10d``), ``host-a``'s with 3 ranks and ``host-b``'s with 1; the
  whole ``host-b`` node is killed; ``host-a``'s agent starts its workers again, they find the
  devices present, plan onto them and resume the newest checkpoint.
* **(c) leaving without a restart** (``runtime.elastic.departure``): one torchrun agent of 4 ranks
  running ``train.py --leave-on-sigterm``; ``host-b``'s worker receives SIGTERM (a preemption
  notice), finishes the step it is in, hands its state over at the step boundary and exits 0; the
  three others re-plan onto their devices and go on in the same processes: no checkpoint read, no
  restart.

Measured per path, from the job's own per-step log lines (``--log-every 1``, time-stamped as they
arrive): the steps lost (completed before the loss, trained again after it: those since the newest
checkpoint), the seconds from the loss (the kill, or the notice) to the next completed step on the
devices left (for (c): the first step after the one in flight at the notice), and the throughput after the
change (samples/s over the steps after the first two of the resumed run) against the ideal for the
devices left: their emulated FLOP/s over the FLOPs of a sample (the work split perfectly, nothing
else costing time); the throughput before the loss against the ideal of all four, for reference.
Path (b)'s time includes torchrun's rendezvous ``last_call_timeout`` (3 s here; 30 s by default):
how long a start that has its minimum of nodes waits for more.

Run (about four minutes; starts its own torchrun jobs)::

    .venv/bin/python bench/elastic.py
    .venv/bin/python bench/elastic.py --smoke    # fewer steps, a tiny model: checks that it runs

The last line is the headline: each path's steps lost, seconds to the next step and throughput
after the change against the ideal.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import smoke  # noqa: E402
from smoke import parse_args  # noqa: E402
from timing import ENTRY_POINTS, Forked, free_port  # noqa: E402

BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(ROOT, "examples", "train.py")
# host-a's devices then host-b's: (kind, emulated speed, memory GiB); host-b's is the one lost
HOST_A = [("emu-full", 1.0, 4), ("emu-full", 1.0, 4), ("emu-half", 0.5, 2)]
HOST_B = [("emu-quarter", 0.25, 1)]
STEP_LINE = re.compile(r"step (\d+)/\d+\s+loss \S+.*?(\d+\.\d) ms$")
# where the run on the devices left takes over: a resume from a checkpoint, or (c) the leave
RESUMED = re.compile(r"resumed at step (\d+)|\[elastic\] leave after step (\d+)")
# torch 2.13's c10d agents share their store with the workers, and a node that joins waits forever
# (README "Elastic"); every agent of path (b) runs with the opt-out
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass
class Job:
    """One path's job: its folder, the sizes, and the whole cluster's spec and plan files."""

    folder: str
    args: argparse.Namespace
    spec: str = ""
    plan: str = ""
    flops_per_sample: float = 0.0   # forward and backward, from the captured TaskGraphs

    def ideal(self, speeds: list[float]) -> float:
        """Samples/s of devices of these emulated speeds with the work split perfectly and nothing
        else costing time: their summed FLOP/s over the FLOPs of a sample."""
        return sum(speeds) * self.args.base_gflops * 1e9 / self.flops_per_sample

    @property
    def workload(self) -> str:
        return os.path.join(self.folder, "workload.py") + ":build"

    def train_args(self, plan: str, cluster: str, checkpoints: str, *extra: str) -> list[str]:
        return [TRAIN, self.workload, "--plan", plan, "--cluster", cluster, "--steps", str(self.args.steps),
                "--checkpoint-dir", checkpoints, "--checkpoint-every", str(self.args.every), "--balance", "off",
                "--log-every", "1", "--timeout", "20", *extra]


@dataclass
class Outcome:
    """What losing the device cost on one path (see the module docstring)."""

    path: str
    steps_lost: int
    to_next_step_s: float
    before: float                 # samples/s before the loss
    after: float                  # samples/s after the change
    ideal: float                  # samples/s of the devices left, their compute split perfectly
    ideal_before: float           # the same for all the devices
    parts: dict = field(default_factory=dict)   # seconds of the phases between the loss and the next step


class Log:
    """A process's merged output, each line with the monotonic time it arrived."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.lines = process, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps(self, after: float = 0.0) -> list[tuple[float, int, float]]:
        """``(arrival, step, elapsed ms)`` of every step line that arrived after ``after``."""
        return [(t, int(m.group(1)), float(m.group(2))) for t, line in self.lines if t > after
                for m in [STEP_LINE.search(line)] if m]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for_step(self, step: int, timeout: float, after: float = 0.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [t for t, s, _ in self.steps(after) if s >= step]
            if done:
                return done[0]
            if self.process.poll() is not None:
                self._thread.join(timeout=5)
                raise RuntimeError(f"the job ended before step {step}:\n{self.text()[-3000:]}")
            time.sleep(0.02)
        raise RuntimeError(f"no step {step} within {timeout:g} s:\n{self.text()[-3000:]}")


def launch(command: list[str], env: dict[str, str]):
    """``command`` (a console script and its arguments) started in a new session, its merged
    output on ``.stdout``: a ``subprocess.Popen``, or in a smoke run the bench process forked
    (:class:`Forked`)."""
    if smoke.active() and os.path.basename(command[0]) in ENTRY_POINTS:
        return Forked(command, env)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def start(command: list[str], **env: str) -> Log:
    full = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(name, None)
    return Log(launch(command, full))


def workers_of(agent: int) -> dict[int, int]:
    """RANK -> pid of the worker processes torchrun agent ``agent`` started."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != agent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(e.split("=", 1) for e in f.read().decode(errors="replace").split("\0") if "=" in e)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in environ:
            found[int(environ["RANK"])] = int(pid)
    return found


def finish(log: Log, timeout: float) -> None:
    try:
        log.process.wait(timeout=timeout)
    finally:
        if log.process.poll() is None:
            os.killpg(log.process.pid, signal.SIGKILL)
    log._thread.join(timeout=5)


def kill_all(*logs: Log) -> None:
    """These torchrun agents and their workers (each in a session of its own), SIGKILL."""
    for log in logs:
        if log.process.poll() is None:
            for pid in [*workers_of(log.process.pid).values(), log.process.pid]:
                with contextlib.suppress(ProcessLookupError):   # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)


def lost_in_time(log: Log, job: "Job", lost_at: float, path: str) -> None:
    """Raises if the job had trained its last step before the device was lost (then nothing was lost:
    on a loaded machine the bench may react after the job is done, and a path would wait for a resume
    that never comes)."""
    last = [t for t, s, _ in log.steps() if s >= job.args.steps]
    if last and last[0] <= lost_at:
        raise RuntimeError(f"({path}) the job trained all {job.args.steps} steps before the device was lost after step "
                           f"{job.args.lose_at}: raise --steps or lower --base-gflops (slower emulated steps)")


def spec_dict(hosts: dict[str, list], base_gflops: float) -> dict:
    """A cluster spec of ``hosts`` (name -> devices), each device's peak the emulated speed priced
    as examples/clusters do (speed * base_gflops / 1000 / 0.4), so the planner predicts what runs."""
    return {"name": "elastic-bench", "network": {"intra_host_gbps": 2.0, "inter_host_gbps": 2.0, "latency_us": 50.0},
            "emulation": {"base_gflops": base_gflops},
            "hosts": [{"name": name, "devices": [
                {"kind": kind, "count": 1, "memory_gib": memory, "emulated_speed": speed,
                 "peak_tflops": speed * base_gflops / 1000 / 0.4} for kind, speed, memory in devices]}
                for name, devices in hosts.items()]}


def prepare(args) -> Job:
    folder = tempfile.mkdtemp(prefix="whalelike-elastic-")
    with open(os.path.join(folder, "workload.py"), "w") as f:
        f.write(f"from examples.wide_mlp import build as wide\n\n\ndef build():\n"
                f"    return wide(width={args.width}, blocks={args.blocks})\n")
    job = Job(folder, args, spec=os.path.join(folder, "cluster.yaml"), plan=os.path.join(folder, "plan.yaml"))
    with open(job.spec, "w") as f:
        yaml.safe_dump(spec_dict({"host-a": HOST_A[:args.host_a], "host-b": HOST_B}, args.base_gflops), f)
    # the whole cluster's plan, made here (the hand-made survivors' plan of path (a) is timed, by the CLI)
    import planner
    import whalelike as wl
    from whalelike.cli import load_workload

    workload = load_workload(job.workload)
    graphs = wl.capture(workload.model, workload.example_args, workload.example_kwargs, loss_fn=workload.loss_fn)
    planner.plan(graphs, wl.Cluster.from_yaml(job.spec), wl.Config(global_batch_size=args.global_batch)).to_yaml(job.plan)
    job.flops_per_sample = sum(g.forward_flops + g.backward_flops for g in graphs.graphs)
    return job


def run(command: list[str]) -> float:
    """Run ``command`` to its end; its seconds (an error with its output if it fails)."""
    began = time.monotonic()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if smoke.active() and os.path.basename(command[0]) in ENTRY_POINTS:   # forked (Forked)
        process = Forked(command, env)
        output = process.stdout.read()
        if process.wait() != 0:
            raise RuntimeError(f"{' '.join(command[:3])} failed:\n{output[-4000:]}")
        return time.monotonic() - began
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.monotonic() - began


def outcome(path: str, job: Job, before: Log, after: Log, lost_at: float, parts: dict) -> Outcome:
    """The measures of one path from the log before the loss and the log of the resumed run."""
    args = job.args
    # the steps of the last start before the loss (a node that joined late restarts the job once)
    began = max([t for t, line in before.lines if t <= lost_at and ("training" in line or RESUMED.search(line))],
                default=0.0)
    done_before = [s for t, s, _ in before.steps() if t <= lost_at]
    resumed = [int(m.group(1) or m.group(2)) for t, line in after.lines if t > lost_at
               for m in [RESUMED.search(line)] if m]
    if not resumed:
        raise RuntimeError(f"({path}) the job never resumed:\n{after.text()[-3000:]}")
    later = [(t, s, ms) for t, s, ms in after.steps(lost_at) if s > resumed[-1]]
    first = later[0][0]

    def throughput(steps) -> float:
        # the first two steps after a start warm up; a short run (a smoke run on a loaded machine, where
        # the loss lands late) may have no more than those, and then they are what there is
        times = [ms for _, _, ms in (steps[2:] if len(steps) > 2 else steps)]
        if not times:
            raise RuntimeError(f"({path}) no step ran after the loss: raise --steps above --lose-at "
                               f"({args.steps} and {args.lose_at})")
        return args.global_batch / (sum(times) / len(times) / 1e3)

    left = [speed for _, speed, _ in HOST_A[:args.host_a]]
    samples_before = throughput([s for s in before.steps(began) if s[0] <= lost_at])
    started = parts.pop("_started", lost_at)
    return Outcome(path, max(0, max(done_before) - resumed[-1]), first - lost_at, samples_before, throughput(later),
                   job.ideal(left), job.ideal(left + [HOST_B[0][1]]), {**parts, "start to next step": first - started})


def wait_for_checkpoint(folder: str, timeout: float) -> None:
    """Until ``folder`` holds a complete checkpoint. A loss before any is complete leaves nothing to
    resume and would time a fresh start: on a loaded machine the background saves of a short run (a
    smoke run's) may all be in flight still when step ``--lose-at`` is done."""
    from runtime import checkpoint

    deadline = time.monotonic() + timeout
    while not checkpoint.complete(folder):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint in {folder} was complete {timeout:.0f} s after step --lose-at")
        time.sleep(0.05)


def one_agent_loses(job: Job, checkpoints: str, flag: str, sent: signal.Signals,
                    resumes: bool = True) -> tuple[Log, float]:
    """One torchrun agent of all the ranks, ``train.py ... flag``; once step ``--lose-at`` is done
    (and, for a path that ``resumes``, a checkpoint is complete), host-b's worker (the last rank) is
    sent ``sent``. The job's log and the time it was sent."""
    world = job.args.host_a + 1
    log = start([os.path.join(BIN, "torchrun"), "--nproc_per_node", str(world), "--master_port", str(free_port()),
                 "--max-restarts", "0", *job.train_args(job.plan, job.spec, checkpoints, flag)])
    try:
        log.wait_for_step(job.args.lose_at, timeout=600)
        if resumes:
            wait_for_checkpoint(checkpoints, timeout=600)
        victim = workers_of(log.process.pid).get(world - 1)
        if victim is not None:
            os.kill(victim, sent)
        lost_at = time.monotonic()
        lost_in_time(log, job, lost_at, "every path")
    except BaseException:
        kill_all(log)
        raise
    return log, lost_at


def restart_by_hand(job: Job) -> Outcome:
    """(a): one agent; rank 3 dies; the job exits; a survivors' spec and plan by hand; 3 ranks resume."""
    args, checkpoints = job.args, os.path.join(job.folder, "a-ckpt")
    log, lost_at = one_agent_loses(job, checkpoints, "--no-elastic", signal.SIGKILL)
    finish(log, timeout=120)
    exited = time.monotonic()
    survivors, plan = os.path.join(job.folder, "survivors.yaml"), os.path.join(job.folder, "plan-survivors.yaml")
    with open(survivors, "w") as f:    # what the person writes: the spec without the lost device
        yaml.safe_dump(spec_dict({"host-a": HOST_A[:args.host_a]}, args.base_gflops), f)
    planning = run([os.path.join(BIN, "whalelike"), "plan", job.workload, "--cluster", survivors,
                    "--global-batch", str(args.global_batch), "-o", plan])
    started = time.monotonic()
    resumed = start([os.path.join(BIN, "torchrun"), "--nproc_per_node", str(args.host_a), "--master_port",
                     str(free_port()), *job.train_args(plan, survivors, checkpoints, "--no-elastic")])
    finish(resumed, timeout=600)
    if resumed.process.returncode != 0:
        raise RuntimeError(f"(a) the resumed job failed:\n{resumed.text()[-3000:]}")
    return outcome("a", job, log, resumed, lost_at,
                   {"failure to exit": exited - lost_at, "whalelike plan": planning, "_started": started})


def replan_on_restart(job: Job) -> Outcome:
    """(b): two agents (host-a: 3 ranks, host-b: 1); host-b's node dies; host-a's workers start
    again, re-plan onto the devices present and resume. On a loaded machine host-b's agent can join
    only after host-a's has trained every step alone (``--nnodes 1:2``): there was then no job on
    both nodes to lose one of, and the path runs again (at most :data:`JOIN_ATTEMPTS` times), from a
    fresh checkpoint directory, saying so on stderr."""
    for attempt in range(1, JOIN_ATTEMPTS):
        try:
            return _replan_on_restart(job, os.path.join(job.folder, f"b-ckpt-{attempt}"))
        except NeverJoined as e:
            print(f"(b) attempt {attempt}: {str(e).splitlines()[0]}; again", file=sys.stderr, flush=True)
    return _replan_on_restart(job, os.path.join(job.folder, f"b-ckpt-{JOIN_ATTEMPTS}"))


def _replan_on_restart(job: Job, checkpoints: str) -> Outcome:
    """One attempt of :func:`replan_on_restart`, checkpointing into ``checkpoints``."""
    args = job.args
    port = free_port()

    def agent(host: str, nproc: int, is_host: bool) -> Log:
        conf = f"is_host={str(is_host).lower()},last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"
        return start([os.path.join(BIN, "torchrun"), "--nnodes", "1:2", "--nproc_per_node", str(nproc),
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"bench-{port}",
                      "--rdzv-conf", conf, "--max-restarts", "2", "--monitor-interval", "0.2",
                      *job.train_args(job.plan, job.spec, checkpoints)], WHALELIKE_HOST=host, **AGENT_ENV)

    a = agent("host-a", args.host_a, True)
    b = agent("host-b", 1, False)
    # the job on every device prints on the node of rank 0 (either agent); on a loaded machine host-a's
    # agent may start alone first (--nnodes 1:2) and restart when host-b joins: its steps before that
    # ran on fewer devices, and host-b lost then was never part of the job
    try:
        before, started = _full_start([a, b], args.host_a + 1, timeout=600)
        before.wait_for_step(args.lose_at, timeout=600, after=started)
        wait_for_checkpoint(checkpoints, timeout=600)
        kill_all(b)
        lost_at = time.monotonic()
        lost_in_time(before, job, lost_at, "b")
    except BaseException:
        kill_all(a, b)
        raise
    finish(a, timeout=600)
    finish(b, timeout=10)
    if a.process.returncode != 0:
        raise RuntimeError(f"(b) host-a's job failed:\n{a.text()[-3000:]}")
    restarted = first_line_after(a, lost_at, "[elastic] membership changed")
    return outcome("b", job, before, a, lost_at, {"failure, restart, re-plan": restarted - lost_at, "_started": restarted})


def first_line_after(log: Log, after: float, marker: str) -> float:
    """When the first line holding ``marker`` arrived after ``after`` (``after`` itself if none did)."""
    return next((t for t, line in log.lines if t > after and marker in line), after)


JOIN_ATTEMPTS = 3


class NeverJoined(RuntimeError):
    """Every agent of a two-node start ended before a start on all the ranks (one node trained alone)."""


def _full_start(logs: list[Log], world: int, timeout: float) -> tuple[Log, float]:
    """The log and the time of the job's first start on all ``world`` ranks: the first ``training
    ... on {world} ranks`` or ``resumed at step N on {world} ranks`` line (rank 0 prints it, on its
    node's agent). A start on fewer ranks (host-a's agent alone, before host-b joined) prints a
    smaller count, so no line is skipped by when it arrived (a gate on the agents' workers being
    seen first missed a start that came before the bench's scan of ``/proc`` on a loaded machine)."""
    deadline = time.monotonic() + timeout
    start = re.compile(rf"(training \d+ steps of \d+ samples|resumed at step \d+) on {world} ranks")
    while time.monotonic() < deadline:
        for log in logs:
            found = [t for t, line in list(log.lines) if start.search(line)]
            if found:
                return log, found[0]
        if all(log.process.poll() is not None for log in logs):
            raise NeverJoined(f"every agent ended before a start on {world} ranks:\n" +
                               "\n".join(l.text()[-1500:] for l in logs))
        time.sleep(0.05)
    raise RuntimeError(f"no start on {world} ranks within {timeout:g} s:\n" + "\n".join(l.text()[-1500:] for l in logs))


def leave_without_restart(job: Job) -> Outcome:
    """(c): one agent of 4 ranks with ``--leave-on-sigterm``; host-b's worker (the last rank) receives
    SIGTERM, leaves at the step boundary, and the others go on in the same processes."""
    log, lost_at = one_agent_loses(job, os.path.join(job.folder, "c-ckpt"), "--leave-on-sigterm", signal.SIGTERM,
                                   resumes=False)
    finish(log, timeout=600)
    if log.process.returncode != 0:
        raise RuntimeError(f"(c) the job failed:\n{log.text()[-3000:]}")
    left = first_line_after(log, lost_at, "[elastic] leave after step")
    return outcome("c", job, log, log, lost_at, {"step in flight, hand-over, new plan": left - lost_at, "_started": left})


# the paths measured, in order
PATHS: dict[str, tuple[str, Callable[[Job], Outcome]]] = {
    "a": ("restart + hand-made plan", restart_by_hand),
    "b": ("automatic re-plan on restart", replan_on_restart),
    "c": ("leaving without a restart", leave_without_restart),
}


def report(outcomes: list[Outcome]) -> str:
    rows = []
    for o in outcomes:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in o.parts.items())
        rows.append(f"  ({o.path}) {PATHS[o.path][0]:<30} steps lost {o.steps_lost:>2}   loss -> next step "
                    f"{o.to_next_step_s:6.1f} s ({parts})   after: {o.after:6.1f} samples/s = {o.after / o.ideal:.0%} "
                    f"of the ideal {o.ideal:.1f} (before: {o.before:.1f} = {o.before / o.ideal_before:.0%} of "
                    f"{o.ideal_before:.1f} on all devices)")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="steps of the job (default 40)")
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints (default 5)")
    parser.add_argument("--lose-at", type=int, default=17, help="the device is lost after this step (default 17)")
    parser.add_argument("--width", type=int, default=128, help="wide_mlp's width (default 128)")
    parser.add_argument("--blocks", type=int, default=4, help="wide_mlp's blocks (default 4)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--base-gflops", type=float, default=0.1, help="the emulation's speed 1 (default 0.1)")
    parser.add_argument("--host-a", type=int, default=3, choices=[1, 2, 3], help="devices on host-a (default 3)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"paths to run (default {','.join(PATHS)})")
    # a smoke run's steps are slow by emulation (sleeps, no CPU): the device is lost in a window of
    # seconds between step --lose-at and the last, which a bench on a loaded machine still meets
    args = parse_args(parser, smoke=dict(steps=16, every=3, lose_at=7, width=16, blocks=2, host_a=1,
                                         base_gflops=0.001))
    job = prepare(args)
    world = args.host_a + 1
    print(f"elastic: {world} ranks ({args.host_a} on host-a, 1 on host-b), {args.steps} steps of {args.global_batch} "
          f"samples, checkpoints every {args.every}; host-b's device is lost after step {args.lose_at}", flush=True)
    outcomes = []
    try:
        for name in args.paths.split(","):
            outcomes.append(PATHS[name][1](job))
            print(report(outcomes[-1:]), flush=True)
    finally:
        shutil.rmtree(job.folder, ignore_errors=True)
    by_path = {o.path: o for o in outcomes}
    ratios = "".join(f"; leaving {by_path[p].to_next_step_s / by_path['c'].to_next_step_s:.2f}x faster than ({p})"
                     for p in ("a", "b") if p in by_path and "c" in by_path)
    print("elastic: " + "; ".join(
        f"({o.path}) {PATHS[o.path][0]}: {o.steps_lost} steps lost, {o.to_next_step_s:.1f} s to the next step, "
        f"throughput after {o.after / o.ideal:.2f}x the ideal" for o in outcomes) + ratios, flush=True)


if __name__ == "__main__":
    main()
