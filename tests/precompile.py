"""Write the bytecode of the modules the suite and the demo import, once, at set-up (``make setup``).

Why: ``pip`` compiles every module of a package it installs, and torch and transformers ship about
ten thousand, most of which no process here ever imports (``torch._inductor``'s code generators,
``torch.testing``, hundreds of transformers architectures): that was two thirds of the set-up's
time. So the Makefile installs without compiling and this script imports what the suite's
processes start with (the preload lists of the warm interpreters, :mod:`warm_python` and
:mod:`dist_utils`, and pytest's own), which writes their bytecode as any first import does. A
module imported later by only some processes is compiled by the first of them (``make test``
unsets ``PYTHONDONTWRITEBYTECODE``, so that process writes it for the others).

Two processes, one a core: this one imports torch and what stands on it, a second one at the same
time the packages that never import torch (:data:`WITHOUT_TORCH`: numpy, scipy, matplotlib,
datasets, pytest, ...; about 2,000 modules of the 4,000). Both may compile a module they share;
the import system writes bytecode atomically, so the second writer only repeats the work.

Invariant: importing here has no effect but the bytecode files; a module that fails to import is
reported and skipped (the process that needs it then fails with the real error).
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
sys.dont_write_bytecode = False

# besides the preload lists: what every pytest worker imports before its first test
SUITE = ["pytest", "xdist.remote", "xdist.plugin", "execnet", "hypothesis", "torch.testing"]
# modules of the preload lists that act when imported (frozen_heap freezes the heap)
SKIP = {"frozen_heap"}
# what the second process imports: packages whose import does not reach torch (one that came to
# would only cost time: both processes would compile torch)
WITHOUT_TORCH = ["numpy", "yaml", "networkx", "pulp", "scipy.interpolate", "scipy.optimize", "matplotlib",
                 "matplotlib.pyplot", "datasets", "tokenizers", "pytest", "xdist.remote", "xdist.plugin",
                 "execnet", "hypothesis"]


def _import_all(names) -> list[str]:
    failed = []
    for name in names:
        if name in SKIP:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, the set-up goes on
            failed.append(f"{name} ({type(e).__name__}: {e})")
    return failed


def main() -> int:
    if sys.argv[1:] == ["--without-torch"]:
        _import_all(WITHOUT_TORCH)     # failures are reported by the main process's final pass
        return 0
    other = subprocess.Popen([sys.executable, __file__, "--without-torch"])
    import dist_utils
    import warm_python

    names = list(dict.fromkeys([*warm_python.PRELOAD, *dist_utils.PRELOAD, *SUITE]))
    first = _import_all([n for n in names if n not in WITHOUT_TORCH])
    other.wait()
    # the rest, now mostly compiled by the other process, in this one too: reports what fails
    failed = first + _import_all([n for n in names if n in WITHOUT_TORCH])
    for line in failed:
        print(f"tests/precompile.py: could not import {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
