"""What the tests that launch ``examples/train.py`` under real torchrun share: the torchrun
binary (warm: ``tests/warm_python.py``), the environment its workers need, a small MLP workload (float32 or float64) written to a
folder, the final state of a checkpoint, and finding a job's worker processes (all, a child's, or
an agent's worker of a given local rank).
"""
from __future__ import annotations

import os
import sys
import textwrap

import torch

import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")


def workload_source(dtype: str = "float32") -> str:
    """A 4-layer MLP workload file (``build``) whose model, example and batches are of ``dtype``."""
    return textwrap.dedent(f"""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        import whalelike as wl

        def build():
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]).to(torch.{dtype})

            def make_batch(n, generator):
                return ((torch.randn(n, 32, generator=generator, dtype=torch.{dtype}),),
                        torch.randn(n, 32, generator=generator, dtype=torch.{dtype}))

            return wl.Workload(model, (torch.randn(8, 32, dtype=torch.{dtype}),), loss_fn=F.mse_loss,
                               make_batch=make_batch)
    """)


def load_workload(folder):
    """``build()`` of the workload file in ``folder``."""
    sys.path.insert(0, str(folder))
    try:
        sys.modules.pop("workload", None)
        from workload import build
    finally:
        sys.path.remove(str(folder))
    return build()


def torchrun() -> str:
    """torchrun, started warm (``tests/warm_python.py``; with ``env()``'s environment)."""
    return warm_python.torchrun()


def env(**extra: str) -> dict:
    """The environment of a job: the library on the path, one thread per rank, warm launchers."""
    return warm_python.environment({**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                    "OMP_NUM_THREADS": "1", **extra})


def final_state(directory, out) -> dict:
    """A complete checkpoint directory's contents as one dict (``model/...``, ``optim/...``, ``meta``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(directory), str(out))
    return torch.load(out, weights_only=False)


def processes(match) -> list[int]:
    """The pids of this machine's processes for which ``match(cmdline, environ)`` holds."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if match(cmdline, environ):
            found.append(int(pid))
    return found


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (``/proc/PID/stat``'s parent field); of a warm launcher,
    its command's."""
    pid = warm_python.command_of(pid) or pid
    found = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(child))
    return found


def worker_of(agent: int, local_rank: int) -> int:
    """The pid of torchrun agent ``agent``'s worker of ``LOCAL_RANK`` ``local_rank``."""
    for pid in children(agent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}" in environ:
            return pid
    raise LookupError(f"agent {agent} runs no worker of LOCAL_RANK {local_rank}")
