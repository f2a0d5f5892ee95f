"""Parts several replica syncs share (:mod:`runtime.replicas.replica_sync`'s protocol), written once.

* :class:`OwnPassenger`: the step's passenger (loss, the straggler monitor's figures) summed in one
  small all-reduce of its own after the step's last backward, for syncs whose collectives have no
  bucket to append it to (the lone worker, FSDP2, the ragged sync); DDP carries it in its last bucket.
* :class:`WholeParameters`: the optimizer steps the module's own parameters, which are always
  current (DDP, the lone worker, FSDP2, whose sharded parameters are the module's).

Invariant: a class using them has ``inner`` (its module) and ``group`` (its process group).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


class OwnPassenger:
    """``carry``/``flush`` with an all-reduce of the passenger's own over ``self.group``."""

    _passenger: Optional[tuple[torch.Tensor, Optional[Callable[[torch.Tensor], None]]]] = None

    def carry(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self._passenger = (tensor, fill)

    def flush(self) -> None:
        """Sum the passenger over the group (``fill`` writes it first)."""
        if self._passenger is not None:
            (tensor, fill), self._passenger = self._passenger, None
            if fill is not None:
                fill(tensor)
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
