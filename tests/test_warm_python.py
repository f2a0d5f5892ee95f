"""The warm launchers (``tests/warm_python.py``) run a command as a cold interpreter would: its argv,
working directory, environment, standard streams and extra file descriptors, its exit status and
signals; a launcher killed outright takes its command with it; what they cannot run warm runs cold."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import warm_python



@pytest.fixture(autouse=True)
def _on(monkeypatch):
    """The launchers under test, also where the suite runs cold (``WHALELIKE_WARM=0``)."""
    monkeypatch.setenv(warm_python.SWITCH_ENV, "1")


def _env(**extra) -> dict:
    return warm_python.environment({**os.environ, "OMP_NUM_THREADS": "1", **extra})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_command_sees_its_own_argv_directory_environment_and_exits_with_its_code(tmp_path):
    code = ("import os, sys, torch; print(sys.argv, os.getcwd(), os.environ['MARK'], sys.executable, "
            "'torch' in sys.modules); sys.stderr.write('to stderr'); sys.exit(3)")
    done = subprocess.run([warm_python.python(), "-c", code, "a", "b c"], cwd=tmp_path, env=_env(MARK="m1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == f"['-c', 'a', 'b c'] {tmp_path} m1 {warm_python.python()} True"
    assert done.stderr == "to stderr"
    # a script by path: its folder heads sys.path, __name__ is __main__, an uncaught error exits 1 with its traceback
    (tmp_path / "script.py").write_text("import sys\nprint(sys.path[0], __name__)\nraise ValueError('boom')\n")
    done = subprocess.run([warm_python.python(), "-u", "script.py"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.strip() == f"{tmp_path} __main__"
    assert "ValueError: boom" in done.stderr and 'script.py", line 3' in done.stderr
    # a module with -m, and PYTHONPATH read from the command's environment
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("import sys\nprint('module', sys.argv[1:])\n")
    done = subprocess.run([warm_python.python(), "-m", "mod", "x"], cwd=tmp_path, capture_output=True, text=True,
                          env=_env(PYTHONPATH=str(tmp_path / "pkg")), timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "module ['x']", done.stderr


def test_an_inherited_descriptor_keeps_its_number(tmp_path):
    read, write = os.pipe()
    try:
        code = f"import os; os.write({write}, b'through the pipe'); os.close({write})"
        done = subprocess.run([warm_python.python(), "-c", code], env=_env(), pass_fds=(write,), timeout=60,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        os.close(write)
        write = -1
        assert os.read(read, 100) == b"through the pipe"
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


def test_signals_reach_the_command_and_a_killed_launcher_takes_it_along(tmp_path):
    marker = tmp_path / "pid"
    code = (f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    for sig, expected in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        marker.unlink(missing_ok=True)
        launcher = subprocess.Popen([warm_python.python(), "-c", code], env=_env())
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.02)
        command = int(marker.read_text())
        assert command != launcher.pid and warm_python.command_of(launcher.pid) == command
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == expected
        deadline = time.monotonic() + 10
        while _alive(command):
            assert time.monotonic() < deadline, f"the command outlived its launcher ({sig.name})"
            time.sleep(0.02)


def test_what_it_cannot_run_warm_runs_cold_and_the_commands_cpu_is_counted():
    before = warm_python.cpu_s()
    # -X is an interpreter option the launcher leaves to the real interpreter
    done = subprocess.run([warm_python.python(), "-X", "utf8", "-c", "import sys; print(sys.flags.utf8_mode)"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    done = subprocess.run([warm_python.python(), "-c", burn], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert warm_python.cpu_s() - before >= 0.5
    assert sys.executable != warm_python.python()
