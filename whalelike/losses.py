"""Losses whalelike recognises, so a ``split`` classifier can keep its logits class-sharded.

To whalelike a loss is an opaque ``loss_fn(outputs, targets)``. Where the model's output is the
logits of a ``split`` Linear and the loss is a plain softmax cross-entropy, the runtime computes the
loss from each rank's class shard and never gathers the full logits (Whale's 100k-class head).
``F.cross_entropy`` and ``nn.CrossEntropyLoss`` (no weights, no label smoothing) are recognised for
``[batch, classes]`` logits; language models, whose logits are ``[batch, positions, vocab]``, use
:func:`token_cross_entropy`, which any other wrapper would hide from the runtime.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy over every position: classes in the last dimension of ``logits``,
    ``targets`` of the leading shape (``IGNORE_INDEX`` entries are skipped)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
