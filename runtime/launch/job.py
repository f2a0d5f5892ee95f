"""The typed job file of ``whalelike train JOB.yaml [--section.key value ...]``.

A job is YAML, one mapping per section::

    model:      {factory: examples/gpt.py:build, weights: null}
    cluster:    {spec: emulated-4}              # or the shorthand `cluster: emulated-4`
    plan:       {global_batch_size: 16}         # or {file: plan.yaml}
    optimizer:  {name: AdamW, lr: 3.0e-4, args: {weight_decay: 0.1}}
    train:      {steps: 100, schedule: cosine, warmup_steps: 10, clip_grad_norm: 1.0}
    data:       {path: examples/data/tinyshakespeare.txt}
    eval:       {every: 20}
    checkpoint: {dir: out/ckpt, every: 10}
    metrics:    {dir: out/metrics}
    export:     {dir: out/trained}          # save_pretrained after the last step
    balance:    {policy: exact}
    elastic:    {enabled: true, leave_on_sigterm: false}

One definition: every field names a flag of :mod:`runtime.launch.trainer` (:data:`FIELDS`), and
its type, default, allowed values and help are that flag's (the section classes are made from the
parser, :func:`_section_class`); a job compiles to the ``argparse.Namespace`` the flags would give
and goes through the trainer's own checks (:func:`runtime.launch.trainer.check_args`), whose
messages then name the key (``train.steps``) instead of the flag. A flag of the trainer that no
field names and :data:`NOT_IN_JOBS` does not list is an error at import: the two cannot drift.

The optimizer is a ``torch.optim`` class name and its keyword arguments; the planner prices its
state (``SGD`` without momentum as ``sgd``, with it ``sgd_momentum``, ``Adam``, ``AdamW``) when it
plans the job (``plan`` without ``file``); another name is refused in one line. A plan file does not
record the optimizer it was made for: make it with ``whalelike plan --optimizer`` of the same name.

Every error is a :class:`JobError`, one line naming the key, the bad value and the fix: an unknown
section or key (the known ones listed), a wrong type, a value not allowed, a missing file or
directory (model factory, weights, plan, cluster, data, tokenizer), all raised by :func:`load`
before any process group exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import os
import re
from typing import Any, Optional, Sequence

import yaml

from runtime.launch import trainer
from whalelike.cluster import Cluster
from whalelike.errors import WhaleError
from whalelike.spec import load_yaml, shown

# section -> key -> the trainer's flag ("model" is its positional MODEL)
FIELDS: dict[str, dict[str, str]] = {
    "model": {"factory": "model", "weights": "--weights"},
    "cluster": {"spec": "--cluster", "profile": "--profile"},
    "plan": {"file": "--plan", "global_batch_size": "--global-batch", "num_micro_batch": "--micro-batches",
             "zero_stage": "--zero", "schedule": "--pipeline-schedule", "memory_reserve": "--memory-reserve"},
    "optimizer": {"name": "--optimizer", "lr": "--lr", "args": "--optimizer-args"},
    "train": {"steps": "--steps", "schedule": "--schedule", "warmup_steps": "--warmup-steps",
              "min_lr_ratio": "--min-lr-ratio", "precision": "--precision", "grad_reduce_dtype": "--grad-reduce-dtype",
              "clip_grad_norm": "--clip-grad-norm", "seed": "--seed", "timeout": "--timeout",
              "on_nonfinite": "--on-nonfinite", "batch_check_every": "--batch-check-every",
              "measure_memory": "--measure-memory", "memory_check": "--no-memory-check", "log_every": "--log-every"},
    "data": {"path": "--data", "tokenizer": "--tokenizer", "seq_len": "--seq-len"},
    "eval": {"every": "--eval-every", "batches": "--eval-batches"},
    "checkpoint": {"dir": "--checkpoint-dir", "every": "--checkpoint-every", "keep": "--keep-checkpoints",
                   "resume": "--no-resume"},
    "metrics": {"dir": "--metrics-dir", "run_timeline": "--run-timeline"},
    "export": {"dir": "--export"},
    "balance": {"policy": "--balance"},
    "elastic": {"enabled": "--no-elastic", "leave_on_sigterm": "--leave-on-sigterm"},
}
# flags whose job field is their negation (``--no-resume`` is ``checkpoint.resume: false``)
NEGATED = {"--no-resume", "--no-elastic", "--no-memory-check"}
# the trainer's flags a job does not set: the naive side-by-side run is a demonstration, not a job
NOT_IN_JOBS = {"--compare-naive", "-h"}
# a section given as a scalar is its first field (``cluster: emulated-4``, ``model: file.py:build``)
SHORTHAND = {"cluster": "spec", "model": "factory"}


class JobError(WhaleError):
    """A job file or override that cannot run: one line naming the key, the value and the fix."""


def _actions() -> dict[str, argparse.Action]:
    parser = trainer.build_parser()
    out = {}
    for action in parser._actions:
        for name in action.option_strings or [action.dest]:
            out[name] = action
    return out


_ACTIONS = _actions()


def _kind(action: argparse.Action) -> type:
    if isinstance(action, argparse._StoreTrueAction):
        return bool
    if action.type is trainer.json_mapping:
        return dict
    return action.type or str


def _section_class(section: str, keys: dict[str, str]) -> type:
    """The section's record: each field typed, defaulted and described by its flag."""
    specs = []
    for key, flag in keys.items():
        action = _ACTIONS[flag]
        kind = _kind(action)
        default = action.default
        if flag in NEGATED:
            default = True
        meta = {"flag": flag, "help": (action.help or "").replace("%%", "%"), "kind": kind,
                "choices": tuple(action.choices) if action.choices else None}
        hint = Optional[kind] if default is None else kind
        value = dataclasses.field(default_factory=dict, metadata=meta) if kind is dict else \
            dataclasses.field(default=default, metadata=meta)
        specs.append((key, hint, value))
    name = section.title().replace("_", "") + "Section"
    return dataclasses.make_dataclass(name, specs, frozen=True, namespace={"__module__": __name__,
                                      "__doc__": f"The job's ``{section}`` section (fields: the trainer's flags)."})


