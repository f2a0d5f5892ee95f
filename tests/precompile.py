"""Write the bytecode of the modules the suite and the demo import, once, at set-up (``make setup``).

Why: ``pip`` compiles every module of a package it installs, and torch and transformers ship about
ten thousand, most of which no process here ever imports (``torch._inductor``'s code generators,
``torch.testing``, hundreds of transformers architectures): that was two thirds of the set-up's
time. So the Makefile installs with ``--no-compile`` and this script imports what the suite's
processes start with (the preload lists of the warm interpreters, :mod:`warm_python` and
:mod:`dist_utils`, and pytest's own), which writes their bytecode as any first import does. A
module imported later by only some processes is compiled by the first of them (``make test``
unsets ``PYTHONDONTWRITEBYTECODE``, so that process writes it for the others).

Invariant: importing here has no effect but the bytecode files; a module that fails to import is
reported and skipped (the process that needs it then fails with the real error).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
sys.dont_write_bytecode = False

# besides the preload lists: what every pytest worker imports before its first test
SUITE = ["pytest", "xdist.remote", "xdist.plugin", "execnet", "hypothesis", "torch.testing"]
# modules of the preload lists that act when imported (frozen_heap freezes the heap)
SKIP = {"frozen_heap"}


def main() -> int:
    import dist_utils
    import warm_python

    names = dict.fromkeys([*warm_python.PRELOAD, *dist_utils.PRELOAD, *SUITE])
    failed = []
    for name in names:
        if name in SKIP:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, the set-up goes on
            failed.append(f"{name} ({type(e).__name__}: {e})")
    for line in failed:
        print(f"tests/precompile.py: could not import {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
