"""Typed specs: dataclass fields that carry their rules, one reader for files, one ``validate``.

Cluster, Config and Plan are dataclasses whose fields say what a good value is (a :class:`Rule`:
type, bounds, allowed values, meaning). The same rule checks a value whether it comes from a YAML
file (:func:`load_yaml` and :class:`Reader`; the error names the file, the field path, the bad
value and the fix) or from Python code (:func:`check_fields` in ``__post_init__``, and
:func:`validate`). Rules are per field, so there is one place to read or change what a field accepts.

Why not pydantic or jsonschema: the records are plain frozen dataclasses the planner and runtime
pass around by the thousand; a rule table next to each field costs nothing at attribute access,
needs no dependency, and gives the one-line, path-naming errors the CLI prints.

Invariants:

* a float rule accepts only finite numbers (ints are accepted and, when read, become floats); an int
  rule rejects bools and floats; a str rule rejects the empty string;
* :func:`load_yaml` refuses before parsing a file over its size limit or that is not UTF-8, and
  reads YAML 1.2 exponents (``1e3``) as numbers and a key given twice in one mapping as an error;
  :class:`Reader` walks at most :data:`MAX_VALUES` values (aliases cannot blow a small file up),
  and messages show bad values cut short (:func:`shown`);
* :func:`validate` runs each check of an object once for its current content: a second call with the
  same ``graphs``/``cluster`` objects costs one digest of the object (see :class:`_Checked`).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import math
import os
import pickle
import re
import reprlib
import typing
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

import yaml

from whalelike.errors import SpecError


# -- rules -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """What a field (or each item of a list field) accepts.

    ``kind``: str, int, float or bool. ``gt``/``ge``/``le``: bounds; ``le_why`` says why the upper
    bound is there (it is printed with the error). ``choices``: the allowed values. ``says``: the
    whole requirement in words, replacing the generic text and the doc (``"a positive integer"``).
    """

    kind: type
    doc: str = ""
    gt: Optional[float] = None
    ge: Optional[float] = None
    le: Optional[float] = None
    le_why: str = ""
    choices: Optional[tuple] = None
    says: Optional[str] = None

    def problem(self, value: Any, spelling: str = "python") -> Optional[str]:
        """Why ``value`` breaks this rule ('must be ..., got ...'), or None. ``spelling`` is
        ``"python"`` or ``"yaml"`` (how true and false are written in the message)."""
        if (_is_kind(self.kind, value, strict=True) and (self.choices is None or value in self.choices)
                and (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.le is None or value <= self.le)):
            return None   # the common case, without building a message
        doc = f" ({self.doc})" if self.doc else ""
        wanted = self.says or (_kind_text(self.kind, spelling, strict=True) + doc)
        if not _is_kind(self.kind, value, strict=True):
            return f"must be {wanted}, got {shown(value)}"
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(repr(c) for c in self.choices)
            return f"must be {self.says or f'one of {allowed}{doc}'}, got {shown(value)}"
        if self.gt is not None and not value > self.gt:
            return f"must be {self.says}, got {shown(value)}" if self.says else f"must be > {_number(self.gt)}, got {shown(value)}"
        if self.ge is not None and not value >= self.ge:
            return f"must be {self.says}, got {shown(value)}" if self.says else f"must be >= {_number(self.ge)}, got {shown(value)}"
        if self.le is not None and not value <= self.le:
            why = f"; {self.le_why}" if self.le_why else ""
            return f"must be <= {_number(self.le)}{doc}, got {_number(value)}{why}"
        return None


def rule(kind: type, doc: str = "", *, gt: Optional[float] = None, ge: Optional[float] = None,
         le: Optional[float] = None, le_why: str = "", choices: Optional[tuple] = None,
         says: Optional[str] = None, **field_args) -> Any:
    """A dataclass field carrying a :class:`Rule` (``field_args`` go to :func:`dataclasses.field`:
    ``default``, ``default_factory``). For a list or dict field the rule applies to each item."""
    return field(metadata={"rule": Rule(kind, doc, gt, ge, le, le_why, choices, says)}, **field_args)


def rule_of(f: dataclasses.Field) -> Optional[Rule]:
    return f.metadata.get("rule")


def rules(cls: type) -> dict[str, Optional[Rule]]:
    """Field name -> rule of a spec dataclass (None for a field without one, e.g. a nested record)."""
    return {f.name: rule_of(f) for f in fields(cls)}


def required(cls: type) -> set[str]:
    return {f.name for f in fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def _is_kind(kind: type, value: Any, strict: bool) -> bool:
    """Whether ``value`` has ``kind``; ``strict`` str means non-empty, a float must be finite."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    if kind is float:
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if kind is str:
        return isinstance(value, str) and (not strict or bool(value.strip()))
    raise TypeError(f"no rule for values of type {kind!r}")


