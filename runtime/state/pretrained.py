"""Hugging Face checkpoints in and out: a ``save_pretrained`` directory read straight into each
rank's pieces, and any plan's model written back as one that ``from_pretrained`` loads.

Why: a run starts from published weights and ends as weights others load. Under a whalelike plan no
rank holds the model as ``transformers`` lays it out: a rank holds rows of a parameter (ZeRO on
FSDP2, ragged ZeRO's memory-proportional rows), a tensor-parallel slice of uneven size (columns
of a row-parallel projection, one range of each of q, k and v of a fused one), some experts of a
stacked experts tensor, or only the layers of its pipeline stage. Each holding is already
described, for checkpoints and re-plans, as a :class:`planner.balance.state_moves.Slab` from the
executor's ``named_state()`` (:mod:`runtime.replicas.held_state`); both directions here work from
those descriptions and nothing else.

**Loading** (:func:`load_pretrained`): every rank opens the directory's safetensors files
(``model.safetensors``, or the shards ``model.safetensors.index.json`` names), reads their headers,
and for each tensor it holds copies exactly the held region out of ``safe_open(...).get_slice``:
rows, a column range, several ranges of a fused projection, its experts. No collective beyond what
``named_state()`` itself runs (P-Reduce's consensus), no rank reads what it does not hold, so a
rank holding a tenth of a ragged ZeRO stage reads a tenth of it (:class:`LoadReport` counts the
bytes). Names: the model's state-dict names; a tied tensor (``lm_head.weight`` and
``model.embed_tokens.weight``, one tensor) is saved once under one of its names, so a name absent
from the files is read under another name of the same tensor (and a second copy a tensor-parallel
stage holds, ``"<name>@<key>"``, like the first). ``transformers`` 5 saves some models in an
"original format" that differs from the model's own (a mixture of experts as one tensor per expert
and projection, ``experts.3.gate_proj.weight``, where the model stacks them in
``experts.gate_up_proj``): the model's own conversion mapping (``conversion_mapping``) names which
file tensors make each model tensor; stacking (``MergeModulelist``) and concatenation
(``Concatenate``) are read slice by slice (a rank holding experts 3-5 reads those experts' files
only), any other conversion is read whole and converted by ``transformers``' own operation, then
cut to the held region (named in :attr:`LoadReport.read_whole`). Values are converted to the held
tensor's dtype; the old values are never read (the held tensors may come from ``torch.empty`` or
``to_empty`` after a model built on the meta device). Every check runs before the first read and
depends only on the model and the files, so every rank fails alike: a missing directory, no
safetensors weights, a tensor of the model absent from the files (one that is neither tied nor
converted), a full shape that differs. Afterwards: a ragged ZeRO sync re-gathers its whole
parameters from the shards written (``named_state()`` marked them stale, as for a checkpoint load);
the optimizer's state is dropped (moments of the old weights are wrong for the new ones).

**Saving** (:func:`save_pretrained`): a collective. Which rank sends which piece of which tensor is
:func:`planner.balance.state_moves.plan_moves` with rank 0 as the one destination holding
everything whole (what it already holds stays local; every piece once, from the holder that has sent
least), the decision :mod:`runtime.checkpoint` makes for storage. Rank 0 assembles one tensor (or one
conversion group) at a time from point-to-point receives, converts it back to ``transformers``'
original format (``revert_weight_conversion``, what ``save_pretrained`` runs) and appends it to the
shard being filled; a shard is written as soon as it is complete (at most ``max_shard_bytes``, a
larger tensor alone), so rank 0 holds one shard and one tensor, never the model. Ties are saved
once, under the name ``transformers`` keeps (not one of ``all_tied_weights_keys``' targets).
``config.json`` (and ``generation_config.json`` for a generating model) come from the model's own
``config.save_pretrained``. All or none: everything is written into a hidden directory beside the
target, synced, then renamed into place; a directory already there is replaced whole in two
renames, keeping its other files (a tokenizer) and dropping its old weight files. A failure on rank
0 is raised on every rank after the transfers end, so no rank hangs.

Why not ``transformers``' own loading on each rank (``from_pretrained``, its ``distributed_config``
and DTensor sharding): it loads into the model's own parameters by their names, whole or as evenly
chunked DTensors; our ranks hold uneven pieces in the executor's tensors (ragged shards, uneven
``ParallelLinear`` slices with fused ranges, ``ExpertParallel``'s local experts) that it does not
know, and it would build a second model per rank. Why not accelerate's
``load_checkpoint_and_dispatch``: it places whole modules on devices, it does not cut tensors.

Why not ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``/``HuggingFaceStorageWriter``
(torch 2.13 has both): the reader's ``read_metadata`` takes every ``*.safetensors`` file in the
directory as the checkpoint (not the index's weight map: a hub snapshot's ``consolidated.safetensors``
beside the shards would be read as chunks of the same tensors), knows file keys only as the state
dict's own names (no conversion from ``transformers``' original format, no ties), and its DCP load
plans through a collective unless told ``no_dist``; what it does per read is the ``get_slice`` call
made here. The writer either writes whole tensors from one rank's full state dict
(``save_distributed=False``: the whole model on one rank) or every rank's pieces into files of its
own, consolidated afterwards by reading them all back and writing the full files again (twice the
writes, and the consolidation on one process reads the whole model); neither reverts the original
format or writes ``config.json``. Streaming one tensor at a time to rank 0 writes each byte once.

Invariant: after :func:`load_pretrained` every rank holds exactly the directory's values of what it
holds, so ``engine.state_dict()`` equals the directory's tensors (converted to the model's dtype);
:func:`save_pretrained` writes ``engine.state_dict()`` so that ``from_pretrained`` gives it back.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.balance.state_moves import Move, Slab, StateMoveError, plan_moves
from runtime.replicas.held_state import NamedState, local, module_state
from whalelike.errors import WhaleError
from whalelike.files import flush_to_disk

log = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2 ** 30          # 5 GiB: what hub repositories commonly use
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class PretrainedError(WhaleError):
    """A Hugging Face directory cannot be read into this Engine, or this Engine's model written as one."""


