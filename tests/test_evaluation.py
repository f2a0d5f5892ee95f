"""Held-out evaluation (``runtime.evaluation``) under data-parallel, pipeline and P-Reduce plans.

One 3-rank spawn (gloo, float64): a small language model trains for two steps on packed documents
(``runtime.packed_data``: a JSON-lines corpus and a BPE tokenizer made here) read through
``PlanBatches`` (shares on the data-parallel plans, whole global batches on the pipeline), then an
:class:`~runtime.evaluation.Evaluator` evaluates it on the validation split every 2 steps. Under a
data-parallel plan with uneven shares and a pipeline whose first stage runs on two ranks, the loss
equals the single-process reference's token mean over the same held-out windows after the same
two steps, and the perplexity is its exponential; rank 0 logs the step, loss and perplexity. Under
P-Reduce (static groups of 2 on 3 replicas, AdamW: the replicas differ after two steps) the loss is
that of the replicas' average, not the share-weighted mean of each replica's own loss (which plain
``Engine.eval_step`` gives, and which differs here), and every replica's parameters are its own
again afterwards, bit for bit.

In process: the held-out batches are the dataset's whole global batches in order (the tail left
out, at most ``max_batches``), and bad settings are one-line errors.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from dist_utils import LogLines, run_ranks
from runtime.evaluation import EvalResult, EvaluationError, Evaluator, eval_batches
from runtime.packed_data import load_packed
from test_packed_data import corpus_documents, train_tokenizer, write_jsonl
from whalelike.losses import token_cross_entropy

WORLD, SEQ_LEN, BATCH, STEPS, EVAL_BATCHES, SEED = 3, 8, 8, 2, 3, 7


class TinyLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(vocab, 12), nn.Linear(12, 12), nn.Linear(12, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _plans(graphs) -> dict:
    from planner.plan import StagePlan
    from plans import make_plan, worker

    layers = list(range(len(graphs.layers)))
    common = {"model_fingerprint": graphs.fingerprint, "cluster": "test-3"}
    dp = [worker(r, 0, r, sizes=s) for r, s in enumerate([[3], [2], [3]])]
    return {
        "data parallel": make_plan([StagePlan(0, [0], layers, f"replicate({WORLD})")], dp, **common),
        "pipeline": make_plan([StagePlan(0, [0], layers[:2], "replicate(2)"),
                               StagePlan(1, [0], layers[2:], "replicate(1)")],
                              [worker(0, 0, 0, sizes=[3, 3]), worker(1, 0, 1, sizes=[1, 1]),
                               worker(2, 1, 0, sizes=[4, 4])], **common),
        "P-Reduce": make_plan([StagePlan(0, [0], layers, f"replicate({WORLD})", replica_sync="partial",
                                         partial_generator="static", partial_group_size=2)], dp, **common),
    }


def _token_mean_loss(model: nn.Module, windows) -> float:
    ids = torch.stack([x for x, _ in windows])
    targets = torch.stack([y for _, y in windows])
    with torch.no_grad():
        return float(token_cross_entropy(model(ids), targets))


def _ranks(rank: int, world_size: int, train, val) -> dict:
    import torch.distributed as dist
    from torch.testing import assert_close

    from reference import train_reference
    from runtime import Engine
    from runtime.data import epoch_order
    from runtime.text_data import PlanBatches
    from whalelike.cluster import Cluster, Device, Network
    from whalelike.graphs.capture import capture

    torch.manual_seed(0)
    vocab = int(max(train.tokens.max(), val.tokens.max())) + 1
    model = TinyLM(vocab).double()
    graphs = capture(model, (train[0][0][None],))
    cluster = Cluster("test-3", tuple(Device(f"emu-{r}", "emu", "localhost", peak_tflops=1.0, memory_gib=4)
                                      for r in range(WORLD)), Network(2.0, 2.0, 20.0), None)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=0.05)  # noqa: E731
    order = epoch_order(len(train), SEED, 0)
    global_batches = [((torch.stack([train[i][0] for i in order[BATCH * k:BATCH * k + BATCH]]),),
                       torch.stack([train[i][1] for i in order[BATCH * k:BATCH * k + BATCH]])) for k in range(STEPS)]
    held_out = [val[i] for i in range(EVAL_BATCHES * BATCH)]
    _, final = train_reference(model, global_batches, make_opt, token_cross_entropy)
    reference = copy.deepcopy(model)
    reference.load_state_dict(final)
    expected = _token_mean_loss(reference, held_out)
    lines = LogLines.attach("runtime.evaluation")
    out = {}
    for name, plan in _plans(graphs).items():
        engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=token_cross_entropy, cluster=cluster,
                        balance="off", timeout_s=60)
        evaluator = Evaluator(val, every=STEPS, max_batches=EVAL_BATCHES)
        stream = iter(PlanBatches(train, plan, rank, seed=SEED, engine=engine))
        results = []
        for _ in range(STEPS):
            engine.train_step(next(stream))
            results.append(evaluator.after_step(engine))
        assert results[0] is None, name
        result = results[-1]
        assert (result.step, result.batches, result.tokens) == (STEPS, EVAL_BATCHES, EVAL_BATCHES * BATCH * SEQ_LEN)
        assert result.perplexity == pytest.approx(math.exp(result.loss), rel=1e-12)
        if name != "P-Reduce":
            assert_close(result.loss, expected, msg=lambda m: f"{name}: held-out loss: {m}")
            continue
        # P-Reduce: the loss of the replicas' average, and each replica's own parameters back afterwards
        params = [p for p in engine.executor.module.parameters()]
        own = [p.detach().clone() for p in params]
        gathered = [[torch.empty_like(p) for _ in range(world_size)] for p in own]
        for g, p in zip(gathered, own):
            dist.all_gather(g, p)
        assert any(not torch.equal(g[0], g[r]) for g in gathered for r in range(1, world_size)), "replicas equal"
        average = copy.deepcopy(model)
        with torch.no_grad():
            for p, g in zip(average.parameters(), gathered):
                p.copy_(torch.stack(g).mean(dim=0))
        of_average = _token_mean_loss(average, held_out)
        assert_close(result.loss, of_average, msg=lambda m: f"P-Reduce: loss of the replicas' average: {m}")
        again = evaluator.run(engine)
        assert again.loss == result.loss
        for p, mine in zip(params, own):
            assert torch.equal(p.detach(), mine), "a replica's parameters changed by evaluating"
        plain = sum(float(engine.eval_step(b)) for b in eval_batches(val, BATCH, EVAL_BATCHES)) / EVAL_BATCHES
        out["plain P-Reduce"], out["P-Reduce"] = plain, result.loss
        assert abs(plain - of_average) > 1e-6, (plain, of_average)
    out["lines"] = lines.lines
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evaluation")
    docs = corpus_documents(96, seed=3)
    return load_packed(write_jsonl(folder / "docs.jsonl", docs), train_tokenizer(folder / "tok", docs), SEQ_LEN,
                       val_fraction=0.25, cache_dir=str(folder / "cache"))


def test_evaluation_equals_the_single_process_loss_under_dp_and_pipeline_and_averages_p_reduce(packed):
    train, val = packed
    assert len(val) >= EVAL_BATCHES * BATCH
    results = run_ranks(_ranks, WORLD, args=(train, val), init_process_group=False, timeout_s=300)
    assert {r["P-Reduce"] for r in results} == {results[0]["P-Reduce"]}   # every rank the same result
    lines = results[0]["lines"]
    assert len(lines) == 4 and all(line.startswith(f"eval step {STEPS}: loss ") and ", perplexity " in line
                                   and f"({EVAL_BATCHES * BATCH * SEQ_LEN} tokens in {EVAL_BATCHES} batches)" in line
                                   for line in lines), lines
    assert results[1]["lines"] == []                                      # logged by rank 0 only


# -- in process ------------------------------------------------------------------------------------------
def test_held_out_batches_are_whole_global_batches_in_order(packed):
    _, val = packed
    batches = list(eval_batches(val, 5))
    assert len(batches) == len(val) // 5
    for k, (inputs, targets) in enumerate(batches):
        assert torch.equal(inputs[0], torch.stack([val[i][0] for i in range(5 * k, 5 * k + 5)]))
        assert torch.equal(targets, torch.stack([val[i][1] for i in range(5 * k, 5 * k + 5)]))
    assert len(list(eval_batches(val, 5, max_batches=2))) == 2


def test_bad_evaluation_settings_are_one_line_errors(packed):
    _, val = packed
    with pytest.raises(EvaluationError, match=rf"docs\.jsonl: the held-out data holds {len(val)} samples, fewer than "
                                              rf"one global batch of 100000 .*keep more data for validation"):
        eval_batches(val, 100_000)
    with pytest.raises(EvaluationError, match=r"max_batches must be at least 1 \(None: every whole batch\), got 0"):
        eval_batches(val, 4, max_batches=0)
    with pytest.raises(EvaluationError, match=r"evaluation every 0 steps: give a positive number of steps"):
        Evaluator(val, every=0)
    assert EvalResult(2.0, math.exp(2.0), 64, 2, step=10).line() == (
        "eval step 10: loss 2.0000, perplexity 7.39 (64 tokens in 2 batches)")
