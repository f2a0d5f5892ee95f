"""The installed launcher: ``whalelike train JOB.yaml [--section.key value ...]``.

Role: turn a typed job file (:mod:`runtime.launch.job`: model, cluster, plan or planning options,
optimizer, train, data, eval, checkpoint, metrics, export, balance, elastic) into one training run
(:mod:`runtime.launch.trainer`, what ``examples/train.py`` runs), under ``torchrun`` or as a single
process.

Invariant: one definition of each option. The trainer's command-line flags are the definition (type,
default, help, checks); every job field names its flag and takes its default and help from it, and a
job compiles to the very ``argparse.Namespace`` the flags would give, checked by the same code. Every
error a job can hold (unknown section or key, wrong type, a missing file or directory, an optimizer the
planner cannot price) is one line naming the key, raised before any rank makes a process group.
"""
