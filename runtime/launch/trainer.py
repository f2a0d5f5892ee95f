"""Train a planned model under torchrun, optionally side by side with the capacity-blind plan.

    torchrun --nproc_per_node 4 examples/train.py examples/hybrid_classifier.py:build \\
        --plan out/plan.yaml --steps 30 --compare-naive

Every rank loads the same workload and plan, draws the same synthetic global batches (a seeded
generator: the "corpus" is made by the workload's ``make_batch``), and trains through
``runtime.Engine``; each rank computes only its share. With ``--compare-naive`` the same model,
from the same initial weights and on the same batches, is trained again under the naive plan
(equal shares, equal layer counts, equal shards on the same devices), and rank 0 prints both loss
curves and throughputs side by side. The emulated cluster's devices are "hardware": the plan was
made from nominal figures only.

Dynamic balancing (``--balance``, default ``exact``): the whalelike run re-plans when a device's
measured speed changes (an ``emulation.stragglers`` entry in the cluster spec makes one slow down
mid-run, e.g. ``--cluster examples/clusters/emulated-straggler.yaml``); rank 0 prints every re-plan
event as it happens, and ``--run-timeline out/run.png`` draws step times per rank with the events
(a Chrome trace goes next to it, ``.json``). The naive run never re-plans: it is the baseline.

Checkpoints (``--checkpoint-dir DIR``): the whalelike run saves every ``--checkpoint-every`` steps
and at the end (``runtime.checkpoint.save_async``: torch.distributed.checkpoint, atomic, written by
a thread while training goes on), and a run started
with the same ``--checkpoint-dir`` resumes from the newest complete checkpoint there: the step, the
model and optimizer state, the data position (the batch generator's state) and the loss curve so far.
``--plan`` may then be left out (the checkpoint's plan is used) or name a *different* plan (another
cluster, other ranks): the state is resharded on load. Under ``torchrun --max-restarts N`` a rank
that dies makes the others fail within ``--timeout`` seconds; torchrun restarts them all and they
resume from the newest checkpoint. ``--no-resume`` starts from step 0 even if checkpoints exist.

Elastic (the default with ``--cluster`` and ``--checkpoint-dir``; ``runtime.elastic.membership``):
under ``torchrun --nnodes MIN:MAX --rdzv-backend c10d --max-restarts N`` each start of the workers
finds which devices of the cluster spec are present (each node stands for the spec host named by
``WHALELIKE_HOST``, or its host name; worker ``LOCAL_RANK`` i for that host's i-th device) and, when
they are not the plan's, plans the model onto them under the plan's Config and resumes the newest
checkpoint there: a node lost for good costs a restart, not a person; a node that joins is taken in
at the next rendezvous. Rank 0 prints each change once (devices lost and gained, both plans, the
predicted step times). When the devices present cannot hold the model, every rank stops with one
line naming the memory missing and the devices present. ``--no-elastic`` runs the plan as given.
With ``--leave-on-sigterm`` a worker that receives SIGTERM (a spot VM's preemption notice; torchrun's
agent passes a node's on to its workers) finishes the step it is in and leaves at its boundary
without a restart (``runtime.elastic.departure``): its state moves to the ranks that stay, which
re-plan onto their devices and go on in the same processes, no checkpoint read and no step lost;
the leaver exits 0. When every worker gets SIGTERM in the same step (the agent stopping them to
restart, as it does when a node joins; a drain of the whole job) they stop at that step's boundary
and write a checkpoint of it first (with ``--checkpoint-dir``), so the restart loses no step; exit
status 143, as the signal would have given. Off by default: the agent also stops workers with
SIGTERM when a peer failed, and a worker stuck in a collective then waits for its ``--timeout``
or the agent's kill (30 s).

Real data (``--data FILE``, with ``--seq-len N``, default the workload's ``seq_len``): a language
model (a workload that sets ``vocab_size``, e.g. ``examples/hf_llama.py:build``) trains on a plain
text file instead of synthetic batches, byte by byte (or through the workload's ``tokenizer``), in
non-overlapping next-token windows (``runtime.text_data.ByteTextDataset``, the file's first 90%:
the last 10% is its validation split). On a single-stage data-parallel plan each rank reads only
its share of every global batch (``runtime.UnevenLoader``) and follows re-planned shares; on
pipeline and tensor-parallel plans every rank reads the whole global batch (the same seeded
permutation on every rank, ``plan.global_batch_size`` windows per step, an epoch's last short batch
dropped). Epochs roll over with a new permutation (seeded by ``--seed`` + the epoch). The data
position (epoch, windows of the epoch read, seed) is in every checkpoint; it is counted in windows,
so a resumed run reads exactly the windows the uninterrupted run would have read next, also onto a
plan with other shares or of another kind (a different global batch size regroups the windows
that follow). A shipped text: ``examples/data/tinyshakespeare.txt`` (see ``examples/data/README.md``).

The training recipe (``runtime.training``): ``--precision fp32|bf16|fp16`` (default: the plan's;
autocast with float32 master weights, fp16 with a loss scaler; ``--grad-reduce-dtype bf16`` sums
replicas' gradients in half the bytes), ``--clip-grad-norm X`` (the whole
model's gradient clipped to global norm X; the norm is printed with each logged step),
``--schedule cosine|linear|constant`` with ``--warmup-steps N`` and ``--min-lr-ratio R`` (a warm-up
from ``--lr / N`` to ``--lr``, then the decay down to ``R * --lr`` at ``--steps``; saved in
checkpoints), and ``--measure-memory`` (each rank's measured peak memory next to the plan's
prediction, in a table at the end; always on GPUs, where it costs nothing). Activation
checkpointing is asked for in the model's annotation (``wl.replicate(recompute=True)``) or chosen
by the planner, and shows in the plan summary.

Errors in the command line or its inputs (a missing plan file, a bad argument, no torchrun
environment, a ``WHALELIKE_HOST`` that names no host of the cluster) are one line on stderr from rank
0 and exit status 2 on every rank, before any planning or process group; a plan
made for another model, found when the Engine captures it, is the same on every rank: one line from
rank 0 too, exit status 1; a failure while training is one line per rank (which rank, which step,
why) and exit status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import planner
import runtime
import whalelike as wl
from runtime import distributed
from runtime.elastic import membership
from runtime.state.pretrained import save_pretrained
from runtime.elastic.departure import Departed, LeaveConfig, Stopping
from runtime.text_data import ByteTextDataset, DataPosition, PlanBatches, TextDataError
from runtime.training.schedules import SCHEDULES as LR_SCHEDULES, lr_schedule
from whalelike.cluster import HOST_ENV, member_host
from whalelike.workload import load_workload
from whalelike.config import DEFAULT_MEMORY_RESERVE, PRECISIONS, SCHEDULE_CHOICES, ZERO_STAGES
from whalelike.display import format_table
from planner.errors import ModelMismatchError
from whalelike.errors import WhaleError, one_line
from whalelike.files import check_output_paths

WARMUP_STEPS = 2


EXIT_USAGE, EXIT_FAILED = 2, 1
EXIT_STOPPED = 128 + 15    # every rank got SIGTERM (--leave-on-sigterm): stopped at a step boundary, as a signal would
_QUIET_RANKS_WAIT_S = 10.0   # the most a quiet rank waits for rank 0 to have said why (another host: all of it)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line once per job (rank 0), not once per rank."""

    def error(self, message):
        say_once(f"{self.prog}: error: {message} (see --help)")
        raise SystemExit(EXIT_USAGE)


