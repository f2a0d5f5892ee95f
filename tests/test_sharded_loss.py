"""The class-sharded head under the cross-entropy users actually write (``runtime.tensor.sharded_loss``).

Unit tests (one process): the loss analysis recognises ``F.cross_entropy`` inside lambdas and
functions, on reshaped or shifted (``logits[:, :-1]``) logits and on a leaf of a ``ModelOutput``/dict/tuple, with its
``ignore_index``; it rejects label smoothing, class weights, other reductions, extra terms and
operators that move the classes; the choice of the head follows the leaf the loss reads.

Exactness (one 3-rank spawn): a ``replicate`` stage on rank 0 feeds a ``split`` head on ranks 1
and 2 (uneven class shards), trained by ``runtime.Engine`` with each loss form for 3 steps with SGD
and AdamW in float64 against ``tests/reference.py``. Recognised forms must keep the head
class-sharded (its local weight has the shard's rows and the Engine computes the sharded loss);
the unrecognised form and a form whose logits turn out not to be ``[rows, classes]`` (the
gathered fallback) must be exact as well. One case is Hugging Face GPT-2 with its (untied)
``lm_head`` split. Three ranks because a pipeline of a replicated body and a two-way head is the
smallest layout where the head's stage is not also the whole model. The spawn's warm-up (dist_utils'
``warm``) captures every case's model once, with its pipeline's fake node values, so the ranks'
Engine captures, and their pipelines' first-step fake runs, are cache hits.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_structure
from transformers.modeling_outputs import CausalLMOutput

import whalelike as wl
from dist_utils import run_ranks
from planner.plan import Plan, StagePlan
from plans import make_plan, worker
from reference import OPTIMIZERS, assert_engine_trains_like_reference, warm_capture
from runtime.tensor.sharded_loss import (ShardedLoss, UnrecognisedLoss, choose_classifier, plain_cross_entropy,
                                  recognise_cross_entropy)
from whalelike.cluster import Cluster, Device, Network

VOCAB, CLASSES, HIDDEN, POSITIONS = 24, 10, 16, 5
HEAD_SHARDS = {VOCAB: [15, 9], CLASSES: [7, 3], 256: [160, 96]}
GLOBAL_BATCH, STEPS = 6, 3


# -- models -------------------------------------------------------------------------------------------
class LM(nn.Module):
    """``[batch, positions, vocab]`` logits in a ``CausalLMOutput`` (or bare, ``bare=True``)."""

    def __init__(self, bare: bool = False):
        super().__init__()
        self.bare = bare
        self.embed, self.mix = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        with wl.replicate(1):
            h = torch.tanh(self.mix(self.embed(tokens)))
        with wl.split(2):
            logits = self.head(h)
        return logits if self.bare else CausalLMOutput(logits=logits)


class Classifier(nn.Module):
    """``[batch, classes]`` logits beside another output leaf, in a dict or (``as_tuple``) a tuple."""

    def __init__(self, as_tuple: bool = False):
        super().__init__()
        self.as_tuple = as_tuple
        self.embed, self.mix = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, tokens):
        with wl.replicate(1):
            h = torch.tanh(self.mix(self.embed(tokens)))
        with wl.split(2):
            pooled = h.mean(1)
            logits = self.head(pooled)
        return (pooled, logits) if self.as_tuple else {"pooled": pooled, "logits": logits}


def _lm_view(out, y):
    return F.cross_entropy(out.logits.view(-1, out.logits.size(-1)), y.view(-1))


def _lm_reshape(out, y):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)


def _lm_flatten(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _lm_shifted(out, y):
    """Hugging Face's causal-LM loss: position t predicts token t + 1."""
    logits = out.logits[:, :-1, :].contiguous()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y[:, 1:].contiguous().view(-1))


def _lm_smoothed(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)


def _lm_classes_in_dim_1(out, y):
    """Traces as reshapes, but the cross-entropy sees ``[batch, vocab, positions]``: classes in dim 1."""
    return F.cross_entropy(out.logits.reshape(out.logits.size(0), VOCAB, -1), y)


def _dict_leaf(out, y):
    return F.cross_entropy(out["logits"], y)


def _tuple_module(out, y):
    return nn.CrossEntropyLoss(ignore_index=-1)(out[1], y)


def _hf_lm_loss(out, y):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=256, n_positions=16, use_cache=False,
                        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    wl.annotate(model, {"transformer": wl.replicate(1), "lm_head": wl.split(2)})
    return model


