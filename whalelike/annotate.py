"""Annotate a model by module path, for models whose code the user cannot edit.

``annotate(model, {"transformer.h.0-5": replicate(2), "lm_head": split(4)})`` tags the matched
modules exactly as if they had been constructed under the scope (``_wl_scope``, see
:mod:`whalelike.strategy`), so capture treats both forms the same way. Each mapping entry is one
scope and therefore one TaskGraph, however many modules its pattern matches; entries given the
*same* strategy object share one scope (``head = wl.split(2)`` for ``"transformer.h.2-3"`` and
``"lm_head"`` makes the blocks and the head one tensor-parallel region), which a pattern language
without alternation could not otherwise say.

Activation checkpointing is a strategy option, as in a scope:
``annotate(model, {"model.layers": replicate(recompute=True)})`` makes the layers one region whose
activations are recomputed in the backward (see :mod:`whalelike.strategy`).

Patterns:

* an exact path: ``"encoder.embeddings"``;
* a range of numbered children: ``"transformer.h.0-5"`` (children ``0`` to ``5`` inclusive);
* an fnmatch glob: ``"encoder.layer.*"`` (``*`` also crosses dots, as in fnmatch).

Entries are applied outermost first, so an entry inside another's module nests under it
(``split`` inside ``replicate`` is tensor parallel inside each replica; other nestings are errors).

One call says everything: a second ``annotate`` call that reaches a module an earlier call
annotated (the module itself or one inside it) is an error naming both strategies, since it would
silently replace the first (``_wl_annotation``: the pattern and strategy that tagged a module;
every call checks all it reaches before tagging any, so a tag found is an earlier call's). Nesting belongs
in one mapping; ``replace=True`` replaces on purpose.
"""
from __future__ import annotations

import difflib
import fnmatch
import logging
import re
from typing import Mapping

import torch.nn as nn

from whalelike.errors import AnnotationError
from whalelike.strategy import Strategy, fresh_scope

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^(?P<prefix>.*?)(?P<lo>\d+)-(?P<hi>\d+)(?P<suffix>(\..*)?)$")


def annotate(model: nn.Module, mapping: Mapping[str, Strategy], *, replace: bool = False) -> dict[str, list[str]]:
    """Tag the modules matched by each pattern of ``mapping`` with its strategy.

    Returns, per pattern, the module paths it matched (in model order). Every module under a
    matched module is tagged too, so construction-time tags inside it are overridden; a deeper
    entry of the same mapping then re-tags its own subtree, nested under the outer strategy.
    A module an earlier ``annotate`` call tagged is an error unless ``replace`` is True, in which
    case this call's strategy replaces the earlier one on the modules it matches.
    """
    if not isinstance(model, nn.Module):
        raise AnnotationError(f"annotate expects an nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    matched: dict[str, list[str]] = {}
    for pattern, strategy in mapping.items():
        if not isinstance(strategy, Strategy):
            raise AnnotationError(
                f"annotate: the value for {pattern!r} must be wl.replicate(...) or wl.split(...), got {strategy!r}"
            )
        matched[pattern] = _match(pattern, modules)
    owner: dict[str, str] = {}
    for pattern, paths in matched.items():
        for path in paths:
            if path in owner:
                raise AnnotationError(
                    f"annotate: module {path!r} is matched by both {owner[path]!r} and {pattern!r}; "
                    "make the patterns disjoint"
                )
            owner[path] = pattern
    if not replace:
        _check_not_annotated(modules, matched, mapping)

    # Outermost first: a pattern's scope nests inside the scope of the pattern enclosing it.
    order = sorted(matched, key=lambda p: min(_depth(path) for path in matched[p]))
    scopes: dict[str, Strategy] = {}
    shared: dict[tuple[int, int], Strategy] = {}  # one strategy object in several entries: one scope
    for pattern in order:
        outer = _enclosing_scope(matched[pattern][0], owner, scopes)
        key = (id(mapping[pattern]), id(outer))
        scope = shared.get(key) or fresh_scope(outer, mapping[pattern])
        shared[key] = scopes[pattern] = scope
        for path in matched[pattern]:
            for sub in modules[path].modules():
                object.__setattr__(sub, "_wl_scope", scope)
                object.__setattr__(sub, "_wl_annotation", (pattern, str(mapping[pattern])))
        log.debug("annotate %r -> %s on %s", pattern, scope, matched[pattern])
    return matched


def _check_not_annotated(modules: Mapping[str, nn.Module], matched: Mapping[str, list[str]],
                         mapping: Mapping[str, Strategy]) -> None:
    """No module this call reaches may carry an earlier call's annotation."""
    for pattern, paths in matched.items():
        for path in paths:
            for sub_path, sub in modules[path].named_modules(prefix=path):
                earlier = getattr(sub, "_wl_annotation", None)
                if earlier is None:
                    continue
                earlier_pattern, earlier_strategy = earlier
                raise AnnotationError(
                    f"annotate: module {sub_path!r} is already annotated with {earlier_strategy} (pattern "
                    f"{earlier_pattern!r} of an earlier annotate call); this call would silently replace it with "
                    f"{mapping[pattern]} (pattern {pattern!r}). Give both entries in one annotate mapping (an entry "
                    "inside another's module nests under it), or pass replace=True to replace the earlier annotation"
                )


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _enclosing_scope(path: str, owner: Mapping[str, str], scopes: Mapping[str, Strategy]):
    """The scope of the nearest matched ancestor of ``path`` (already applied), else None."""
    parts = path.split(".")
    for k in range(len(parts) - 1, 0, -1):
        pattern = owner.get(".".join(parts[:k]))
        if pattern is not None:
            return scopes[pattern]
    return None


def _match(pattern: str, modules: Mapping[str, nn.Module]) -> list[str]:
    if not isinstance(pattern, str) or not pattern:
        raise AnnotationError(f"annotate: module path must be a non-empty string, got {pattern!r}")
    if pattern in modules:
        return [pattern]
    found: list[str] = []
    m = _RANGE.match(pattern)
    if m:
        lo, hi = int(m["lo"]), int(m["hi"])
        if lo > hi:
            raise AnnotationError(f"annotate: range {pattern!r} is empty ({lo} > {hi}); write it low-high")
        wanted = [f"{m['prefix']}{i}{m['suffix']}" for i in range(lo, hi + 1)]
        missing = [w for w in wanted if w not in modules]
        if missing and len(missing) < len(wanted):
            raise AnnotationError(
                f"annotate: range {pattern!r} names modules that do not exist: {', '.join(missing)}"
            )
        found = [w for w in wanted if w in modules]
    elif any(c in pattern for c in "*?["):
        found = [p for p in modules if p and fnmatch.fnmatchcase(p, pattern)]
        # A glob matches a subtree's root and its children alike; keep only the outermost matches.
        found = [p for p in found if not any(p.startswith(q + ".") for q in found)]
    if not found:
        close = difflib.get_close_matches(pattern, [p for p in modules if p], n=5, cutoff=0.5)
        hint = f"closest existing paths: {', '.join(close)}" if close else (
            f"top-level modules: {', '.join(n for n, _ in _children(modules))}")
        raise AnnotationError(f"annotate: no module matches {pattern!r} in the model; {hint}")
    return found


def _children(modules: Mapping[str, nn.Module]):
    return [(p, m) for p, m in modules.items() if p and "." not in p]