@dataclass(frozen=True)
class LoadReport:
    """What one rank read in :func:`load_pretrained`: ``tensors`` held tensors written, ``slices``
    ``get_slice`` reads, ``bytes_read`` the bytes those reads returned (in the files' dtypes),
    ``read_whole`` the model tensors read whole because ``transformers`` converts them with an
    operation not read slice by slice."""

    directory: str
    tensors: int
    slices: int
    bytes_read: int
    read_whole: tuple[str, ...] = ()


# -- the model's names -------------------------------------------------------------------------------
@dataclass
class _Model:
    """The whole model's state-dict names (every rank has them, whatever it holds): full shapes,
    and the names of each tensor (a tied tensor has several, in state-dict order; the first is
    the name ``named_state()`` gives it)."""

    module: nn.Module
    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, list[str]]

    @classmethod
    def of(cls, module: nn.Module) -> "_Model":
        by_id: dict[int, list[str]] = {}
        shapes = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            by_id.setdefault(id(tensor), []).append(name)
            shapes[name] = tuple(tensor.shape)     # a DTensor's shape is the whole tensor's
        return cls(module, shapes, {name: names for names in by_id.values() for name in names})

    @property
    def hugging_face(self) -> bool:
        transformers = sys.modules.get("transformers")     # a model of that class imported it
        return transformers is not None and isinstance(self.module, transformers.PreTrainedModel)

    def canonical(self, name: str) -> str:
        """The model's name of a held tensor: its first name (a second copy ``"<name>@<key>"`` is ``name``)."""
        name = name.split("@", 1)[0]
        return self.aliases[name][0] if name in self.aliases else name


def _engine_state(engine) -> NamedState:
    """What this rank holds (the executor's ``named_state()``), or the whole model before the
    executor is built (every rank holds it whole then)."""
    if engine.slot.built:
        return engine.slot.executor.named_state()
    return module_state(engine.model)


# -- the files -----------------------------------------------------------------------------------------
class _Files:
    """A ``save_pretrained`` directory's safetensors: each key's file, shape and dtype (headers
    only), and reads of slices of them, counted."""

    def __init__(self, directory: str, stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.directory = directory
        if not os.path.exists(directory):
            raise PretrainedError(f"{directory}: no such directory; pass the directory a save_pretrained wrote "
                                  f"(config.json and {WEIGHTS} or {INDEX} in it)")
        if not os.path.isdir(directory):
            raise PretrainedError(f"{directory}: is a file, not a directory; pass the directory that holds "
                                  f"{WEIGHTS} (or {INDEX} and its shards)")
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise PretrainedError(f"{index}: not a safetensors index ({e}); it must hold a 'weight_map' of "
                                      "tensor name -> shard file, as save_pretrained writes it") from e
        elif os.path.isfile(os.path.join(directory, WEIGHTS)):
            weight_map, files = None, [WEIGHTS]
        else:
            present = sorted(os.listdir(directory))
            shown = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "") if present else "nothing"
            raise PretrainedError(f"{directory}: no {WEIGHTS} or {INDEX} in it (it holds {shown}); save the model "
                                  "with transformers' save_pretrained (safetensors, the default) or "
                                  "runtime.state.pretrained.save_pretrained")
        self.handles: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise PretrainedError(f"{index}: names shard {name}, which is not in {directory}; copy the whole "
                                      "directory save_pretrained wrote")
            try:
                handle = stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:      # safetensors raises its own error type for a damaged header
                raise PretrainedError(f"{path}: not a readable safetensors file ({e}); write it again") from e
            self.handles[name] = handle
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key, name) != name:
                    continue                      # the index places this key in another shard
                piece = handle.get_slice(key)
                self.file_of[key], self.shapes[key], self.dtypes[key] = name, tuple(piece.get_shape()), piece.get_dtype()
        if weight_map is not None:
            absent = sorted(k for k in weight_map if k not in self.file_of)
            if absent:
                raise PretrainedError(f"{index}: {_listed(absent)} not in the shard the index names; the directory "
                                      "is incomplete, copy it again")
        self.slices = 0
        self.bytes_read = 0

    def read(self, key: str, index: tuple) -> torch.Tensor:
        """``key``'s entries at ``index`` (a tuple of slices; all of them: the whole tensor)."""
        handle = self.handles[self.file_of[key]]
        if all(s == slice(None) for s in index):
            value = handle.get_tensor(key)
        else:
            value = handle.get_slice(key)[index]
        self.slices += 1
        self.bytes_read += value.numel() * value.element_size()
        return value


