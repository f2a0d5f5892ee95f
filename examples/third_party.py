"""A BERT-style encoder written the way third-party libraries (Hugging Face ``transformers``) write
models, annotated only from the outside with ``wl.annotate`` by module path.

The model code is deliberately left as such libraries have it: a config object, a ``ModuleList``
of layers named ``encoder.layer.N``, an extended attention mask computed in the model's own
``forward`` with Python branches on ``attention_mask.dim()``, and ``batch, seq = input_ids.size()``
unpacking. Plain ``torch.fx.symbolic_trace`` cannot trace that (a traced value cannot drive a
Python ``if``), so ``wl.capture`` goes through ``torch.export``, whose ``nn_module_stack`` maps the
graph back to the annotated module paths.

    wl.annotate(model, {"embeddings": wl.replicate(), "encoder.layer.0-1": wl.replicate(),
                        "encoder.layer.2-3": wl.replicate(), "classifier": wl.split()})
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import whalelike as wl
from whalelike.workload import Workload


# ---- "library" code: imagine this lives in site-packages and cannot be edited ----------------------
@dataclass
class EncoderConfig:
    vocab_size: int = 1000
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 64
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.0
    num_labels: int = 4


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
                      + self.position_embeddings(position_ids))
        return self.dropout(self.LayerNorm(embeddings))


class SelfAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        query = self.transpose_for_scores(self.query(hidden_states))
        key = self.transpose_for_scores(self.key(hidden_states))
        value = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        probs = F.softmax(scores + attention_mask, dim=-1)
        context = torch.matmul(probs, value).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (self.all_head_size,))


class Layer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        attended = self.attention_norm(hidden_states + self.attention_output(self.attention(hidden_states, attention_mask)))
        out = self.output_norm(attended + self.output(F.gelu(self.intermediate(attended))))
        return (out,)


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList([Layer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)[0]
        return hidden_states


class EncoderForSequenceClassification(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def get_extended_attention_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if attention_mask.dim() == 3:
            extended = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            extended = attention_mask[:, None, None, :]
        else:
            raise ValueError(f"Wrong shape for attention_mask (shape {attention_mask.shape})")
        return (1.0 - extended.to(dtype)) * torch.finfo(dtype).min

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch_size, seq_length = input_ids.size()
        if seq_length > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {seq_length} exceeds {self.config.max_position_embeddings}")
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length), device=input_ids.device)
        extended = self.get_extended_attention_mask(attention_mask, self.embeddings.word_embeddings.weight.dtype)
        hidden = self.encoder(self.embeddings(input_ids, token_type_ids), extended)
        return self.classifier(hidden[:, 0])


# ---- user code: annotate from the outside ---------------------------------------------------------
def build(num_hidden_layers: int = 4, hidden_size: int = 64, num_attention_heads: int = 4, seq_len: int = 16,
          vocab_size: int = 1000, num_labels: int = 4, batch_size: int = 8, seed: int = 0) -> Workload:
    """The annotated model, an example (input_ids, attention_mask) batch, cross-entropy, and data."""
    if num_hidden_layers < 2:
        raise ValueError(f"third_party.build: num_hidden_layers must be >= 2 for two stages, got {num_hidden_layers}")
    torch.manual_seed(seed)
    config = EncoderConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                           num_attention_heads=num_attention_heads, intermediate_size=4 * hidden_size,
                           max_position_embeddings=max(64, seq_len), num_labels=num_labels)
    model = EncoderForSequenceClassification(config)
    half = num_hidden_layers // 2
    wl.annotate(model, {
        "embeddings": wl.replicate(),
        f"encoder.layer.0-{half - 1}": wl.replicate(),
        f"encoder.layer.{half}-{num_hidden_layers - 1}": wl.replicate(),
        "classifier": wl.split(),
    })

    def make_batch(num_samples: int, generator: torch.Generator):
        # The label is the first token's residue: learnable from the [CLS] position.
        input_ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=generator)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (num_samples, 1), generator=generator)
        attention_mask = (torch.arange(seq_len) < lengths).long()
        return (input_ids, attention_mask), input_ids[:, 0] % num_labels

    example, _ = make_batch(batch_size, torch.Generator().manual_seed(seed))
    return Workload(model=model, example_args=example, loss_fn=F.cross_entropy, make_batch=make_batch)


if __name__ == "__main__":
    w = build()
    print(wl.capture(w.model, w.example_args))
