"""The ``whalelike`` command: inspect a model's TaskGraphs, look at clusters, plan, simulate.

This is the one place that ties ``whalelike``, ``planner`` (and, for training, ``runtime``)
together (docs/ARCHITECTURE.md section 1); the planner is imported only by the commands that need it.
Training is launched with the ordinary ``torchrun``, and so is ``profile`` (one rank per device):
``train`` and ``profile`` import ``runtime.launch`` and ``runtime.profiling`` inside the command, the
two commands that run the runtime. ``train`` returns the trainer's exit status.

Errors a user can cause (:class:`~whalelike.errors.WhaleError`, or a file that cannot be read or
written) print one line, ``whalelike: error: ...``, and exit with status 2; ``--debug`` shows the
traceback instead. Commands that write files check every output path (extension, directory, two
options naming one file) before any work, and write all of them or none (:mod:`whalelike.files`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import textwrap
import time
from typing import Iterator, Optional, Sequence

from whalelike.cluster import Cluster
from whalelike.config import DEFAULT_MEMORY_RESERVE, DP_SYNCS, GROUP_GENERATORS, OPTIMIZERS, PRECISIONS, RESHARDING, SCHEDULE_CHOICES, ZERO_STAGES, Config
from whalelike.errors import WhaleError, one_line
from whalelike.files import Outputs, check_output_paths
from whalelike.spec import validate
from whalelike.workload import load_workload  # noqa: F401  (MODEL's loader; runtime.launch uses it too)

log = logging.getLogger("whalelike")

EXIT_USAGE = 2

MODEL_HELP = (
    "the model, as path/to/file.py:factory. factory() takes no arguments and returns a "
    "whalelike.workload.Workload, or a (model, example_args) tuple where example_args is a tensor or a "
    "tuple of tensors whose first dimension is the batch"
)

EPILOG = """\
examples:
  whalelike inspect examples/gpt.py:build             TaskGraph table of a model
  whalelike cluster                                   list the built-in clusters
  whalelike cluster whale-v100-p100                   devices of a built-in cluster
  whalelike cluster my-cluster.yaml                   check a cluster file, show its devices
  whalelike plan examples/gpt.py:build --cluster emulated-4 --global-batch 32 \\
      --micro-batches 4 -o plan.yaml --timeline plan.png
  whalelike simulate plan.yaml --timeline plan.png    replay a saved plan's step
  torchrun --nproc-per-node 4 -m whalelike.cli profile examples/gpt.py:build --cluster emulated-4 \\
      -o profile.yaml --plot curves.png               measure every device (one rank each)

MODEL names a function in your file that takes no arguments, for example:

  def build():
      model = MyNet()                                 # with wl.replicate(...) / wl.split(...) scopes
      return model, (torch.randn(8, 512),)            # the model and example inputs (batch first)

Training with a plan is started with torchrun (see docs/quickstart.md).
"""


# -- loading the user's model ----------------------------------------------------------------------
def capture_workload(args: argparse.Namespace, workload=None):
    """The TaskGraphs of the command's MODEL (``workload``: already loaded), costed for its optimizer."""
    wl = workload if workload is not None else load_workload(args.model)
    from whalelike.graphs.capture import capture  # after the factory's checks: they fail fast, capture imports more

    with _status(f"capturing {args.model}"):
        graphs = capture(wl.model, wl.example_args, wl.example_kwargs, optimizer=args.optimizer, loss_fn=wl.loss_fn)
    return graphs


@contextlib.contextmanager
def _warnings_unless_failed(verbose: bool) -> Iterator[None]:
    """Hold the log records of the block (the planner's warnings about the alternatives it tried:
    a partition that does not fit, a fallback to recompute) and print them when it succeeds; when it
    fails, its error says what went wrong in one line and they are dropped (with ``--verbose``
    they are printed before it)."""
    root = logging.getLogger()
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handlers, root.handlers = root.handlers, [Hold()]
    ok = False
    try:
        yield
        ok = True
    finally:
        root.handlers = handlers
        if ok or verbose:
            for record in held:
                for handler in handlers:
                    if record.levelno >= handler.level:
                        handler.handle(record)