# -- which file tensors make which model tensor ----------------------------------------------------
@dataclass
class _Source:
    """How the files hold a model tensor: ``parts`` concatenated along ``concat`` (None: one part),
    each part the file tensor ``keys[0]`` or, when ``stacked``, ``keys`` stacked along a new
    dimension 0 (one per expert). ``converter``: a ``transformers`` conversion read whole instead
    (its ``keys`` are the file tensors it takes, by source pattern)."""

    shape: tuple[int, ...]
    parts: list[list[str]]
    stacked: bool = False
    concat: Optional[int] = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    converter: Any = None
    patterns: list[str] = field(default_factory=list)


def _sources(model: _Model, files: _Files) -> tuple[dict[str, _Source], list[str]]:
    """Each model name the files hold -> its :class:`_Source`, and the file keys no model name takes."""
    names = model.shapes
    sources: dict[str, _Source] = {}
    groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    rename = _renamer(model) if model.hugging_face else None
    unused = []
    for key in _natural(files.shapes):
        target, pattern = (key, None) if key in names or rename is None else rename(key)
        if target not in names:
            unused.append(key)
        elif pattern is None:
            sources.setdefault(target, _Source(files.shapes[key], [[key]]))
        else:
            converter, members = groups.setdefault(target, (pattern[1], []))
            members.append((pattern[0], key))
    for target, (converter, members) in groups.items():
        for name, source in _converted(target, converter, members, files, model).items():
            sources.setdefault(name, source)
    return sources, unused


def _renamer(model: _Model):
    """``transformers``' own renaming of a file key to the model's (its conversion mapping, with the
    base-model prefix added or removed): key -> (model name, None) or (model name, (source
    pattern, the converter that takes it))."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError as e:      # another transformers version: names are taken as they are
        log.warning("transformers %s has no conversion mapping (%s): file names are matched to the model's "
                    "as they are", getattr(sys.modules["transformers"], "__version__", "?"), e)
        return lambda key: (key, None)
    mapping = get_model_conversion_mapping(model.module)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    present = dict.fromkeys(model.shapes, True)
    prefix = model.module.base_model_prefix

    def rename(key: str):
        target, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if target not in present and key in present:
            return key, None
        return target, None if pattern is None else (pattern, by_pattern[pattern])
    return rename


def _converted(target: str, converter, members: list[tuple[str, str]], files: _Files,
               model: _Model) -> dict[str, _Source]:
    """The model tensors a ``transformers`` conversion makes from the file keys ``members``
    ((source pattern, key), in natural order): stacking and concatenation as sliceable sources,
    anything else as one source read whole (every model tensor it makes)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    by_pattern: dict[str, list[str]] = {p: [] for p in converter.source_patterns}
    for pattern, key in members:
        by_pattern[pattern].append(key)
    parts = [by_pattern[p] for p in converter.source_patterns if by_pattern[p]]
    kinds = [type(op) for op in ops]
    stacked = bool(ops) and kinds[0] is MergeModulelist and ops[0].dim == 0
    rest = ops[1:] if stacked else ops
    sliceable = len(converter.target_patterns) == 1 and (
        (not rest and stacked and len(parts) == 1)
        or (len(rest) == 1 and type(rest[0]) is Concatenate and (stacked or all(len(p) == 1 for p in parts))
            and not (stacked and rest[0].dim == 0)))
    if sliceable:
        concat = rest[0].dim if rest else None
        shapes = [[files.shapes[k] for k in keys] for keys in parts]
        for keys, part in zip(parts, shapes):
            if len(set(part)) != 1:
                raise PretrainedError(f"{files.directory}: {target} is stacked from {_listed(keys)}, whose shapes "
                                      f"differ ({sorted(set(part))}); the files are not of this model")
        inner = [((len(keys),) + part[0]) if stacked else part[0] for keys, part in zip(parts, shapes)]
        if concat is None:
            shape = inner[0]
        else:
            others = {s[:concat] + s[concat + 1:] for s in inner if len(s) > concat}
            if len(others) != 1 or any(len(s) <= concat for s in inner):
                raise PretrainedError(f"{files.directory}: {target} joins {_listed([k for p in parts for k in p])} "
                                      f"along dim {concat}, whose other dimensions differ ({inner}); the files are "
                                      "not of this model")
            shape = inner[0][:concat] + (sum(s[concat] for s in inner),) + inner[0][concat + 1:]
        spans, start = [], 0
        for s in inner:
            spans.append((start, start + (s[concat] if concat is not None else 0)))
            start = spans[-1][1]
        return {target: _Source(shape, parts, stacked, concat, spans)}
    # anything else: transformers' own conversion on the whole tensors; on meta tensors first, for
    # the names and shapes it makes
    made = _convert(target, converter, [(p, k) for p, k in members],
                    lambda key: torch.empty(files.shapes[key], dtype=_DTYPES.get(files.dtypes[key], torch.float32),
                                            device="meta"), model)
    patterns = [p for p, _ in members]
    return {name: _Source(tuple(value.shape), [[k for _, k in members]], converter=(target, converter),
                          patterns=patterns) for name, value in made.items()}


