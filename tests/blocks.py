"""Small model blocks several test files train: one definition, so a fix reaches every test."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FxBlock(nn.Module):
    """An fx-traceable pre-norm block: explicit matmul attention with a causal mask and literal head
    counts in ``view`` (call_method), then a SwiGLU MLP."""

    def __init__(self, hidden=32, heads=4, seq=6):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(hidden, 64), nn.Linear(hidden, 64), nn.Linear(64, hidden)
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / self.head_dim ** 0.5 + self.mask
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))
