"""Warm Python interpreters for the commands the suite runs as subprocesses (the docs' commands,
torchrun jobs): a ``python`` that starts with torch, transformers and the library already imported.

Why: a cold ``python`` here spends 4-6 s of CPU before the first line of a script runs (torch 2 s,
``torch._dynamo``, which every ``torch.optim`` step imports, 1.5 s, transformers 1.5 s), and a
4-rank torchrun job starts five of them. The docs test alone runs about a hundred, which on two
cores was most of the suite's time. ``tests/dist_utils.py`` solves the same problem for the ranks
it spawns with a forkserver; this is the same idea for programs started by path: a server (one
per test process, started on first use) imports :data:`PRELOAD` once and forks a fresh process
for each command. Nothing is stubbed: torchrun's agent, the CLIs and the scripts run their real
code with their real arguments, in their own process, session, working directory and
environment, with the caller's open file descriptors at the same numbers.

How a command reaches it: :func:`start` writes a directory of small launchers (``python``,
``python3``, and one per console script of the environment: ``torchrun``, ``whalelike``, ...)
that take the place of the interpreter. A launcher (:mod:`warm_shim`, stdlib only, started with
``-S``: tens of milliseconds) sends its argv, environment, working directory and file descriptors
to the server, forwards the signals it gets (``SIGTERM``, ``SIGINT``, ...) to the command's
process, and exits as it exits (the same code, or killed by the same signal). If it is killed
itself (``SIGKILL``), the command is killed with it. Whatever it cannot run warm (an interpreter
option it does not know, no server) it runs cold: it ``exec``s the real interpreter with the
same argv. In the command, ``sys.executable`` is the launcher, so what it starts in turn
(torchrun's workers, ``multiprocessing`` children) is warm too.

What differs from a cold start, and why it is acceptable here: the modules of :data:`PRELOAD` are
already imported (a missing import in the library could hide; ``tests/test_import_graph.py`` and
the cold runs the other tests make keep that covered), and every process forked from one server
shares its string-hash seed (a cold interpreter draws its own). The server is single-threaded when it forks but for the allocator's own
background thread that ``pyarrow`` (``datasets``) starts, which jemalloc makes safe across
``fork`` (its ``pthread_atfork`` handlers); it runs no tensor op and no collective, so no torch
thread pool or process group is inherited. The rest is reset as a fresh
interpreter has it: ``os.environ`` (C level too), ``sys.argv``, ``sys.path`` from the command's
``PYTHONPATH`` and script directory, the standard streams (line-buffered on a terminal, unbuffered
with ``-u``), signal handlers, and the random generators (``random`` and numpy reseeded from the
OS, torch's default generator back to its initial seed). ``WHALELIKE_WARM=0`` in the environment
of the test process turns it off: every command then runs cold.

CPU accounting: the commands are the server's descendants, not the test's, so their CPU would be
missing from ``tests/conftest.py``'s per-test figure. Each command's CPU (its own and its waited-for
children's) is appended to the server's ledger, which :func:`cpu_s` sums. To see which commands
cost what, ``WHALELIKE_COMMAND_CPU=FILE`` in the test process's environment appends a line per
command to FILE: its CPU seconds, working directory and argv; ``WHALELIKE_COMMAND_PROFILE=FOLDER``
runs each command under cProfile (``FOLDER/cmd-<pid>.prof``).

A script runs as ``python script`` runs it, called straight from the server's frames (not through
``runpy``), and the server runs as a script, not ``-c``: so every frame below the command's own
belongs to an imported module, as in a cold interpreter. ``inspect.stack()`` (torchrun's agent
calls it about twenty times per rendezvous) scans all of ``sys.modules`` for each frame whose file
no module has; with torch and transformers preloaded, that was a second of CPU per torchrun launch.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from warm_shim import receive, send   # the framing the launchers speak

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SOCKET_ENV = "WHALELIKE_WARM_SOCKET"
REAL_ENV = "WHALELIKE_WARM_PYTHON"      # the real interpreter, for a launcher's cold fallback
SWITCH_ENV = "WHALELIKE_WARM"           # "0": no server, every command cold

# imported once by the server: what the docs' commands and the suite's torchrun jobs import (a
# module missing here is imported by the command as usual; one that fails to import is skipped)
PRELOAD = ["torch", "torch.distributed", "torch.fx", "torch._dynamo", "torch.distributed.run",
           "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.nn.parallel", "torch.export._trace", "numpy", "yaml", "networkx", "pulp",
           "scipy.interpolate", "scipy.optimize", "matplotlib", "matplotlib.pyplot", "safetensors.torch",
           "transformers", "transformers.modeling_utils",
           *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "bert")),
           "datasets", "tokenizers", "whalelike", "whalelike.cli", "planner", "runtime", "runtime.engine",
           "runtime.launch.trainer", "runtime.parallel.pipeline", "runtime.checkpoint", "runtime.replicas.fsdp_sync"]

COMMAND_CPU_ENV = "WHALELIKE_COMMAND_CPU"
# a folder: every command runs under cProfile, its statistics in FOLDER/cmd-<pid>.prof (the server's
# environment decides, as for the ledger: set it in the test process's)
COMMAND_PROFILE_ENV = "WHALELIKE_COMMAND_PROFILE"
_SERVER_ENV = dict(os.environ)   # in the server: its environment at start (a command's replaces os.environ)
TORCH_INITIAL_SEED = 67280421310721      # torch's default generator's seed in a fresh process

_BASE_PATH: list[str] = []   # the server's: a cold interpreter's sys.path past its script directory and PYTHONPATH
_MAX_FDS = 250


# -- the server -------------------------------------------------------------------------------------
def serve(path: str, ledger: str) -> None:
    """Import :data:`PRELOAD`, then fork a monitor for each connection on the Unix socket ``path``,
    appending each command's CPU seconds to ``ledger``; runs until killed (:func:`start` runs it)."""
    import gc
    import importlib
    import warnings

    given = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path if p and p != str(HERE) and p not in given]

    warnings.filterwarnings("ignore")
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional module the environment lacks
            pass
    warnings.resetwarnings()
    gc.collect()
    gc.freeze()   # the preloaded heap: not walked (nor copied page by page) by the commands' collections
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)    # monitors are reaped by the kernel
    print("ready", flush=True)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)   # nobody reads the server's stdout after this line
    os.close(quiet)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _monitor(conn, ledger)
            finally:
                os._exit(0)
        conn.close()


