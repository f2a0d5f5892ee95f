"""The two parallel primitives, ``replicate`` and ``split``, and the explicit scope stack.

A :class:`Strategy` is a small immutable value. Used as a context manager it pushes itself onto
a module-level stack; modules constructed and code run under it belong to one TaskGraph. Scopes
are recorded in two ways:

* construction time: every ``nn.Module`` created under a scope is tagged (``_wl_scope``) when its
  ``__init__`` finishes, through a patch installed only while a scope is open;
* forward time: while tracing, :mod:`whalelike.graphs.capture` reads the stack at each traced operation.

Nesting rule (Whale): ``split`` inside ``replicate`` means tensor parallel inside each replica.
Every other nesting is an error.

Activation checkpointing is asked per region: ``replicate(n, recompute=True)`` or
``split(n, recompute=True)``. It is a property of the region, not of the parallel layout: the
TaskGraph records it (``TaskGraph.strategy.recompute``), the planner makes every pipeline stage that
runs such a TaskGraph recompute (``StagePlan.recompute``) and the runtime wraps that stage's module
(:mod:`runtime.training.recompute`). A region nested in a recomputing one recomputes too (its code
is inside the region the user asked for). It changes no structure, so the model fingerprint
ignores it (:attr:`Strategy.structure`).

ZeRO is asked the same way, on ``replicate`` only (it shards state over the data-parallel replicas):
``replicate(n, zero=k)`` fixes the ZeRO stage ``k`` (0 DDP, 1 optimizer state, 2 and gradients, 3
and parameters sharded) of every pipeline stage running the region (``StagePlan.zero_stage``, run by
``runtime.replicas.fsdp_sync``); without it the planner chooses (``Config.zero_stage``, else the lowest
stage that fits). A ``split`` nested in it keeps it on the top level (tensor parallel inside, ZeRO
across the replicas). Like ``recompute`` it is no structure: the fingerprint ignores it.

How the replicas stay in step is asked the same way, on ``replicate`` only: ``replicate(n,
sync="partial")`` runs the region's stages with Prague's partial all-reduce (P-Reduce: each replica
steps on its own gradient, then averages its parameters with a small group; approximate,
``runtime.replicas.partial_sync``), ``sync="exact"`` keeps the exact gradient sum whatever
``Config.dp_sync`` says, and None (the default) follows ``Config.dp_sync``. P-Reduce averages
replicas, so it needs two or more (``replicate(1, sync="partial")`` is an error) and whole parameters
(not with ``zero`` above 0). No structure either.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch.nn as nn

from whalelike.config import DP_SYNCS, ZERO_STAGES
from whalelike.errors import AnnotationError

Kind = Literal["replicate", "split"]
_scope_ids = itertools.count()


@dataclass(frozen=True)
class Strategy:
    """A parallel strategy: ``kind`` over ``device_count`` devices (None: the planner chooses).

    ``inner`` is the ``split`` nested inside a ``replicate`` (tensor parallel in each replica).
    ``scope_id`` distinguishes two textually separate scopes with equal settings: each ``with``
    block is its own TaskGraph. ``recompute``: the region's activations are recomputed in the
    backward instead of kept (activation checkpointing); it takes part in equality
    (``replicate(2) != replicate(2, recompute=True)``), not in :attr:`structure`. ``zero``: the ZeRO
    stage the region fixes (0-3, ``replicate`` only), None to let the planner choose; like
    ``recompute``, in equality and not in :attr:`structure`. ``sync``: how the region's replicas stay
    in step (``"exact"``, ``"partial"``: P-Reduce; None follows ``Config.dp_sync``); the same.
    """

    kind: Kind
    device_count: Optional[int] = None
    inner: Optional["Strategy"] = None
    scope_id: int = field(default=-1, compare=False)
    recompute: bool = False
    zero: Optional[int] = None
    sync: Optional[str] = None

    def __post_init__(self):
        if self.kind not in ("replicate", "split"):
            raise AnnotationError(f"strategy kind must be 'replicate' or 'split', got {self.kind!r}")
        _check_device_count(self.kind, self.device_count)
        if not isinstance(self.recompute, bool):
            raise AnnotationError(
                f"{self.kind}(recompute=...): recompute must be True or False, got {self.recompute!r} "
                f"({type(self.recompute).__name__}); write {self.kind}(recompute=True) to recompute the region's "
                "activations in the backward"
            )
        _check_zero(self.kind, self.zero)
        _check_sync(self.kind, self.device_count, self.zero, self.sync)

    def __str__(self) -> str:
        return self._text(with_recompute=True)

    @property
    def structure(self) -> str:
        """The text of the parallel layout alone (``str`` without ``recompute``): what the model
        fingerprint hashes, since recomputing changes no TaskGraph, layer or boundary."""
        return self._text(with_recompute=False)

    @property
    def fixed_degrees(self) -> Optional[tuple[int, int]]:
        """``(data-parallel, tensor-parallel)`` degrees the counts fix (``split(m)``: (1, m);
        ``replicate(n)``: (n, 1); ``replicate(n)+split(m)``: (n, m)), None when a count is left to the
        planner."""
        inner = self.inner
        if self.kind == "split":
            return None if self.device_count is None else (1, self.device_count)
        if self.device_count is None or (inner is not None and inner.device_count is None):
            return None
        return self.device_count, (inner.device_count if inner is not None else 1)

    @property
    def asks_recompute(self) -> bool:
        """Whether this region (or the ``split`` nested in it) asked for activation checkpointing."""
        return self.recompute or (self.inner is not None and self.inner.recompute)

    def _text(self, with_recompute: bool) -> str:
        n = "auto" if self.device_count is None else str(self.device_count)
        options = [n]
        if with_recompute and self.recompute:
            options.append("recompute")
        if with_recompute and self.zero is not None:
            options.append(f"zero={self.zero}")
        if with_recompute and self.sync is not None:
            options.append(f"sync={self.sync}")
        text = f"{self.kind}({','.join(options)})"
        return f"{text}+{self.inner._text(with_recompute)}" if self.inner is not None else text

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Strategy":
        scope = _STACK.push(self)
        return scope

    def __exit__(self, *exc) -> None:
        _STACK.pop()


class _ExportAnnotation:
    """While torch.export traces (it preserves node meta), a forward-time scope also annotates the
    nodes created under it (``node.meta["custom"]["wl_scope"]``): export has no tracer hook we own."""

    def __init__(self):
        self.open: list = []

    def enter(self, scope: Strategy) -> None:
        import torch.fx.traceback as fx_traceback

        ctx = fx_traceback.annotate({"wl_scope": scope}) if fx_traceback.has_preserved_node_meta() else None
        if ctx is not None:
            ctx.__enter__()
        self.open.append(ctx)

    def exit(self) -> None:
        ctx = self.open.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)


def _check_device_count(kind: str, device_count) -> None:
    if device_count is None:
        return
    if isinstance(device_count, bool) or not isinstance(device_count, int):
        raise AnnotationError(
            f"{kind}(device_count): device_count must be a positive integer or None, "
            f"got {device_count!r} ({type(device_count).__name__})"
        )
    if device_count <= 0:
        raise AnnotationError(f"{kind}(device_count): device_count must be > 0, got {device_count}")


def _check_zero(kind: str, zero) -> None:
    if zero is None:
        return
    if kind != "replicate":
        raise AnnotationError(
            f"{kind}(zero={zero!r}): zero is an option of replicate only (ZeRO shards state over data-parallel "
            f"replicas, {kind} has none); write replicate(n, zero={zero!r}) around the {kind}"
        )
    if isinstance(zero, bool) or not isinstance(zero, int) or zero not in ZERO_STAGES:
        raise AnnotationError(
            f"replicate(zero=...): zero must be one of {', '.join(map(str, ZERO_STAGES))} or None, got {zero!r}; "
            "write replicate(n, zero=1) (optimizer state sharded), zero=2 (and gradients), zero=3 (and "
            "parameters), zero=0 (DDP), or leave it out to let the planner choose"
        )


def _check_sync(kind: str, device_count, zero, sync) -> None:
    if sync is None:
        return
    if kind != "replicate":
        raise AnnotationError(
            f"{kind}(sync={sync!r}): sync is an option of replicate only (it says how data-parallel replicas stay "
            f"in step, {kind} has none); write replicate(n, sync={sync!r}) around the {kind}"
        )
    if not isinstance(sync, str) or sync not in DP_SYNCS:
        raise AnnotationError(
            f"replicate(sync=...): sync must be one of {', '.join(map(repr, DP_SYNCS))} or None, got {sync!r}; "
            "write replicate(n, sync='partial') for Prague's partial all-reduce (approximate), sync='exact' for "
            "the exact gradient sum, or leave it out to follow Config.dp_sync"
        )
    if sync == "partial" and device_count == 1:
        raise AnnotationError(
            "replicate(1, sync='partial'): P-Reduce averages a region's replicas, and one device has none to "
            "average with; give the region two or more devices (replicate(n, sync='partial'), n >= 2) or drop sync="
        )
    if sync == "partial" and zero:
        raise AnnotationError(
            f"replicate(zero={zero}, sync='partial'): P-Reduce averages whole parameters, which ZeRO stage {zero} "
            "shards over the replicas; drop zero= (P-Reduce runs at ZeRO stage 0) or sync='partial'"
        )


def replicate(device_count: Optional[int] = None, *, recompute: bool = False, zero: Optional[int] = None,
              sync: Optional[str] = None) -> Strategy:
    """Data parallel: the code under this scope forms one TaskGraph replicated on ``device_count`` devices.
    ``recompute=True``: its activations are recomputed in the backward (activation checkpointing).
    ``zero=k`` (0-3): the ZeRO stage of its data-parallel groups (None: the planner chooses).
    ``sync="partial"``: Prague's partial all-reduce instead of the exact gradient sum (approximate;
    ``"exact"``: the exact sum whatever ``Config.dp_sync`` says; None: follow it)."""
    return Strategy("replicate", device_count, recompute=recompute, zero=zero, sync=sync)


def split(device_count: Optional[int] = None, *, recompute: bool = False) -> Strategy:
    """Tensor parallel: the operators under this scope are sharded across ``device_count`` devices.
    ``recompute=True``: its activations are recomputed in the backward (activation checkpointing)."""
    return Strategy("split", device_count, recompute=recompute)


class _ScopeStack(threading.local):
    """The explicit annotation stack. Entries are *effective* strategies (nesting resolved)."""

    def __init__(self):
        self.entries: list[Strategy] = []
        self.default: Strategy = Strategy("replicate", None, scope_id=-1)
        self.default_is_set = False  # set_default_strategy was called: un-annotated code gets it, not a neighbour's
        self.export = _ExportAnnotation()

    def push(self, strategy: Strategy) -> Strategy:
        outer = self.entries[-1] if self.entries else None
        effective = _nest(outer, strategy)
        self.entries.append(effective)
        self.export.enter(effective)
        _install_module_tagging()
        return effective

    def pop(self) -> None:
        self.export.exit()
        self.entries.pop()

    def current(self) -> Optional[Strategy]:
        return self.entries[-1] if self.entries else None


def _nest(outer: Optional[Strategy], inner: Strategy) -> Strategy:
    """Resolve ``inner`` opened inside ``outer`` into one effective strategy with a fresh scope id.
    The effective strategy carries ``recompute`` on its top level: asked by either scope."""
    sid = next(_scope_ids)
    if outer is None:
        return Strategy(inner.kind, inner.device_count, None, sid, recompute=inner.recompute, zero=inner.zero,
                        sync=inner.sync)
    if outer.kind == "replicate" and outer.inner is None and inner.kind == "split":
        return Strategy("replicate", outer.device_count, Strategy("split", inner.device_count), sid,
                        recompute=outer.recompute or inner.recompute, zero=outer.zero, sync=outer.sync)
    raise AnnotationError(
        f"cannot open {inner} inside {outer}: the only allowed nesting is split inside replicate "
        "(tensor parallel inside each data-parallel replica)"
    )



def fresh_scope(outer: Optional[Strategy], strategy: Strategy) -> Strategy:
    """A fresh scope (a new scope id, so one TaskGraph per opening) for ``strategy`` opened inside
    ``outer`` (None: at the top), by the nesting rule; a ``strategy`` already nested (a
    replicate+split, as :func:`whalelike.annotate.annotate` may be given one) is accepted at the top,
    with ``recompute`` on its top level. The one place outside the scope stack that draws scope ids."""
    if strategy.inner is not None and outer is None:
        inner = Strategy(strategy.inner.kind, strategy.inner.device_count)   # recompute lives on the top level
        return Strategy(strategy.kind, strategy.device_count, inner, next(_scope_ids),
                        recompute=strategy.asks_recompute, zero=strategy.zero, sync=strategy.sync)
    return _nest(outer, strategy)


_STACK = _ScopeStack()


def current_scope() -> Optional[Strategy]:
    """The innermost open scope (nesting resolved), or None outside every scope."""
    return _STACK.current()


def set_default_strategy(strategy: Optional[Strategy]) -> None:
    """Set the strategy that un-annotated code gets.

    Without it (or after ``set_default_strategy(None)``), un-annotated code with parameters joins a
    neighbouring annotated TaskGraph (see :mod:`whalelike.graphs.regions`), and a model with no annotation
    at all is one ``replicate()`` over all devices. With it, un-annotated code with parameters forms
    TaskGraphs of this strategy.
    """
    if strategy is None:
        _STACK.default, _STACK.default_is_set = Strategy("replicate", None, scope_id=-1), False
        return
    if not isinstance(strategy, Strategy):
        raise AnnotationError(f"set_default_strategy expects wl.replicate(...), wl.split(...) or None, got {strategy!r}")
    _STACK.default = Strategy(strategy.kind, strategy.device_count, strategy.inner, scope_id=-1,
                              recompute=strategy.recompute, zero=strategy.zero, sync=strategy.sync)
    _STACK.default_is_set = True


def default_strategy() -> Strategy:
    return _STACK.default


def default_strategy_is_set() -> bool:
    """Whether the user chose a strategy for un-annotated code with :func:`set_default_strategy`."""
    return _STACK.default_is_set


# -- construction-time tagging -------------------------------------------------------------
def _install_module_tagging() -> None:
    """Tag modules created under a scope. ``nn.Module.__init__`` runs first in every subclass's
    ``__init__``; we tag there, and children created later under a *different* scope get theirs.

    Installed when a scope first opens and left in place (a module created outside every scope is
    not tagged: the wrapper reads the open scope, this thread's). Not installed and removed at each
    outermost scope's entry and exit: a forward that opens scopes (``with wl.replicate():`` in
    ``forward``) would assign to ``nn.Module`` twice per scope per step, and each assignment
    invalidates the attribute caches of every module class, a cost the user's own loop paid. A
    wrapper someone installed after ours is wrapped again at the next opening, never replaced."""
    current = nn.Module.__init__
    if getattr(current, "_wl_tagging", False):
        return

    def tagging_init(module, *args, **kwargs):
        current(module, *args, **kwargs)
        scope = _STACK.current()
        if scope is not None:
            object.__setattr__(module, "_wl_scope", scope)

    tagging_init._wl_tagging = True
    nn.Module.__init__ = tagging_init


def module_scope(module: nn.Module) -> Optional[Strategy]:
    """The scope a module was created (or annotated) under, if any."""
    return getattr(module, "_wl_scope", None)
