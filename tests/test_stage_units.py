"""A pipeline stage cut into layer units (runtime.parallel.stage_units), in one process.

On ``transformers``' GPT-2 (tied input and output embeddings, learned positions) captured whole as one
stage: the cut stage computes the same loss and gradients bit for bit as the stage before cutting
(both share the captured tensors), no parameter is registered more often than before, each layer's
own parameters live in its unit and the tied embedding, read by the first layer and the head, in the
root (the head's unit, whose module registers it too, joins the root unit under FSDP2); the state (the same tensors) keeps its model names through the stage worker's
mapping; recompute runs inside the units and computes the same.
"""
from __future__ import annotations

import torch

from hf_models import gpt2
from runtime.parallel import stage_units
from runtime.parallel.stage_split import split_stages
from runtime.replicas.sync_parts import own_units
from runtime.training import recompute
from whalelike.graphs.capture import capture


def _stage(graphs):
    return split_stages(graphs.graph_module, {n.name: 0 for n in graphs.graph_module.graph.nodes}).stages[0].module


def _loss_and_grads(stage, params, inputs, targets):
    for p in params:
        p.grad = None
    out = stage(*inputs)       # the graph's outputs: the logits, first of a tuple or whole
    logits = out if isinstance(out, torch.Tensor) else (out["logits"] if isinstance(out, dict) else out[0])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def test_a_cut_stage_computes_the_same_and_holds_each_parameter_once():
    real = gpt2(layers=2)
    torch.manual_seed(0)
    inputs, targets = real.make_batch(4, torch.Generator().manual_seed(1))
    graphs = capture(real.model, inputs)
    whole, cut = _stage(graphs), _stage(graphs)
    params = list(dict.fromkeys(whole.parameters()))
    assert {id(p) for p in cut.parameters()} == {id(p) for p in params}   # the same tensors
    before = {id(t) for t in cut.state_dict(keep_vars=True).values()}
    registered = len(list(cut.named_parameters(remove_duplicate=False)))

    paths = stage_units.cut(cut)
    assert paths == stage_units.unit_paths(cut) and len(paths) >= 4     # embeddings, two blocks, the head
    assert all(p.startswith("units.submod_") for p in paths)
    # no parameter registered more often than before (the tied embedding is twice: the attribute the
    # embedding reads and the head's module, a leaf the graph calls), the same tensors, all in the state
    assert len(list(cut.named_parameters(remove_duplicate=False))) == registered
    assert {id(p) for p in cut.parameters()} == {id(p) for p in params}
    assert {id(t) for t in cut.state_dict(keep_vars=True).values()} == before
    # the tied embedding, read by the first layer and the head, stays in the root: FSDP2 leaves the
    # head's unit (which registers it too) to the root unit, every other layer is a unit of its own
    tied = real.model.transformer.wte.weight
    owners = [n for n, p in cut.named_parameters(remove_duplicate=False) if p is tied]
    assert any(n.count(".") == 1 and n.startswith("units.") for n in owners), owners
    head = next(path for path in paths if any(n.startswith(path + ".") for n in owners))
    assert own_units(cut, paths) == [path for path in paths if path != head]
    block = real.model.transformer.h[1].attn.c_attn.weight
    owner = next(n for n, p in cut.named_parameters() if p is block)
    assert owner.startswith("units.submod_"), owner

    want = _loss_and_grads(whole, params, inputs, targets)
    got = _loss_and_grads(cut, params, inputs, targets)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # recompute inside the units (as the stage worker wraps them): the same again
    recompute.wrap_stage(cut, "layer", layer_names=paths)
    assert recompute.recomputed_layers(cut) == paths
    again = _loss_and_grads(cut, params, inputs, targets)
    assert torch.equal(again[0], want[0]) and all(torch.equal(a, b) for a, b in zip(again[1], want[1]))
    recompute.unwrap_stage(cut)
    assert recompute.recomputed_layers(cut) is None


def test_a_stage_of_one_layer_is_not_cut():
    graphs = capture(torch.nn.Linear(8, 4), (torch.randn(2, 8),))
    stage = _stage(graphs)
    assert len({u for u in recompute.layer_units(stage).values()}) == 1
    assert stage_units.cut(stage) == [] and stage_units.unit_paths(stage) == []
    assert stage_units.UNITS not in dict(stage.named_children())
