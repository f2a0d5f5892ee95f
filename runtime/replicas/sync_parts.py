"""Parts several replica syncs share (:mod:`runtime.replicas.replica_sync`'s protocol), written once.

* :class:`OwnPassenger`: the step's passenger (loss, the straggler monitor's figures) summed in one
  small all-reduce of its own after the step's last backward, for syncs whose collectives have no
  bucket to append it to (the lone worker, FSDP2, the ragged sync); DDP carries it in its last bucket.
* :class:`WholeParameters`: the optimizer steps the module's own parameters, which are always
  current (DDP, the lone worker, FSDP2, whose sharded parameters are the module's).
* :class:`Exact`: a sync whose steps are the synchronous SGD of one device (``exact`` True) and that
  has nothing to do after the optimizer step (``after_step`` does nothing): every sync but P-Reduce.
* :func:`own_units`: which of the layer modules a ZeRO sync wraps as units of their own hold only
  their own parameters (FSDP2 and the ragged sync at stage 3 free a unit's parameters between uses).

Invariant: a class using them has ``inner`` (its module) and ``group`` (its process group).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

log = logging.getLogger(__name__)


def own_units(module: nn.Module, paths: Sequence[str]) -> list[str]:
    """The module paths among ``paths`` (layer submodules of ``module``, none inside another) whose
    every parameter is registered only inside their own subtree. A parameter also registered
    elsewhere (a tied weight: ``lm_head.weight`` is ``embed_tokens.weight``) stays with the root
    unit, whose gather spans all its uses: in a unit of its own it would be freed between the uses
    (ZeRO 3), and FSDP2 refuses a parameter managed by two units. The planner leaves the same layers
    out of its units from the capture (:func:`planner.devices.cost_model.fsdp_unit_names`); this is
    the check on the module itself, for ties the capture cannot see (a parameter registered in a
    module whose forward never reads it)."""
    inside: dict[int, set[str]] = {}
    for name, owner in module.named_modules(remove_duplicate=False):
        for pname, param in owner.named_parameters(recurse=False):
            inside.setdefault(id(param), set()).add(f"{name}.{pname}" if name else pname)
    kept = []
    for path in paths:
        sub = module.get_submodule(path)
        outside = sorted(n for p in sub.parameters() for n in inside.get(id(p), ())
                         if not n.startswith(path + "."))
        if outside:
            log.info("ZeRO: %s shares %s with the rest of the model; its parameters join the root unit", path,
                     ", ".join(outside))
        else:
            kept.append(path)
    return kept


class Exact:
    """``exact`` and ``after_step`` of a synchronous sync (see the module docstring)."""

    exact = True

    def after_step(self, plan, step: int, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Nothing: the replicas are in step after the optimizer step already."""


class OwnPassenger:
    """``carry``/``flush`` with an all-reduce of the passenger's own over ``self.group``."""

    _passenger: Optional[tuple[torch.Tensor, Optional[Callable[[torch.Tensor], None]]]] = None

    def carry(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self._passenger = (tensor, fill)

    def flush(self) -> None:
        """Sum the passenger over the group (``fill`` writes it first; a group of one rank is its sum)."""
        if self._passenger is not None:
            (tensor, fill), self._passenger = self._passenger, None
            if fill is not None:
                fill(tensor)
            if dist.get_world_size(self.group) > 1:
                dist.all_reduce(tensor, group=self.group)


class WholeParameters:
    """``parameters``/``current``/``loaded`` of a sync whose optimizer steps the module's parameters."""

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: the module's parameters."""
        return list(self.inner.parameters())

    def current(self) -> None:
        """The module's parameters are always current."""

    def loaded(self) -> None:
        """Nothing is kept beside the module's parameters (a sharded module's loads write its rows)."""