def _kind_text(kind: type, spelling: str, strict: bool) -> str:
    if kind is bool:
        return "true or false" if spelling == "yaml" else "True or False"
    return {int: "an integer", float: "a number", str: "a non-empty string" if strict else "a string"}[kind]


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 2, 4, 4, 4
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 80, 80, 40


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut short: a value read from a file may be a huge or
    deeply nested structure (YAML aliases can nest a list in itself a billion times over)."""
    return _SHOWN.repr(value)


def _number(x: Any) -> str:
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 10**15:
        return f"{float(x):g}" if x < 10**308 else f"an integer of {len(str(abs(x)))} digits"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_fields(obj: Any, prefix: str, error: type = SpecError) -> None:
    """Check every field of a constructed record that has a rule and is set (not None) against it;
    ``prefix`` starts the message: ``"Config."`` or ``"device 'v100-0': "``; ``error`` is raised
    (ValueError for the planner's internal records, whose bad values are bugs, not user input)."""
    for f in fields(obj):
        spec_rule = rule_of(f)
        value = getattr(obj, f.name)
        if spec_rule is not None and value is not None:
            problem = spec_rule.problem(value)
            if problem:
                raise error(f"{prefix}{f.name} {problem}")


def check_rules(obj: Any, path: str, error: type = SpecError) -> None:
    """Check every rule in ``obj`` and the records, lists and dicts it holds (for :func:`validate`
    of records that are not checked at construction, like a Plan); errors name the field path.

    Speed (a 1024-device plan holds ~4 * 10^5 numbers, most in per-micro-batch lists): a list of
    plain numbers is checked in one pass (:func:`_plain_items_pass`); only a list that fails it is
    walked item by item, so the error still names the first bad item by its path."""
    for name, step, spec_rule in _field_rules(type(obj)):
        _check_value(getattr(obj, name), spec_rule, path, step, error)


@functools.lru_cache(maxsize=None)
def _field_rules(cls: type) -> tuple[tuple[str, str, Optional[Rule]], ...]:
    """(name, path step ``.name``, rule) of each field of a record class."""
    return tuple((f.name, f".{f.name}", rule_of(f)) for f in fields(cls))


@functools.lru_cache(maxsize=None)
def _is_record(cls: type) -> bool:
    return dataclasses.is_dataclass(cls)


def _check_value(value: Any, spec_rule: Optional[Rule], path: str, step: str, error: type) -> None:
    """Check ``value``, found at ``path + step`` (``step``: a field's ``.name`` or an item's
    ``[i]``); the joined path is built only where it is passed on or named in an error."""
    if value is None:
        return
    if _is_record(type(value)) and not isinstance(value, type):
        check_rules(value, path + step, error)
    elif isinstance(value, (list, tuple)):
        if spec_rule is not None and _plain_items_pass(spec_rule, value):
            return
        where = path + step
        for i, item in enumerate(value):
            _check_value(item, spec_rule, where, f"[{i}]", error)
    elif isinstance(value, dict):
        where = path + step
        for key, item in value.items():
            _check_value(item, spec_rule, where, f"[{shown(key)}]", error)
    elif spec_rule is not None:
        problem = spec_rule.problem(value)
        if problem:
            raise error(f"{path}{step} {problem}")


def _plain_items_pass(spec_rule: Rule, items: Any) -> bool:
    """True when every item of ``items`` is a plain ``int`` (or, for a float rule, a finite plain
    ``float``) that ``spec_rule`` accepts; False when any is not, or may not be (the caller then
    checks item by item with :meth:`Rule.problem`, which decides). Never True for a value
    :meth:`Rule.problem` refuses."""
    kind = spec_rule.kind
    if kind is float:
        for x in items:
            t = type(x)
            if t is float:
                if x - x != 0.0:   # inf or nan
                    return False
            elif t is not int:
                return False
    elif kind is int:
        for x in items:
            if type(x) is not int:
                return False
    else:
        return False
    if not items:
        return True
    if spec_rule.choices is not None and not all(x in spec_rule.choices for x in items):
        return False
    if spec_rule.gt is not None or spec_rule.ge is not None:
        low = min(items)
        if spec_rule.gt is not None and not low > spec_rule.gt:
            return False
        if spec_rule.ge is not None and not low >= spec_rule.ge:
            return False
    return spec_rule.le is None or max(items) <= spec_rule.le


# -- reading files ---------------------------------------------------------------------------------
_YAML_12_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKey(yaml.YAMLError):
    """A mapping names one key twice (PyYAML would keep the last silently)."""

    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(f"duplicate key {shown(key)}")
        self.key, self.first_line, self.second_line = key, first_line, second_line


class StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader (libyaml's when installed) with two fixes: ``1e3`` is a number, as in
    YAML 1.2 and JSON (YAML 1.1, which PyYAML follows, wants ``1.0e+3``), and a key given twice in
    one mapping is an error instead of the last one winning."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue  # `<<: *base` merges may be overridden by the mapping's own keys
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:
                    continue  # an unhashable key: the constructor reports it
        return super().construct_mapping(node, deep=deep)


    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except ValueError as e:  # int('1' * 5000), the date 2024-13-45: a traceback without this
            reason = str(e).split(";")[0]
            raise yaml.constructor.ConstructorError(None, None, f"cannot read {shown(node.value)}: {reason}",
                                                    node.start_mark) from None


StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_12_EXPONENT, list("-+0123456789."))


def load_yaml(path: str | os.PathLike, *, what: str, limit: int, limit_why: str, error: type = SpecError,
              missing: str = "") -> Any:
    """Parse the YAML file at ``path`` (a ``what`` file: "cluster", "plan") into plain data.

    Refused before parsing: a file over ``limit`` bytes (``limit_why`` says why the limit), one that
    is not UTF-8 (the error gives the byte offset), a missing file (``missing`` is the hint appended).
    Malformed YAML and duplicate keys name the line. Every error is ``error`` and starts with the path.
    """
    origin = os.fspath(path)
    try:
        with open(origin, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(_too_big(origin, what, f"{size:,} bytes ({_mib(size)})", limit, limit_why))
            data = f.read(limit + 1)   # a pipe or special file has no size until read
    except FileNotFoundError:
        raise error(f"{origin}: no such {what} file{'; ' + missing if missing else ''}") from None
    except IsADirectoryError:
        raise error(f"{origin}: is a directory, not a {what} file; pass the path of a YAML file") from None
    except OSError as e:
        raise error(f"{origin}: cannot read the {what} file ({e.strerror or e}); check the path and its "
                    "permissions") from None
    if len(data) > limit:
        raise error(_too_big(origin, what, f"more than {limit:,} bytes", limit, limit_why))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{origin}: not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} (line {line}) "
                    f"is not valid UTF-8; save the {what} file as UTF-8") from None
    try:
        return yaml.load(text, Loader=StrictLoader)
    except DuplicateKey as e:
        raise error(f"{origin}: line {e.second_line}: duplicate key {shown(e.key)} (first at line {e.first_line}); "
                    "each key may appear once in a mapping, remove one of them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{origin}: {where}malformed YAML ({problem}); check the indentation and the brackets "
                    "there") from None


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _too_big(origin: str, what: str, size: str, limit: int, why: str) -> str:
    return (f"{origin}: the file is {size}, over the {_mib(limit)} limit for {what} files ({why}); "
            f"check that this is the {what} file you meant")


