"""Run ``bench/NAME.py --smoke`` as a fresh process that starts with the imports done.

A bench started as ``python bench/NAME.py`` first spends seconds of CPU importing torch,
transformers and the library (about 5 s on this machine), which for most smoke runs is more than
the run itself, and the suite starts about thirty of them. Here the bench runs in a process the
test process's forkserver makes (``dist_utils``: it imported those modules once and never ran a
tensor op or a collective), exactly as Python runs a script: ``__main__`` is the bench file
(``runpy.run_path``), its folder heads ``sys.path``, ``sys.argv`` is its command line, the
working directory is the repository, the environment is the one given, stdout and stderr are
files (so the bench's own subprocesses write there too), and the exit status is the script's.
What differs from a cold start is only that the modules are imported already, and that
``sys.executable`` is ``tests/warm_python.py``'s launcher, so that the torchrun jobs and commands
the bench starts from its folder start warm as well. The CPU seconds the
bench used (its own and those of the subprocesses it waited for) join the launching process's
``dist_utils.RANK_CPU_S``, as a spawned rank's do, so that the suite's CPU accounting sees them.
"""
from __future__ import annotations

import os
import pathlib
import resource
import runpy
import sys
import tempfile
import traceback
from dataclasses import dataclass

import dist_utils
import warm_python
from dist_utils import _context

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run_bench(name: str, args: list[str], env: dict[str, str], timeout_s: float) -> Finished:
    """``bench/{name}.py *args`` in a preloaded fresh process; raises TimeoutError past ``timeout_s``."""
    ctx = _context()
    # what the bench launches (torchrun jobs, the CLI) through sys.executable's folder runs warm too
    env, python = warm_python.environment(dict(env)), warm_python.python()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = ctx.Process(target=_main, args=(name, list(args), env, out, err, python), daemon=False)
        process.start()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
            raise TimeoutError(f"bench/{name}.py {' '.join(args)} still ran after {timeout_s:g} s:\n"
                               f"{_read(out)[-4000:]}\n{_read(err)[-4000:]}")
        cpu = _read(os.path.join(tmp, "cpu"))
        dist_utils.RANK_CPU_S[0] += float(cpu) if cpu else 0.0
        return Finished(process.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _main(name: str, args: list[str], env: dict[str, str], out: str, err: str, python: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.executable = python
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    script = ROOT / "bench" / f"{name}.py"
    sys.argv = [str(script.relative_to(ROOT)), *args]
    sys.path.insert(0, str(script.parent))
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:   # sys.exit("message"): Python prints it to stderr and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter does for an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        pathlib.Path(out).with_name("cpu").write_text(str(sum(u.ru_utime + u.ru_stime for u in usage)))
    sys.exit(code)