# name -> (model factory, loss, head path, its classes, whether the head keeps its logits class-sharded)
CASES = {
    "lm-lambda-view": (LM, _lm_view, "head", VOCAB, True),
    "lm-def-reshape-ignore-index": (LM, _lm_reshape, "head", VOCAB, True),
    "lm-flatten": (LM, _lm_flatten, "head", VOCAB, True),
    "lm-shifted": (LM, _lm_shifted, "head", VOCAB, True),
    "lm-token-cross-entropy": (lambda: LM(bare=True), wl.token_cross_entropy, "head", VOCAB, True),
    "dict-leaf": (Classifier, _dict_leaf, "head", CLASSES, True),
    "tuple-nn-module": (lambda: Classifier(as_tuple=True), _tuple_module, "head", CLASSES, True),
    "lm-label-smoothing": (LM, _lm_smoothed, "head", VOCAB, False),
    "lm-classes-in-dim-1": (LM, _lm_classes_in_dim_1, "head", VOCAB, True),   # sharded head, gathered at the loss
    "hf-gpt2": (_gpt2, _hf_lm_loss, "lm_head", 256, True),
}


def _batches(vocab: int, classes: int, seed: int) -> list[tuple[tuple, torch.Tensor]]:
    """Token batches; targets per position (``classes == vocab``, some ignored) or per sample."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (GLOBAL_BATCH, POSITIONS), generator=g)
        if classes != vocab:
            targets = torch.randint(0, classes, (GLOBAL_BATCH,), generator=g)
        else:
            targets = torch.randint(0, vocab, (GLOBAL_BATCH, POSITIONS), generator=g)
            # ignored positions, as many in each micro-batch of 3 samples: the pipeline weights each
            # micro-batch's mean by its samples, which is the global mean only for equal valid counts
            targets[0, 1:3] = targets[GLOBAL_BATCH // 2, 1:3] = -100   # (kept by the shifted loss too)
        out.append(((tokens,), targets))
    return out


# -- unit tests: the analysis ---------------------------------------------------------------------
LM_SPEC = tree_structure(CausalLMOutput(logits=torch.zeros(1)))
DICT_SPEC = tree_structure({"pooled": torch.zeros(1), "logits": torch.zeros(1)})
TUPLE_SPEC = tree_structure((torch.zeros(1), torch.zeros(1)))
TENSOR_SPEC = tree_structure(torch.zeros(1))


@pytest.mark.parametrize("loss_fn, spec, leaf, ignore_index", [
    (lambda out, y: F.cross_entropy(out.logits.view(-1, out.logits.size(-1)), y.view(-1)), LM_SPEC, 0, -100),
    (_lm_reshape, LM_SPEC, 0, -100),
    (_lm_flatten, LM_SPEC, 0, -100),
    (_lm_shifted, LM_SPEC, 0, -100),
    (lambda out, y: F.cross_entropy(out[0].reshape(-1, out.logits.shape[-1]), y.reshape(-1), ignore_index=-1),
     LM_SPEC, 0, -1),
    (_dict_leaf, DICT_SPEC, 1, -100),   # dict leaves flatten in insertion order
    (_tuple_module, TUPLE_SPEC, 1, -1),
    (wl.token_cross_entropy, TENSOR_SPEC, 0, -100),
    (F.cross_entropy, TENSOR_SPEC, 0, -100),
    (nn.CrossEntropyLoss(ignore_index=5), TENSOR_SPEC, 0, 5),
    (lambda out, y: F.cross_entropy(out.logits.contiguous().unsqueeze(0).squeeze(0).flatten(0, 1), y.view(-1)),
     LM_SPEC, 0, -100),
])
def test_recognises_the_forms_users_write(loss_fn, spec, leaf, ignore_index):
    form = recognise_cross_entropy(loss_fn, spec)
    assert (form.leaf, form.ignore_index, form.num_leaves) == (leaf, ignore_index, spec.num_leaves)


@pytest.mark.parametrize("loss_fn, reason", [
    (_lm_smoothed, "label smoothing 0.1"),
    (lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="sum"), "reduction 'sum'"),
    (lambda out, y: nn.CrossEntropyLoss(weight=torch.ones(VOCAB))(out.logits.flatten(0, 1), y.flatten()),
     "class weights"),
    (lambda out, y: _lm_flatten(out, y) + 0.01 * out.logits.square().mean(), "returns add"),
    (lambda out, y: F.cross_entropy(out.logits[y >= 0], y[y >= 0]), "getitem"),
    (lambda out, y: F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten()), "Tensor.float"),
    (lambda out, y: F.cross_entropy(out.logits.transpose(1, 2), y), "Tensor.transpose"),
    (lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), out.logits.flatten(0, 1).argmax(-1)), "also used"),
    (lambda out, y: _lm_flatten(out, y) if out.logits.dim() == 3 else 0, "cannot trace"),
    (lambda out, y: F.mse_loss(out.logits, y), "not the value of F.cross_entropy"),
])
def test_rejects_what_is_not_a_plain_cross_entropy(loss_fn, reason):
    with pytest.raises(UnrecognisedLoss, match=reason):
        recognise_cross_entropy(loss_fn, LM_SPEC)
    assert plain_cross_entropy(F.mse_loss) is None and plain_cross_entropy(F.cross_entropy) == -100


def test_replay_finds_the_local_input_and_targets_or_refuses():
    """At run time the loss is replayed on a storage-free stand-in of the full logits: this rank's
    shard of what the cross-entropy sees and the targets it gets, or a refusal when the classes
    are not last or an index may touch them."""
    local = torch.randn(2, POSITIONS, 9)    # this rank's 9 of the 24 classes
    targets = torch.randint(0, VOCAB, (2, POSITIONS))
    for loss_fn in (_lm_view, _lm_reshape, _lm_flatten):
        shard, target = recognise_cross_entropy(loss_fn, LM_SPEC).cross_entropy_args([local], targets, VOCAB)
        assert torch.equal(shard, local.reshape(-1, 9)) and torch.equal(target, targets.reshape(-1))
    shard, target = recognise_cross_entropy(_lm_shifted, LM_SPEC).cross_entropy_args([local], targets, VOCAB)
    assert torch.equal(shard, local[:, :-1].reshape(-1, 9)) and torch.equal(target, targets[:, 1:].reshape(-1))
    with pytest.raises(UnrecognisedLoss, match=r"shape \(2, 24, 5\)"):
        recognise_cross_entropy(_lm_classes_in_dim_1, LM_SPEC).cross_entropy_args([local], targets, VOCAB)
    first_classes = lambda out, y: F.cross_entropy(out.logits[..., :5].flatten(0, 1), y.flatten())  # noqa: E731
    with pytest.raises(UnrecognisedLoss):
        recognise_cross_entropy(first_classes, LM_SPEC).cross_entropy_args([local], targets, VOCAB)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.split(2):
            self.body = nn.Embedding(VOCAB, HIDDEN)
            self.head, self.aux = nn.Linear(HIDDEN, VOCAB), nn.Linear(HIDDEN, CLASSES)

    def forward(self, tokens):
        h = torch.tanh(self.body(tokens))
        return {"logits": self.head(h), "aux": self.aux(h.mean(1))}


def test_the_head_is_the_leaf_the_loss_reads(caplog):
    graphs = wl.capture(_TwoHeads(), (torch.randint(0, VOCAB, (2, POSITIONS)),))
    gm = graphs.graph_module
    heads = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in ("head", "aux")]
    lm = choose_classifier(gm, heads, lambda out, y: F.cross_entropy(out["logits"].flatten(0, 1), y.flatten()))
    aux = choose_classifier(gm, heads, lambda out, y: F.cross_entropy(out["aux"], y))
    assert (lm.node.target, aux.node.target) == ("head", "aux")
    with caplog.at_level(logging.INFO, logger="runtime.tensor.sharded_loss"):
        smoothed = lambda out, y: F.cross_entropy(out["aux"], y, label_smoothing=0.2)  # noqa: E731
        assert choose_classifier(gm, heads, smoothed, path=lambda n: n.target) is None
    assert "split head 'head', 'aux' gathers its logits" in caplog.text and "label smoothing" in caplog.text


def test_a_model_output_keeps_its_type_through_fx_capture():
    graphs = wl.capture(LM(), (torch.randint(0, VOCAB, (2, POSITIONS)),))
    out = graphs.graph_module(torch.randint(0, VOCAB, (2, POSITIONS)))
    assert isinstance(out, CausalLMOutput) and out.logits.shape == (2, POSITIONS, VOCAB)


# -- exactness: 3 ranks, every case --------------------------------------------------------------------
def _plan(graphs, head: str, classes: int) -> Plan:
    """Stage 0 (TaskGraph 0, replicate) on rank 0, stage 1 (TaskGraph 1, split) on ranks 1 and 2."""
    assert [tg.strategy.kind for tg in graphs] == ["replicate", "split"], [str(tg.strategy) for tg in graphs]
    stages = [StagePlan(s, [s], [layer.index for layer in graphs.layers if layer.taskgraph == s], strategy,
                        shards) for s, strategy, shards in
              ((0, "replicate(1)", {}), (1, "split(2)", {head: HEAD_SHARDS[classes]}))]
    workers = [(0, 0, 1), (1, 0, 2), (1, 1, 2)]
    return make_plan(stages, [worker(r, stage, 0, tp, size, sizes=[3, 3])
                              for r, (stage, tp, size) in enumerate(workers)],
                     model_fingerprint=graphs.fingerprint, cluster="test-3", global_batch_size=GLOBAL_BATCH)


def _cluster() -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4) for i in range(3))
    return Cluster("test-3", devices, Network(2.0, 2.0, 50.0), None)


def _case(name: str) -> tuple:
    """The case's model (seeded, float64) and its batches."""
    make_model, _, _, classes, _ = CASES[name]
    torch.manual_seed(0)
    return make_model().double(), _batches(256 if classes == 256 else VOCAB, classes, seed=1)


