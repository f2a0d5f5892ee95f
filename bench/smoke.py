"""The ``--smoke`` flag every bench script takes: the same run at tiny sizes, in seconds.

A smoke run goes through the bench's own code path (the same functions, the same peer and
whalelike sides, the same checks of exactness and fairness, the same final headline line) with
tiny models and few steps, rounds and repeats, so ``tests/test_bench_smoke.py`` can keep every
bench working without minutes of CPU. Its timings and ratios mean nothing. The smoke sizes are
argparse defaults only: options given on the command line still win, and without ``--smoke``
nothing changes. Imported by the bench scripts, which Python runs with ``bench/`` on its path.
"""
from __future__ import annotations

import argparse

_active = False


def active() -> bool:
    """Whether this process is a smoke run (its ``--smoke`` was given)."""
    return _active


def parse_args(parser: argparse.ArgumentParser, smoke: dict, normal: dict | None = None) -> argparse.Namespace:
    """``parser.parse_args()`` with a ``--smoke`` flag. ``smoke`` maps argument names (``dest``s) to
    the values a smoke run uses by default; ``normal`` gives the full-size values of names that are
    not command-line options (module-level sizes that workers read from ``args``), so the normal run
    keeps them as they were."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and few steps: runs the whole bench in seconds to check that it works "
                             "(its figures mean nothing); options given explicitly still apply")
    unknown = set(smoke) - {action.dest for action in parser._actions} - set(normal or {})
    if unknown:   # a misspelt name would only add an attribute nobody reads
        raise ValueError(f"smoke sizes for no option of this bench: {sorted(unknown)}")
    parser.set_defaults(**(normal or {}))
    known, _ = parser.parse_known_args()
    if known.smoke:
        parser.set_defaults(**smoke)
    args = parser.parse_args()
    global _active
    _active = args.smoke
    if args.smoke:
        shrunk = ", ".join(f"{name} {getattr(args, name)}" for name in smoke)
        print(f"smoke run (--smoke): {shrunk}; the figures below check that the bench runs, they measure nothing"
              if shrunk else "smoke run (--smoke): the full run (nothing to shrink)", flush=True)
    return args
