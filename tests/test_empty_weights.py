"""Models built without storage (``whalelike.empty_weights``) and the Engine's check of them
(``runtime.engine.check_weights``), in one process. The distributed path (a model built on the meta
device, filled from a ``save_pretrained`` directory rank by rank, its tie spanning a tensor-parallel stage and a DDP or
FSDP2 stage, trained against the single-process reference, exported, set-up memory measured) runs in
``tests/test_pretrained.py``'s spawn."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import whalelike as wl
from runtime.engine import check_weights
from whalelike.errors import WhaleError


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("counts", torch.zeros(4))


def test_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    with wl.empty_weights():
        model = Rotary()
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    assert torch.equal(model.inv_freq, torch.arange(4.0))
    assert check_weights(model, None) is True                 # empty: to be filled
    assert check_weights(Rotary(), None) is False             # built normally


def test_empty_weights_removes_its_hook_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with wl.empty_weights():
            raise RuntimeError("boom")
    assert not any(p.is_meta for p in nn.Linear(2, 2).parameters())


def test_a_meta_buffer_no_checkpoint_holds_is_refused():
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(WhaleError, match=r"\['inv_freq'\].*empty_weights"):
        check_weights(model, None)


def test_weights_of_the_wrong_kind_are_refused():
    with pytest.raises(WhaleError, match="save_pretrained directory or a function"):
        check_weights(Rotary(), 3)


def test_a_model_built_on_meta_captures_with_cpu_inputs_and_measures_its_autocast_activations():
    """Issue 36: a real-size model is built on meta and given ordinary CPU example inputs; its
    bf16/fp16 activation bytes are measured under autocast on fake tensors (meta has no autocast),
    and equal those of the same model built with storage."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import hf_llama
    from whalelike.graphs.capture import capture, with_autocast

    small = dict(n_layer=2, hidden_size=32, n_head=2, n_kv_head=1, seq_len=16, batch_size=2)
    built = hf_llama.build(**small)
    with wl.empty_weights():
        empty = hf_llama.build(**small)
    assert all(p.is_meta for p in empty.model.parameters())
    assert not any(t.is_meta for t in empty.example_args)
    expected = with_autocast(capture(built.model, built.example_args))
    got = with_autocast(capture(empty.model, empty.example_args))
    assert all(layer.autocast is not None for layer in got.layers)
    assert [layer.autocast for layer in got.layers] == [layer.autocast for layer in expected.layers]
    assert [layer.activation_bytes_per_sample for layer in got.layers] == [layer.activation_bytes_per_sample for layer in expected.layers]
