"""A GPT-style decoder annotated at construction time: a pipeline of two ``replicate`` stages and a
``split`` LM head (Whale's recipe for a large-vocabulary language model).

    with wl.replicate():  embeddings + first half of the blocks      -> TaskGraph 0 (stage 0)
    with wl.replicate():  second half of the blocks + final norm     -> TaskGraph 1 (stage 1)
    with wl.split():      LM head, sharded over the vocabulary       -> TaskGraph 2

The loss is ``wl.token_cross_entropy`` (cross-entropy of every position's next-token prediction),
which the runtime recognises: when the head gets several devices, each computes the loss from its
own slice of the vocabulary and the full logits never exist on one rank.

``build()`` defaults train a few dozen steps on a CPU in seconds; scale with the keyword arguments
(``build(n_layer=24, d_model=1024, n_head=16, vocab_size=50_304, seq_len=1024)`` is GPT-2 medium).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import whalelike as wl
from whalelike.workload import Workload, counting_tokens


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Decoder-only transformer. ``stages`` replicate stages share the blocks evenly."""

    def __init__(self, vocab_size: int = 512, seq_len: int = 32, n_layer: int = 4, d_model: int = 64,
                 n_head: int = 4, stages: int = 2):
        super().__init__()
        if not 1 <= stages <= n_layer:
            raise ValueError(f"GPT: stages must be between 1 and n_layer={n_layer}, got {stages}")
        bounds = [round(i * n_layer / stages) for i in range(stages + 1)]
        self.h = nn.ModuleList()
        for s in range(stages):
            with wl.replicate():
                if s == 0:
                    self.wte = nn.Embedding(vocab_size, d_model)
                    self.wpe = nn.Embedding(seq_len, d_model)
                self.h.extend(Block(d_model, n_head) for _ in range(bounds[s], bounds[s + 1]))
                if s == stages - 1:
                    self.ln_f = nn.LayerNorm(d_model)
        with wl.split():
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(vocab_size: int = 512, seq_len: int = 32, n_layer: int = 4, d_model: int = 64, n_head: int = 4,
          stages: int = 2, batch_size: int = 8, seed: int = 0) -> Workload:
    """The model, an example batch of token ids, the loss, and a synthetic token stream."""
    torch.manual_seed(seed)
    model = GPT(vocab_size, seq_len, n_layer, d_model, n_head, stages)

    make_batch = counting_tokens(vocab_size, seq_len)

    (example,), _ = make_batch(batch_size, torch.Generator().manual_seed(seed))
    return Workload(model=model, example_args=(example,), loss_fn=wl.token_cross_entropy, make_batch=make_batch)


if __name__ == "__main__":
    w = build()
    print(wl.capture(w.model, w.example_args))