@contextlib.contextmanager
def _status(what: str) -> Iterator[None]:
    """Say on stderr what is running (capture and planning can take seconds) and how long it took."""
    print(f"{what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    log.info("%s took %.1f s", what, time.perf_counter() - start)


# -- writing files: all or none (whalelike.files) -------------------------------------------------
PLAN_OUTPUTS = {"-o": ("output", "yaml"), "--timeline": ("timeline", "png"), "--trace": ("trace", "json")}
SIMULATE_OUTPUTS = {"--timeline": ("timeline", "png"), "--trace": ("trace", "json")}
PROFILE_OUTPUTS = {"-o": ("output", "yaml"), "--plot": ("plot", "png")}


def _check_outputs(args: argparse.Namespace, options: dict[str, tuple[str, str]],
                   inputs: dict[str, Optional[str]]) -> dict[str, tuple[str, str]]:
    """The output options the user gave (label -> (path, kind)), checked before any work: a bad
    path or extension, two options naming one file, or an output that would replace an input fail
    in milliseconds, not after planning."""
    given = {label: (getattr(args, dest), kind) for label, (dest, kind) in options.items()
             if getattr(args, dest) is not None}
    check_output_paths({label: path for label, (path, _) in given.items()},
                       kinds={label: kind for label, (_, kind) in given.items()}, inputs=inputs)
    return given


@contextlib.contextmanager
def _outputs() -> Iterator[Outputs]:
    """A command's files (:class:`whalelike.files.Outputs`): all are written when the block ends
    normally, none if it raises; then says which were written."""
    with Outputs() as out:
        yield out
        written = out.commit()
    for target in written:
        print(f"wrote {target}")


# -- commands --------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> None:
    graphs = capture_workload(args)
    print(json.dumps(graphs.to_dict(), indent=2) if args.json else graphs.table())


def cmd_cluster(args: argparse.Namespace) -> None:
    if args.cluster is not None:
        print(Cluster.load(args.cluster).summary())
        return
    from whalelike.display import format_table

    rows = [[name, Cluster.preset(name).inventory()] for name in Cluster.preset_names()]
    print(format_table(["preset", "devices"], rows, title="built-in clusters (whalelike cluster NAME for details):"))


def cmd_plan(args: argparse.Namespace) -> None:
    if args.renamed_schedule is not None:
        raise WhaleError(f"whalelike plan: --schedule is now --pipeline-schedule (one name for the pipeline "
                         f"schedule on every command; train.py's --schedule is the learning-rate schedule): "
                         f"--pipeline-schedule {args.renamed_schedule}")
    model_file = args.model.rpartition(":")[0] or None
    outputs = _check_outputs(args, PLAN_OUTPUTS, inputs={"MODEL": model_file, "--cluster": args.cluster,
                                                         "--profile": args.profile})
    import planner  # after the checks: importing torch takes seconds
    import planner.schedule.timeline

    cluster = Cluster.load(args.cluster)
    config = Config(global_batch_size=args.global_batch, num_micro_batch=args.micro_batches,
                    schedule=args.pipeline_schedule, optimizer=args.optimizer, sync_batchnorm=args.sync_batchnorm,
                    resharding=args.resharding, delay_weight_gradients=args.delay_weight_gradients,
                    precision=args.precision, zero_stage=args.zero, ragged_shards=not args.even_shards,
                    dp_sync=args.dp_sync, partial_generator=args.partial_generator,
                    partial_group_size=args.partial_group_size, partial_delta_c=args.partial_delta_c,
                    memory_reserve=args.memory_reserve)
    writers = {"-o": planner.Plan.to_yaml,   # the timelines on the cluster's network, as predicted
               "--timeline": lambda plan, path: planner.schedule.timeline.write_png(plan, path, network=cluster),
               "--trace": lambda plan, path: planner.schedule.timeline.write_chrome_trace(plan, path, network=cluster)}
    with _outputs() as out:
        staged = [(out.stage(path, kind, label=label), writers[label]) for label, (path, kind) in outputs.items()]
        if args.calibrate and args.profile is not None:
            raise WhaleError("whalelike plan: --calibrate times the update a profile already measured; give one of "
                             "--calibrate and --profile")
        if args.calibrate:   # before planning, on the model's own parameters (runtime.profiling.update_rate)
            workload = load_workload(args.model)
            graphs = capture_workload(args, workload)
            from runtime.profiling.update_rate import calibrate_update
            with _status("timing the optimizer's update on this machine"):
                cluster, calibration = calibrate_update(workload.model, cluster, optimizer=args.optimizer)
            print(calibration.line())
        else:
            graphs = capture_workload(args)
        profile = None
        if args.profile is not None:
            from planner.devices.profile import Profile
            profile = Profile.from_yaml(args.profile, graphs=graphs, cluster=cluster, precision=config.precision)
        speeds = f", speeds measured in {args.profile}" if profile is not None else ""
        with _status(f"planning on {cluster.name} ({cluster.inventory()}{speeds})"), \
                _warnings_unless_failed(args.verbose):
            plan = planner.plan(graphs, cluster, config, profile=profile)
        print(plan.summary(cluster))
        for tmp, write in staged:
            write(plan, tmp)


def cmd_simulate(args: argparse.Namespace) -> None:
    outputs = _check_outputs(args, SIMULATE_OUTPUTS, inputs={"PLAN": args.plan, "--cluster": args.cluster})
    import planner  # after the checks: importing torch takes seconds
    import planner.schedule.timeline

    if not os.path.isfile(args.plan):
        raise WhaleError(f"{args.plan}: no such plan file; make one with `whalelike plan ... -o {args.plan}`")
    cluster = Cluster.load(args.cluster) if args.cluster is not None else None
    try:
        plan = planner.Plan.from_yaml(args.plan)
        if cluster is None and plan.cluster in Cluster.preset_names():
            cluster = Cluster.preset(plan.cluster)   # as runtime.Engine does
        if cluster is not None:  # its devices exist there, on their hosts, with room (planner.plan_checks)
            validate(plan, cluster=cluster)
    except WhaleError as e:  # name the file when the planner's message does not
        if str(e).startswith(args.plan):
            raise
        raise WhaleError(f"{args.plan}: {e}") from e
    writers = {"--timeline": planner.schedule.timeline.write_png, "--trace": planner.schedule.timeline.write_chrome_trace}
    with _outputs() as out:
        staged = [(out.stage(path, kind, label=label), writers[label]) for label, (path, kind) in outputs.items()]
        result = planner.simulate(plan, network=cluster)   # without a cluster: the plan's timing fields alone
        print(result.summary())
        for tmp, write in staged:
            write(result, tmp)


def cmd_profile(args: argparse.Namespace) -> None:
    """Under torchrun, one rank per device: every rank checks the outputs (local checks, so all fail
    alike before the rendezvous), measures its device (runtime.profiling), and rank 0 writes."""
    model_file = args.model.rpartition(":")[0] or None
    outputs = _check_outputs(args, PROFILE_OUTPUTS, inputs={"MODEL": model_file, "--cluster": args.cluster})
    cluster = Cluster.load(args.cluster)
    workload = load_workload(args.model)
    import planner.devices.speed_curves   # after the checks: importing torch takes seconds
    from runtime.profiling import profile_cluster

    rank = int(os.environ.get("RANK", "0"))
    launch = (f"torchrun --nproc-per-node {len(cluster.devices)} -m whalelike.cli profile {args.model} "
              f"--cluster {args.cluster} -o {args.output}")
    writers = {"-o": lambda profile, path: profile.to_yaml(path), "--plot": planner.devices.speed_curves.write_png}
    with _outputs() if rank == 0 else contextlib.nullcontext() as out:
        staged = [(out.stage(path, kind, label=label), writers[label]) for label, (path, kind) in outputs.items()] \
            if rank == 0 else []
        profile = profile_cluster(workload, cluster, precision=args.precision, optimizer=args.optimizer,
                                  unit="layer" if args.per_layer else "taskgraph", cap=args.max_batch,
                                  warmup=args.warmup, repeats=args.repeats, cache_directory=args.cache_dir,
                                  refresh=args.refresh, timeout_s=args.timeout, progress=not args.no_progress,
                                  command=launch)
        if rank == 0:
            print(profile.summary())
            for tmp, write in staged:
                write(profile, tmp)


def cmd_train(args: argparse.Namespace) -> int:
    """Under torchrun (one rank per device) or as one process: the job file with its overrides,
    checked on every rank before any process group (runtime.launch), then trained; the exit status."""
    import runtime.launch.job   # after argument parsing: importing torch takes seconds

    return runtime.launch.job.main(args.config, args.overrides)


# -- argument parsing ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="whalelike",
        description="Train one PyTorch model across unequal accelerators: inspect the TaskGraphs that "
                    "replicate()/split() scopes make, plan them onto a cluster, simulate the plan.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    # the same flags after the command name; SUPPRESS keeps a subcommand from resetting them
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, summary: str, details: str, examples: str):
        return commands.add_parser(name, help=summary, description=textwrap.fill(f"{summary}. {details}", 88),
                                   parents=[common], epilog=f"examples:\n{examples}\n",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    optimizer = dict(choices=OPTIMIZERS, default="adamw",
                     help="optimizer whose state the memory model counts (default: adamw)")

    p = command("inspect", "print the TaskGraphs of a model",
                "One row per TaskGraph (one per replicate/split scope): strategy, modules, forward and "
                "backward FLOPs, parameter, optimizer-state and activation bytes, boundary tensors.",
                "  whalelike inspect examples/gpt.py:build\n  whalelike inspect examples/gpt.py:build --json")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (for scripts)")
    p.add_argument("--optimizer", **optimizer)
    p.set_defaults(run=cmd_inspect)

    p = command("cluster", "show a cluster spec, or list the built-in ones",
                "NAME is a built-in preset; a path is a YAML spec file, checked field by field "
                "(examples/clusters/ has commented ones to copy).",
                "  whalelike cluster\n  whalelike cluster poplar-c\n  whalelike cluster examples/clusters/lab-mixed.yaml")
    p.add_argument("cluster", metavar="NAME_OR_YAML", nargs="?", help="preset name or path to a cluster YAML file")
    p.set_defaults(run=cmd_cluster)

    p = command("plan", "plan a model onto a cluster and save the plan",
                "Captures MODEL, balances work by device speed and memory, prints one row per device and "
                "the predicted speed-up over the capacity-blind plan, and writes the plan (and pictures). "
                "Files are written only if everything succeeds.",
                "  whalelike plan examples/gpt.py:build --cluster emulated-4 --global-batch 32 -o plan.yaml\n"
                "  whalelike plan examples/gpt.py:build --cluster my.yaml --global-batch 256 \\\n"
                "      --micro-batches 8 --pipeline-schedule gpipe -o plan.yaml --timeline plan.png --trace plan.json")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--cluster", required=True, metavar="NAME_OR_YAML",
                   help="preset name (see `whalelike cluster`) or path to a cluster YAML file")
    p.add_argument("--global-batch", required=True, type=int, metavar="N", help="samples per optimizer step")
    p.add_argument("--micro-batches", type=int, default=1, metavar="M",
                   help="micro-batches per step: pipeline depth, or gradient accumulation for one stage (default: 1)")
    p.add_argument("--pipeline-schedule", choices=SCHEDULE_CHOICES, default="1f1b",
                   help="pipeline schedule (default: 1f1b; auto: the planner plans 1f1b and zb-h1 and keeps the "
                        "faster predicted); the same flag as train.py's")
    p.add_argument("--schedule", dest="renamed_schedule", help=argparse.SUPPRESS)   # the old name: says the new
    p.add_argument("--optimizer", **optimizer)
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="BatchNorm in training mode takes its statistics over each stage's data-parallel group "
                        "(exact against one device with one micro-batch); default: per worker, as DDP")
    p.add_argument("--resharding", choices=RESHARDING, default="auto",
                   help="strategy of the cross-mesh resharding at stage boundaries (default: auto, the fastest "
                        "predicted per boundary)")
    p.add_argument("--delay-weight-gradients", action="store_true",
                   help="each backward sends its input gradients before computing its weight gradients")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="training precision: fp32, or bf16/fp16 autocast with float32 master weights; each device "
                        "is priced at its rate for it, and one that cannot run it is refused (default: fp32)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None, metavar="N",
                   help="ZeRO stage of every data-parallel stage: 0 (DDP), 1 (optimizer state sharded), 2 (and "
                        "gradients), 3 (and parameters), on FSDP2; default: the planner picks per stage the lowest "
                        "that fits")
    p.add_argument("--even-shards", action="store_true",
                   help="ZeRO state in FSDP2's even shards only; default: at ZeRO 1-3 of a single stage where even "
                        "shards do not fit, each device holds a fraction of the state in proportion to the memory "
                        "it has left (ragged shards)")
    p.add_argument("--memory-reserve", type=float, default=DEFAULT_MEMORY_RESERVE, metavar="F",
                   help="the fraction of each device's memory the plan leaves free for what the memory model does "
                        f"not price (default {DEFAULT_MEMORY_RESERVE:g}; 0 plans to the last byte)")
    p.add_argument("--dp-sync", choices=DP_SYNCS, default="exact",
                   help="how data-parallel replicas stay in step: exact (summed gradients, the default) or partial "
                        "(Prague's P-Reduce: each replica steps on its own gradient, then averages with a small "
                        "group; tolerates short slowdowns, APPROXIMATE)")
    p.add_argument("--partial-generator", choices=GROUP_GENERATORS, default="smart",
                   help="with --dp-sync partial: how P-Reduce forms its groups (default smart: random divisions "
                        "served at each request, a straggler left out of a fast worker's group; static: a fixed, "
                        "conflict-free schedule every worker computes alone)")
    p.add_argument("--partial-group-size", type=int, default=2, metavar="G",
                   help="with --dp-sync partial: workers per P-Reduce group (default 2)")
    p.add_argument("--partial-delta-c", type=int, default=2, metavar="C",
                   help="with --dp-sync partial: Prague's threshold, how many requests a worker may lag the "
                        "requester and still join its group (default 2)")
    p.add_argument("--profile", metavar="PROFILE.yaml",
                   help="device speeds and links measured by `whalelike profile` for this model, cluster and "
                        "precision, instead of the cluster spec's figures")
    p.add_argument("--calibrate", action="store_true",
                   help="time the optimizer's update on this machine (under a second) and price it on the emulated "
                        "devices, whose update runs here at a speed no spec sheet gives; without it (or a profile) "
                        "an emulated device's update is not priced, a real GPU's is priced from its memory bandwidth")
    p.add_argument("-o", "--output", required=True, metavar="PLAN.yaml", help="where to write the plan (.yaml or .yml)")
    p.add_argument("--timeline", metavar="FILE.png", help="also draw the simulated step as a PNG picture")
    p.add_argument("--trace", metavar="FILE.json",
                   help="also write the simulated step as a Chrome trace (open in ui.perfetto.dev)")
    p.set_defaults(run=cmd_plan)

    p = command("simulate", "simulate one training step of a saved plan",
                "Replays the plan's schedule event by event: step time, bubble, per-device busy and idle time.",
                "  whalelike simulate plan.yaml\n  whalelike simulate plan.yaml --timeline step.png --trace step.json")
    p.add_argument("plan", metavar="PLAN.yaml", help="a plan written by `whalelike plan`")
    p.add_argument("--cluster", metavar="NAME_OR_YAML",
                   help="the cluster the plan is for: its devices must be there, on their hosts, with room for the "
                        "plan (default: the preset the plan names, when it names one)")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the step as a PNG picture")
    p.add_argument("--trace", metavar="FILE.json", help="write the step as a Chrome trace (open in ui.perfetto.dev)")
    p.set_defaults(run=cmd_simulate)

    p = command("profile", "measure every device of a cluster for a model (run under torchrun)",
                "One rank per device, all at once (Poplar's online profiling): each TaskGraph's (or layer's) "
                "forward and backward time against micro-batch size at powers of two up to the largest that "
                "fits, the out-of-memory edge by binary search, and each link's latency and bandwidth from timed "
                "transfers. Devices of a kind already measured for the model at the precision come from the "
                "cache. Rank 0 prints the table and writes the profile (and the speed curves).",
                "  torchrun --nproc-per-node 4 -m whalelike.cli profile examples/gpt.py:build --cluster emulated-4 \\\n"
                "      -o profile.yaml --plot curves.png\n"
                "  torchrun --nproc-per-node 2 -m whalelike.cli profile my.py:build --cluster my.yaml -o p.yaml "
                "--precision bf16 --per-layer")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--cluster", required=True, metavar="NAME_OR_YAML",
                   help="preset name or cluster YAML file: rank r runs its r-th device")
    p.add_argument("-o", "--output", required=True, metavar="PROFILE.yaml",
                   help="where rank 0 writes the profile (.yaml or .yml; every rank checks the path first)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw each device's speed curve with its measured points")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="precision to measure at (default: fp32)")
    p.add_argument("--optimizer", **optimizer)
    p.add_argument("--per-layer", action="store_true",
                   help="time every layer instead of every TaskGraph (what the partitioner moves)")
    p.add_argument("--max-batch", type=int, default=1024, metavar="N",
                   help="largest micro-batch tried (default: 1024); a device that fits it is recorded at the cap")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed steps before each batch's timing (default: 1)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="timed steps per batch; the median is kept (default: 3)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="profile cache (default: $WHALELIKE_CACHE, else $XDG_CACHE_HOME/whalelike/profiles, else "
                        "~/.cache/whalelike/profiles)")
    p.add_argument("--refresh", action="store_true", help="measure every device, even the kinds the cache holds")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="bound on every collective, the rendezvous included (default: 300)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_profile)

    p = command("train", "train a model as a job file says (run under torchrun)",
                "CONFIG is a YAML job (examples/job.yaml; sections model, cluster, plan, optimizer, train, data, "
                "eval, checkpoint, metrics, balance, elastic: runtime/launch/job.py); --section.key VALUE "
                "overrides one key. The resolved job is printed first; an unknown key, a wrong type or a missing "
                "file is one line before any rank starts.",
                "  torchrun --nproc-per-node 4 -m whalelike.cli train examples/job.yaml\n"
                "  torchrun --nproc-per-node 2 -m whalelike.cli train examples/job.yaml --cluster.spec emulated-2 "
                "--train.steps 4")
    p.add_argument("config", metavar="CONFIG", help="the job's YAML file")
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="--section.key VALUE",
                   help="override one key of the job (e.g. --train.steps 10)")
    p.set_defaults(run=cmd_train)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="whalelike: %(levelname)s: %(message)s")
    try:
        status = args.run(args)
    except BrokenPipeError:  # `whalelike inspect --json | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (WhaleError, OSError) as e:
        if args.debug:
            raise
        message = one_line(e)
        print(f"whalelike: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("whalelike: interrupted", file=sys.stderr)
        return 130
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
