"""Every command and code block of the user docs runs: the README and the pages under ``docs/`` cannot
drift from the code, because each fenced block is executed or checked here, page by page.

The kind of a block is its fence's first word, and every opening fence must name one:

- ``bash``: run with ``bash -euo pipefail``. A page's blocks run in order in one scratch directory
  where the repository's top-level entries (``examples/``, ``.venv/``, ``bench/``, ...) are links, so
  a later block reads what an earlier one wrote (``out/plan.yaml``) and nothing lands in the
  repository. Two rewrites keep the suite's time: a step count (``--steps N``, ``--train.steps N``,
  and a job file's ``steps: N`` that a ``yaml`` block writes) is capped at :data:`STEPS` (the command must run; how long is the benches' business; enough for the
  trainer's warm-up steps and the docs' learning-rate warm-ups), and a fixed
  rendezvous port (``localhost:29400``) becomes a free one.
- ``python``: a complete script, run in that directory with the suite's interpreter; a first line
  ``# torchrun --nproc-per-node N`` runs it under torchrun with ``N`` ranks, and a first line
  ``# file: NAME`` writes it to ``NAME`` there instead (a factory or a module that a later command of
  the page runs; it is compiled at once).
- ``yaml``: parsed; a first line ``# cluster`` loads it as a cluster (``Cluster.from_dict``), ``# job``
  checks it as a job file (``runtime.launch.job.from_dict``: keys and types), and ``# file: NAME``
  writes it to ``NAME`` for a later command of the page (and loads it as a cluster if it has ``hosts``).
  A ``yaml invalid`` block holds a mistake on purpose (a later command shows the error it gives): it
  is parsed and written, not loaded.
- ``json``: parsed.
- ``text``: output or a synopsis, shown and not run, except its commands: a line ``$ COMMAND`` (with
  its ``\\`` continuation lines) is a command the page shows with its output, and runs like a
  ``bash`` block's (from the same directory, after the blocks above it).

Shown output is compared where the command is deterministic (a plan, a capture's table, the
defaults): a ``text`` block marked ``output`` must match what ran. Its lines are the standard output
of the block just above it (a ``bash`` or ``python`` block that ran), or, in a block of ``$``
commands, each command's lines are those after it up to the next ``$``. Every shown line must
appear in that output, in order (trailing blanks ignored); lines may be left out, so a page can
show an excerpt, but none may differ. A ``text`` block that shows a plan summary (``plan for
model ...``) or a capture's table (``N TaskGraph(s), captured with ...``) must say which it is:
``output``, or ``varies`` when the run measures something (a profile taken on the page, timings)
and its figures cannot repeat. A ``text error`` block shows commands that fail: each ``$`` command
must exit with an error, and the lines after it must appear, in order, in its standard error. In a
shown line, ``...`` stands for any text (a path, a list cut short), and a line of only ``...`` for
lines left out.

A ``bash`` or ``python`` block may say why it cannot run here, ``norun=REASON``, with a reason from
:data:`NORUN`: it needs a CUDA device or several machines, or it is the suite's own set-up. Its
flags are still checked by ``tests/test_docs_flags.py``. Relative links of every page must resolve.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml

import warm_python

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"bash", "python", "yaml", "json", "text"}
NORUN = {
    "cuda": "needs a CUDA device (make gpu-check runs the one-GPU checks)",
    "machines": "needs several machines",
    "suite": "the set-up or the suite itself (make setup, make demo, make test)",
}
STEPS = 6
TIMEOUT_S = 600
FENCE = re.compile(r"^```(.*)$")
TORCHRUN = re.compile(r"^#\s*torchrun\s+--nproc[-_]per[-_]node[ =](\d+)\s*$")
FILE = re.compile(r"^#\s*file:\s*(\S+)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


# a record of past runs (their commands as they were then, their output): the benches themselves run at smoke
# size in tests/test_bench_smoke.py, and BENCHMARKS.md's table names each one's command
RECORDS = {ROOT / "docs" / "benchmarks-history.md"}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in RECORDS)]


def blocks(page: Path) -> list[tuple[int, str, dict, str]]:
    """(line, kind, options, text) of each fenced block of ``page``, in order."""
    found, open_at, info, body = [], None, "", []
    for number, line in enumerate(page.read_text().split("\n"), 1):
        fence = FENCE.match(line)
        if open_at is None:
            if fence:
                open_at, info, body = number, fence.group(1).strip(), []
        elif fence and not fence.group(1).strip():
            words = info.split()
            kind = words[0] if words else ""
            options = dict(w.split("=", 1) if "=" in w else (w, "") for w in words[1:])
            found.append((open_at, kind, options, "\n".join(body) + "\n"))
            open_at = None
        else:
            body.append(line)
    assert open_at is None, f"{page.relative_to(ROOT)}:{open_at}: a fenced block is never closed"
    return found


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_block_declares_its_kind():
    bad = []
    for page in _pages():
        for line, kind, options, text in blocks(page):
            where = f"{_id(page)}:{line}"
            if kind not in KINDS:
                bad.append(f"{where}: kind {kind!r} (one of {sorted(KINDS)})")
            reason = options.get("norun")
            if reason is not None and (reason not in NORUN or kind not in {"bash", "python"}):
                bad.append(f"{where}: norun={reason!r} (a bash or python block, one of {sorted(NORUN)})")
            marks = {"output", "varies", "error"} & set(options)
            if (marks and kind != "text") or len(marks) > 1:
                bad.append(f"{where}: {' and '.join(sorted(marks))} (a text block, one of them)")
            if "invalid" in options and kind != "yaml":
                bad.append(f"{where}: invalid (a yaml block: a file with a mistake, for the error a later command shows)")
            if "error" in marks and not shown_commands(text):
                bad.append(f"{where}: error (a block of `$` commands, each shown with the error it prints)")
            if kind == "text" and not marks and SHOWS_DETERMINISTIC.search(text):
                bad.append(f"{where}: shows a plan or a capture's table: mark it `output` (compared with the run "
                           f"above it) or `varies` (a measured run's)")
    assert not bad, "fenced blocks the docs test cannot classify:\n" + "\n".join(bad)


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for match in LINK.finditer(text):
            target = (match.group(1) or match.group(2)).split("#", 1)[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{_id(page)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def _scratch(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", "out", "__pycache__", ".venv"}:
            (work / entry.name).symlink_to(entry)
    venv = ROOT / ".venv"
    server = warm_python.start()
    if server is None:
        (work / ".venv").symlink_to(venv)
    else:   # the environment's commands (.venv/bin/torchrun, ...) as warm launchers (tests/warm_python.py)
        (work / ".venv").mkdir()
        for entry in venv.iterdir():
            (work / ".venv" / entry.name).symlink_to(server["bin"] if entry.name == "bin" else entry)
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shrunk_steps(text: str) -> str:
    """A YAML file's ``steps: N`` (a job's ``train.steps``) capped at :data:`STEPS`."""
    return re.sub(r"(\bsteps:\s*)(\d+)", lambda m: f"{m.group(1)}{min(int(m.group(2)), STEPS)}", text)


def shrunk(command: str, port: int) -> str:
    """``command`` as the test runs it: step counts capped at :data:`STEPS`, the fixed rendezvous
    port replaced by ``port``."""
    command = re.sub(r"(--(?:train\.)?steps)([ =])(\d+)", lambda m: f"{m.group(1)}{m.group(2)}{min(int(m.group(3)), STEPS)}",
                     command)
    return command.replace("localhost:29400", f"localhost:{port}")


def _run(argv: list[str], cwd: Path, where: str, fails: bool = False) -> str:
    """Runs ``argv`` from ``cwd``; its standard output (it must exit 0), or with ``fails`` its
    standard error (it must exit with an error)."""
    # the profile cache in the page's directory: a page measures as a first run on a fresh machine does,
    # and nothing lands in the home directory (~/.cache/whalelike/profiles, the default)
    env = warm_python.environment(dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=f"{ROOT / '.venv' / 'bin'}:"
                                       f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                                       WHALELIKE_CACHE=str(cwd / ".cache" / "whalelike")))
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert (done.returncode != 0) == fails, (
        f"{where} {'succeeded, but the page shows it failing' if fails else 'failed'} (exit {done.returncode}):\n"
        f"{' '.join(argv)}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-6000:]}")
    return done.stderr if fails else done.stdout


def missing_from(shown: str, output: str) -> Optional[str]:
    """None when every non-blank line of ``shown`` appears in ``output``, in order (trailing blanks
    ignored; lines of ``output`` may be skipped; ``...`` in a shown line stands for any text, a line
    of only ``...`` for lines left out), else why not: the first shown line that does not, and the
    output from the last line matched."""
    lines = [line.rstrip() for line in output.split("\n")]
    at = 0
    for number, line in enumerate(shown.split("\n"), 1):
        line = line.rstrip()
        if not line or line == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")))
        found = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        if found is None:
            rest = "\n".join(lines[at:at + 40])
            return (f"shown line {number} is not in the output (in order):\n  {line}\n"
                    f"--- the output from there on\n{rest}")
        at = found + 1
    return None


def shown_outputs(text: str) -> list[str]:
    """The output a ``text`` block shows after each of its ``$ COMMAND`` lines (:func:`shown`)."""
    return [output for _, output in shown(text)]


SHOWS_DETERMINISTIC = re.compile(r"^(plan for model \S+ on |\d+ TaskGraph\(s\), captured with )", re.M)


def _check_yaml(text: str, where: str, work: Path, invalid: bool = False) -> None:
    data = yaml.safe_load(text)
    first = text.lstrip().split("\n", 1)[0].strip()
    named = FILE.match(first)
    if named:   # written for a later command of the page; a cluster file is loaded as one too
        (work / named.group(1)).write_text(shrunk_steps(text))
    if invalid:   # a file with a mistake, for the error a later command shows
        return
    if first == "# cluster" or (named and isinstance(data, dict) and "hosts" in data):
        import whalelike as wl
        wl.Cluster.from_dict(data)
    elif first == "# job":
        from runtime.launch import job
        job.from_dict(data, origin=where)


def shown(text: str) -> list[tuple[str, str]]:
    """The ``$ COMMAND`` lines of a ``text`` block, each with its ``\\`` continuation lines, and the
    output the block shows after it (up to the next command)."""
    pairs: list[tuple[list[str], list[str]]] = []
    continued = False
    for line in text.split("\n"):
        if continued:
            pairs[-1][0].append(line)
        elif line.startswith("$ "):
            pairs.append(([line[2:]], []))
        elif pairs:
            pairs[-1][1].append(line)
            continue
        else:
            continue
        continued = line.rstrip().endswith("\\")
    return [("\n".join(command), "\n".join(output)) for command, output in pairs]


def shown_commands(text: str) -> list[str]:
    """The ``$ COMMAND`` lines of a ``text`` block (:func:`shown`)."""
    return [command for command, _ in shown(text)]


def _runnable_pages() -> list[Path]:
    return [p for p in _pages() if any((kind in {"bash", "python", "yaml", "json"} and "norun" not in options)
                                       or (kind == "text" and shown_commands(text))
                                       for _, kind, options, text in blocks(p))]


@pytest.mark.parametrize("page", _runnable_pages(), ids=_id)
def test_the_page_s_blocks_run(page, tmp_path):
    import json
    work = _scratch(tmp_path)
    port = _free_port()
    above: Optional[str] = None   # the standard output of the block just above, when it ran
    for line, kind, options, text in blocks(page):
        where = f"{_id(page)}:{line}"
        if "norun" in options:
            above = None
            continue
        if kind == "text":
            commands = shown(text)
            for number, (command, output) in enumerate(commands):
                script = work / f"shown_{line}_{number}.sh"
                script.write_text(shrunk(command, port) + "\n")
                ran = _run(["bash", "-euo", "pipefail", str(script)], work, f"{where} ($ {command.split(chr(10))[0]})",
                           fails="error" in options)
                if "output" in options or "error" in options:
                    why = missing_from(output, ran)
                    assert why is None, f"{where}: the output shown for `$ {command.split(chr(10))[0]}` differs from the run's: {why}"
            if "output" in options and not commands:
                assert above is not None, f"{where}: marked `output`, but no block that ran is just above it"
                why = missing_from(text, above)
                assert why is None, f"{where}: the output shown differs from the run of the block above: {why}"
            above = None
            continue
        above = None
        if kind == "yaml":
            _check_yaml(text, where, work, invalid="invalid" in options)
        elif kind == "json":
            json.loads(text)
        elif kind == "bash":
            script = work / f"block_{line}.sh"
            script.write_text(shrunk(text, port))
            above = _run(["bash", "-euo", "pipefail", str(script)], work, where)
        elif kind == "python":
            named = FILE.match(text.split("\n", 1)[0])
            if named:
                target = work / named.group(1)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
                compile(text, where, "exec")
                continue
            script = work / f"block_{line}.py"
            script.write_text(text)
            ranks = TORCHRUN.match(text.split("\n", 1)[0])
            python = warm_python.python()
            argv = ([python, "-m", "torch.distributed.run", "--nproc-per-node", ranks.group(1),
                     "--master-port", str(_free_port()), script.name] if ranks else [python, script.name])
            above = _run(argv, work, where)


def test_shown_commands_are_found_with_their_continuations():
    text = "$ whalelike plan m.py:f \\\n      -o p.yaml\nplan for model ...\n$ whalelike simulate p.yaml\nstep 1 ms\n"
    assert shown_commands(text) == ["whalelike plan m.py:f \\\n      -o p.yaml", "whalelike simulate p.yaml"]


def test_the_rewrites():
    """What the runner changes in a command, and only that."""
    assert shrunk("train.py m --steps 30 --compare-naive", 1) == "train.py m --steps 6 --compare-naive"
    assert shrunk("whalelike train j.yaml --train.steps 10", 1) == "whalelike train j.yaml --train.steps 6"
    assert shrunk("--steps 1 --rdzv-endpoint localhost:29400", 5) == "--steps 1 --rdzv-endpoint localhost:5"
    assert shlex.split(shrunk("--warmup-steps 5", 1)) == ["--warmup-steps", "5"]
    assert shrunk_steps("train: {steps: 10, warmup_steps: 20}\neval: {every: 5}\n") == \
        "train: {steps: 6, warmup_steps: 20}\neval: {every: 5}\n"
    assert shrunk_steps("train:\n  steps: 3\n") == "train:\n  steps: 3\n"


def test_shown_output_is_matched_line_by_line_in_order():
    output = "capturing m.py:f ...\nplan for model 0f: 2 stage(s)\n  stage 0: a\n\nsolver: greedy   \nwrote p.yaml\n"
    assert missing_from("plan for model 0f: 2 stage(s)\n\nsolver: greedy\n", output) is None   # an excerpt
    assert missing_from("", output) is None
    assert "shown line 2" in missing_from("plan for model 0f: 2 stage(s)\n  stage 0: b\n", output)  # changed
    assert "shown line 2" in missing_from("solver: greedy\n  stage 0: a\n", output)                # out of order
    assert missing_from("error: x.py: no such file (relative to ...)\n", "error: x.py: no such file (relative to /tmp/a/b)") is None
    assert missing_from("...\n  stage 0: a\n", output) is None                                   # lines left out
    assert "shown line 1" in missing_from("error: y...\n", "error: x.py\n")
    text = "$ whalelike plan m.py:f \\\n      -o p.yaml\nplan for model 0f\n$ whalelike simulate p.yaml\nstep 1 ms\n"
    assert shown_outputs(text) == ["plan for model 0f", "step 1 ms\n"]
    assert shown_outputs("no command\n") == []
