"""Losses for ``split`` classifiers whose logits stay class-sharded.

To whalelike a loss is a ``loss_fn(outputs, targets)``. Where a ``split`` Linear's logits are the
model output, or one leaf of it (``.logits`` of a ModelOutput, a tuple or dict item), and the loss
is a plain softmax cross-entropy of them, the runtime computes it from each rank's class shard and
never gathers the full logits (Whale's 100k-class head). ``runtime.tensor.sharded_loss`` finds that out by
tracing ``loss_fn``: ``F.cross_entropy`` or ``nn.CrossEntropyLoss`` (no weights, no label
smoothing, mean reduction) called in a lambda or function on logits that are only reshaped
(``view(-1, V)``, ``reshape``, ``flatten(0, 1)``) are all recognised. :func:`token_cross_entropy`
is that loss for ``[batch, positions, vocab]`` logits, ready-made.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy over every position: classes in the last dimension of ``logits``,
    ``targets`` of the leading shape (``IGNORE_INDEX`` entries are skipped)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