def _said_marker() -> str:
    """A file rank 0 creates once it has printed (same host: the other ranks stop waiting then)."""
    job = f"{os.environ.get('MASTER_PORT', '')}-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    return os.path.join(tempfile.gettempdir(), f"whalelike-train-said-{job}")


def say_once(line: str) -> None:
    """Print ``line`` on rank 0 only. The other ranks, failing alike, wait before they exit (torchrun
    stops every rank as soon as one exits with an error, and rank 0 must have said why): until rank 0
    has printed (a marker file, on its host) or at most ``_QUIET_RANKS_WAIT_S``, so a loaded machine
    cannot lose the line."""
    marker = _said_marker()
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            open(marker, "w").close()
        return
    deadline = time.monotonic() + _QUIET_RANKS_WAIT_S
    while time.monotonic() < deadline and not os.path.exists(marker):
        time.sleep(0.05)
    time.sleep(0.2)        # rank 0's exit goes first: torchrun then reports it, with its message


def build_parser(prog: str = "train.py") -> argparse.ArgumentParser:
    """The trainer's flags: the one definition of every training option (type, default, help). The
    job file's fields (:mod:`runtime.launch.job`) take their defaults and help from here."""
    p = _Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="path/to/file.py:factory returning a whalelike.Workload with loss_fn and make_batch")
    p.add_argument("--plan", help="plan YAML written by `whalelike plan` (optional when resuming: the checkpoint's)")
    p.add_argument("--cluster", help="preset name or cluster YAML the plan was made for (default: the plan's preset)")
    p.add_argument("--profile", metavar="PROFILE.yaml",
                   help="the cluster as `whalelike profile` measured it for this model (the one the plan was made "
                        "from with `whalelike plan --profile`): re-plans for measured speeds start from its rates")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (the peak of a --schedule; default 1e-3)")
    p.add_argument("--optimizer", default="AdamW", metavar="NAME",
                   help="torch.optim class: SGD, Adam or AdamW, whose state the planner prices (default AdamW)")
    p.add_argument("--optimizer-args", type=json_mapping, default={}, metavar="JSON",
                   help="the optimizer's other keyword arguments as a JSON mapping, e.g. '{\"weight_decay\": 0.1}'")
    p.add_argument("--weights", metavar="DIR",
                   help="fill the model from this local Hugging Face save_pretrained directory (each rank reads "
                        "the slices it holds; runtime.Engine(weights=...))")
    p.add_argument("--precision", choices=list(PRECISIONS),
                   help="training precision (default: the plan's, `whalelike plan --precision`)")
    p.add_argument("--grad-reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="dtype replicas sum gradients in: fp32 (exact, default) or bf16 (half the bytes)")
    p.add_argument("--clip-grad-norm", type=float, metavar="X",
                   help="clip the whole model's gradient to this global norm before each step (default: no clipping)")
    p.add_argument("--schedule", default="constant", choices=list(LR_SCHEDULES),
                   help="learning-rate schedule after the warm-up (default constant)")
    p.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help="steps of linear warm-up from lr/N to lr (default 0)")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, metavar="R",
                   help="cosine/linear decay ends at R * lr at the last step (default 0)")
    p.add_argument("--measure-memory", action="store_true",
                   help="measure each rank's peak memory on CPU too (slower; always on GPUs) and report it")
    p.add_argument("--no-memory-check", action="store_true",
                   help="leave the plan as planned when a rank's measured peak memory runs above its prediction "
                   "(default: a few steps into each plan the ranks compare, and the plan is re-priced for the "
                   "measured ratios; needs measured peaks: GPUs, or --measure-memory)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic batches, or of each epoch's permutation with --data (default 0)")
    p.add_argument("--data", metavar="FILE", help="train a language model on this text file (byte-level, or the "
                   "workload's tokenizer) instead of synthetic batches: each rank reads its share on a data-parallel "
                   "plan, every rank the whole global batch on a pipeline or tensor-parallel plan")
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens per window with --data (default: the workload's seq_len, what the plan was made for)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="with --data: a saved tokenizer directory; --data's files (text, JSON lines, parquet; "
                        "glob patterns, comma-separated) are then tokenized and packed with document boundaries "
                        "(runtime.packed_data.load_packed)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="with --data: evaluate on the validation split every N steps (0: never; runtime.evaluation)")
    p.add_argument("--eval-batches", type=int, metavar="N",
                   help="global batches per evaluation (default: every whole batch of the validation split)")
    p.add_argument("--global-batch", type=int, metavar="N",
                   help="without --plan: plan the model onto --cluster now, with this many samples per step")
    p.add_argument("--micro-batches", type=int, default=1, metavar="M",
                   help="without --plan: micro-batches per step (default 1)")
    p.add_argument("--zero", type=int, choices=list(ZERO_STAGES), metavar="N",
                   help="without --plan: ZeRO stage of every data-parallel stage (default: the planner picks)")
    p.add_argument("--pipeline-schedule", default="1f1b", choices=list(SCHEDULE_CHOICES),
                   help="without --plan: the pipeline schedule (default 1f1b)")
    p.add_argument("--memory-reserve", type=float, default=DEFAULT_MEMORY_RESERVE, metavar="F",
                   help="without --plan: the fraction of each device's memory the plan leaves free "
                        f"(default {DEFAULT_MEMORY_RESERVE:g}; whalelike.Config.memory_reserve)")
    p.add_argument("--export", metavar="DIR",
                   help="after the last step, write the trained model there as a Hugging Face save_pretrained "
                        "directory (safetensors shards, index, config.json) that from_pretrained loads "
                        "(runtime.state.pretrained.save_pretrained; an existing directory's model files are replaced)")
    p.add_argument("--metrics-dir", metavar="DIR",
                   help="rank 0 writes each step's figures there: JSON lines (steps.jsonl) and TensorBoard "
                        "scalars (tensorboard/) with loss, lr, gradient norm, tokens/s, MFU per device kind, peak "
                        "memory per rank, re-plans and leaves (runtime.control.metrics.Metrics)")
    p.add_argument("--compare-naive", action="store_true", help="also train under the capacity-blind plan")
    p.add_argument("--balance", default="exact", choices=["exact", "semi", "resize", "off"],
                   help="dynamic balancing policy of the whalelike run (default exact: never approximate)")
    p.add_argument("--run-timeline", metavar="PNG", help="write step times per rank and re-plan events here "
                   "(and a Chrome trace next to it, .json)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here and resume from the newest one")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="steps between checkpoints (default 10; one is also saved at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="newest checkpoints kept (default 2)")
    p.add_argument("--no-resume", action="store_true", help="start at step 0 even if --checkpoint-dir has checkpoints")
    p.add_argument("--no-elastic", action="store_true",
                   help="with --cluster and --checkpoint-dir, run the plan as given even if the devices present differ "
                        "(default: re-plan onto the devices present, runtime.elastic)")
    p.add_argument("--leave-on-sigterm", action="store_true",
                   help="a worker sent SIGTERM (a preemption notice) leaves at the next step boundary and the others "
                        "go on without a restart, re-planned onto the devices left (runtime.elastic.departure)")
    p.add_argument("--log-every", type=int, default=5, metavar="N",
                   help="in a log (not a terminal), print every N-th step's line (default 5)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="bound on every collective: a dead or hung rank fails the others after this (default 300)")
    p.add_argument("--on-nonfinite", default="raise", choices=["raise", "skip"],
                   help="a NaN or inf loss stops training naming the step (raise, default) or skips that step")
    p.add_argument("--batch-check-every", type=int, default=100, metavar="N",
                   help="check every N steps (and the first) that all ranks pass the same batch; 0: never (default 100)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(args, p.error)
    return args


def check_args(args: argparse.Namespace, fail) -> None:
    """The checks across flags, ``fail(message)`` for the first broken one (the parser's error, or
    the job file's, which names the key instead of the flag)."""
    p = argparse.Namespace(error=fail)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must exceed the {WARMUP_STEPS} untimed warm-up steps of the throughput table, got {args.steps}")
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if args.log_every < 1:
        p.error(f"--log-every must be at least 1, got {args.log_every}")
    if args.keep_checkpoints < 1:
        p.error(f"--keep-checkpoints must be at least 1, got {args.keep_checkpoints}")
    if not (args.timeout > 0) or args.timeout == float("inf"):
        p.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.batch_check_every < 0:
        p.error(f"--batch-check-every must be 0 (off) or a number of steps, got {args.batch_check_every}")
    if args.clip_grad_norm is not None and not (0 < args.clip_grad_norm < float("inf")):
        p.error(f"--clip-grad-norm must be a positive finite number (1.0 in most recipes), got {args.clip_grad_norm}")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        p.error(f"--warmup-steps must be in [0, --steps {args.steps}), got {args.warmup_steps}")
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        p.error(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    if not (args.lr > 0 and args.lr < float("inf")):
        p.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.seq_len is not None and args.data is None:
        p.error("--seq-len applies to --data only; give --data FILE or drop --seq-len")
    if args.seq_len is not None and args.seq_len < 1:
        p.error(f"--seq-len must be at least 1, got {args.seq_len}")
    if args.compare_naive and args.leave_on_sigterm:
        p.error("--compare-naive and --leave-on-sigterm do not mix: a rank that leaves cannot run the naive "
                "baseline afterwards; drop one")
    if args.compare_naive and args.checkpoint_dir:
        p.error("--compare-naive and --checkpoint-dir do not mix: the naive run is a side-by-side baseline, not "
                "a job to resume; drop one")
    if args.tokenizer is not None and args.data is None:
        p.error("--tokenizer applies to --data only; give --data FILES or drop --tokenizer")
    if args.eval_every < 0:
        p.error(f"--eval-every must be 0 (never) or a number of steps, got {args.eval_every}")
    if args.eval_every and args.data is None:
        p.error("--eval-every evaluates on --data's validation split; give --data FILE or drop --eval-every")
    if args.eval_batches is not None and args.eval_batches < 1:
        p.error(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if args.global_batch is not None and args.global_batch < 1:
        p.error(f"--global-batch must be a positive number of samples, got {args.global_batch}")
    if args.micro_batches < 1:
        p.error(f"--micro-batches must be at least 1, got {args.micro_batches}")
    try:
        optimizer_class(args.optimizer, args.optimizer_args)
    except WhaleError as e:
        p.error(str(e))


def json_mapping(text: str) -> dict:
    """``--optimizer-args``: a JSON mapping of keyword arguments."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON mapping of keyword arguments, got {text!r}")
    return value


# torch.optim's classes whose state the planner prices (whalelike.config.OPTIMIZERS names them);
# SGD with momentum keeps one buffer per parameter, without none
PRICED_OPTIMIZERS = ("SGD", "Adam", "AdamW")


def optimizer_class(name: str, kwargs: dict):
    """The ``torch.optim`` class named ``name``, its keyword arguments ``kwargs`` checked against
    its signature; a name the planner cannot price is an error saying which it can."""
    cls = getattr(torch.optim, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise WhaleError(f"--optimizer {name!r} is not a torch.optim optimizer; give one of "
                         f"{', '.join(PRICED_OPTIMIZERS)} (torch.optim class names)")
    if name not in PRICED_OPTIMIZERS:
        raise WhaleError(f"--optimizer {name}: the planner cannot price its state (it prices "
                         f"{', '.join(PRICED_OPTIMIZERS)}); use one of them")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "lr"}
    for key in kwargs:
        if key == "lr":
            raise WhaleError("--optimizer-args: give the learning rate as --lr (the schedule's peak), not 'lr'")
        if key not in accepted:
            raise WhaleError(f"--optimizer-args: torch.optim.{name} takes no keyword {key!r}; it takes "
                             f"{', '.join(sorted(accepted))}")
    return cls


def priced_optimizer(name: str, kwargs: dict) -> str:
    """The planner's name (``wl.Config.optimizer``) for the state of ``torch.optim.<name>(**kwargs)``."""
    optimizer_class(name, kwargs)
    if name == "SGD":
        return "sgd_momentum" if kwargs.get("momentum", 0) else "sgd"
    return name.lower()


def optimizer_factory(args):
    """``params -> torch.optim.<--optimizer>(params, lr=--lr, **--optimizer-args)``."""
    cls = optimizer_class(args.optimizer, args.optimizer_args)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in args.optimizer_args.items()}   # betas
    return lambda params: cls(params, lr=args.lr, **kwargs)


def metrics_controller(directory: str):
    """``--metrics-dir``'s controller (:class:`runtime.control.metrics.Metrics`): each step's figures
    as JSON lines in ``steps.jsonl`` (loss, learning rate, gradient norm, tokens/s, MFU per device kind,
    peak memory per rank, re-plans and leaves), and as TensorBoard scalars in ``tensorboard/`` where
    the ``tensorboard`` package is installed (``pip install 'whalelike[metrics]'``; without it, the
    JSON lines alone, said once)."""
    import importlib.util

    from runtime.control.metrics import Metrics
    board = None
    if importlib.util.find_spec("tensorboard") is not None:
        board = os.path.join(directory, "tensorboard")
    else:
        say_once(f"train.py: note: --metrics-dir {directory}: JSON lines only; install tensorboard "
                 "(pip install 'whalelike[metrics]') for TensorBoard scalars too")
    return Metrics(os.path.join(directory, "steps.jsonl"), tensorboard=board)


def _profile(args, cluster: wl.Cluster, plan: planner.Plan):
    """The profile of ``--profile`` (checked against the cluster and the plan's precision; the
    Engine checks the model), or None."""
    if args.profile is None:
        return None
    from planner.devices.profile import Profile
    return Profile.from_yaml(args.profile, cluster=cluster, precision=args.precision or plan.precision)


class _JobWide(WhaleError):
    """An error every rank meets alike while building its Engine (the plan made for another model):
    said once a job, as the input errors are."""


def _engine(name: str, model, plan: planner.Plan, cluster: wl.Cluster, workload: wl.Workload, args) -> "runtime.Engine":
    """The Engine of one run of :func:`train`, as the flags ``args`` set it up."""
    return runtime.Engine(model, plan, optimizer=optimizer_factory(args), weights=args.weights,
                          loss_fn=workload.loss_fn, cluster=cluster, timeout_s=args.timeout,
                          balance=args.balance if name == "whalelike" else "off",
                          example_args=workload.example_args, on_nonfinite=args.on_nonfinite,
                          batch_check_every=args.batch_check_every, precision=args.precision,
                          clip_grad_norm=args.clip_grad_norm, scheduler=schedule(args),
                          measure_memory=True if args.measure_memory else None,
                          memory_check=not args.no_memory_check,
                          grad_reduce_dtype=args.grad_reduce_dtype,
                          profile=_profile(args, cluster, plan) if name == "whalelike" else None,
                          departures=LeaveConfig(sigterm=True) if args.leave_on_sigterm else None)


def train(name: str, workload: wl.Workload, initial_state: "dict | None", plan: planner.Plan, cluster: wl.Cluster,
          args, resume: "runtime.checkpoint.CheckpointInfo | None" = None, dataset: "ByteTextDataset | None" = None) -> dict:
    """Train the workload's model under ``plan`` (a fresh copy from ``initial_state`` when one is given,
    for a run beside another; continuing ``resume`` if given); return its
    losses and timings (rank 0 prints). Only the whalelike run checkpoints."""
    if initial_state is None:
        model = workload.model
    else:
        model = copy.deepcopy(workload.model)
        model.load_state_dict(initial_state)
    try:
        engine = _engine(name, model, plan, cluster, workload, args)
    except ModelMismatchError as e:
        if resume is not None and args.plan is None:
            # the plan came from the checkpoint (no --plan): the checkpoint is what belongs to another model
            raise _JobWide(f"--checkpoint-dir {args.checkpoint_dir} holds a checkpoint of another model "
                           f"({resume.path}: model {e.planned}, this model is {e.actual}), whose plan is resumed when "
                           "no --plan is given; give this model a --checkpoint-dir of its own, or pass --no-resume "
                           "to start afresh") from None
        raise _JobWide(str(e)) from None
    batches = SyntheticBatches(workload, plan, args.seed) if dataset is None else \
        TextBatches(dataset, engine, args.seed)
    evaluator = None
    if args.eval_every and name == "whalelike":
        from runtime.evaluation import Evaluator
        evaluator = Evaluator(dataset.validation, args.eval_every, args.eval_batches)
    if args.metrics_dir is not None and name == "whalelike":
        engine.add_controller(metrics_controller(args.metrics_dir))
    losses, step_times, save_times = [], [], []
    show = engine.rank == 0
    if resume is not None:
        extra = runtime.checkpoint.load(engine, resume)
        batches.restore(extra, resume.path)
        losses = list(extra["losses"])
        if show:
            moved = "" if resume.world_size == plan.world_size and _same_plan(resume, plan) else \
                f", resharded from the {resume.world_size}-rank plan it was saved with"
            print(f"\n[{name}] resumed at step {engine.step} on {plan.world_size} ranks from {resume.path}{moved}",
                  flush=True)
    elif show:
        print(f"\n[{name}] training {args.steps} steps of {plan.global_batch_size} samples on {plan.world_size} ranks"
              f"{batches.describe()}", flush=True)
    saving = args.checkpoint_dir is not None and name == "whalelike"
    pending = None
    stopping = None
    for step in range(engine.step, args.steps):
        batch = batches.next()
        start = time.perf_counter()
        try:
            loss = engine.train_step(batch)
        except Stopping as e:        # --leave-on-sigterm and every rank got SIGTERM: this step is done, then stop
            loss, stopping = e.loss, e
        elapsed = time.perf_counter() - start
        losses.append(float(loss))
        if step >= WARMUP_STEPS:
            step_times.append(elapsed)
        result = evaluator.after_step(engine) if evaluator is not None and stopping is None else None
        show = engine.rank == 0      # a leave renumbers the ranks (the old rank 0 may have left)
        if show:
            progress(step + 1, args.steps, losses[-1], elapsed, engine.stats[-1], show_lr=engine.scheduler is not None,
                     every=args.log_every)
            if result is not None:
                print(f"  {result.line()}", flush=True)
            if engine.replans and engine.replans[-1].step == step:
                print(f"  re-plan at {engine.replans[-1].line()}", flush=True)
            if engine.departures is not None and engine.departures.history and \
                    engine.departures.history[-1].step == step:
                print(f"  [elastic] leave after step {step + 1}: {engine.departures.history[-1].line().split(': ', 1)[1]}",
                      flush=True)
        if saving and (engine.step % args.checkpoint_every == 0 or engine.step == args.steps or stopping):
            # written in the background while training goes on; the stall is the wait for the
            # previous checkpoint (if still writing) and the snapshot of this rank's pieces
            start = time.perf_counter()
            if pending is not None:
                pending.wait()
            pending = runtime.checkpoint.save_async(engine, args.checkpoint_dir, keep=args.keep_checkpoints,
                                            extra={**batches.state(), "losses": list(losses), "seed": args.seed})
            save_times.append(time.perf_counter() - start)
        if stopping is not None:
            break
    if pending is not None:
        pending.wait()
    if args.export is not None and name == "whalelike" and stopping is None:
        # every rank sends what it holds, rank 0 writes (runtime.state.pretrained): from_pretrained loads it
        start = time.perf_counter()
        written = save_pretrained(engine, args.export, config=getattr(model, "config", None))
        if show:
            print(f"  exported the trained model to {written} (save_pretrained format) in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    if stopping is not None:
        saved = f"; checkpoint step-{engine.step:08d} written, a restart resumes there" if saving else ""
        if show:
            print(f"  [elastic] stopped after step {engine.step}: every rank got SIGTERM{saved}", flush=True)
        raise stopping
    if args.run_timeline and name == "whalelike":
        from runtime.balance.run_timeline import gather_run, write_run_png, write_run_trace

        record = gather_run(engine)
        if record is not None:
            write_run_png(record, args.run_timeline, title=f"{name}: step times per rank, policy {args.balance}")
            write_run_trace(record, _trace_path(args.run_timeline))
            print(f"  wrote {args.run_timeline} and its Chrome trace", flush=True)
    overruns = sum(s.overruns for s in engine.stats)
    segments = sum(s.segments for s in engine.stats)
    mean_step = sum(step_times) / len(step_times) if step_times else float("nan")
    return {"name": name, "losses": losses, "step_ms": mean_step * 1e3, "replans": len(engine.replans),
            "predicted_ms": plan.prediction.step_time_ms, "speeds": plan.speeds,
            "throughput": plan.global_batch_size / mean_step, "overruns": f"{overruns}/{segments}",
            "save_ms": [t * 1e3 for t in save_times], "memory": gather_memory(engine),
            "norms": [s.grad_norm for s in engine.stats], "skipped": sum(s.skipped for s in engine.stats)}


def schedule(args):
    """The ``--schedule`` factory for the Engine, or None when the learning rate stays ``--lr`` (no
    warm-up, constant): then no scheduler runs at all."""
    if args.schedule == "constant" and args.warmup_steps == 0:
        return None
    return lr_schedule(args.schedule, args.warmup_steps, args.steps, args.min_lr_ratio)


def gather_memory(engine: runtime.Engine) -> "list[dict] | None":
    """Every rank's measured peak (the largest over its steps after the first) next to the plan's
    prediction for its worker, on rank 0 (a collective); None when memory was not measured."""
    peaks = [s.peak_memory_bytes for s in engine.stats[1:] if s.peak_memory_bytes is not None]
    mine = {"rank": engine.rank, "device": engine.worker.device, "measured": max(peaks) if peaks else None,
            "predicted": engine.plan.worker(engine.rank).memory_gib * 2**30}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return rows if all(r["measured"] is not None for r in rows) else None


class SyntheticBatches:
    """The workload's ``make_batch`` from a generator seeded with ``--seed``: every rank draws the same
    whole global batch; the position is the generator's state."""

    def __init__(self, workload: wl.Workload, plan: planner.Plan, seed: int):
        self.make_batch, self.size = workload.make_batch, plan.global_batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def describe(self) -> str:
        return ""

    def restore(self, extra: dict, where: str) -> None:
        if "generator" not in extra:
            raise WhaleError(f"{where} was trained on --data {extra.get('data_file', '?')}; resume with the same "
                             "--data, or start afresh with --no-resume")
        self.generator.set_state(extra["generator"])

    def next(self):
        return self.make_batch(self.size, self.generator)

    def state(self) -> dict:
        return {"generator": self.generator.get_state()}


class TextBatches:
    """``--data``: the batches of ``runtime.text_data.PlanBatches`` under the engine's plan (shares on a
    data-parallel plan, following re-plans; whole global batches otherwise); the position is a
    ``DataPosition``, counted in windows (see the module docstring)."""

    def __init__(self, dataset: ByteTextDataset, engine: runtime.Engine, seed: int):
        self.dataset, self.engine = dataset, engine
        self.position = DataPosition(seed=seed, num_samples=len(dataset))
        self._stream = None

    def describe(self) -> str:
        return f", reading {self.dataset}"

    def restore(self, extra: dict, where: str) -> None:
        if "data" not in extra:
            raise WhaleError(f"{where} was trained on synthetic batches, not --data; drop --data to resume it, or "
                             "start afresh with --no-resume")
        self.position = DataPosition.from_dict(extra["data"])

    def next(self):
        if self._stream is None:   # after restore: the stream starts at the position
            self._stream = PlanBatches(self.dataset, self.engine.plan, self.engine.rank, position=self.position,
                                       engine=self.engine)
            self._iter = iter(self._stream)
        batch = next(self._iter)
        self.position = self._stream.position
        return batch

    def state(self) -> dict:
        return {"data": self.position.to_dict(), "data_file": os.path.basename(self.dataset.path)}


def text_dataset(args, workload: wl.Workload) -> "ByteTextDataset | None":
    """``--data``'s training windows, checked before training (every rank reads the same file, so
    every rank fails alike); None without ``--data``."""
    if args.data is None:
        return None
    if workload.vocab_size is None:
        raise WhaleError(f"--data trains a language model on token ids, and {args.model} does not say it is one: "
                         "its Workload must set vocab_size (and seq_len), as examples/hf_llama.py:build does")
    seq_len = args.seq_len if args.seq_len is not None else workload.seq_len
    if seq_len is None:
        raise WhaleError(f"--seq-len is required: {args.model}'s Workload sets no seq_len")
    try:
        if args.tokenizer is not None:    # documents tokenized and packed (runtime.packed_data)
            from runtime.packed_data import load_packed
            train, val = load_packed(args.data.split(","), args.tokenizer, seq_len, vocab_size=workload.vocab_size)
        else:
            train = ByteTextDataset(args.data, seq_len, tokenizer=workload.tokenizer, vocab_size=workload.vocab_size)
            val = ByteTextDataset(args.data, seq_len, split="val", tokenizer=workload.tokenizer,
                                  vocab_size=workload.vocab_size) if args.eval_every else None
    except TextDataError as e:
        raise WhaleError(f"--data {e}") from None
    if args.eval_every and val is None:
        raise WhaleError(f"--eval-every {args.eval_every}: --data {args.data} keeps no validation split")
    train.validation = val   # --eval-every's held-out windows (runtime.evaluation.Evaluator)
    return train


def _trace_path(png: str) -> str:
    return os.path.splitext(png)[0] + ".json"


def _same_plan(info, plan: planner.Plan) -> bool:
    return info.load_plan().to_dict() == plan.to_dict()


def progress(step: int, steps: int, loss: float, elapsed: float, stats: "runtime.StepStats | None" = None,
             show_lr: bool = False, every: int = 5) -> None:
    """A bar redrawn in place on a terminal; every ``every``-th step (``--log-every``) on its own line
    in a log. Losses of steps run with ZERO-resizing (policies semi/resize) or Prague's partial all-reduce (a plan whose
    stages run replica_sync 'partial', whalelike plan --dp-sync partial) are marked approximate; the gradient norm
    (with --clip-grad-norm), a scheduled learning rate and a skipped step are shown."""
    done = step * 30 // steps
    extra = ""
    if stats is not None:
        extra += " (approximate)" if stats.approximate else ""
        extra += f"  norm {stats.grad_norm:.3f}" if stats.grad_norm is not None else ""
        extra += f"  lr {stats.lr:.2e}" if show_lr and stats.lr is not None else ""
        extra += " (skipped: fp16 overflow)" if stats.overflow else " (skipped)" if stats.skipped else ""
    line = f"  [{'#' * done}{'.' * (30 - done)}] step {step}/{steps}  loss {loss:.4f}{extra}  {elapsed * 1e3:7.1f} ms"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if step == steps else "", flush=True)
    elif step % every == 0 or step == steps:
        print(line, flush=True)


def main(argv=None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace, prog: str = "train.py") -> int:
    """Train as the flags ``args`` say (checked by :func:`check_args`); the exit status. ``prog``
    starts every line it prints about the job."""
    try:
        workload, plan, cluster, resume = inputs(args)
        dataset = text_dataset(args, workload)
    except (WhaleError, OSError) as e:
        # the same inputs on every rank (a plan made at start: rank 0's error on every rank): one line per job
        say_once(f"{prog}: error: {one_line(e)}")
        if dist.is_initialized():
            dist.destroy_process_group()
        return EXIT_USAGE
    if resume is not None and resume.step >= args.steps:
        say_once(f"{prog}: {resume.path} already holds step {resume.step} of --steps {args.steps}; nothing to do "
                  "(raise --steps to train on)")
        return 0
    try:
        if elastic(args):
            try:
                plan, cluster = elastic_start(args, workload, plan, cluster, resume)
            except membership.MembershipError as e:
                # the same on every rank (gathered and broadcast): one line per job
                say_once(f"{prog}: error: {one_line(e)}")
                return EXIT_FAILED
        # a second copy of the model and of its initial state only for the naive baseline: a job trains the
        # workload's own model, so no rank holds the whole model twice
        initial_state = copy.deepcopy(workload.model.state_dict()) if args.compare_naive else None
        runs = [("whalelike", plan)]
        if args.compare_naive:
            graphs = wl.capture(workload.model, workload.example_args, workload.example_kwargs,
                                loss_fn=workload.loss_fn)
            config = wl.Config(global_batch_size=plan.global_batch_size, num_micro_batch=plan.num_micro_batch,
                               schedule=plan.schedule, precision=plan.precision)
            # priced as the plan was: from the profile the plan was made from, when given
            runs.append(("naive", planner.naive_plan(graphs, cluster, config, profile=_profile(args, cluster, plan))))
        results = [train(name, workload, initial_state, p, cluster, args, resume if name == "whalelike" else None,
                         dataset=dataset) for name, p in runs]
        if dist.get_rank() == 0:
            report(results, args.steps)
    except Departed as e:
        # this worker gave notice and handed its state over; the others train on: a success
        print(f"{prog}: rank {os.environ.get('RANK', '?')}: left the job after step {e.step + 1}/{args.steps} "
              f"({e.reason}); its state went to the ranks that stay", flush=True)
        return 0
    except Stopping:
        # every rank got SIGTERM (the agent restarting its workers, a drain): stopped at a step boundary
        return EXIT_STOPPED
    except _JobWide as e:
        say_once(f"{prog}: error: {one_line(e)}")
        return EXIT_FAILED
    except (WhaleError, RuntimeError, OSError) as e:
        # a failure while training differs by rank (which peer died, which step): one line each
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        print(f"{prog}: rank {rank}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def elastic(args) -> bool:
    """Whether this run follows the devices present (``runtime.elastic``): given a cluster spec to
    find them in and a checkpoint directory to resume from, unless ``--no-elastic``."""
    return args.cluster is not None and args.checkpoint_dir is not None and not args.no_elastic


def elastic_start(args, workload: wl.Workload, plan: planner.Plan, spec: wl.Cluster, resume):
    """The plan and cluster of the devices present at this start (``runtime.elastic.membership``):
    the plan in force is the checkpoint's when resuming, else ``--plan``'s; ``--plan`` runs as it is
    when its devices are the ones present. Rank 0 prints the change, if any, once."""
    in_force = resume.load_plan() if resume is not None else plan
    started = membership.start(spec, in_force, lambda: wl.capture(workload.model, workload.example_args,
                                                                   workload.example_kwargs, loss_fn=workload.loss_fn),
                               args.timeout, given=[plan] if args.plan is not None else [])
    if started.change is not None and dist.get_rank() == 0:
        print("\n".join(f"[elastic] {line}" for line in started.change.lines()), flush=True)
    return started.plan, started.cluster


def inputs(args):
    """The workload, plan, cluster and checkpoint to resume, checked before training starts: every
    rank reads the same files, so every rank fails alike (and none waits for the others)."""
    if args.run_timeline is not None:
        trace = "--run-timeline's trace"
        check_output_paths({"--run-timeline": args.run_timeline, trace: _trace_path(args.run_timeline)},
                           kinds={"--run-timeline": "png", trace: "json"})
    if args.weights is not None and not os.path.isdir(args.weights):
        raise WhaleError(f"--weights {args.weights}: no such directory; give a local save_pretrained directory")
    resume = None
    if args.checkpoint_dir is not None and not args.no_resume:
        if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
            raise WhaleError(f"--checkpoint-dir {args.checkpoint_dir} is a file; give a directory (it is created)")
        resume = runtime.checkpoint.latest(args.checkpoint_dir)
    if args.plan is None and resume is None and args.global_batch is None:
        where = f" and {args.checkpoint_dir} holds no checkpoint to resume" if args.checkpoint_dir else ""
        raise WhaleError(f"--plan is required (a plan YAML from `whalelike plan`), or --global-batch with --cluster "
                         f"to plan now{where}")
    if args.plan is not None and not os.path.isfile(args.plan):
        raise WhaleError(f"--plan {args.plan}: no such file; write one with `whalelike plan MODEL --cluster ... -o "
                         f"{args.plan}`")
    # what follows builds the model and may plan it (minutes at real size), and the Engine could not
    # start without torchrun's environment anyway: said first
    missing = distributed.torchrun_missing()
    if missing:
        raise WhaleError(f"the trainer runs under torchrun (environment lacks {', '.join(missing)}): launch it with "
                         "`torchrun --nproc_per_node N ...`, N the plan's workers, even for one device")
    # with --weights the factory builds the model without storage (whalelike.empty_weights): each rank
    # then gives storage to what its part of the plan holds and reads only that from the files
    with wl.empty_weights() if args.weights is not None else contextlib.nullcontext():
        workload = load_workload(args.model)
    if workload.loss_fn is None or workload.make_batch is None:
        raise WhaleError(f"{args.model} must return a Workload with loss_fn and make_batch to train")
    if elastic(args) and os.environ.get(HOST_ENV):
        # the host this node stands for must be one of the spec's: said before any planning, once a job
        member_host(wl.Cluster.load(args.cluster), os.environ[HOST_ENV], socket.gethostname())
    if args.plan is None and resume is None:
        plan, cluster = plan_now(args, workload)
    else:
        plan = planner.Plan.from_yaml(args.plan if args.plan is not None else resume.plan)
        try:
            cluster = wl.Cluster.load(args.cluster or plan.cluster)
        except WhaleError as e:
            if args.cluster:
                raise
            raise WhaleError(f"{e}; the plan{' of the checkpoint resumed' if args.plan is None else ''} was made for "
                             f"cluster {plan.cluster!r}: pass its file with --cluster FILE") from None
    # elastic: the plan is checked against the devices present once they are known (elastic_start)
    plan.validate(cluster=None if elastic(args) else cluster)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if plan.world_size != world and not elastic(args):
        raise WhaleError(f"the plan has {plan.world_size} workers but torchrun started {world} ranks; launch "
                         f"`torchrun --nproc_per_node {plan.world_size} ...`, or make a plan for {world} devices")
    if resume is not None and args.plan is not None:
        saved = resume.load_plan()
        if saved.global_batch_size != plan.global_batch_size:
            say_once(f"train.py: warning: {resume.path} was trained with global batches of {saved.global_batch_size} "
                      f"samples, --plan has {plan.global_batch_size}: the run continues, with other batches than "
                      "the uninterrupted run would have drawn")
    return workload, plan, cluster, resume


def planning_config(args, precision: "str | None" = None) -> wl.Config:
    """The planner's Config of the planning flags (``--global-batch`` ...), its optimizer the one
    ``--optimizer`` names, priced."""
    return wl.Config(global_batch_size=args.global_batch, num_micro_batch=args.micro_batches,
                     schedule=args.pipeline_schedule, zero_stage=args.zero, memory_reserve=args.memory_reserve,
                     precision=precision or args.precision or "fp32",
                     optimizer=priced_optimizer(args.optimizer, args.optimizer_args))


def plan_now(args, workload: wl.Workload):
    """Without ``--plan``: the model planned onto ``--cluster`` under the planning flags. Every rank
    captures the model (its Engine needs the trace); rank 0 measures it and plans, and the others
    take its figures and its plan (:class:`runtime.distributed.MeasuredOnce`,
    :func:`runtime.distributed.from_rank0`, over the default group, made here for it within
    ``--timeout``): the plan every rank would have made, computed once. A planning error is rank
    0's, raised on every rank alike (one line a job)."""
    if args.cluster is None:
        raise WhaleError("--global-batch plans the model now and needs --cluster (a preset name or cluster YAML)")
    cluster = wl.Cluster.load(args.cluster)
    config = planning_config(args)
    rank = distributed.init(args.timeout) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
    with distributed.MeasuredOnce(rank) as share:
        graphs = wl.capture(workload.model, workload.example_args, workload.example_kwargs,
                            optimizer=config.optimizer, loss_fn=workload.loss_fn, share=share)
    plan = distributed.from_rank0(lambda: planner.plan(graphs, cluster, config), rank)
    if rank == 0:
        print(plan.summary(cluster), flush=True)
    return plan, cluster


def report(results: list[dict], steps: int) -> None:
    marks = sorted({0, *range(4, steps, 5), steps - 1} & set(range(len(results[0]["losses"]))))
    print()
    print(format_table(["step", *(f"{r['name']} loss" for r in results)],
                       [[m + 1, *(f"{r['losses'][m]:.4f}" for r in results)] for m in marks],
                       title="loss curve"))
    print()
    print(format_table(["plan", "ms/step", "predicted ms/step", "error", "samples/s", "re-plans", "emulation overruns"],
                       [[r["name"], f"{r['step_ms']:.1f}", f"{r['predicted_ms']:.1f} ({r['speeds']})",
                         f"{r['step_ms'] / r['predicted_ms'] - 1:+.1%}" if r["predicted_ms"] > 0 else "-",
                         f"{r['throughput']:.1f}", r["replans"], r["overruns"]]
                        for r in results],
                       title=f"measured throughput (mean over the steps this run trained, after step {WARMUP_STEPS}) "
                             "against the plan's prediction (error: measured / predicted - 1)"))
    saves = results[0]["save_ms"]
    if saves:
        print(f"\ncheckpoints: {len(saves)} saved in the background; training stalled {sum(saves) / len(saves):.1f} ms "
              f"per save on average (first {saves[0]:.1f} ms), not counted in ms/step")
    memory = results[0]["memory"]
    if memory is not None:
        print()
        print(format_table(["rank", "device", "measured peak MiB", "predicted MiB", "measured / predicted"],
                           [[r["rank"], r["device"], f"{r['measured'] / 2**20:.1f}", f"{r['predicted'] / 2**20:.1f}",
                             f"{r['measured'] / r['predicted']:.2f}" if r["predicted"] else "-"] for r in memory],
                           title="memory per rank (measured: the largest step peak after the first; predicted: the plan)"))
    if len(results) == 2:
        print(f"\nmeasured speed-up of the hardware-aware plan over the naive plan: "
              f"{results[0]['throughput'] / results[1]['throughput']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
