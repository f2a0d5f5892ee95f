"""Writes ``docs/reference/cli.md``, the command-line reference, from the argparse definitions.

Every command's ``--help`` as the code defines it: ``whalelike`` and each of its subcommands, and the
trainer (``examples/train.py``; ``whalelike train`` runs it from a job file). Generated, never edited
by hand: ``tests/test_docs_flags.py`` regenerates it and fails when the committed page differs.

    .venv/bin/python docs/reference/generate_cli.py
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "cli.md"
WIDTH = "100"   # argparse wraps help at the terminal's width: fixed, so the page is the same everywhere


def _help(parser: argparse.ArgumentParser) -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return parser.format_help().rstrip()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def render() -> str:
    """The page's text."""
    sys.path.insert(0, str(ROOT))
    from runtime.launch import trainer
    from whalelike import cli

    parser = cli.build_parser()
    parts = ["# Command-line reference", "",
             "Generated from the code by `docs/reference/generate_cli.py`; do not edit by hand.", "",
             "## whalelike", "", "```text", _help(parser), "```"]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        parts += ["", f"## whalelike {name}", "", "```text", _help(sub), "```"]
    parts += ["", "## examples/train.py (the trainer; `whalelike train JOB.yaml` sets its flags from a job file)", "",
              "```text", _help(trainer.build_parser()), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    text = render()   # puts the repository on the path
    from whalelike.files import write_atomic

    write_atomic(PAGE, text)
    print(f"wrote {PAGE}")
