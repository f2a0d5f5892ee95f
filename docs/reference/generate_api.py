"""Writes ``docs/reference/api.md``, the Python API reference, from the code's signatures and docstrings.

Every public name: the ``__all__`` of ``whalelike``, ``planner`` and ``runtime``, and the few
modules whose names the guides have users import or call (``runtime.checkpoint``, ``runtime.control.metrics``,
``planner.devices.profile``, ``runtime.balance.sync_policy``, ``runtime.text_data``). For each, its kind, signature
(``inspect.signature``) and docstring (``inspect.getdoc``); for a class, its bases, its dataclass
fields with their defaults and meanings, and its public methods and properties with their own
signature and the first paragraph of their docstring. Names keep their ``__all__`` order (a module
without one: its definition order), so the page is the same wherever it is generated.

Generated, never edited by hand: ``tests/test_docs_reference.py`` regenerates it and fails when
the committed page differs.

    .venv/bin/python docs/reference/generate_api.py
"""
from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "api.md"
WIDTH = 100                 # a signature longer than this is written one parameter a line
PACKAGES = ("whalelike", "planner", "runtime")


def _public_defined(module: types.ModuleType) -> list[str]:
    """A module without ``__all__``: the public classes and functions it defines, in source order."""
    found = [(inspect.getsourcelines(obj)[1], name) for name, obj in vars(module).items()
             if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
             and obj.__module__ == module.__name__]
    return [name for _, name in sorted(found)]


# (module, what of it: "__all__", "defined" (its own public classes and functions), or a list of names)
SECTIONS: list[tuple[str, Any]] = [
    ("whalelike", "__all__"),
    ("planner", "__all__"),
    ("runtime", "__all__"),
    ("runtime.checkpoint", "defined"),
    ("runtime.control.metrics", ["Metrics"]),
    ("planner.devices.profile", "__all__"),
    ("runtime.balance.sync_policy", ["SyncPolicy"]),
    ("runtime.text_data", ["PlanBatches"]),
]

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")
_CODE = re.compile(r"(``.+?``|`[^`\n]+`)")
_EMPHASIS = re.compile(r"((?<![\w*])\*[^\s*](?:[^*]*[^\s*])?\*(?![\w*]))")


# ----------------------------------------------------------------------------------------- values


def _qualified(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    if module in ("builtins", ""):
        return name
    return f"{module}.{name}"


def _value(value: Any) -> str:
    """A stable rendering of a default value: never a memory address nor this checkout's path."""
    if isinstance(value, enum.Enum):
        text = f"{type(value).__name__}.{value.name}"
    elif inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.ismodule(value):
        text = _qualified(value) if not inspect.ismodule(value) else value.__name__
    elif isinstance(value, (list, tuple, set, frozenset)) and type(value) in (list, tuple, set, frozenset):
        items = [_value(v) for v in value]
        if isinstance(value, list):
            text = f"[{', '.join(items)}]"
        elif isinstance(value, tuple):
            text = f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        else:
            text = f"{{{', '.join(sorted(items))}}}" if items else f"{type(value).__name__}()"
    elif type(value) is dict:
        text = "{" + ", ".join(f"{_value(k)}: {_value(v)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
        if " at 0x" in text:
            text = f"<{_qualified(type(value))} object>"
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, typing.ForwardRef):   # a NamedTuple's fields under postponed annotations
        annotation = annotation.__forward_arg__
    if isinstance(annotation, str):   # written as a string (a forward reference): shown without its quotes
        quoted = len(annotation) > 1 and annotation[0] == annotation[-1] and annotation[0] in "'\""
        return annotation[1:-1] if quoted else annotation
    return inspect.formatannotation(annotation)


# ------------------------------------------------------------------------------------- signatures


def _parameters(signature: inspect.Signature) -> list[str]:
    """Each parameter as written in a ``def``, with the ``/`` and ``*`` markers."""
    out: list[str] = []
    kinds = [p.kind for p in signature.parameters.values()]
    for i, p in enumerate(signature.parameters.values()):
        if p.kind is p.KEYWORD_ONLY and inspect.Parameter.VAR_POSITIONAL not in kinds \
                and (i == 0 or kinds[i - 1] is not p.KEYWORD_ONLY):
            out.append("*")
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_value(p.default)}" if p.annotation is not p.empty else f"={_value(p.default)}"
        out.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(kinds) or kinds[i + 1] is not p.POSITIONAL_ONLY):
            out.append("/")
    return out


def _signature(name: str, signature: Optional[inspect.Signature], drop_first: bool = False,
               returns: bool = True) -> str:
    """``name(parameters) -> return``, one parameter a line when longer than WIDTH."""
    if signature is None:
        return name
    if not returns:
        signature = signature.replace(return_annotation=signature.empty)
    if drop_first and signature.parameters:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    params = _parameters(signature)
    ret = "" if signature.return_annotation is signature.empty else f" -> {_annotation(signature.return_annotation)}"
    one_line = f"{name}({', '.join(params)}){ret}"
    if len(one_line) <= WIDTH:
        return one_line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){ret}"


