"""Real ``transformers`` models from small configs built in code (nothing is downloaded).

Each builder returns a :class:`RealModel`: the model (dropout off, so a step is deterministic and
comparable with a single-process reference), a batch maker, the loss a user writes for it, and the
module paths to annotate for a pipeline and for ``split`` over a range of blocks. The five cover
what the issue names: GPT-2 (tied input/output embeddings, ``Conv1D``), BERT, ViT, a Llama-style
decoder (grouped-query attention, SwiGLU, rotary embeddings) and a ResNet with BatchNorm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, CLASSES = 256, 16, 8


@dataclass
class RealModel:
    name: str
    model: nn.Module
    make_batch: Callable[[int, torch.Generator], tuple[tuple, torch.Tensor]]
    loss_fn: Callable
    pipeline: dict[str, str]      # module path pattern -> "replicate" (the pipeline annotation)
    blocks: str                   # the block range ``split`` goes over in the tensor-parallel tests


def lm_loss(out, targets):
    """What users write for a causal LM: cross-entropy over ``.logits`` of the ModelOutput."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def classifier_loss(out, targets):
    return F.cross_entropy(out.logits, targets)


def _tokens(batch: int, gen: torch.Generator):
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    return (ids,), torch.randint(0, VOCAB, (batch, SEQ), generator=gen)


def _token_classes(batch: int, gen: torch.Generator):
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=gen),), torch.randint(0, CLASSES, (batch,), generator=gen)


def _images(batch: int, gen: torch.Generator):
    return (torch.randn(batch, 3, 32, 32, generator=gen),), torch.randint(0, CLASSES, (batch,), generator=gen)


def _halves(blocks: str, layers: int) -> dict[str, str]:
    """The pipeline annotation: the first half of the ``layers`` numbered blocks under ``blocks``, then the rest."""
    half = layers // 2
    span = lambda lo, hi: f"{blocks}.{lo}" if lo == hi else f"{blocks}.{lo}-{hi}"  # noqa: E731
    return {span(0, half - 1): "replicate", span(half, layers - 1): "replicate"}


def gpt2(layers: int = 4) -> RealModel:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return RealModel("gpt2", GPT2LMHeadModel(config), _tokens, lm_loss,
                     _halves("transformer.h", layers), "transformer.h.1-2")


def bert(layers: int = 4) -> RealModel:
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                        vocab_size=VOCAB, num_labels=CLASSES, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return RealModel("bert", BertForSequenceClassification(config), _token_classes, classifier_loss,
                     _halves("bert.encoder.layer", layers), "bert.encoder.layer.1-2")


def vit(layers: int = 4) -> RealModel:
    from transformers import ViTConfig, ViTForImageClassification
    config = ViTConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=8, num_labels=CLASSES, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return RealModel("vit", ViTForImageClassification(config), _images, classifier_loss,
                     _halves("vit.layers", layers), "vit.layers.1-2")


def llama(layers: int = 4) -> RealModel:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=VOCAB, use_cache=False, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return RealModel("llama", LlamaForCausalLM(config), _tokens, lm_loss,
                     _halves("model.layers", layers), "model.layers.1-2")


def resnet() -> RealModel:
    from transformers import ResNetConfig, ResNetForImageClassification
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=CLASSES)
    return RealModel("resnet", ResNetForImageClassification(config), _images, classifier_loss,
                     {"resnet.encoder.stages.0": "replicate", "resnet.encoder.stages.1": "replicate"}, "")


TRANSFORMERS = {"gpt2": gpt2, "bert": bert, "vit": vit, "llama": llama}
ALL = {**TRANSFORMERS, "resnet": resnet}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 4) -> RealModel:
    """The named model, seeded, in ``dtype``, with its pipeline annotation applied; a transformer
    has ``layers`` blocks (the first half one pipeline region, the rest the other)."""
    import whalelike as wl
    torch.manual_seed(seed)
    real = ALL[name](layers) if name in TRANSFORMERS else ALL[name]()
    real.model.to(dtype)
    wl.annotate(real.model, {path: getattr(wl, kind)() for path, kind in real.pipeline.items()})
    return real
