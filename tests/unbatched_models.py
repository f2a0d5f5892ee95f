"""Models whose pipeline boundary carries a value without a batch dimension, annotated by module
path as a user does who cannot edit the model (issue 30, item 2). Each builder returns a
:class:`hf_models.RealModel` (model, batch maker, loss, the path annotation; no ``split`` blocks).

* ``deberta``: ``transformers``' DeBERTa-v2 with relative attention (``p2c``, ``c2p``) and
  LayerNorm'd relative embeddings, its two encoder layers two ``replicate`` regions and its
  classifier a ``split`` one. Its encoder computes the relative-position buckets (from the
  sequence length and constants: ``torch.tensor(c)``, which ``torch.export`` turns into a fresh
  copy written in place) and the normalised relative embeddings (from parameters) once and hands
  them to every layer: values without a batch dimension that depend on no input value, which
  capture recomputes in every layer that reads them.
* ``table``: a learned position table normalised once (parameters and the input's sequence
  length, through ``x.size(1)`` in an fx trace) and read by both blocks: the same branch in a
  model fx traces.
* ``statistic``: the first region returns a statistic of its input (the batch's largest absolute
  value) and a parameter scaled by it: values without a batch dimension that depend on data (one
  carries a gradient back to its parameter), which cross the boundary whole, once per micro-batch.
  Every sample holds the same largest value (``_peaked``), so the statistic of any micro-batch or
  share of one is the whole batch's, and training is exact against one process.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_models import CLASSES, VOCAB, RealModel, classifier_loss

SEQ, DIN, HIDDEN, PEAK = 16, 8, 32, 3.0


def _token_classes(batch: int, gen: torch.Generator):
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=gen),), torch.randint(0, CLASSES, (batch,), generator=gen)


def _peaked(batch: int, gen: torch.Generator):
    """Inputs in (-1, 1) with one entry of every sample at ``PEAK``: each sample's largest absolute
    value is ``PEAK``, so is every subset's."""
    x = torch.rand(batch, SEQ, DIN, generator=gen) * 2 - 1
    x[:, 0, 0] = PEAK
    return (x,), torch.randint(0, CLASSES, (batch,), generator=gen)


def deberta() -> RealModel:
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    config = DebertaV2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             vocab_size=VOCAB, max_position_embeddings=64, relative_attention=True,
                             pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16,
                             norm_rel_ebd="layer_norm", type_vocab_size=0, num_labels=CLASSES,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0)
    return RealModel("deberta", DebertaV2ForSequenceClassification(config), _token_classes, classifier_loss,
                     {"deberta.encoder.layer.0": "replicate", "deberta.encoder.layer.1": "replicate",
                      "classifier": "split"}, "")


class _Table(nn.Module):
    """A learned position table cut to the input's length and normalised: parameters and a shape."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(SEQ, HIDDEN))
        self.norm_weight, self.norm_bias = nn.Parameter(torch.ones(HIDDEN)), nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, x):
        return F.layer_norm(self.weight[:x.size(1)], (HIDDEN,), self.norm_weight, self.norm_bias)


class _Block(nn.Module):
    def __init__(self, din: int):
        super().__init__()
        self.fc = nn.Linear(din, HIDDEN)

    def forward(self, h, table):
        return torch.tanh(self.fc(h) + table)


class TableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = _Table()
        self.block0, self.block1 = _Block(DIN), _Block(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        table = self.table(x)
        return self.head(self.block1(self.block0(x, table), table).mean(1))


def table() -> RealModel:
    return RealModel("table", TableModel(), _peaked, F.cross_entropy,
                     {"block0": "replicate", "block1": "replicate"}, "")


class _Stem(nn.Module):
    """Returns the hidden state, the batch's largest absolute input value, and a parameter scaled by it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIN, HIDDEN)
        self.gain = nn.Parameter(torch.rand(HIDDEN) + 0.5)

    def forward(self, x):
        peak = x.abs().amax()
        return torch.tanh(self.fc(x)), self.gain * peak, peak


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, h, scale, peak):
        return self.out(torch.tanh(self.fc(h * scale)).mean(1) / peak)


class StatisticModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.head = _Stem(), _Head()

    def forward(self, x):
        return self.head(*self.stem(x))


def statistic() -> RealModel:
    # two workers a stage: the statistic has an owner slot and a slot whose copy is not used,
    # and its gradient comes back from two consuming slots
    return RealModel("statistic", StatisticModel(), _peaked, F.cross_entropy,
                     {"stem": "replicate:2", "head": "replicate:2"}, "")


MODELS = {"deberta": deberta, "table": table, "statistic": statistic}


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> RealModel:
    """The named model, seeded, in ``dtype``, with its path annotation applied (``"replicate:2"``:
    ``wl.replicate(2)``)."""
    import whalelike as wl
    torch.manual_seed(seed)
    real = MODELS[name]()
    real.model.to(dtype)
    strategies = {}
    for path, spec in real.pipeline.items():
        kind, _, devices = spec.partition(":")
        strategies[path] = getattr(wl, kind)(*([int(devices)] if devices else []))
    wl.annotate(real.model, strategies)
    return real
