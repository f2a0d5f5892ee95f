"""Train a planned model under torchrun: a thin wrapper of :mod:`runtime.launch.trainer` (its
docstring says everything the flags do), kept so ``torchrun ... examples/train.py MODEL --plan ...``
and every script importing ``parse_args``/``text_dataset`` from here keep working. The installed
launcher is ``whalelike train JOB.yaml`` (:mod:`runtime.launch`).

    torchrun --nproc_per_node 4 examples/train.py examples/hybrid_classifier.py:build \\
        --plan out/plan.yaml --steps 30 --compare-naive
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script from anywhere

from runtime.launch.trainer import *  # noqa: E402,F401,F403
from runtime.launch.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
