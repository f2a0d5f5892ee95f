"""Parameters tied across pipeline stages: every copy gets the full gradient and stays identical.

Why: GPT-2 (``tie_word_embeddings``), T5 and many Llama-family configs use one matrix as the input
embedding (first stage) and the output projection (last stage). After the pipeline split each
stage holds the same ``nn.Parameter`` object, but on different ranks those are separate copies:
each would see only its own stage's gradient and the copies would drift apart. Megatron-LM keeps
an *embedding group* (the first and last pipeline stage of each data-parallel rank) and all-reduces
the embedding gradient in it after the data-parallel all-reduce. Its pairing needs one rank per
stage per data-parallel index; here stages sit on device groups of different sizes with uneven
shares (stage 0 on two devices taking 11:5 of each micro-batch, the last on one), so there is no
such pairing. Instead:

* one process group per set of ranks holding a copy (every worker of every holding stage, all
  replicas and tensor-parallel ranks; ties with the same holders share the group and one
  all-reduce);
* before the stages are sharded, the copy of the group's first rank is broadcast, so all copies
  start equal;
* after backward (DDP has already summed each stage's gradient over its data-parallel group, with
  the losses weighted by ``samples / global_batch_size``, so every worker of a stage holds that
  stage's share of the global-batch gradient), exactly one worker per stage and tensor-parallel
  shard contributes it (``replica == 0`` and ``dp_index == 0``), every other holder contributes
  zeros, and the SUM all-reduce hands every copy the sum over stages: the global-batch gradient of
  the tied parameter, the same bits on every holder. Equal values and equal gradients keep the
  optimizers' copies bit-identical.

Tensor-parallel copies: a ``split`` stage may hold the parameter sharded (GPT-2's ``lm_head`` as a
class-sharded Linear holds rows of the embedding matrix). A sharded copy contributes its slice of
the full gradient (each shard is complete for its slice after the tensor-parallel backward) and
takes its slice of the sum; a whole copy on a tensor-parallel stage is complete on every shard, so
only ``tp_index`` 0 contributes it. The same rule syncs a parameter that one tensor-parallel stage
holds both whole and sharded (an embedding and a class-sharded head in one ``split`` stage).

Invariant: after :meth:`TiedParameters.sum_gradients`, the gradient of every copy on every rank is
the slice it holds of ``sum over stages of that stage's gradient``: what the single-process model's
``.grad`` holds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.plan import Plan, Worker
from runtime.parallel.stage_split import PipelineSplit
from runtime.tensor.layers import ParallelLinear
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)


class TiedParameterError(WhaleError):
    """A parameter shared by several pipeline stages cannot be kept in sync."""


@dataclass(frozen=True)
class Tie:
    """One trainable parameter held by several stages, or held twice by one tensor-parallel stage
    (then sharding may give it several copies on one rank). ``name`` is the model's name for it
    (all its names, comma-separated); ``stages`` are the stages holding it, ascending."""

    name: str
    stages: tuple[int, ...]


@dataclass
class _Copy:
    """A tensor on this rank holding entries of the full tied value: ``full.reshape(-1)[index]``
    (``index`` shaped like the copy), or all of it when ``index`` is None."""

    param: nn.Parameter
    index: Optional[torch.Tensor] = None

    @property
    def sharded(self) -> bool:
        return self.index is not None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.index is None else full.reshape(-1)[self._index_on(full.device)]

    def add_into(self, full: torch.Tensor, value: torch.Tensor) -> None:
        if self.index is None:
            full.add_(value)
        else:
            full.view(-1).index_add_(0, self._index_on(full.device).reshape(-1), value.reshape(-1))

    def _index_on(self, device: torch.device) -> torch.Tensor:
        if self.index.device != device:     # found before the copy had storage (built on meta)
            self.index = self.index.to(device)
        return self.index


def find_ties(split: PipelineSplit, tensor_parallel_stages: set[int] = frozenset(),
              names: Optional[nn.Module] = None) -> list[tuple[Tie, dict[int, nn.Parameter]]]:
    """Every tie of ``split``: (the tie, stage -> the parameter object in that stage).

    A trainable parameter is tied when several stages hold it, or when a tensor-parallel stage
    (in ``tensor_parallel_stages``) holds it in more than one place, as sharding may then copy it.
    The order is the same on every rank (stages, then name). ``names`` gives the model's names
    (default: the stage-local ones).
    """
    holders: dict[int, dict[int, nn.Parameter]] = {}
    places: dict[tuple[int, int], int] = {}
    for stage in split.stages:
        for _, module in stage.module.named_modules(remove_duplicate=False):
            for p in module._parameters.values():
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    holders.setdefault(id(p), {})[stage.index] = p
                    places[(id(p), stage.index)] = places.get((id(p), stage.index), 0) + 1
    model_names: dict[int, list[str]] = {}
    source = names if names is not None else split.root
    for name, p in source.named_parameters(remove_duplicate=False):
        model_names.setdefault(id(p), []).append(name)
    ties = []
    for key, by_stage in holders.items():
        twice = any(places[(key, s)] > 1 and s in tensor_parallel_stages for s in by_stage)
        if len(by_stage) > 1 or twice:
            name = ", ".join(model_names.get(key, ["<unnamed>"]))
            ties.append((Tie(name, tuple(sorted(by_stage))), by_stage))
    return sorted(ties, key=lambda t: (t[0].stages, t[0].name))


class TiedParameters:
    """Keeps this rank's copies of tied parameters in sync (see the module docstring).

    Construct it on every rank of the plan, in the same order relative to other group creations,
    after the stage split and *before* sharding (it creates the process groups, a collective over
    the whole world, and broadcasts the initial values); call :meth:`attach` after sharding and
    :meth:`sum_gradients` once per step, after its last backward (and DDP's all-reduce).
    """

    def __init__(self, split: PipelineSplit, plan: Plan, rank: int, group: Optional[dist.ProcessGroup],
                 names: Optional[nn.Module] = None):
        self.worker: Worker = plan.worker(rank)
        ties = find_ties(split, plan.tensor_parallel_stages, names)
        self.ties = [t for t, _ in ties]
        if ties and group is not None and group is not dist.group.WORLD \
                and dist.get_world_size(group) != dist.get_world_size():
            tie = ties[0][0]
            raise TiedParameterError(
                f"parameter {tie.name!r} is used by stages {list(tie.stages)} (tied weights), and keeping its "
                f"copies in sync needs a process group of its holders, created collectively over the whole "
                f"world; this plan runs on {dist.get_world_size(group)} of {dist.get_world_size()} ranks: run it "
                f"on the whole world (group=None), or untie the parameter")
        # holders -> this rank's originals of the ties they hold (the same order on every rank)
        self._groups: list[tuple[tuple[int, ...], Optional[dist.ProcessGroup], list[tuple[Tie, nn.Parameter]]]] = []
        by_holders: dict[tuple[int, ...], list[tuple[Tie, dict[int, nn.Parameter]]]] = {}
        for tie, by_stage in ties:
            members = tuple(sorted(dist.get_global_rank(group, w.rank) if group is not None else w.rank
                                   for w in plan.workers if w.stage in tie.stages))
            by_holders.setdefault(members, []).append((tie, by_stage))
        for members, held in sorted(by_holders.items()):
            pg = _holders_group(members) if len(members) > 1 else None   # every rank creates every group
            if self.worker.stage in held[0][0].stages:
                self._groups.append((members, pg, [(tie, by_stage[self.worker.stage]) for tie, by_stage in held]))
        mine = split.stages[self.worker.stage].module
        self._places = {id(original): _places(mine, original) for _, _, held in self._groups for _, original in held}
        self._copies: list[list[list[_Copy]]] = []
        self._broadcast_initial()
        if self._groups:
            log.info("rank %d: tied parameters %s kept in sync with stages %s", rank,
                     [t.name for _, _, held in self._groups for t, _ in held],
                     [t.stages for _, _, held in self._groups for t, _ in held])

    @torch.no_grad()
    def _broadcast_initial(self) -> None:
        """The copies start equal: the group's first rank's value goes to every holder. A model on
        the meta device has no values yet: its holders fill every copy from one source (a
        checkpoint, an init by name), so they start equal without it."""
        for members, pg, held in self._groups:
            if pg is None or any(p.is_meta for _, p in held):
                continue
            flat = torch.cat([p.detach().reshape(-1) for _, p in held])
            dist.broadcast(flat, src=members[0], group=pg)
            offset = 0
            for _, p in held:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()

    def attach(self, stage_module: nn.Module) -> None:
        """Find this rank's copies of each tied parameter in ``stage_module`` (after sharding):
        the original object where it stayed, a slice where a parallel Linear replaced its module."""
        self._copies = [[_copies_of(tie, original, self._places[id(original)], stage_module, self.worker)
                         for tie, original in held] for _, _, held in self._groups]

    def held(self) -> list[tuple[Tie, list[tuple[Optional[torch.Tensor], nn.Parameter]]]]:
        """This rank's copies of each tied parameter it holds: ``(index, tensor)``, the tensor being
        ``full.reshape(-1)[index]`` of the tied value (``index`` None: all of it)."""
        return [(tie, [(c.index, c.param) for c in copies])
                for (_, _, held), per_tie in zip(self._groups, self._copies)
                for (tie, _), copies in zip(held, per_tie)]

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Every copy's ``.grad`` becomes its slice of the sum over stages (one all-reduce per group)."""
        contributes = self.worker.replica == 0 and self.worker.dp_index == 0
        for (members, pg, held), per_tie in zip(self._groups, self._copies):
            fulls = []
            for (_, original), copies in zip(held, per_tie):
                # the whole value's shape on the copies' device (a model built on the meta device
                # keeps the whole original there where this rank holds a slice)
                device = copies[0].param.device if copies else original.device
                full = torch.zeros(original.shape, dtype=original.dtype, device=device)
                for copy in copies:
                    if contributes and copy.param.grad is not None and (copy.sharded or self.worker.tp_index == 0):
                        copy.add_into(full, copy.param.grad)
                fulls.append(full)
            flat = torch.cat([f.reshape(-1) for f in fulls])
            if pg is not None:
                dist.all_reduce(flat, group=pg)
            offset = 0
            for full, copies in zip(fulls, per_tie):
                full = flat[offset: offset + full.numel()].view_as(full)
                offset += full.numel()
                for copy in copies:
                    value = copy.take(full)
                    if copy.param.grad is None:
                        copy.param.grad = value.clone()
                    else:
                        copy.param.grad.copy_(value)


def _places(module: nn.Module, param: nn.Parameter) -> list[tuple[str, str]]:
    """Every (module path, attribute) of ``module`` holding ``param``."""
    return [(path, attr) for path, sub in module.named_modules(remove_duplicate=False)
            for attr, p in sub._parameters.items() if p is param]


def _copies_of(tie: Tie, original: nn.Parameter, places: list[tuple[str, str]], stage_module: nn.Module,
               worker: Worker) -> list[_Copy]:
    """The tensors that now stand where ``original`` stood before sharding, as copies of it."""
    copies: dict[int, _Copy] = {}
    for path, attr in places:
        module = stage_module.get_submodule(path)
        p = module._parameters.get(attr)
        if p is original:
            copies[id(p)] = _Copy(p)
        elif isinstance(module, ParallelLinear) and isinstance(p, nn.Parameter):
            # where each local entry sits in the full tensor: the layer's own slicing of the positions
            # (on the CPU while the copy has no storage yet: a model built on the meta device)
            positions = torch.arange(original.numel(), device="cpu" if p.is_meta else p.device).view(original.shape)
            index = module.shard_of(attr, positions)
            copies[id(p)] = _Copy(p) if module.sharded_dim(attr) is None else _Copy(p, index)
        else:
            raise TiedParameterError(
                f"parameter {tie.name!r} is tied across stages {list(tie.stages)}, but on stage {worker.stage} "
                f"(rank {worker.rank}) {type(module).__name__} {path or '<stage>'!r} replaced it with "
                f"{'nothing' if p is None else 'a tensor that is no known slice of it'}, so its copies cannot be "
                f"kept in sync; untie the parameter, or keep that module out of the split scope")
    return list(copies.values())


_HOLDER_GROUPS: dict[int, tuple[object, dict[tuple[int, ...], object]]] = {}


def _holders_group(members: tuple[int, ...]):
    """One communicator per set of holders for the life of the world's process group. A re-planned
    executor (runtime.balance.rebalance rebuilds it when layers move) reuses it instead of creating another:
    ``new_group`` is a collective over the whole world, and each group keeps its connections open
    until the world is destroyed. Every rank builds the same executors in the same order, so every
    rank hits or misses this cache alike and the collective stays matched."""
    world = dist.group.WORLD
    entry = _HOLDER_GROUPS.get(id(world))
    if entry is None or entry[0] is not world:
        entry = _HOLDER_GROUPS[id(world)] = (world, {})
    if members not in entry[1]:
        entry[1][members] = dist.new_group(list(members), timeout=_world_timeout())
    return entry[1][members]


def _world_timeout():
    """The default group's collective timeout (the Engine's ``timeout_s`` when the Engine made the
    group), so a dead holder fails the others as fast as on every other group, not after torch's
    30-minute default for new groups; None (torch's default) if the backend does not say."""
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(_backend_device()).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _backend_device():
    import torch

    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
