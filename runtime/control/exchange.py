"""The step-end exchange: one vector summed over the ranks in the collective that ends a step.

Several things must reach every rank at every step boundary (the straggler monitor's speeds, the
leave flags of ranks given notice, what a new controller wants to know); each would cost a small
all-reduce of its own, a latency paid on every step by every rank. Instead each controller asks
for its share of one vector (:class:`Part`), and the executor sums the whole of it in the
collective that ends the step anyway (DDP's last gradient bucket, the pipeline's loss all-reduce,
FSDP2's passenger all-reduce), right after the step's compute: the :class:`Passenger` is filled at
send time, so this step's figures travel. An executor without such a collective leaves it
:attr:`Passenger.carried` False and the Engine sums it on its own.

Invariant: every rank composes the same parts in the same order for a step (each part's size is a
function of the step, the plan and the controller's own state, identical on every rank), so the
summed vector means the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


class Passenger:
    """A vector summed over the ranks in the collective that ends a step (see the module
    docstring). The executor calls :meth:`fill` right before that collective (or takes
    :meth:`load`'s carrier) and :meth:`arrived` with the summed values."""

    def __init__(self, size: int, fill: Callable[[], torch.Tensor]):
        self.vector = torch.zeros(size, dtype=torch.float64)
        self._fill = fill
        self.filled = False
        self.carried = False

    def fill(self) -> torch.Tensor:
        if not self.filled:
            self.vector.copy_(self._fill())
            self.filled = True
        return self.vector

    def arrived(self, summed: torch.Tensor) -> None:
        self.vector.copy_(summed.detach().to("cpu", torch.float64))
        self.carried = True

    def load(self, loss: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
        """The step's one summed vector, ``[loss, figures...]`` in the loss's dtype and device, and
        the function that writes the figures into it (call it right before the collective, after
        the step's compute). Every executor carries the loss and the figures this way."""
        carrier = torch.cat([loss.reshape(1), loss.new_zeros(self.vector.numel())])
        return carrier, lambda c: c[1:].copy_(self.fill())

    def unload(self, carrier: torch.Tensor) -> torch.Tensor:
        """After the collective summed ``carrier`` (from :meth:`load`): keep the figures, return the loss."""
        self.arrived(carrier[1:])
        return carrier[0].clone()


@dataclass
class Part:
    """One controller's share of a step's exchange: ``size`` values, written by ``fill()`` at send
    time (float64, each rank its own contribution: the vector is summed), handed back summed to
    ``arrived(values)``."""

    size: int
    fill: Callable[[], torch.Tensor]
    arrived: Callable[[torch.Tensor], None]


def compose(parts: Sequence[Part]) -> Optional[Passenger]:
    """One passenger carrying ``parts`` one after another (None when there is none)."""
    parts = [p for p in parts if p.size]
    if not parts:
        return None

    def fill() -> torch.Tensor:
        values = []
        for part in parts:
            value = part.fill().reshape(-1).to(torch.float64)
            if value.numel() != part.size:
                raise ValueError(f"an exchange part of {part.size} values was filled with {value.numel()}")
            values.append(value)
        return torch.cat(values)

    class Composed(Passenger):
        def arrived(self, summed: torch.Tensor) -> None:
            super().arrived(summed)
            offset = 0
            for part in parts:
                part.arrived(self.vector[offset: offset + part.size].clone())
                offset += part.size

    return Composed(sum(p.size for p in parts), fill)