def _convert(target: str, converter, members: list[tuple[str, str]], read, model: _Model) -> dict[str, torch.Tensor]:
    """Run a fresh copy of ``converter`` on the file tensors ``members`` (``read(key)`` gives each):
    the model tensors it makes, by name."""
    job = deepcopy(converter)
    for pattern, key in members:
        job.add_tensor(target, key, pattern, read(key))
    made = job.convert(target, model=model.module, config=getattr(model.module, "config", None))
    return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


def _natural(keys) -> list[str]:
    """``keys`` in ``transformers``' order (numbers numerically), which orders the experts it stacks."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        def dot_natural_key(key: str):
            return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]
    return sorted(keys, key=dot_natural_key)


# -- loading ---------------------------------------------------------------------------------------------
def load_pretrained(engine, directory: str | os.PathLike) -> LoadReport:
    """Fill what this rank holds of ``engine``'s model from the ``save_pretrained`` directory
    ``directory`` (module docstring): each held tensor's region, read from the files and nothing
    else. Every rank calls it (``named_state()`` may be a collective); no other communication.
    The optimizer's state is dropped (its moments belong to the old weights). Returns what this
    rank read."""
    directory = os.path.abspath(os.fspath(directory))
    with contextlib.ExitStack() as stack:
        model = _Model.of(engine.model)
        files = _Files(directory, stack)
        sources = _checked_sources(model, files)      # every check before named_state(): all ranks fail alike
        report = _fill(model, files, sources, _engine_state(engine))
    optimizer = engine.slot.optimizer if engine.slot.built else None
    if optimizer is not None:
        optimizer.state.clear()      # moments of the old weights; the next step starts them afresh
    log.info("rank %d: %d tensors from %s, %d slices, %.1f MiB read", _rank(), report.tensors, directory,
             report.slices, report.bytes_read / 2 ** 20)
    return report


def load_state(module: nn.Module, held: NamedState, directory: str | os.PathLike) -> LoadReport:
    """:func:`load_pretrained` without an Engine: fill ``held`` (the model's name -> (tensor, the
    :class:`Slab` of ``module``'s tensor it holds), as ``named_state()`` gives it) from ``directory``."""
    directory = os.path.abspath(os.fspath(directory))
    with contextlib.ExitStack() as stack:
        model = _Model.of(module)
        files = _Files(directory, stack)
        return _fill(model, files, _checked_sources(model, files), held)


def _checked_sources(model: _Model, files: _Files) -> dict[str, _Source]:
    """Where each of the model's names is in the files (ties under their other name), checked."""
    sources, unused = _sources(model, files)
    for name, names in model.aliases.items():    # a tied tensor saved once: read it under its other name
        if name not in sources:
            alias = next((n for n in names if n in sources), None)
            if alias is not None:
                sources[name] = sources[alias]
    _check(model, sources, files.directory)
    if unused and _rank() == 0:
        log.warning("%s holds %d tensor(s) this model does not have, not read: %s", files.directory, len(unused),
                    _listed(unused))
    return sources


def _fill(model: _Model, files: _Files, sources: Mapping[str, _Source], held: NamedState) -> LoadReport:
    """Copy each held region out of the files."""
    read_whole: dict[Any, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name, (tensor, slab) in held.items():
            model_name = model.canonical(name)
            source = sources.get(model_name)
            if source is None:
                raise PretrainedError(f"{files.directory}: this rank holds {name}, which is not a tensor of the "
                                      f"model's state dict ({_listed(model.shapes)}); the executor names its state "
                                      "by the model's names (named_state)")
            if slab.shape != tuple(source.shape):
                raise PretrainedError(f"{files.directory}: {model_name} has shape {tuple(source.shape)} there, "
                                      f"{slab.shape} in this rank's plan; load a checkpoint of this model")
            _write(files, source, local(tensor).detach(), slab, model_name, model, read_whole)
    return LoadReport(files.directory, len(held), files.slices, files.bytes_read,
                      tuple(sorted({n for made in read_whole.values() for n in made})))


def _check(model: _Model, sources: Mapping[str, _Source], directory: str) -> None:
    """Every tensor of the model is in the files with its full shape (the same answer on every
    rank: it reads only the model and the headers)."""
    missing = [name for name in model.shapes if name not in sources]
    if missing:
        raise PretrainedError(f"{directory} lacks {len(missing)} of this model's {len(model.shapes)} tensors: "
                              f"{_listed(missing)}; load a directory saved from this model's architecture and "
                              "config (tied weights may be absent, other tensors may not)")
    wrong = [f"{name} {sources[name].shape} there, {shape} in the model" for name, shape in model.shapes.items()
             if tuple(sources[name].shape) != tuple(shape)]
    if wrong:
        raise PretrainedError(f"{directory} holds tensors of other shapes than this model's: {_listed(wrong)}; "
                              "load a directory saved from a model of this config")


def _write(files: _Files, source: _Source, target: torch.Tensor, slab: Slab, name: str, model: _Model,
           read_whole: dict) -> None:
    """Copy the region ``slab`` of the model tensor ``source`` makes into ``target`` (the local
    tensor holding it)."""
    if source.converter is not None:
        key = id(source)
        if key not in read_whole:       # one conversion may make several held tensors (q, k and v)
            made_for, converter = source.converter
            read_whole[key] = _convert(made_for, converter, list(zip(source.patterns, source.parts[0])),
                                       lambda k: files.read(k, (slice(None),) * len(files.shapes[k])), model)
        whole = read_whole[key][name]
        for view, region in _held_views(target, slab):
            _copy(view, whole[region], name)
        return
    for key, index, view in _reads(source, target, slab):
        _copy(view, files.read(key, index), name)


def _held_views(target: torch.Tensor, slab: Slab) -> Iterator[tuple[torch.Tensor, tuple]]:
    """(the local view, the full-tensor index it holds) of each range of ``slab``."""
    if slab.whole:
        yield target, (slice(None),) * len(slab.shape)
        return
    for lo, hi in slab.ranges:
        view = target.narrow(slab.dim, slab.local_offset(slab.dim, lo), hi - lo)
        yield view, (slice(None),) * slab.dim + (slice(lo, hi),)


def _reads(source: _Source, target: torch.Tensor, slab: Slab) -> Iterator[tuple[str, tuple, torch.Tensor]]:
    """(file key, index into it, local view it fills) of every file region the held region
    ``slab`` of ``target`` covers. A model tensor made of parts (concatenated along
    ``source.concat``, each stacked along dimension 0 from one file tensor per index or one file
    tensor) is cut into cells, each cell one file tensor; each held range takes the part of each
    cell it overlaps."""
    stacked, concat = source.stacked, source.concat
    shift = 1 if stacked else 0                 # model dimension d is file dimension d - shift
    ndim = len(source.shape) - shift
    held = ([(None, 0, 0, 0)] if slab.whole else
            [(slab.dim, lo, hi, slab.local_offset(slab.dim, lo)) for lo, hi in slab.ranges])
    for dim, lo, hi, offset in held:
        for j, keys in enumerate(source.parts):
            p0, p1 = source.spans[j] if concat is not None else (0, 0)
            for e, key in enumerate(keys):
                index = [slice(None)] * ndim
                view = target
                if stacked:
                    if dim == 0:
                        if not lo <= e < hi:
                            continue
                        view = view.select(0, offset + e - lo)
                    else:
                        view = view.select(0, e)
                if concat is not None:
                    c = concat - shift
                    if dim == concat:
                        a, b = max(lo, p0), min(hi, p1)
                        if a >= b:
                            continue
                        index[c] = slice(a - p0, b - p0)
                        view = view.narrow(c, offset + a - lo, b - a)
                    else:
                        view = view.narrow(c, p0, p1 - p0)
                if dim is not None and dim != concat and not (stacked and dim == 0):
                    index[dim - shift] = slice(lo, hi)
                    view = view.narrow(dim - shift, offset, hi - lo)
                yield key, tuple(index), view


def _copy(view: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(view.shape) != tuple(value.shape):     # copy_ would broadcast a wrong piece silently
        raise PretrainedError(f"{name}: a read of shape {tuple(value.shape)} for a held piece of shape "
                              f"{tuple(view.shape)}; a bug in runtime.state.pretrained's slicing, please report it")
    view.copy_(value)


# -- saving ---------------------------------------------------------------------------------------------
def save_pretrained(engine, directory: str | os.PathLike, *, config: Any = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, original_format: bool = True) -> str:
    """Write ``engine``'s whole model as a ``save_pretrained`` directory (module docstring): every
    rank calls it at the same step boundary; rank 0 writes, one tensor at a time from the ranks
    holding it. ``config``: the ``transformers`` config to write as ``config.json`` (default: the
    model's own, when it is a ``PreTrainedModel``; an object with ``save_pretrained``, or a dict).
    ``max_shard_bytes``: the most bytes of tensors in one file (a larger tensor gets a file of
    its own). ``original_format``: write what ``transformers``' ``save_pretrained`` writes (its
    conversions reverted: one tensor per expert); False writes the model's own names and shapes.
    Returns the directory (absolute)."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise PretrainedError(f"save_pretrained max_shard_bytes={max_shard_bytes!r}: give a positive number of "
                              f"bytes (default {DEFAULT_SHARD_BYTES}, 5 GiB)")
    directory = os.path.abspath(os.fspath(directory))
    rank = _rank()
    model = _Model.of(engine.model)
    held = {model.canonical(n): v for n, v in _engine_state(engine).items() if "@" not in n}
    mine = {"slabs": {n: slab for n, (_, slab) in held.items()},
            "dtypes": {n: local(t).dtype for n, (t, _) in held.items()},
            "buffers": [n for n, (t, _) in held.items() if not isinstance(t, nn.Parameter)],
            "problem": _target_problem(directory) if rank == 0 else None}
    described: list[dict] = [None] * dist.get_world_size()
    engine.runtime.collective(lambda: dist.all_gather_object(described, mine))
    if described[0]["problem"]:
        raise PretrainedError(described[0]["problem"])
    order, saved_as = _saved_names(model)
    moves = _gatherers(described, order, model)
    dtypes = {n: d["dtypes"][n] for d in reversed(described) for n in d["dtypes"]}
    groups = _groups(model, order, saved_as, original_format)
    writer = _Writer(directory, max_shard_bytes, model, groups, saved_as, dtypes, original_format) \
        if rank == 0 else None
    device = engine.device

    def transfer():
        for group in groups:
            tensors = {}
            for name in group:
                tensors[name] = _gather(name, moves[name], held, model.shapes[name], dtypes[name], rank, device)
            if writer is not None:
                writer.add({saved_as[n]: t for n, t in tensors.items()})
        failure = [writer.finish(config) if writer is not None else None]
        dist.broadcast_object_list(failure, src=0)
        return failure[0]
    failure = engine.runtime.collective(transfer)
    if failure:
        raise PretrainedError(failure)
    log.info("rank %d: model saved to %s", rank, directory)
    return directory


def _target_problem(directory: str) -> Optional[str]:
    """Why rank 0 cannot write ``directory`` (None: it can), checked before any transfer; missing
    parents are created, as ``transformers``' ``save_pretrained`` does."""
    parent = os.path.dirname(directory)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        return f"save_pretrained {directory}: cannot create its parent {parent} ({e.strerror or e}); choose a " \
               "writable place"
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"save_pretrained {directory}: is a file; name a directory (a new one, or one to replace)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"save_pretrained {directory}: cannot create files in {parent} (permission denied); choose a " \
               "writable directory"
    return None


def _saved_names(model: _Model) -> tuple[list[str], dict[str, str]]:
    """The tensors to write, each once, in state-dict order, by the name ``named_state()`` gives
    it; and the name each is written under: of a tie's names, the first that ``transformers`` does
    not list as a tied target (``from_pretrained`` ties the others to it). Names
    ``_keys_to_ignore_on_save`` are left out, as ``save_pretrained`` does."""
    module = model.module
    targets = set(getattr(module, "all_tied_weights_keys", None) or {}) if model.hugging_face else set()
    ignored = set(getattr(module, "_keys_to_ignore_on_save", None) or ()) if model.hugging_face else set()
    order, saved_as = [], {}
    for name, names in model.aliases.items():
        if names[0] != name:
            continue
        kept = [n for n in names if n not in ignored]
        if not kept:
            continue
        order.append(name)
        saved_as[name] = next((n for n in kept if n not in targets), kept[0])
    return order, saved_as


def _gatherers(described: list[dict], order: list[str], model: _Model) -> dict[str, list[Move]]:
    """Who sends rank 0 which piece of each tensor (:func:`plan_moves`, rank 0 the one
    destination holding everything whole; a buffer from its lowest-ranked holder, the copy DDP
    keeps)."""
    holders: dict[int, dict[str, Slab]] = {}
    owner: dict[str, int] = {}
    for rank, d in enumerate(described):
        for name in d["buffers"]:
            owner.setdefault(name, rank)
    for rank, d in enumerate(described):
        holders[rank] = {n: s for n, s in d["slabs"].items() if owner.get(n, rank) == rank}
    unheld = [n for n in order if not any(n in h for h in holders.values())]
    if unheld:
        raise PretrainedError(f"save_pretrained: no rank holds {_listed(unheld)} of the model; every tensor of "
                              "the model's state dict must be held by some rank (named_state)")
    try:
        moves = plan_moves(holders, {0: {n: Slab(model.shapes[n]) for n in order}})
    except StateMoveError as e:
        raise PretrainedError(f"save_pretrained: {e}") from e
    out: dict[str, list[Move]] = {n: [] for n in order}
    for move in moves:
        out[move.name].append(move)
    return out


def _gather(name: str, moves: list[Move], held: NamedState, shape: tuple[int, ...], dtype: torch.dtype,
            rank: int, device: torch.device) -> Optional[torch.Tensor]:
    """Rank 0: the whole tensor ``name`` on the CPU, from its own pieces and those the others send;
    another rank: its pieces of it sent (None)."""
    full = torch.empty(shape, dtype=dtype) if rank == 0 else None
    pending = []
    for move in moves:
        if move.src != rank and rank != 0:
            continue
        tensor, slab = held[name] if move.src == rank else (None, None)
        piece = _piece(local(tensor).detach(), slab, move) if tensor is not None else None
        region = full if move.dim is None else (full.narrow(move.dim, move.lo, move.hi - move.lo)
                                                if full is not None else None)
        if move.src == rank == 0:
            region.copy_(piece)
        elif rank == 0:
            buffer = torch.empty(region.shape, dtype=dtype, device=device)
            pending.append((dist.irecv(buffer, src=move.src), buffer, region))
        else:
            sent = piece.contiguous()      # kept alive until the send completes
            pending.append((dist.isend(sent, dst=0), sent, None))
    for work, buffer, region in pending:
        work.wait()
        if region is not None:
            region.copy_(buffer)
    return full


def _piece(tensor: torch.Tensor, slab: Slab, move: Move) -> torch.Tensor:
    """The part of ``tensor`` (holding ``slab``) that ``move`` sends."""
    if move.dim is None:
        return tensor
    return tensor.narrow(move.dim, slab.local_offset(move.dim, move.lo), move.hi - move.lo)


def _groups(model: _Model, order: list[str], saved_as: Mapping[str, str], original_format: bool) -> list[list[str]]:
    """The tensors to write in the order written, those one ``transformers`` conversion reverts
    together side by side (several model tensors may make one file tensor)."""
    if not (original_format and model.hugging_face):
        return [[n] for n in order]
    converters = _reverse_converters(model.module)
    if not converters:
        return [[n] for n in order]
    from transformers.core_model_loading import apply_converters

    grouped: dict[str, list[str]] = {}
    for name in order:
        renamed, pattern = apply_converters(saved_as[name], converters)
        grouped.setdefault(renamed if pattern is not None else f"\0{name}", []).append(name)
    return list(grouped.values())


def _reverse_converters(module: nn.Module) -> list:
    """The converters ``transformers``' ``revert_weight_conversion`` runs for ``module`` (the same
    selection, reversed), for grouping only."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter
    except ImportError:
        return []
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(module, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    return [c for c in reverse if isinstance(c, WeightConverter)]


class _Writer:
    """Rank 0's side of a save: the shards planned up front (names and sizes from the reverted
    conversion on meta tensors), filled as tensors arrive, each written when complete, into a
    hidden directory beside the target that :meth:`finish` moves into place. A failure is kept
    (the transfers go on, so no rank waits for a send nobody receives) and returned by :meth:`finish`."""

    def __init__(self, directory: str, max_shard_bytes: int, model: _Model, groups: list[list[str]],
                 saved_as: Mapping[str, str], dtypes: Mapping[str, torch.dtype], original_format: bool):
        self.directory, self.model = directory, model
        self.revert = original_format and model.hugging_face
        self.failure: Optional[str] = None
        self.temp: Optional[str] = None
        try:
            planned = []
            for group in groups:
                meta = {saved_as[n]: torch.empty(model.shapes[n], dtype=dtypes[n], device="meta") for n in group}
                planned.extend((k, v.numel() * v.element_size(), v.numel()) for k, v in self._convert(meta).items())
            shards: list[list[str]] = []
            size = 0
            for key, nbytes, _ in planned:
                if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
                    shards.append([])
                    size = 0
                shards[-1].append(key)
                size += nbytes
            if not shards:
                raise PretrainedError("the model has no tensors to save")
            names = [WEIGHTS] if len(shards) == 1 else [
                f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            self.file_of = {key: names[i] for i, keys in enumerate(shards) for key in keys}
            self.waiting = {names[i]: set(keys) for i, keys in enumerate(shards)}
            self.files = names
            self.total_bytes = sum(b for _, b, _ in planned)
            self.total_parameters = sum(n for _, _, n in planned)
            self.filling: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
            parent, base = os.path.split(directory)
            self.temp = os.path.join(parent, f".{base}.{secrets.token_hex(4)}.partial")
            os.mkdir(self.temp)
        except Exception as e:
            self._fail(e)

    def _convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.revert:
            return tensors
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model.module, tensors)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """The whole tensors of one group, by the names they are saved under."""
        if self.failure is not None:
            return
        try:
            for key, value in self._convert(tensors).items():
                file = self.file_of[key]
                if value.untyped_storage().nbytes() != value.numel() * value.element_size() \
                        or not value.is_contiguous():
                    value = value.clone(memory_format=torch.contiguous_format)   # a view of a reverted tensor
                self.filling[file][key] = value
                self.waiting[file].discard(key)
                if not self.waiting[file]:
                    self._write(file)
        except Exception as e:
            self._fail(e)

    def _write(self, file: str) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.temp, file)
        save_file(self.filling.pop(file), path, metadata={"format": "pt"})
        flush_to_disk(path)

    def finish(self, config: Any) -> Optional[str]:
        """Index, config, the move into place; the failure's one line, or None."""
        try:
            if self.failure is None:
                unwritten = sorted(f for f, keys in self.waiting.items() if keys)
                if unwritten:
                    raise PretrainedError(f"shards {unwritten} were never complete: "
                                          f"{_listed(sorted(k for f in unwritten for k in self.waiting[f]))} "
                                          "missing (a bug: report it)")
                if len(self.files) > 1:
                    index = {"metadata": {"total_size": self.total_bytes, "total_parameters": self.total_parameters},
                             "weight_map": dict(sorted(self.file_of.items()))}
                    self._text(INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
                self._configs(config)
                _install(self.temp, self.directory, set(self.files) | {INDEX})
                self.temp = None
        except Exception as e:
            self._fail(e)
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
        return self.failure

    def _configs(self, config: Any) -> None:
        module = self.model.module
        if config is None and self.model.hugging_face:
            config = module.config
        if isinstance(config, Mapping):
            self._text("config.json", json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        elif config is not None:
            config.save_pretrained(self.temp)
        if self.model.hugging_face and module.can_generate() and getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(self.temp)
        for name in os.listdir(self.temp):
            flush_to_disk(os.path.join(self.temp, name))

    def _text(self, name: str, text: str) -> None:
        path = os.path.join(self.temp, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        flush_to_disk(path)

    def _fail(self, error: BaseException) -> None:
        if self.failure is None:
            reason = str(error) if isinstance(error, WhaleError) else f"{type(error).__name__}: {error}"
            self.failure = f"save_pretrained {self.directory}: writing on rank 0 failed: {reason}; nothing was " \
                           "written there (check its space and permissions)"
        self.filling = {}


def _install(temp: str, target: str, written: set[str]) -> None:
    """Move the finished ``temp`` into place as ``target``. A directory already there is replaced
    whole (two renames; a crash between them leaves it under a hidden ``.old`` name beside the
    target), its files other than weights carried over (hard links), its old weight files dropped."""
    flush_to_disk(temp)
    parent, base = os.path.split(target)
    if not os.path.exists(target):
        os.rename(temp, target)
        flush_to_disk(parent)
        return
    new = set(os.listdir(temp))
    for entry in os.listdir(target):
        if entry in written or entry in new or entry == WEIGHTS or entry == INDEX or _SHARD.match(entry):
            continue
        source, copy = os.path.join(target, entry), os.path.join(temp, entry)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, copy, symlinks=True)
        else:
            try:
                os.link(source, copy, follow_symlinks=False)
            except OSError:
                shutil.copy2(source, copy, follow_symlinks=False)
    old = os.path.join(parent, f".{base}.{secrets.token_hex(4)}.old")
    os.rename(target, old)
    try:
        os.rename(temp, target)
    except BaseException:
        os.rename(old, target)
        raise
    flush_to_disk(parent)
    shutil.rmtree(old, ignore_errors=True)


# -- small helpers -------------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _listed(names, most: int = 5) -> str:
    names = list(names)
    shown = ", ".join(str(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