SECTIONS: dict[str, type] = {section: _section_class(section, keys) for section, keys in FIELDS.items()}


def _check_no_drift() -> None:
    named = {flag for keys in FIELDS.values() for flag in keys.values()}
    for flag, action in _ACTIONS.items():
        if action.option_strings and flag == action.option_strings[0] and flag not in named | NOT_IN_JOBS:
            raise RuntimeError(f"runtime.launch.job: the trainer's flag {flag} has no job field; add it to FIELDS "
                               "(or to NOT_IN_JOBS)")


_check_no_drift()


@dataclasses.dataclass(frozen=True)
class Job:
    """A whole job: one record per section (:data:`SECTIONS`); ``origin`` the file it was read from."""

    sections: dict
    origin: str = "the job"

    def __getattr__(self, name: str) -> Any:
        try:
            return self.sections[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(record) for name, record in self.sections.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# -- reading ---------------------------------------------------------------------------------------
def _meta(section: str, key: str) -> dict:
    return next(f.metadata for f in dataclasses.fields(SECTIONS[section]) if f.name == key)


def _kind_text(kind: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping of keyword arguments"}[kind]


def _checked(origin: str, section: str, key: str, value: Any) -> Any:
    """``value`` for ``section.key``, as its field's type (an int for a float widened)."""
    meta = _meta(section, key)
    kind, where = meta["kind"], f"{origin}: {section}.{key}"
    if value is None:
        default = next(f.default for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
        if default is None:
            return None
        raise JobError(f"{where} cannot be null; give {_kind_text(kind)} or leave the key out (default "
                       f"{shown(default)})")
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise JobError(f"{where} must be {_kind_text(kind)}, got {shown(value)} ({type(value).__name__}); "
                       f"{meta['help']}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise JobError(f"{where} must be one of {', '.join(map(str, meta['choices']))}, got {shown(value)}")
    if kind is dict:
        for k in value:
            if not isinstance(k, str):
                raise JobError(f"{where}: key {shown(k)} must be a string (a keyword argument's name)")
    return value


def _known_key(origin: str, section: str, key: Any) -> str:
    if section not in SECTIONS:
        close = difflib.get_close_matches(str(section), list(SECTIONS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise JobError(f"{origin}: unknown section {shown(section)}; {hint}the sections are {', '.join(SECTIONS)}")
    keys = FIELDS[section]
    if key not in keys:
        close = difflib.get_close_matches(str(key), list(keys), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise JobError(f"{origin}: unknown key {section}.{shown(key) if not isinstance(key, str) else key}; "
                       f"{hint}the keys of {section} are {', '.join(keys)}")
    return key


def from_dict(data: Any, origin: str = "the job", overrides: Sequence[str] = ()) -> Job:
    """A :class:`Job` from parsed YAML ``data`` and command-line ``overrides``
    (``["--train.steps", "4", "--data.path=x.txt"]``), every value checked by its field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise JobError(f"{origin}: the top level must be a mapping of sections ({', '.join(SECTIONS)}), got "
                       f"{shown(data)}")
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for section, body in data.items():
        _known_key(origin, section, next(iter(FIELDS.get(section, {"": ""}))))
        if section in SHORTHAND and not isinstance(body, (dict, type(None))):
            body = {SHORTHAND[section]: body}
        if body is None:
            continue
        if not isinstance(body, dict):
            raise JobError(f"{origin}: section {section} must be a mapping with keys {', '.join(FIELDS[section])}, "
                           f"got {shown(body)}")
        for key, value in body.items():
            _known_key(origin, section, key)     # before the value: an unknown key has no type
            values[section][key] = _checked(origin, section, key, value)
    for section, key, value in _overrides(overrides):
        values[section][key] = _checked("command line", section, key, value)
    return Job({section: SECTIONS[section](**values[section]) for section in SECTIONS}, origin)


def _overrides(argv: Sequence[str]):
    """``(section, key, value)`` of each ``--section.key value`` (or ``=value``), the text read as
    its field's type."""
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise JobError(f"command line: {shown(item)} is not an override; write --section.key value "
                           f"(e.g. --train.steps 10), sections: {', '.join(SECTIONS)}")
        name, eq, text = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(items):
                raise JobError(f"command line: --{name} needs a value (--{name} VALUE)")
            text = items[i + 1]
            i += 1
        i += 1
        section, _, key = name.partition(".")
        _known_key("command line", section, key.replace("-", "_"))
        key = key.replace("-", "_")
        yield section, key, _parse_text(section, key, text)


def _parse_text(section: str, key: str, text: str) -> Any:
    """A command-line value as the field's type: YAML's reading of it (``null`` for none, ``true``
    and ``false``, mappings for ``args``), a string field kept as written."""
    kind = _meta(section, key)["kind"]
    if kind is str and text.lower() not in ("null", "none", "~"):
        return text
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise JobError(f"command line: --{section}.{key} {shown(text)} is not {_kind_text(kind)}") from None
    if kind is float and isinstance(value, str):   # 1e-3: YAML 1.1 reads it as text
        try:
            value = float(value)
        except ValueError:
            return value       # not a number: the type check that follows names the key and the value
    return value


def load(path: str, overrides: Sequence[str] = ()) -> Job:
    """The job file at ``path`` with ``overrides`` applied."""
    data = load_yaml(path, what="job", limit=1 << 20, limit_why="a job file names files, it does not hold data",
                     error=JobError, missing="write one like examples/job.yaml")
    return from_dict(data, origin=path, overrides=overrides)


# -- compiling -------------------------------------------------------------------------------------
def to_args(job: Job) -> argparse.Namespace:
    """The trainer's ``argparse.Namespace`` for ``job``, checked by the trainer's own checks (their
    messages naming the job's keys) and for files that must exist, before anything starts."""
    args = trainer.build_parser().parse_args([job.model.factory or "MODEL"])   # every flag's default
    for section, keys in FIELDS.items():
        for key, flag in keys.items():
            value = getattr(job.sections[section], key)
            setattr(args, _ACTIONS[flag].dest, (not value) if flag in NEGATED else value)
    if job.model.factory is None:
        raise JobError(f"{job.origin}: model.factory is required: path/to/file.py:factory returning a "
                       "whalelike.Workload, e.g. examples/gpt.py:build")

    def fail(message: str):
        raise JobError(f"{job.origin}: {_named(message)}")

    trainer.check_args(args, fail)
    _check_paths(job)
    return args


_FLAG_KEYS = {flag: f"{section}.{key}" for section, keys in FIELDS.items() for key, flag in keys.items()
              if flag.startswith("--")}
_FLAG_RE = re.compile("|".join(re.escape(f) for f in sorted(_FLAG_KEYS, key=len, reverse=True)) + r"(?![\w-])")


def _named(message: str) -> str:
    """A trainer message with each flag replaced by its job key (``--steps`` -> ``train.steps``)."""
    return _FLAG_RE.sub(lambda m: _FLAG_KEYS[m.group(0)], message)


def _check_paths(job: Job) -> None:
    """Every file or directory the job reads exists (one line naming the key), before any rank starts."""
    origin = job.origin

    def need(key: str, path: Optional[str], kind: str, fix: str) -> None:
        if path is None:
            return
        ok = os.path.isdir(path) if kind == "directory" else os.path.isfile(path)
        if not ok:
            raise JobError(f"{origin}: {key} {path}: no such {kind}; {fix}")

    factory_file = job.model.factory.rpartition(":")[0]
    need("model.factory", factory_file or job.model.factory, "file", "give path/to/file.py:factory, relative to "
         f"{os.getcwd()}")
    need("model.weights", job.model.weights, "directory", "give a local Hugging Face save_pretrained directory")
    need("plan.file", job.plan.file, "file", "write one with `whalelike plan`, or leave plan.file out to plan now")
    spec = job.cluster.spec
    if spec is not None and spec not in Cluster.preset_names():
        need("cluster.spec", spec, "file", f"give a preset ({', '.join(Cluster.preset_names())}) or a cluster YAML")
    need("cluster.profile", job.cluster.profile, "file", "write one with `whalelike profile`")
    need("data.tokenizer", job.data.tokenizer, "directory", "give a directory written by save_pretrained")
    if job.data.path is not None:
        for part in job.data.path.split(",") if job.data.tokenizer is not None else [job.data.path]:
            if not (glob.glob(part) if job.data.tokenizer is not None else os.path.isfile(part)):
                raise JobError(f"{origin}: data.path {part}: no such file; give a text file (or, with "
                               "data.tokenizer, text/JSON-lines/parquet files or glob patterns)")
    if job.checkpoint.dir is not None and os.path.exists(job.checkpoint.dir) and not os.path.isdir(job.checkpoint.dir):
        raise JobError(f"{origin}: checkpoint.dir {job.checkpoint.dir} is a file; give a directory (it is created)")
    if job.metrics.dir is not None and os.path.exists(job.metrics.dir) and not os.path.isdir(job.metrics.dir):
        raise JobError(f"{origin}: metrics.dir {job.metrics.dir} is a file; give a directory (it is created)")


def main(config: str, overrides: Sequence[str] = ()) -> int:
    """``whalelike train CONFIG [--section.key value ...]``: load, check, print the resolved job
    (rank 0), train (:func:`runtime.launch.trainer.run`); the exit status."""
    prog = "whalelike train"
    try:
        job = load(config, overrides)
        args = to_args(job)
    except WhaleError as e:
        trainer.say_once(f"{prog}: error: {trainer.one_line(e)}")
        return trainer.EXIT_USAGE
    if args.metrics_dir is not None:
        os.makedirs(args.metrics_dir, exist_ok=True)
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {config} resolved:\n" + "\n".join(f"  {line}" for line in job.to_yaml().splitlines()),
              flush=True)
    return trainer.run(args, prog=prog)
