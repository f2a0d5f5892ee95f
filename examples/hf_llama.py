"""A real Hugging Face ``transformers`` Llama (``LlamaForCausalLM``), a byte-level language model,
annotated by module path (its code is not ours to edit).

    tail = wl.split()
    wl.annotate(model, {
        "model.layers.0-1": wl.replicate(),   # TaskGraph 0: data parallel (the token embedding joins it)
        "model.layers.2-3": tail,             # TaskGraph 1: tensor-parallel blocks ...
        "lm_head":          tail,             #   ... and the vocabulary-sharded head (one region)
    })

The Llama family's pieces are all here: RMSNorm, rotary position embeddings (the cos/sin tables
are constants, copied into every Layer that uses them), grouped-query attention (4 query heads
share 2 key/value heads: ``split`` cuts the query heads and the key/value heads that serve them
together, or keeps the key/value projections whole when the heads cannot be cut evenly) and the
SwiGLU MLP (``gate_proj`` and ``up_proj`` cut by features, ``down_proj`` by rows). Everything
un-annotated joins the region next to it: the embedding the first, the final norm the blocks
before it. The input and output embeddings are untied (Llama's default). The loss is what users
write for a causal LM, ``F.cross_entropy(logits.view(-1, V), targets.reshape(-1))`` over ``.logits``
(``reshape``: a batch's targets may be a slice of a longer token run): the runtime recognises it and
keeps the logits sharded over the vocabulary.

The vocabulary is 256 bytes (``Workload.vocab_size``), so ``examples/train.py --data FILE`` trains
it on any text file with no tokenizer, e.g. the shipped ``examples/data/tinyshakespeare.txt``;
``make_batch`` is a synthetic, learnable byte stream for runs without ``--data``.

    whalelike plan examples/hf_llama.py:build --cluster emulated-4 --global-batch 16 --micro-batches 2 -o out/llama.yaml
    torchrun --nproc_per_node 4 examples/train.py examples/hf_llama.py:build --plan out/llama.yaml \\
        --data examples/data/tinyshakespeare.txt --steps 20

``build_recompute`` is ``build(recompute=True)``: the same model with activation checkpointing on both
regions (docs/guides/training-recipe.md plans it with ``--precision bf16`` on
``examples/clusters/emulated-mixed-bf16.yaml`` and trains it with clipping and a cosine schedule).

Nothing is downloaded: the config is built in code. ``build()`` defaults train a few dozen steps on
a CPU in well under a minute; ``build(hidden_size=4096, n_layer=32, n_head=32, n_kv_head=8,
intermediate_size=14336, vocab_size=128_256, seq_len=8192)`` is Llama-3-8B's shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import whalelike as wl
from whalelike.workload import Workload, counting_tokens


def causal_lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the ``.logits`` of a ``CausalLMOutput`` (the plain form, which
    the runtime recognises and computes on class-sharded logits)."""
    logits = out.logits
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build(vocab_size: int = 256, seq_len: int = 64, n_layer: int = 4, hidden_size: int = 64, n_head: int = 4,
          n_kv_head: int = 2, intermediate_size: int | None = None, batch_size: int = 8, seed: int = 0,
          recompute: bool = False) -> Workload:
    """Llama from a small config, annotated; an example batch, the loss, and a learnable byte stream.

    ``intermediate_size`` defaults to Llama's ~8/3 of ``hidden_size``, rounded up to a multiple of 16.
    ``recompute=True`` turns activation checkpointing on for both regions (the blocks, with the
    embedding, final norm and head that join them): ``wl.replicate(recompute=True)`` and
    ``wl.split(recompute=True)`` (see :func:`build_recompute`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if n_layer < 2:
        raise ValueError(f"hf_llama: n_layer must be at least 2 (one replicate and one split range), got {n_layer}")
    if n_head % n_kv_head:
        raise ValueError(f"hf_llama: n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head}): each "
                         "key/value head serves a whole group of query heads")
    if intermediate_size is None:
        intermediate_size = -(-8 * hidden_size // 3 // 16) * 16
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                         max_position_embeddings=seq_len, use_cache=False, attention_dropout=0.0,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    half = n_layer // 2
    tail = wl.split(recompute=recompute)
    wl.annotate(model, {
        f"model.layers.0-{half - 1}": wl.replicate(recompute=recompute),
        f"model.layers.{half}-{n_layer - 1}": tail,
        "lm_head": tail,
    })

    make_batch = counting_tokens(vocab_size, seq_len)

    (example,), _ = make_batch(batch_size, torch.Generator().manual_seed(seed))
    return Workload(model=model, example_args=(example,), loss_fn=causal_lm_loss, make_batch=make_batch,
                    vocab_size=vocab_size, seq_len=seq_len)


def build_recompute(**kwargs) -> Workload:
    """:func:`build` with activation checkpointing on its blocks (``recompute=True``): each block keeps
    only its input per micro-batch in flight and runs its forward again in the backward, one block at
    a time (torch's non-reentrant checkpoint). As a factory: ``examples/hf_llama.py:build_recompute``."""
    return build(**kwargs, recompute=True)


if __name__ == "__main__":
    w = build()
    print(wl.capture(w.model, w.example_args))
