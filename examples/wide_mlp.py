"""A parameter-heavy residual MLP under one ``replicate`` region: the model of "Models bigger than a
device" (README) and of ``bench/zero_hetero.py``.

Its state is almost all parameters (16 bytes each with AdamW in float32), so on
``examples/clusters/emulated-4-small-memory.yaml`` a full replica does not fit the smallest device
and ``whalelike plan`` picks the lowest ZeRO stage at which every device fits. Each block is a
module of its own, so ZeRO 3 gathers one block's parameters at a time (runtime.replicas.fsdp_sync).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import whalelike as wl
from whalelike.workload import Workload


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class WideMLP(nn.Module):
    def __init__(self, width: int = 256, blocks: int = 8, classes: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        with wl.replicate():
            for block in self.blocks:
                x = block(x)
            return self.head(x)


def build(width: int = 256, blocks: int = 8, classes: int = 16, seed: int = 0) -> Workload:
    """The model, an example batch, cross-entropy, and a learnable synthetic task (classes from a
    fixed random projection of the input)."""
    torch.manual_seed(seed)
    model = WideMLP(width, blocks, classes)
    projection = torch.randn(width, classes, generator=torch.Generator().manual_seed(seed + 1))

    def make_batch(num_samples: int, generator: torch.Generator):
        x = torch.randn(num_samples, width, generator=generator)
        return (x,), (x @ projection).argmax(dim=1)

    return Workload(model=model, example_args=(torch.randn(2, width),), loss_fn=F.cross_entropy,
                    make_batch=make_batch)