def _signature_of(obj: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):   # a builtin, or an exception class without an __init__ of its own
        return None


# ------------------------------------------------------------------------------------- docstrings


def own_doc(obj: Any) -> Optional[str]:
    """The docstring written for ``obj`` itself: not one inherited from a base class, and not the
    ``Name(field, ...)`` text ``dataclasses`` puts on a class that has none."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc or not doc.strip():
        return None
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        try:
            generated = obj.__name__ + str(inspect.signature(obj)).replace(" -> None", "")
        except (TypeError, ValueError):
            generated = None
        if doc == generated:
            return None
    return inspect.cleandoc(doc)


def _inline(text: str) -> str:
    """Markdown for reStructuredText-flavoured prose: roles become code, and outside code ``<``
    and ``*`` are escaped (an HTML tag, emphasis)."""
    text = _ROLE.sub(lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", text)
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):
        pieces = _EMPHASIS.split(parts[i].replace("<", "&lt;"))   # *word*, emphasis in both languages
        parts[i] = "".join(p if j % 2 else p.replace("*", r"\*") for j, p in enumerate(pieces))
    return "".join(parts)


def _escape_line(line: str) -> str:
    stripped = line.lstrip()
    if stripped.startswith(("#", ">", "=", "+ ")) or re.match(r"\d+[.)] ", stripped):
        line = line[: len(line) - len(stripped)] + "\\" + stripped
    if line.endswith("::"):
        line = line[:-1]
    return _inline(line)


def _markdown(doc: str) -> list[str]:
    """A docstring as Markdown lines, paragraph by paragraph: prose as it is (roles as code, HTML
    and emphasis escaped), and a paragraph whose layout carries meaning (an indented literal block,
    or lines aligned under a hanging indent, such as a list of fields) fenced as text."""
    out: list[str] = []
    paragraphs = re.split(r"\n\s*\n", doc.strip("\n"))
    for paragraph in paragraphs:
        lines = [line.rstrip() for line in paragraph.splitlines()]
        if lines[0].startswith(" "):
            out += ["```text", *(line[4:] if line.startswith("    ") else line.lstrip() for line in lines), "```", ""]
        elif any(line.startswith(" ") for line in lines[1:]):
            out += ["```text", *(_ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), line)
                                 for line in lines), "```", ""]
        else:
            out += [_escape_line(line) for line in lines] + [""]
    while out and not out[-1].strip():
        out.pop()
    return out


def _first_paragraph(doc: Optional[str]) -> list[str]:
    if not doc:
        return []
    return _markdown(doc.split("\n\n", 1)[0].strip())


# ----------------------------------------------------------------------------------------- kinds


def _kind(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return "exception"
        return "dataclass" if dataclasses.is_dataclass(obj) else "class"
    if callable(obj):
        return "function"
    return "constant"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] in PACKAGES


# --------------------------------------------------------------------------------------- classes


def _fields(cls: type) -> list[str]:
    from whalelike.spec import rule_of

    rows = [["field", "type", "default", "meaning"]]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f"`{_value(f.default)}`"
        elif f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            made = _value(factory) if not getattr(factory, "__name__", "") == "<lambda>" else ""
            default = f"`{made}()`" if made else "computed"
        else:
            default = "required"
        if not f.init:
            default += " (not an argument)"
        rule = rule_of(f)
        meaning = ""
        if rule is not None:
            meaning = rule.says or rule.doc
            if rule.choices and "one of" not in meaning:
                meaning += ("; " if meaning else "") + "one of " + ", ".join(f"`{c!r}`" for c in rule.choices)
        meaning = _inline(meaning).replace("|", r"\|")
        kind = _annotation(f.type).replace("|", r"\|")
        rows.append([f"`{f.name}`", f"`{kind}`", default, meaning])
    if not any(row[3] for row in rows[1:]):   # no field says what it means: no empty column
        rows = [row[:3] for row in rows]
    return [f"| {' | '.join(rows[0])} |", "|" + " --- |" * len(rows[0])] + [f"| {' | '.join(r)} |" for r in rows[1:]]


def _members(cls: type) -> list[tuple[str, Any, type]]:
    """Public methods and properties, own ones first, then those of the project's base classes."""
    seen: set[str] = set()
    found = []
    for base in cls.__mro__:
        if not _ours(base):
            continue
        for name, member in vars(base).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(member, (staticmethod, classmethod, property)) or \
                    hasattr(member, "func") and hasattr(member, "attrname"):   # functools.cached_property
                found.append((name, member, base))
            elif inspect.isfunction(member):
                found.append((name, member, base))
    return found


