"""The single-process reference every distributed-training test compares against.

Same initial weights, same data, the whole global batch in one process: ``train_reference``
returns the loss of each step and the final state, which a parallel run must reproduce
(``torch.testing.assert_close``). ``OPTIMIZERS`` are the two the acceptance criteria name: SGD
with momentum (gradients enter linearly) and AdamW (normalised updates, so a wrong gradient scale
that SGD would show only in magnitude still changes the parameters).
"""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn as nn

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def train_reference(model: nn.Module, batches: Sequence[tuple[tuple, torch.Tensor]], make_opt: Callable,
                    loss_fn: Callable) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Train a copy of ``model`` on each ``(inputs, targets)`` batch; the losses and the final state."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
