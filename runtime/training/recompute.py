"""Activation checkpointing of a stage: its forward runs under torch's non-reentrant checkpoint.

Why. A pipeline stage with several micro-batches in flight keeps every one's saved activations
until its backward; recomputing them in the backward keeps only the stage's inputs (and the output
the executor holds as the backward's root), at the price of a second forward. The planner decides
which stages do it (``StagePlan.recompute``: asked by a region's ``recompute=True``, or chosen
because the stage does not fit otherwise) and prices both sides: memory in
:mod:`planner.devices.memory`, the extra forward in :func:`planner.devices.cost_model.backward_flops`.

Why torch's ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` and not
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` or the reentrant variant: the
wrapper module inserts ``_checkpoint_wrapped_module`` into every parameter's name, and the
runtime's state names (checkpoints, re-plans, the replica sync's buckets) are the model's own; the
reentrant variant drops gradients of inputs that do not require them, needs at least one input
that does (a first stage's token ids do not), and does not support ``torch.autograd.grad``.
So :func:`wrap` replaces the *instance's* ``forward`` attribute (the class's ``forward`` stays):
``module(...)`` still runs every hook, parameters and buffers keep their names, and
:func:`unwrap` restores what was there. The RNG state is preserved (``preserve_rng_state``), so
dropout draws the same masks in the recompute and training stays exact.

Under ``torch.no_grad()`` (evaluation) the forward runs plainly: nothing is saved to recompute.

Invariant: a wrapped module computes the same values and gradients as the unwrapped one, bit for
bit (same operators, same RNG draws); only what is kept between forward and backward changes.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_SAVED = "_wl_recompute_forward"   # the instance's own forward before wrapping (None: the class's)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The module's own forward, under non-reentrant checkpoint when autograd records."""
    own = self.__dict__[_SAVED]
    forward = own if own is not None else types.MethodType(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def wrap(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward recompute its activations in the backward, in place (its
    parameters, buffers and hooks untouched); returns it. Wrapping twice is an error, so each
    :func:`unwrap` undoes exactly one wrap."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"recompute.wrap expects an nn.Module, got {type(module).__name__}")
    if is_wrapped(module):
        raise ValueError(f"recompute.wrap: {type(module).__name__} already recomputes its activations; "
                         "call recompute.unwrap(module) first")
    object.__setattr__(module, _SAVED, module.__dict__.get("forward"))
    # a bound method (deep copies of the module rebind it to the copy)
    object.__setattr__(module, "forward", types.MethodType(_checkpointed_forward, module))
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """Undo :func:`wrap` (no-op on a module that is not wrapped); returns the module."""
    if not is_wrapped(module):
        return module
    own = module.__dict__.pop(_SAVED)
    del module.__dict__["forward"]
    if own is not None:
        object.__setattr__(module, "forward", own)
    return module


def is_wrapped(module: nn.Module) -> bool:
    """Whether :func:`wrap` applies to ``module`` now."""
    return _SAVED in module.__dict__