def _monitor(conn: socket.socket, ledger: str) -> None:
    """One command: fork it, tell the launcher its pid, forward the launcher's signals, report how it
    ended; kill it if the launcher goes away first."""
    request, fds = receive(conn, _MAX_FDS)
    if request is None:
        return
    pid = os.fork()
    if pid == 0:
        conn.close()
        code = 1
        try:
            code = _command(request, fds)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    # which process runs the launcher's command (command_of), while it runs
    record = os.path.join(os.path.dirname(ledger), "pids", str(request["launcher"]))
    with open(record, "w") as f:
        f.write(str(pid))
    send(conn, {"pid": pid})

    def forward():
        while True:
            try:
                message, _ = receive(conn)
            except OSError:
                message = None
            if message is None:   # the launcher is gone: so is its command
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                return
            with contextlib.suppress(OSError):
                os.kill(pid, message["signal"])

    threading.Thread(target=forward, daemon=True).start()
    _, status, usage = os.wait4(pid, 0)
    with contextlib.suppress(OSError):
        os.unlink(record)
    with open(ledger, "a") as f:
        f.write(f"{usage.ru_utime + usage.ru_stime:.3f}\n")
    if os.environ.get(COMMAND_CPU_ENV):   # one line a command: its CPU seconds, directory and argv
        with open(os.environ[COMMAND_CPU_ENV], "a") as f:
            f.write(f"{usage.ru_utime + usage.ru_stime:7.2f} {request['cwd']} {' '.join(map(str, request['argv']))}\n")
    with contextlib.suppress(OSError):
        send(conn, {"status": status})