# A plan of 16,384 workers with 8 micro-batches holds about 900k values (read at ~1.5 us each);
# YAML aliases (``*name``) let a file of a few KiB repeat a mapping millions of times, which the
# reader would then walk for minutes.
MAX_VALUES = 2_000_000


class Reader:
    """Turns parsed data into spec records; every error is ``error``, names ``origin`` (the file,
    when given), the field path, the bad value and the fix. It reads at most :data:`MAX_VALUES`."""

    def __init__(self, origin: Optional[str] = None, error: type = SpecError, root: str = ""):
        self.origin, self.error, self.root = origin, error, root   # root: the path of the whole file
        self.values_left = MAX_VALUES

    def spend(self, path: str, count: int = 1) -> None:
        """Count ``count`` values read at ``path``; past :data:`MAX_VALUES`, fail naming the
        outermost list element being read (``plan.workers[108]``, not a field inside it: where the
        budget runs out inside an element depends only on how many fields a record has, while the
        element is where a repeated alias sits)."""
        self.values_left -= count
        if self.values_left < 0:
            element = path[:path.index("]") + 1] if "]" in path else path
            raise self.fail(f"{element}: the data holds more than {MAX_VALUES:,} values, more than any spec needs; "
                            "YAML aliases (*name) repeat what an anchor (&name) marks, check where they are used")

    def fail(self, message: str) -> Exception:
        return self.error(f"{self.origin}: {message}" if self.origin else message)

    def mapping(self, value: Any, path: str, keys: Mapping[str, Optional[Rule]], needed: set[str],
                check_values: bool = True) -> dict:
        """Check that ``value`` is a mapping with only ``keys`` and every ``needed`` one and, with
        ``check_values``, that each value with a rule keeps it (None means 'not set' for a key that
        is not needed); return a copy, float values as floats."""
        if not isinstance(value, dict):
            got = "an empty file" if value is None and path == self.root and self.origin else shown(value)
            raise self.fail(f"{path or 'the top level'} must be a mapping with keys {', '.join(keys)}, got {got}")
        for key in value:
            if key not in keys:
                close = difflib.get_close_matches(str(key), list(keys), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(keys)}"
                name = key if isinstance(key, str) and len(key) <= 80 else shown(key)
                raise self.fail(f"{_join(path, name)}: unknown key; {hint}")
        for key in sorted(needed - value.keys()):
            doc = f" ({keys[key].doc})" if keys[key] is not None and keys[key].doc else ""
            raise self.fail(f"{path or 'the top level'}: missing required key {key!r}{doc}")
        self.spend(path or "the top level", len(value))
        out = dict(value)
        for key, item in value.items():
            spec_rule = keys[key]
            if check_values and spec_rule is not None and (item is not None or key in needed):
                out[key] = self.scalar(item, spec_rule, _join(path, key))
        return out

    def scalar(self, value: Any, spec_rule: Rule, path: str) -> Any:
        problem = spec_rule.problem(value, spelling="yaml")
        if problem:
            raise self.fail(f"{path} {problem}")
        return float(value) if spec_rule.kind is float else value

    def sequence(self, value: Any, path: str, what: str, allow_empty: bool = False) -> list:
        if not isinstance(value, list) or (not value and not allow_empty):
            raise self.fail(f"{path} must be a {'' if allow_empty else 'non-empty '}list of {what}, got {shown(value)}")
        return value

    def record(self, cls: type, value: Any, path: str) -> Any:
        """Build the spec dataclass ``cls`` from a mapping, converting nested records, lists and
        dicts by the field types and checking each value by its field's rule."""
        keys = rules(cls)
        needed = required(cls)
        values = self.mapping(value, path, keys, needed, check_values=False)
        hints = _hints(cls)
        for name, item in list(values.items()):
            if item is None and name not in needed:
                del values[name]   # None means 'not set': the field's default
            else:
                values[name] = self.convert(hints[name], keys[name], item, _join(path, name))
        return self.build(cls, values, path)

    def convert(self, hint: Any, spec_rule: Optional[Rule], value: Any, path: str) -> Any:
        """``value`` as type ``hint``; ``spec_rule`` checks the scalars in it."""
        self.spend(path)
        origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            return self.record(hint, value, path)
        if origin is typing.Union:
            args = typing.get_args(hint)
            if value is None and type(None) in args:
                return None
            (inner,) = [a for a in args if a is not type(None)]
            return self.convert(inner, spec_rule, value, path)
        if origin in (list, tuple):
            if not isinstance(value, list):
                raise self.fail(f"{path} must be a list, got {shown(value)}")
            item = typing.get_args(hint)[0]
            items = [self.convert(item, spec_rule, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
        if origin is dict:
            if not isinstance(value, dict):
                raise self.fail(f"{path} must be a mapping, got {shown(value)}")
            key_type, item = typing.get_args(hint)
            for key in value:
                if not _is_kind(key_type, key, strict=False):
                    raise self.fail(f"{path}: key {shown(key)} must be {_kind_text(key_type, 'yaml', strict=False)}")
            return {k: self.convert(item, spec_rule, v, f"{path}[{shown(k)}]") for k, v in value.items()}
        if spec_rule is not None:
            return self.scalar(value, spec_rule, path)
        if not _is_kind(hint, value, strict=False):
            raise self.fail(f"{path} must be {_kind_text(hint, 'yaml', strict=False)}, got {shown(value)}")
        return float(value) if hint is float else value

    def build(self, cls: type, values: Mapping[str, Any], path: str) -> Any:
        """Construct a record; its own cross-field checks get the file (and path) prefixed."""
        try:
            return cls(**values)
        except SpecError as e:
            raise self.fail(f"{path}: {e}" if path else str(e)) from None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# -- the one entry point ---------------------------------------------------------------------------
Check = Callable[..., None]


def validate(obj: Any, *, graphs: Any = None, cluster: Any = None) -> None:
    """Raise a :class:`~whalelike.errors.SpecError` (a subclass for plans) naming the first broken
    rule of ``obj``, a Cluster, Config or Plan: its field rules, its cross-field checks and, when
    given, its match with a model's TaskGraphs (``graphs``) and a ``cluster``.

    A spec class lists its checks in a class attribute ``spec_checks``: ``"self"`` (cross-field),
    ``"graphs"``, ``"cluster"`` -> a function ``(obj[, against])``. A class whose records are not
    checked at construction (Plan) names its root in error paths in ``spec_path`` (its field rules
    are then checked here, first) and its error type in ``spec_error``.

    Each check runs once per content of ``obj`` and object checked against (``is``): validating a
    plan again costs a digest of its pickled content (5 ms for 1024 workers of 64 micro-batches), so the
    runtime may validate wherever it needs the guarantee. Other ``graphs``/``cluster`` objects,
    or an edited plan, are checked afresh.
    """
    checks: Mapping[str, Check] = getattr(type(obj), "spec_checks", None) or {}
    if not dataclasses.is_dataclass(obj) or "self" not in checks:
        raise TypeError(f"validate() takes a Cluster, Config or Plan, got {type(obj).__name__}")
    against = {name: value for name, value in (("graphs", graphs), ("cluster", cluster)) if value is not None}
    for name in against:
        if name not in checks:
            raise TypeError(f"a {type(obj).__name__} is not checked against {name}; leave {name}= out")
    done = _Checked.of(obj)
    if done.needs("self", None):
        path = getattr(type(obj), "spec_path", None)
        if path is not None:
            check_rules(obj, path, getattr(type(obj), "spec_error", SpecError))
        checks["self"](obj)
        done.add("self", None)
    for name, value in against.items():
        if done.needs(name, value):
            checks[name](obj, value)
            done.add(name, value)


class _Checked:
    """What an object passed, for its content when checked: (check name, object it was checked
    against, kept alive so its id stays unique). Kept in a table beside the object (by id, dropped
    when the object is collected), so copying, pickling and comparing it never see it; a changed
    content (a mutable Plan edited in place) starts over."""

    _table: dict[int, tuple[weakref.ref, "_Checked"]] = {}

    def __init__(self, digest: bytes):
        self.digest = digest
        self.passed: list[tuple[str, Any]] = []

    @classmethod
    def of(cls, obj: Any) -> "_Checked":
        try:   # the content's bytes: pickle is ~20x faster than repr on a 1024-worker plan (5 vs 95 ms)
            content = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):   # a record holding something unpicklable
            content = repr(obj).encode()
        digest = hashlib.blake2b(content, digest_size=16).digest()
        key = id(obj)
        entry = cls._table.get(key)
        if entry is not None and entry[0]() is obj and entry[1].digest == digest:
            return entry[1]
        done = cls(digest)
        cls._table[key] = (weakref.ref(obj, lambda _, key=key: cls._table.pop(key, None)), done)
        return done

    def needs(self, name: str, against: Any) -> bool:
        return not any(n == name and a is against for n, a in self.passed)

    def add(self, name: str, against: Any) -> None:
        self.passed.append((name, against))


# -- measured device profiles (planner.devices.profile) --------------------------------------------
# The checks of a :class:`planner.devices.profile.Profile` (its ``spec_checks``), here because this
# module is the one validation layer; whalelike/ imports nothing of planner/, so they read the
# profile's fields by name. What each rule protects: the planner interpolates each device's speed
# curve over the batches measured for every unit, so every unit of a device must have the same
# batches, max_batch among them, every time finite and >= 0; a profile answers for one model
# (fingerprint), one cluster (its devices by name, kind and host, in rank order) and one precision.
class ProfileError(SpecError):
    """A device profile that is malformed, or was measured for another model, cluster or precision."""


PROFILE_UNITS = ("taskgraph", "layer")       # what one measured unit is: a TaskGraph, or a Layer
PROFILE_EDGES = ("memory", "cap")             # how max_batch was found (see DeviceProfile.edge)
# planner.devices.network's INTRA_HOST, INTER_HOST, and "collective": a ring all-reduce over every device, fitted
# per ring step (runtime.profiling.links.measure_collective)
PROFILE_LINK_KINDS = ("intra-host", "inter-host", "collective")


def _profile_fix(profile: Any) -> str:
    world = len(profile.devices)
    return (f"measure it again: torchrun --nproc-per-node {world} -m whalelike.cli profile MODEL --cluster CLUSTER "
            "-o PROFILE.yaml (docs/guides/profiling.md)")


def check_profile(profile: Any) -> None:
    """Cross-field rules of a Profile; a :class:`ProfileError` naming the device, unit or batch."""
    if not profile.devices:
        raise ProfileError("profile.devices is empty; a profile holds one entry per device of its cluster")
    names: set[str] = set()
    units: Optional[set] = None
    for d in profile.devices:
        where = f"profile device {d.name!r}"
        if d.name in names:
            raise ProfileError(f"{where} appears twice; each device of the cluster has one entry")
        names.add(d.name)
        if not d.times:
            raise ProfileError(f"{where} has no measured times; {_profile_fix(profile)}")
        batches: Optional[set] = None
        for unit, points in d.times.items():
            if unit < 0:
                raise ProfileError(f"{where}: unit index {unit} is negative; units are numbered from 0")
            if not points:
                raise ProfileError(f"{where}: unit {unit} has no measured batch; {_profile_fix(profile)}")
            for batch, pair in points.items():
                if not 1 <= batch <= d.max_batch:
                    raise ProfileError(f"{where}: unit {unit} is timed at batch {batch}, outside 1..max_batch "
                                       f"({d.max_batch}); a batch that does not fit cannot have been timed")
                if len(pair) != 2:
                    raise ProfileError(f"{where}: unit {unit} at batch {batch} holds {shown(list(pair))}; each point "
                                       "is [forward seconds, backward seconds]")
            if batches is None:
                batches = set(points)
            elif set(points) != batches:
                raise ProfileError(f"{where}: unit {unit} is timed at batches {sorted(points)} but unit "
                                   f"{min(d.times)} at {sorted(batches)}; every unit of a device is timed at the "
                                   f"same batches (one training step times them all)")
        if d.max_batch not in batches:
            raise ProfileError(f"{where}: max_batch {d.max_batch} is not among its timed batches {sorted(batches)}; "
                               "the largest batch that fits is always timed")
        if units is None:
            units = set(d.times)
        elif set(d.times) != units:
            raise ProfileError(f"{where} times units {sorted(d.times)} but device {profile.devices[0].name!r} times "
                               f"{sorted(units)}; every device measures the same model")
        for batch, peak in d.memory_bytes.items():
            if not 1 <= batch <= d.max_batch:
                raise ProfileError(f"{where}: memory measured at batch {batch}, outside 1..max_batch ({d.max_batch})")
            if d.capacity_bytes is not None and peak > d.capacity_bytes:
                raise ProfileError(f"{where}: batch {batch} peaked at {peak:,} bytes, more than the capacity "
                                   f"{d.capacity_bytes:,}; such a batch does not fit and cannot be in the profile")
    if profile.unit not in PROFILE_UNITS:
        raise ProfileError(f"profile.unit must be one of {', '.join(PROFILE_UNITS)}, got {shown(profile.unit)}")
    kinds: set[str] = set()
    for link in profile.links:
        if link.kind in kinds:
            raise ProfileError(f"profile.links holds two {link.kind} links; one fit per kind of link")
        kinds.add(link.kind)
        for end in (link.src, link.dst):
            if end not in names:
                raise ProfileError(f"profile {link.kind} link names device {end!r}, which the profile does not "
                                   f"have (devices: {', '.join(sorted(names))})")
        if link.src == link.dst:
            raise ProfileError(f"profile {link.kind} link goes from {link.src!r} to itself; a link joins two devices")
        if len(link.points) < 2:
            raise ProfileError(f"profile {link.kind} link has {len(link.points)} timed size(s); an alpha-beta fit "
                               "needs at least two")


def check_profile_model(profile: Any, graphs: Any) -> None:
    """The profile was measured for the model ``graphs`` were captured from (its fingerprint, and
    one timed unit per TaskGraph or Layer)."""
    fingerprint = getattr(graphs, "fingerprint", None)
    if fingerprint != profile.model_fingerprint:
        raise ProfileError(f"the profile was measured for another model (fingerprint {profile.model_fingerprint[:12]}, "
                           f"this model's is {str(fingerprint)[:12]}); {_profile_fix(profile)}")
    count = len(graphs.graphs) if profile.unit == "taskgraph" else len(graphs.layers)
    units = set(profile.devices[0].times)
    if units != set(range(count)):
        raise ProfileError(f"the profile times {profile.unit}s {sorted(units)} but the model has {count} "
                           f"{profile.unit}s (0..{count - 1}); {_profile_fix(profile)}")


def check_profile_cluster(profile: Any, cluster: Any) -> None:
    """The profile was measured on ``cluster``: its name, and its devices by name, kind and host in
    rank order."""
    if profile.cluster != cluster.name:
        raise ProfileError(f"the profile was measured on cluster {profile.cluster!r}, not {cluster.name!r}; "
                           f"{_profile_fix(profile)}")
    mine = [(d.name, d.kind, d.host) for d in profile.devices]
    theirs = [(d.name, d.kind, d.host) for d in cluster.devices]
    if mine != theirs:
        diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        got = "nothing" if diff >= len(mine) else "{} ({} on {})".format(*mine[diff])
        want = "nothing" if diff >= len(theirs) else "{} ({} on {})".format(*theirs[diff])
        raise ProfileError(f"the profile's devices differ from cluster {cluster.name!r}'s at rank {diff}: the profile "
                           f"has {got}, the cluster {want}; {_profile_fix(profile)}")


def check_profile_precision(profile: Any, precision: str) -> None:
    """The profile was measured at ``precision`` (times and memory both depend on it)."""
    if profile.precision != precision:
        raise ProfileError(f"the profile was measured at precision {profile.precision}, not {precision}; profile at "
                           f"{precision} (whalelike profile ... --precision {precision}), or plan at "
                           f"{profile.precision}")
