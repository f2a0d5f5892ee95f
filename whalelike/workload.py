"""What a model factory returns: the model, example inputs, and (for training) a loss and data.

The CLI's ``MODEL`` argument is ``path/to/file.py:factory``; ``factory()`` takes no arguments and
returns a :class:`Workload` (or a ``(model, example_args)`` tuple, enough for ``inspect`` and
``plan``). ``example_args`` is a tuple of tensors whose first dimension is the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from whalelike.errors import WhaleError


@dataclass
class Workload:
    model: nn.Module
    example_args: tuple
    example_kwargs: dict = field(default_factory=dict)
    # loss_fn(outputs, targets) -> scalar mean loss over the samples of the batch
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None
    # make_batch(num_samples, generator) -> (inputs tuple, targets) for training and benchmarks
    make_batch: Optional[Callable[[int, torch.Generator], tuple[tuple, torch.Tensor]]] = None


def as_workload(obj: Any, origin: str) -> Workload:
    """Accept a Workload or a ``(model, example_args)`` tuple; anything else is a clear error."""
    if isinstance(obj, Workload):
        workload = obj
    elif isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], nn.Module):
        args = obj[1] if isinstance(obj[1], tuple) else (obj[1],)
        workload = Workload(model=obj[0], example_args=args)
    else:
        raise WhaleError(
            f"{origin} must return a whalelike.Workload or a (model, example_args) tuple, "
            f"got {type(obj).__name__}"
        )
    if not isinstance(workload.model, nn.Module):
        raise WhaleError(f"{origin}: Workload.model must be an nn.Module, got {type(workload.model).__name__}")
    if not isinstance(workload.example_args, tuple):
        workload.example_args = (workload.example_args,)
    return workload