def _command(request: dict, fds: list[int]) -> int:
    """In the command's process: become the fresh interpreter ``request`` describes, run it, exit
    as Python would."""
    os.setsid()
    numbers = request["fds"]
    # the received descriptors to their numbers in the launcher: first above every number in play, so
    # that no move closes a descriptor not yet moved
    floor = max([*numbers, *fds], default=2) + 1
    staged = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for number, fd in zip(numbers, staged):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.umask(request["umask"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    _reopen_streams(unbuffered)
    sys.executable = request["executable"]
    sys.argv = list(request["argv"])
    profile_dir = _SERVER_ENV.get(COMMAND_PROFILE_ENV)
    if profile_dir:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()

        def dump():
            profile.disable()
            os.makedirs(profile_dir, exist_ok=True)
            profile.dump_stats(os.path.join(profile_dir, f"cmd-{os.getpid()}.prof"))

        atexit.register(dump)
    kind, target = request["kind"], request["target"]
    first = "" if kind in ("module", "code") else os.path.dirname(os.path.abspath(target))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    _reseed()
    import runpy

    code = 0
    try:
        if kind == "path":
            _run_script(target)
        elif kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            import types

            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        import traceback

        traceback.print_exc()
        code = 1
    _finish()
    return code


def _run_script(path: str) -> None:
    """Run the script ``path`` as ``python path`` does: its code compiled under its own name and run
    in a fresh ``__main__``, called straight from here. Not ``runpy.run_path``, whose frames (file
    ``<frozen runpy>``) a cold ``python script`` never has: ``inspect.stack()`` looks up the module of
    every frame and, for a file no module has, scans all of ``sys.modules`` (thousands here, with
    torch and transformers preloaded), once per frame and call: torchrun's agent calls it about twenty
    times per rendezvous, which cost it a second of CPU per launch. (A zip file or a directory, which
    ``python`` runs through its ``__main__``, goes to ``runpy``.)"""
    import builtins
    import importlib.machinery
    import runpy
    import types

    if not os.path.isfile(path) or path.endswith(".zip"):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:
        source = f.read()
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What the interpreter does at exit: join the non-daemon threads, run atexit, flush."""
    try:
        threading._shutdown()
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _reopen_streams(unbuffered: bool) -> None:
    def stream(fd: int, mode: str):
        try:
            os.fstat(fd)
        except OSError:
            return None
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="strict")
        tty = raw.isatty()
        buffered = io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                                line_buffering=tty or fd == 2, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, "r")
    sys.stdout = sys.__stdout__ = stream(1, "w")
    sys.stderr = sys.__stderr__ = stream(2, "w")


def _reseed() -> None:
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].random.default_generator.manual_seed(TORCH_INITIAL_SEED)


# -- the test process's side ---------------------------------------------------------------------
_server: dict = {}


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


def start() -> Optional[dict]:
    """This process's server, started on first use (None when turned off): its socket, ledger and
    launcher directory."""
    if not enabled():
        return None
    if _server.get("pid") == os.getpid():
        return _server
    folder = Path(tempfile.mkdtemp(prefix="wl-warm-"))
    if len(str(folder / "socket")) > 100:   # a Unix socket's path holds at most 107 bytes: a long TMPDIR
        shutil.rmtree(folder)
        folder = Path(tempfile.mkdtemp(prefix="wl-warm-", dir="/tmp"))
    path, ledger = str(folder / "socket"), str(folder / "ledger")
    Path(ledger).touch()
    (folder / "pids").mkdir()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT))
    # started as a script, not with -c: every frame of a command's stack then belongs to a module, as in a
    # cold interpreter (see _run_script)
    proc = subprocess.Popen([sys.executable, __file__, "serve", path, ledger], env=env,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the warm-interpreter server did not start (said {line!r}, exit {proc.poll()})")
    bin_dir = folder / "bin"
    _write_launchers(bin_dir, path)
    _server.clear()
    _server.update(pid=os.getpid(), proc=proc, socket=path, ledger=ledger, folder=folder, bin=bin_dir)
    atexit.register(stop)
    return _server


def stop() -> None:
    proc = _server.get("proc")
    if proc is not None and _server.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(_server["folder"], ignore_errors=True)
        _server.clear()


def cpu_s() -> float:
    """CPU seconds of every command this process's server has run to the end."""
    ledger = _server.get("ledger") if _server.get("pid") == os.getpid() else None
    if ledger is None:
        return 0.0
    with open(ledger) as f:
        return sum(float(line) for line in f if line.strip())


def command_of(launcher_pid: int) -> Optional[int]:
    """The pid of the process running the command of the warm launcher ``launcher_pid`` (the
    launcher's children are the command's: a test that walks a process tree asks here), or None
    when ``launcher_pid`` is not a running warm launcher of this process's server."""
    if _server.get("pid") != os.getpid():
        return None
    try:
        return int((_server["folder"] / "pids" / str(launcher_pid)).read_text())
    except (OSError, ValueError):
        return None


def _write_launchers(bin_dir: Path, socket_path: str) -> None:
    """``python`` and ``python3`` launchers, and one per console script of this environment's bin
    (a Python script whose first line names this interpreter)."""
    bin_dir.mkdir(parents=True)
    real = sys.executable
    names = {"python": None, "python3": None, f"python{sys.version_info[0]}.{sys.version_info[1]}": None}
    venv_bin = Path(real).parent
    for entry in sorted(venv_bin.iterdir()):
        if entry.name in names or not entry.is_file():
            continue
        try:
            first = entry.open("rb").readline()
        except OSError:
            continue
        if first.startswith(b"#!") and Path(first[2:].decode(errors="replace").strip().split()[0]).name.startswith("python"):
            names[entry.name] = str(entry)
    for name, script in names.items():
        body = (f"#!{real} -S\n"
                f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
                f"import warm_shim; warm_shim.main({real!r}, {script!r})\n")
        target = bin_dir / name
        target.write_text(body)
        target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def environment(env: dict) -> dict:
    """``env`` for a command that should run warm: the launchers first on ``PATH`` and the server's
    socket named (``env`` as it is when turned off)."""
    server = start()
    if server is None:
        return env
    return dict(env, PATH=f"{server['bin']}{os.pathsep}{env.get('PATH', '')}", **{
        SOCKET_ENV: server["socket"], REAL_ENV: sys.executable})


def python() -> str:
    """The interpreter to run a warm command with (the real one when turned off)."""
    return launcher("python")


def torchrun() -> str:
    """torchrun, warm (the environment's own when turned off)."""
    return launcher("torchrun")


def launcher(name: str) -> str:
    """The warm launcher of the environment's command ``name`` (``python``, ``torchrun``,
    ``whalelike``), or the command itself when turned off."""
    server = start()
    real = Path(sys.executable).parent / name if name != "python" else Path(sys.executable)
    return str(real) if server is None else str(server["bin"] / name)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:   # start()'s server
    # under its module name too: a command's stack holds the server's frames, and inspect finds their
    # module by that name once the command's own script has become __main__
    sys.modules["warm_python"] = sys.modules["__main__"]
    serve(sys.argv[2], sys.argv[3])
