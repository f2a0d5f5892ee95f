"""Encoder-decoder models and root-level glue in a pipeline (issue 21, items 1 and 2).

Item 1: a ``transformers`` BART (small config built in code, nothing downloaded; BART rather than
T5 because it captures in half the time) annotated by module path (the encoder layers one region,
the decoder layers the other) returns a ``Seq2SeqLMOutput`` whose ``encoder_last_hidden_state`` is
computed in an earlier pipeline stage than the logits. The plan checks and the stage split decide
where such an output goes by one rule (:func:`whalelike.graphs.output_tree.route_outputs`): the
tests check that plan-time and run-time acceptance agree on every model used here (accepted by
both, or refused by both with the same words), and train the accepted plans on 4 ranks against a
single-process float64 reference, with the language-model loss (the encoder output is left out:
it crosses no stage for the loss) and with a loss that also reads the encoder output (it is sent
on to the last stage and its gradient comes back). Each rank reports what its stage holds.

Item 2: a model whose own ``forward`` adds a bias buffer, reshaped and scaled, to the logits (glue
with no module path, fed only by a buffer) used to make a TaskGraph of its own with no FLOPs, a
pipeline stage nobody asked for; it now joins the head's region (the README's rule for
un-annotated code), and its plan trains exactly.

One 4-rank spawn trains all three (the BART runs with AdamW only, to keep the spawn short). The ranks' warm-up (dist_utils' ``warm``) captures each
model once for all ranks, and its pipeline's fake node values: every rank's capture, and its
pipeline's first-step fake runs, are then cache hits.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import planner
import whalelike as wl
from dist_utils import run_ranks
from planner import PlanError
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from runtime.parallel.stage_split import ModelInput, StageSplitError, node_stages_from_plan, split_stages
from whalelike.cluster import Cluster

pytest.importorskip("transformers")  # a pinned test dependency (pyproject [dev]); never skipped in CI

VOCAB, SOURCE, TARGET = 64, 8, 6
GLOBAL_BATCH, MICRO_BATCHES, STEPS = 8, 2, 3


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def _config() -> wl.Config:
    return wl.Config(global_batch_size=GLOBAL_BATCH, num_micro_batch=MICRO_BATCHES)


# -- the models and their losses ---------------------------------------------------------------------
def bart(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A two-layer BART (one encoder and one decoder layer, tied embeddings), dropout off, annotated
    by module path: the encoder layers one region, the decoder layers the other; the embeddings,
    layer norms and head are not annotated and join their neighbours."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    model = BartForConditionalGeneration(config).to(dtype)
    # two devices a region: on models this small the fastest plan is one data-parallel stage (a pipeline's
    # closing all-reduce costs more than their compute), and these tests are about the pipeline's glue
    wl.annotate(model, {"model.encoder.layers": wl.replicate(2), "model.decoder.layers": wl.replicate(2)})
    return model


def bart_batch(n: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """Source ids with padding masked at the end of every other sample, decoder ids, target ids."""
    ids = torch.randint(3, VOCAB, (n, SOURCE), generator=gen)
    mask = torch.ones(n, SOURCE, dtype=torch.long)
    mask[1::2, -2:] = 0
    return (ids, mask, torch.randint(3, VOCAB, (n, TARGET), generator=gen)), torch.randint(3, VOCAB, (n, TARGET),
                                                                                           generator=gen)


def lm_loss(out, targets):
    """What users write: cross-entropy over ``.logits``; the encoder output is not read."""
    return F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), targets.reshape(-1))


def lm_loss_and_encoder_penalty(out, targets):
    """The cross-entropy plus a penalty on the encoder output, which the loss therefore reads."""
    return lm_loss(out, targets) + 0.1 * out.encoder_last_hidden_state.pow(2).mean()


LOSSES = {"lm": lm_loss, "lm+encoder": lm_loss_and_encoder_penalty}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class BiasedLM(nn.Module):
    """Embedding, four blocks and a head; the model's own forward adds a bias buffer, reshaped and
    scaled there, to the logits. The shape check makes torch.fx fail (control flow on an input), so
    it is captured with torch.export, which keeps the buffer arithmetic as graph nodes."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("logit_bias", torch.linspace(-1.0, 1.0, VOCAB))

    def forward(self, ids):
        if ids.dim() != 2:
            raise ValueError(f"ids must be (batch, positions), got {tuple(ids.shape)}")
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.logit_bias[None, None] * 0.5