def _member(cls: type, name: str, member: Any, owner: type) -> list[str]:
    inherited = f" (from `{_qualified(owner)}`)" if owner is not cls else ""
    if isinstance(member, property) or (hasattr(member, "func") and hasattr(member, "attrname")):
        getter = member.fget if isinstance(member, property) else member.func
        sig = _signature_of(getter)
        ret = "" if sig is None or sig.return_annotation is sig.empty else f": {_annotation(sig.return_annotation)}"
        head = f"- `{name}{ret}` *(property)*{inherited}"
        doc = own_doc(getter) or (member.__doc__ if isinstance(member, property) and member.__doc__ else None)
    else:
        label = ""
        if isinstance(member, staticmethod):
            function, drop = member.__func__, False
            label = " *(static method)*"
        elif isinstance(member, classmethod):
            function, drop = member.__func__, True
            label = " *(class method)*"
        else:
            function, drop = member, True
        text = _signature(name, _signature_of(function), drop_first=drop)
        doc = own_doc(function)
        if "\n" in text:   # the name and what it does in the list, the wrapped signature below it
            paragraph = _first_paragraph(doc)
            head = f"- `{name}`{label}{inherited}" + (": " + paragraph[0] if paragraph else "")
            return [head, *("  " + line if line else "" for line in paragraph[1:]), "", "```text", text, "```", ""]
        head = f"- `{text}`{label}{inherited}"
    paragraph = _first_paragraph(doc)
    if not paragraph:
        return [head]
    return [head + ": " + paragraph[0], *("  " + line if line else "" for line in paragraph[1:])]


# ---------------------------------------------------------------------------------------- entries


def _entry(qualified: str, obj: Any) -> tuple[str, list[str]]:
    """The heading and the lines of one public name."""
    kind = _kind(obj)
    heading = f"`{qualified}` ({kind})"
    lines = [f"### {heading}", ""]
    if kind == "module":
        doc = own_doc(obj)
        lines += _first_paragraph(doc) + ["", f"Its public names: [module `{obj.__name__}`]"
                                                f"(#{_anchor(f'Module `{obj.__name__}`')}) below.", ""]
        return heading, lines
    if kind == "constant":
        lines += ["```text", f"{qualified.rsplit('.', 1)[-1]} = {_value(obj)}", "```", ""]
        return heading, lines

    defined = getattr(obj, "__module__", "")
    facts = [f"Defined in `{defined}`."]
    if inspect.isclass(obj):
        bases = [b for b in obj.__bases__ if b is not object]
        if bases:
            facts.append("Bases: " + ", ".join(f"`{_qualified(b)}`" for b in bases) + ".")
        if dataclasses.is_dataclass(obj) and obj.__dataclass_params__.frozen:
            facts.append("Frozen (its fields cannot be reassigned).")
    lines += [" ".join(facts), ""]

    name = qualified.rsplit(".", 1)[-1]
    signature = _signature_of(obj)
    if signature is not None and not (inspect.isclass(obj) and issubclass(obj, BaseException)
                                      and "__init__" not in vars(obj)):
        lines += ["```text", _signature(name, signature, returns=not inspect.isclass(obj)), "```", ""]
    doc = own_doc(obj)
    lines += (_markdown(doc) if doc else ["*No docstring.*"]) + [""]
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            lines += ["**Fields**", ""] + _fields(obj) + [""]
        members = _members(obj)
        if members:
            lines += ["**Methods and properties**", ""]
            for member_name, member, owner in members:
                lines += _member(obj, member_name, member, owner)
            lines.append("")
    return heading, lines


def _names(module: types.ModuleType, what: Any) -> list[str]:
    if what == "__all__":
        return list(module.__all__)
    if what == "defined":
        return _public_defined(module)
    return list(what)


def render() -> str:
    """The page's text."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    toc: list[str] = []
    body: list[str] = []
    anchors: set[str] = set()
    for module_name, what in SECTIONS:
        module = importlib.import_module(module_name)
        kind = "Package" if hasattr(module, "__path__") else "Module"
        section = f"{kind} `{module_name}`"
        toc.append(f"- [{section}](#{_anchor(section)})")
        body += [f"## {section}", ""]
        intro = _first_paragraph(own_doc(module))
        chosen = "its `__all__`" if what == "__all__" else (
            "the public classes and functions it defines" if what == "defined" else
            "the names its users import")
        body += intro + ["", f"Documented here: {chosen}.", ""]
        for name in _names(module, what):
            heading, lines = _entry(f"{module_name}.{name}", getattr(module, name))
            anchor = _anchor(heading)
            if anchor in anchors:
                raise RuntimeError(f"two headings share the anchor #{anchor}")
            anchors.add(anchor)
            toc.append(f"  - [`{name}`](#{anchor}) ({_kind(getattr(module, name))})")
            body += lines
    while body and not body[-1]:
        body.pop()
    head = ["# Python API reference", "",
            "Generated from the code's signatures and docstrings by `docs/reference/generate_api.py`; do not edit "
            "by hand (regenerate with `.venv/bin/python docs/reference/generate_api.py`).", "",
            "## Contents", ""]
    return "\n".join(head + toc + [""] + body) + "\n"


if __name__ == "__main__":
    text = render()   # puts the repository on the path
    from whalelike.files import write_atomic

    write_atomic(PAGE, text)
    print(f"wrote {PAGE}")
