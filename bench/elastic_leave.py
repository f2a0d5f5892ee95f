"""What a device that gives notice costs: leaving without a restart against the restart path, side by side.

Workload: a 4-rank job under ``torchrun`` on this machine (gloo, CPU), a float32 MLP of six Linear
layers annotated as two pipeline stages (``replicate`` each), planned by ``planner.plan`` on four
equal devices: two stages of two data-parallel ranks. During step ``--notice-step`` K, rank 2
(stage 1) is lost for good, and the job goes on with the three devices left.

* **leave** (issue 23 item 2, :mod:`runtime.elastic.departure`): ``Engine(departures=True)``;
  rank 2 receives SIGTERM during step K, finishes the step, hands its state over at the step
  boundary (here: nothing, its data-parallel peer holds the same) and exits 0; the three others
  form a new process group, re-plan onto their devices, move the layers that change stage and run
  step K + 1 on three ranks. No checkpoint is read; no step is lost.
* **restart**: the same job writing a checkpoint every ``--checkpoint-every`` steps
  (:func:`runtime.checkpoint.save`); rank 2 is killed (SIGKILL) during step K; its peers' collective
  fails, they exit, torchrun ends; a new ``torchrun`` starts three workers, which capture the
  model, make the plan for the three devices and load the newest checkpoint onto it
  (:func:`runtime.checkpoint.load`), then redo the steps since that checkpoint.

Measured per path: seconds from the notice (the SIGTERM, or the kill) until step K + 1 is complete,
the first step beyond the one in flight at the notice, so both paths are timed to the same
progress; the steps lost (completed before the notice and run again); and the median step time
on three ranks afterwards. Both paths run the same worker code (``--worker``), the same model,
data (batch ``s`` drawn from seed ``s``) and plans.

Run (starts torchrun itself; a minute or two)::

    .venv/bin/python bench/elastic_leave.py [--steps 14 --notice-step 6 --checkpoint-every 4 --width 512]
    .venv/bin/python bench/elastic_leave.py --smoke   # tiny sizes: checks that it runs

The last line is the headline: the restart path's seconds to step K + 1 over the leave's, and the
steps each lost.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LEAVER = 2


def model_and_plan(width: int, devices: int):
    import planner
    import torch
    import torch.nn as nn
    import whalelike as wl
    from whalelike.cluster import Cluster, Device, Network
    from whalelike.graphs.capture import capture

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            layers = []
            for _ in range(2):
                with wl.replicate(1):
                    layers += [nn.Linear(width, width) for _ in range(3)]
            self.layers = nn.ModuleList(layers)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    spec = Cluster("leave-bench", tuple(Device(f"cpu-{i}", "cpu", "localhost", peak_tflops=0.05, memory_gib=4)
                                        for i in range(4)), Network(2.0, 2.0, 50.0))
    model = Mlp()
    if devices < 4:
        spec = spec.present([d.name for i, d in enumerate(spec.devices) if i != LEAVER])
    graphs = capture(model, (torch.zeros(2, width),))
    plan = planner.plan(graphs, spec, wl.Config(global_batch_size=32, num_micro_batch=2))
    return model, plan, spec


def batch(step: int, width: int):
    import torch

    g = torch.Generator().manual_seed(step)
    return (torch.randn(32, width, generator=g),), torch.randn(32, width, generator=g)


def worker(args) -> None:
    """One rank of a torchrun job: ``--mode`` leave (departures on, SIGTERM at step K), restart
    (checkpoints, SIGKILL at step K) or resume (three ranks from the newest checkpoint)."""
    import torch
    import torch.nn.functional as F

    from runtime import Engine, checkpoint

    torch.set_num_threads(1)
    out = pathlib.Path(args.out)
    rank = int(os.environ["RANK"])
    model, plan, spec = model_and_plan(args.width, 3 if args.mode == "resume" else 4)
    engine = Engine(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=F.mse_loss,
                    cluster=spec, timeout_s=60, balance="off", departures=args.mode == "leave",
                    example_args=batch(0, args.width)[0])
    if args.mode == "resume":
        checkpoint.load(engine, checkpoint.latest(out / "checkpoints"))
    log = open(out / f"{args.mode}-rank{rank}.jsonl", "a")
    while engine.step < args.steps:
        step = engine.step
        if step == args.notice_step and rank == LEAVER and args.mode in ("leave", "restart"):
            (out / f"{args.mode}-notice.json").write_text(json.dumps({"time": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGTERM if args.mode == "leave" else signal.SIGKILL)
        engine.train_step(batch(step, args.width))    # a leaver raises Departed (SystemExit 0) here
        log.write(json.dumps({"step": step, "time": time.time(), "world": engine.plan.world_size}) + "\n")
        log.flush()
        if args.mode == "restart" and engine.step % args.checkpoint_every == 0:
            checkpoint.save(engine, out / "checkpoints")


def torchrun(args, mode: str, nproc: int, out: pathlib.Path) -> int:
    from timing import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "--max-restarts", "0", str(pathlib.Path(__file__).resolve()),
               "--worker", "--mode", mode, "--out", str(out), "--steps", str(args.steps),
               "--notice-step", str(args.notice_step), "--checkpoint-every", str(args.checkpoint_every),
               "--width", str(args.width)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if mode == "leave" and done.returncode != 0 or mode == "resume" and done.returncode != 0:
        sys.stderr.write(done.stdout[-20000:])
        raise SystemExit(f"the {mode} job failed (exit {done.returncode})")
    return done.returncode


def records(out: pathlib.Path, modes: tuple[str, ...], rank: int) -> list[dict]:
    rows = []
    for mode in modes:
        path = out / f"{mode}-rank{rank}.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def measure(args, out: pathlib.Path, path: str) -> dict:
    """Run one path; seconds from the notice to step K + 1 complete, steps lost, step time after."""
    sys.path.insert(0, str(ROOT))
    if path == "leave":
        torchrun(args, "leave", 4, out)
        modes, ended = ("leave",), None
    else:
        code = torchrun(args, "restart", 4, out)
        ended = time.time()         # the failure found and the job torn down
        if code == 0:
            raise SystemExit("the restart job ended cleanly although a rank was killed")
        # as many workers as the plan for the devices left has (the planner may leave one idle)
        torchrun(args, "resume", model_and_plan(args.width, 3)[1].world_size, out)
        modes = ("restart", "resume")
    notice = json.loads((out / f"{modes[0]}-notice.json").read_text())
    rows = records(out, modes, rank=0)          # rank 0 stays in both paths
    target = next(r for r in rows if r["step"] == args.notice_step + 1 and r["time"] > notice["time"])
    seen = [r["step"] for r in rows]
    redone = {step for step in seen if seen.count(step) > 1}     # completed, then run again after a resume
    after = [r for r in rows if r["time"] > target["time"]]
    times = [b["time"] - a["time"] for a, b in zip(after, after[1:]) if b["step"] == a["step"] + 1]
    worlds = sorted({r["world"] for r in after})
    return {"seconds": target["time"] - notice["time"], "lost": len(redone),
            "down_s": ended - notice["time"] if ended is not None else 0.0,
            "step_s": statistics.median(times) if times else float("nan"), "worlds": worlds}


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from smoke import parse_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("leave", "restart", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=14, help="steps of the job")
    parser.add_argument("--notice-step", type=int, default=6, help="the step during which rank 2 is lost")
    parser.add_argument("--checkpoint-every", type=int, default=4, help="the restart path's checkpoint interval")
    parser.add_argument("--width", type=int, default=512, help="the MLP's width")
    args = parse_args(parser, smoke={"steps": 6, "notice_step": 3, "checkpoint_every": 2, "width": 32})
    if args.worker:
        sys.path.insert(0, str(ROOT))
        worker(args)
        return
    if not 0 < args.checkpoint_every <= args.notice_step < args.steps - 2:
        raise SystemExit("need 0 < --checkpoint-every <= --notice-step < --steps - 2")
    base = pathlib.Path(tempfile.mkdtemp(prefix="elastic-leave-"))
    try:
        results = {}
        for path in ("leave", "restart"):
            out = base / path
            out.mkdir()
            results[path] = measure(args, out, path)
    finally:
        if os.environ.get("ELASTIC_LEAVE_KEEP"):
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    k = args.notice_step
    print(f"4 ranks (torchrun, gloo, CPU), MLP width {args.width}, rank {LEAVER} lost during step {k} of "
          f"{args.steps}; restart path checkpoints every {args.checkpoint_every} steps")
    print(f"{'path':<10} {'notice -> step ' + str(k + 1) + ' done':>24} {'of it: job down':>16} {'steps lost':>11} "
          f"{'step after':>11} {'ranks':>6}")
    for path, r in results.items():
        print(f"{path:<10} {r['seconds']:>22.2f} s {r['down_s']:>14.2f} s {r['lost']:>11d} {r['step_s'] * 1e3:>8.0f} ms "
              f"{'/'.join(map(str, r['worlds'])):>6}")
    print("(job down: from the notice until the first torchrun has exited, the failure found and every worker "
          "stopped; the rest is the new torchrun's start, capture, plan, checkpoint load and the steps run again)")
    leave, restart = results["leave"], results["restart"]
    print(f"elastic leave: notice to step {k + 1} done {leave['seconds']:.2f} s without a restart against "
          f"{restart['seconds']:.2f} s restarting = {restart['seconds'] / leave['seconds']:.2f}x faster; steps lost "
          f"{leave['lost']} against {restart['lost']}")


if __name__ == "__main__":
    main()