def _case_plan(name: str) -> Plan:
    _, _, head, classes, _ = CASES[name]
    model, data = _case(name)
    return _plan(wl.capture(model, data[0][0]), head, classes)


def _run_case(rank: int, name: str, plan: Plan) -> dict:
    _, loss_fn, head, classes, _ = CASES[name]
    model, data = _case(name)
    result = {}
    for opt, make_opt in OPTIMIZERS.items():
        engine, _, _ = assert_engine_trains_like_reference(model, plan, data, make_opt, loss_fn, _cluster(),
                                                           f"{name}/{opt}", timeout_s=60)
        params = dict(engine.executor.stage.module.named_parameters())
        result[opt] = {"head_rows": next((tuple(p.shape)[0] for n, p in params.items()
                                          if n.endswith(f"{head.replace('.', '_')}.weight")), None),
                       "sharded_loss": isinstance(engine.executor.stage_worker.loss_fn, ShardedLoss)}
    return result


def _ranks(rank: int, world_size: int, plans: dict[str, Plan]) -> dict:
    return {name: _run_case(rank, name, plans[name]) for name in CASES}


def _warm() -> None:
    """Each case's model captured on its first batch, once, before the ranks fork (dist_utils'
    ``warm``): every Engine's capture in the ranks is then a cache hit, and so are its pipeline's fake
    node values (``reference.warm_capture``)."""
    for name in CASES:
        model, data = _case(name)
        warm_capture(model, data[0][0])


