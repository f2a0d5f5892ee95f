"""A real Hugging Face ``transformers`` GPT-2, annotated by module path (its code is not ours to edit).

    tail = wl.split()
    wl.annotate(model, {
        "transformer.h.0-1": wl.replicate(),   # TaskGraph 0: data parallel (the embeddings join it)
        "transformer.h.2-3": tail,             # TaskGraph 1: tensor parallel blocks ...
        "lm_head":           tail,             #   ... and the vocabulary-sharded head (one region)
    })

Everything un-annotated joins the region next to it: the token and position embeddings the first
region, the final ``ln_f`` the blocks before it (never sharded there: ``split`` shards only what it
was given). The same strategy object given to two entries makes them one region. Under ``split`` the planner cuts each block's attention by heads and its MLP by
features, in proportion to the devices' speeds, and the runtime shards GPT-2's fused ``c_attn``
``Conv1D`` (q, k and v side by side) accordingly. ``lm_head`` is tied to the token embedding
(GPT-2's default ``tie_word_embeddings``): the stages holding the two copies add their gradients,
so the tie holds exactly. The loss is what users write for a causal LM, cross-entropy over
``.logits`` of the model's ``CausalLMOutput``; the runtime recognises it and keeps the logits
sharded over the vocabulary.

Nothing is downloaded: the config is built in code. ``build()`` defaults train a few dozen steps
on a CPU in well under a minute; ``build(n_layer=12, d_model=768, n_head=12, vocab_size=50_257,
seq_len=1024)`` is GPT-2 small (and ``from_pretrained`` weights load into the same model).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import whalelike as wl
from whalelike.workload import Workload, counting_tokens


def causal_lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the ``.logits`` of a ``CausalLMOutput``."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(vocab_size: int = 512, seq_len: int = 32, n_layer: int = 4, d_model: int = 64, n_head: int = 4,
          batch_size: int = 8, seed: int = 0) -> Workload:
    """GPT-2 from a small config, annotated; an example batch, the loss, and a learnable token stream."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if n_layer < 2:
        raise ValueError(f"hf_gpt2: n_layer must be at least 2 (one replicate and one split range), got {n_layer}")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=d_model, n_layer=n_layer,
                        n_head=n_head, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    half = n_layer // 2
    tail = wl.split()
    wl.annotate(model, {
        f"transformer.h.0-{half - 1}": wl.replicate(),
        f"transformer.h.{half}-{n_layer - 1}": tail,
        "lm_head": tail,
    })

    make_batch = counting_tokens(vocab_size, seq_len)

    (example,), _ = make_batch(batch_size, torch.Generator().manual_seed(seed))
    return Workload(model=model, example_args=(example,), loss_fn=causal_lm_loss, make_batch=make_batch)


if __name__ == "__main__":
    w = build()
    print(wl.capture(w.model, w.example_args))