def biased_lm(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = BiasedLM().to(dtype)
    wl.annotate(model, {"blocks.0-1": wl.replicate(2), "blocks.2-3": wl.replicate(2)})   # two stages: see bart()
    return model


def token_batch(n: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    return (torch.randint(0, VOCAB, (n, SOURCE), generator=gen),), torch.randint(0, VOCAB, (n, SOURCE), generator=gen)


def token_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@functools.lru_cache(maxsize=None)
def _captured(name: str, loss: str | None):
    """The float32 model, its example batch of 4 and its capture (given the loss, or not), once per process."""
    model, make_batch = (bart, bart_batch) if name == "bart" else (biased_lm, token_batch)
    model = model()
    inputs, _ = make_batch(4, torch.Generator().manual_seed(0))
    loss_fn = None if loss is None else (LOSSES[loss] if name == "bart" else token_loss)
    return model, inputs, wl.capture(model, inputs, loss_fn=loss_fn)


def _stage_layers(graphs, plan) -> list[list[str]]:
    return [[graphs.layers[i].name for i in st.layers] for st in plan.stages]


def _stage_reads(graphs, plan) -> list[set[str]]:
    """Per stage, the model tensors its layers' nodes read (``get_attr`` targets): a layer may read
    a parameter of another module through a value capture recomputes in it (BART's learned position
    embedding, ``whalelike.graphs.constant_copies``), so its stage holds that parameter too."""
    attrs = {n.name: n.target for n in graphs.graph_module.graph.nodes if n.op == "get_attr"}
    return [{attrs[n] for i in st.layers for n in graphs.layers[i].nodes if n in attrs} for st in plan.stages]


# -- item 1: plan-time and run-time acceptance agree -------------------------------------------------
def _acceptance(graphs, plan, loss_fn) -> tuple[str, str]:
    """What the plan checks and the stage split say of ``plan``: "accepted" or the error's words."""
    try:
        plan.validate(graphs=graphs)
        at_plan = "accepted"
    except PlanError as e:
        at_plan = str(e)
    try:
        split_stages(graphs.graph_module, node_stages_from_plan(graphs, plan), loss_fn=loss_fn)
        at_run = "accepted"
    except StageSplitError as e:
        at_run = str(e)
    return at_plan, at_run


@pytest.mark.parametrize("loss", [None, "lm", "lm+encoder"])
def test_bart_plans_with_the_encoder_before_the_last_stage_are_accepted_alike(loss):
    model, inputs, graphs = _captured("bart", loss)
    encoder_output = next(leaf for leaf in graphs.outputs if leaf.name == "encoder_last_hidden_state")
    assert encoder_output.batched and encoder_output.layer_name.startswith("model.encoder")
    assert graphs.loss_reads == {None: None, "lm": (0,), "lm+encoder": (0, 1)}[loss]
    plan = planner.plan(graphs, _cluster(), _config())
    layers = _stage_layers(graphs, plan)
    assert len(layers) == 2 and "model.encoder.layers.0" not in layers[-1], layers
    plan_side, run_side = _acceptance(graphs, plan, None if loss is None else LOSSES[loss])
    assert plan_side == run_side == "accepted"
    # the split's routes: the encoder output is left out only where the loss is known not to read it
    split = split_stages(graphs.graph_module, node_stages_from_plan(graphs, plan))
    routed = {"forwarded": [leaf.name for leaf, _ in split.routes.forwarded],
              "dropped": [leaf.name for leaf, _ in split.routes.dropped]}
    kept = "dropped" if loss == "lm" else "forwarded"
    assert routed[kept] == ["encoder_last_hidden_state"] and not routed[{"dropped": "forwarded",
                                                                          "forwarded": "dropped"}[kept]]
    # the split, run in one process, returns what the model returns (None where left out)
    output = split.model_output(dict(zip(split.stages[-1].outputs, _run_split(split, inputs))))
    expected = model(*inputs)
    assert_close(output.logits, expected.logits)
    if kept == "forwarded":
        assert_close(output.encoder_last_hidden_state, expected.encoder_last_hidden_state)
    else:
        assert output.encoder_last_hidden_state is None


def _run_split(split, inputs: tuple) -> tuple:
    """Every stage in order in one process; the last stage's values in its output order."""
    values: dict = {}
    for stage in split.stages:
        args = [inputs[v.index] if isinstance(v, ModelInput) else values[v] for v in stage.inputs]
        values.update(stage.unpack(stage.module(*args)))
    return tuple(values[v] for v in split.stages[-1].outputs)


class Summarised(nn.Module):
    """An encoder whose mean square (a scalar, not batched) is returned beside the logits."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))
        self.decoder = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        for layer in self.encoder:
            x = layer(x)
        summary = x.pow(2).mean()     # glue: joins encoder.1, which computes what it reads
        for layer in self.decoder:
            x = layer(x)
        return x, summary


SUMMARY_LOSSES = {"reads the summary": lambda out, y: F.mse_loss(out[0], y) + out[1],
                  "logits only": lambda out, y: F.mse_loss(out[0], y)}


def test_an_unbatched_output_before_the_last_stage_is_refused_alike_only_when_the_loss_may_read_it():
    torch.manual_seed(0)
    model = Summarised()
    # the decoder under split keeps the stage boundary where the annotation puts it (the partitioner
    # moves layers only between plain replicate stages)
    wl.annotate(model, {"encoder": wl.replicate(), "decoder": wl.split()})
    x = torch.randn(4, 8)
    captures = {loss: wl.capture(model, (x,), loss_fn=SUMMARY_LOSSES.get(loss))
                for loss in (None, "reads the summary", "logits only")}
    graphs = captures["logits only"]
    (summary,) = [leaf for leaf in graphs.outputs if leaf.index == 1]
    assert not summary.batched and summary.layer_name == "encoder.1"
    # the loss decides nothing in the fingerprint: one plan, checked against each capture
    plan = planner.plan(graphs, _cluster(), _config())
    assert _stage_layers(graphs, plan)[0][-1] == "encoder.1", _stage_layers(graphs, plan)
    assert _acceptance(graphs, plan, SUMMARY_LOSSES["logits only"]) == ("accepted", "accepted")
    split = split_stages(graphs.graph_module, node_stages_from_plan(graphs, plan), loss_fn=SUMMARY_LOSSES["logits only"])
    (logits,) = _run_split(split, (x,))
    assert_close(logits, model(x)[0])
    assert [(leaf.name, stage) for leaf, stage in split.routes.dropped] == [("[1]", 0)]
    for loss, why in ((None, "the loss may read it"), ("reads the summary", "the loss reads it")):
        plan_side, run_side = _acceptance(captures[loss], plan, SUMMARY_LOSSES.get(loss))
        # one rule, the same words: the plan checks name the field, then the split's reason follows
        assert run_side.startswith("model output '[1]' (a tensor of shape [], computed by layer "), run_side
        assert plan_side == f"plan.stages: {run_side}; then re-plan with `whalelike plan`"
        assert why in run_side and "Put layer encoder.1 in the last stage's region" in run_side
        with pytest.raises(PlanError, match="only tensors batched along dimension 0 cross pipeline stages"):
            planner.plan(captures[loss], _cluster(), _config())


# -- item 2: root-level glue joins its neighbour -----------------------------------------------------
def test_a_bias_buffer_added_to_the_logits_in_forward_joins_the_head():
    model, inputs, graphs = _captured("biased_lm", "lm")
    assert graphs.method == "export"
    assert len(graphs) == 2, graphs.table()
    head = next(layer for layer in graphs.layers if layer.name == "head")
    assert head.taskgraph == 1 and head is graphs.layers[-1]
    assert "<root>" not in [layer.name for layer in graphs.layers]
    nodes = {n.name: n for n in graphs.graph_module.graph.nodes}
    bias_reads = [n for n in nodes.values() if n.op == "get_attr" and n.target == "logit_bias"]
    glue = {u.name for read in bias_reads for u in read.users}
    assert glue and glue <= set(head.nodes)     # reshaped, scaled and added in the head's layer
    plan = planner.plan(graphs, _cluster(), _config())
    assert len(plan.stages) == 2 and all(
        sum(graphs.layers[i].forward_flops for i in st.layers) > 0 for st in plan.stages), plan.summary()
    assert _acceptance(graphs, plan, token_loss) == ("accepted", "accepted")


# -- 4 ranks against a single-process float64 reference ----------------------------------------------
RUNS = {   # name -> (model builder, batch maker, loss, optimizers)
    "bart/lm": (bart, bart_batch, lm_loss, ("adamw",)),
    "bart/lm+encoder": (bart, bart_batch, lm_loss_and_encoder_penalty, ("adamw",)),
    "biased_lm": (biased_lm, token_batch, token_loss, ("sgd", "adamw")),
}


def _train(rank: int, world_size: int, plans: dict) -> dict:
    out = {}
    for name, plan in plans.items():
        build, make_batch, loss_fn, optimizers = RUNS[name]
        model = build(torch.float64)
        gen = torch.Generator().manual_seed(1)
        data = []
        for _ in range(STEPS):
            inputs, targets = make_batch(GLOBAL_BATCH, gen)
            data.append((tuple(x.double() if x.is_floating_point() else x for x in inputs), targets))
        for opt in optimizers:
            engine, _, _ = assert_engine_trains_like_reference(model, plan, data, OPTIMIZERS[opt], loss_fn, _cluster(),
                                                               f"{name}/{opt}")
        split = engine.executor.split
        out[name] = {"stage": engine.worker.stage, "holds": sorted(engine.executor.named_state()),
                     "forwarded": [(leaf.name, s) for leaf, s in split.routes.forwarded],
                     "dropped": [(leaf.name, s) for leaf, s in split.routes.dropped]}
    return out


def _warm() -> None:
    """Each model's float64 capture on the ranks' first batch, once, before the ranks fork
    (dist_utils' ``warm``): the ranks' Engines' captures are cache hits, and so are their pipelines'
    fake node values (``reference.warm_capture``)."""
    for build, make_batch in dict.fromkeys((build, make_batch) for build, make_batch, _, _ in RUNS.values()):
        inputs, _ = make_batch(GLOBAL_BATCH, torch.Generator().manual_seed(1))
        warm_capture(build(torch.float64), tuple(x.double() if x.is_floating_point() else x for x in inputs))


def _state_names(module: nn.Module, layers: list[str]) -> set[str]:
    """The model's names of the parameters and buffers of the modules named ``layers``."""
    return {f"{path}.{name}" for path in layers for name, _ in module.get_submodule(path).named_parameters()} | \
        {f"{path}.{name}" for path in layers for name, _ in module.get_submodule(path).named_buffers()}


def test_encoder_decoder_and_root_glue_train_exactly_under_their_plans():
    plans, layers, reads = {}, {}, {}
    for name in RUNS:
        model_name, _, loss = name.partition("/")
        _, _, graphs = _captured(model_name, loss or "lm")
        plans[name] = planner.plan(graphs, _cluster(), _config())
        layers[name] = _stage_layers(graphs, plans[name])
        reads[name] = _stage_reads(graphs, plans[name])
        assert len(plans[name].stages) == 2, plans[name].summary()
    results = run_ranks(_train, 4, args=(plans,), init_process_group=False, timeout_s=600, warm=_warm)
    for name, plan in plans.items():
        ranks = [r[name] for r in results]
        assert [r["stage"] for r in ranks] == [w.stage for w in plan.workers]
        model = (bart if name.startswith("bart") else biased_lm)()
        ties = {"model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                "lm_head.weight"}
        for rank, got in enumerate(ranks):
            stage = got["stage"]
            expected = _state_names(model, layers[name][stage])
            expected |= reads[name][stage] & set(model.state_dict())   # what recomputed values read
            if stage == len(plan.stages) - 1:   # the root's bias buffer, read by the glue that joined the head
                expected.add("final_logits_bias" if name.startswith("bart") else "logit_bias")
            # tied embeddings are held once, under one of their names, by each stage using them
            assert set(got["holds"]) - ties == expected - ties, (name, rank, layers[name][stage])
        last = [r for r in ranks if r["stage"] == len(plan.stages) - 1]
        encoder_stage = next(s for s, paths in enumerate(layers[name]) if "model.encoder.layers.0" in paths) \
            if name.startswith("bart") else None
        for got in last:
            if name == "bart/lm":
                assert got["dropped"] == [("encoder_last_hidden_state", encoder_stage)] and not got["forwarded"]
            elif name == "bart/lm+encoder":
                assert got["forwarded"] == [("encoder_last_hidden_state", encoder_stage)] and not got["dropped"]
            else:
                assert not got["forwarded"] and not got["dropped"]