def test_every_form_trains_exactly_and_recognised_forms_keep_the_head_sharded():
    plans = {name: _case_plan(name) for name in CASES}   # planned once here, not on every rank
    results = run_ranks(_ranks, 3, args=(plans,), init_process_group=False, timeout_s=400, warm=_warm)
    for name, (_, _, _, classes, sharded) in CASES.items():
        for tp_index, rank in enumerate((1, 2)):
            for opt in OPTIMIZERS:
                got = results[rank][name][opt]
                assert got["head_rows"] == HEAD_SHARDS[classes][tp_index], (name, rank, got)
                assert got["sharded_loss"] is sharded, (name, rank, got)


def _bf16_logits_loss(rank: int, world_size: int) -> tuple:
    from runtime.tensor.layers import sharded_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, generator=g).bfloat16().requires_grad_()
    target = torch.randint(0, 10, (6,), generator=g)
    sizes = [6, 4]
    local = logits[:, sum(sizes[:rank]):sum(sizes[:rank + 1])]
    loss = sharded_cross_entropy(local, target, sizes, rank)
    loss.backward()
    reference = F.cross_entropy(logits.detach().float(), target)   # what autocast's cross_entropy computes
    return loss.dtype, float(loss), float(reference), logits.grad.dtype


def test_low_precision_logits_give_a_float32_loss_as_autocast_does():
    # bf16 logits (a split head under autocast): the loss is computed and returned in float32, as
    # F.cross_entropy's is under torch.autocast, not rounded to bf16's 8 significant bits
    for dtype, loss, reference, grad_dtype in run_ranks(_bf16_logits_loss, 2):
        assert dtype == torch.float32 and grad_dtype == torch.bfloat16
        assert loss == pytest.approx(reference, rel=1e-6)
