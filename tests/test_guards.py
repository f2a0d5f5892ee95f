"""runtime.guards and the Engine's guards, on 2 gloo ranks in one spawn (and the fingerprint in-process).

In the spawn, each check on fresh Engines (shares 3/2: rank 1 holds samples 3 and 4):

* bad options (``timeout_s`` <= 0, NaN, inf, not a number; ``on_nonfinite``; ``batch_check_every``)
  are clear errors raised before any collective; every group the Engine builds has its timeout;
* a NaN in one of rank 1's samples makes the *global* loss NaN on both ranks, so both raise
  NonFiniteLossError at the same step without a collective of their own, the parameters untouched;
  the same through the pipeline executor (the loss is all-reduced there too);
* ``on_nonfinite="skip"`` with an infinite loss (finite gradients: the guard reads the loss) drops
  that step on both ranks: training on [b0, bad, b2] equals the single-process reference on [b0, b2];
* ranks that pass different global batches fail at the first step and at every
  ``batch_check_every``-th, naming rank 1, and not in between; Share steps are not compared;
* a rank with an empty share under emulation (no modeled work) counts no overrun and logs no
  overrun warning (it used to warn on every run).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from dist_utils import run_ranks
from planner.plan import StagePlan
from reference import train_reference
from runtime import Engine, Share
from runtime.guards import BatchMismatchError, NonFiniteLossError, fingerprint
from test_runtime_dp import CLASSES, Net, batches, make_cluster, make_plan
from whalelike.graphs.capture import capture
from whalelike.cluster import Emulation
from whalelike.errors import WhaleError

WORLD = 2
SHARES = [[3], [2]]
TIMEOUT_S = 30.0
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)  # noqa: E731


def _cluster(emulation=None):
    cluster = make_cluster(emulation)
    return dataclasses.replace(cluster, devices=cluster.devices[:WORLD])


def _engine(model, plan, emulation=None, **kwargs) -> Engine:
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    return Engine(copy.deepcopy(model), plan, optimizer=ADAMW, loss_fn=F.cross_entropy,
                  cluster=_cluster(emulation), **kwargs)


def _poisoned(batch, value: float):
    """``batch`` with ``value`` in the target logit offset of sample 4 (rank 1's last sample):
    NaN makes the loss NaN; -inf makes it +inf with finite gradients."""
    (x, z), y = batch
    z = z.clone()
    z[4, y[4]] = value
    return (x, z), y


def _check_options(model, plan) -> None:
    for bad in (0, -1.0, math.nan, math.inf, "30", True):
        with pytest.raises(WhaleError, match=r"timeout_s must be a positive, finite number of seconds .* got "
                                             + re.escape(repr(bad)) + "; e.g. timeout_s=300"):
            _engine(model, plan, timeout_s=bad)
    with pytest.raises(WhaleError, match=r"on_nonfinite must be 'raise' .* or 'skip' .* got 'ignore'"):
        _engine(model, plan, on_nonfinite="ignore")
    for bad in (-1, 2.5, None):
        with pytest.raises(WhaleError, match=rf"batch_check_every must be a whole number of steps >= 0 .* got {bad}"):
            _engine(model, plan, batch_check_every=bad)
    engine = _engine(model, plan, timeout_s=7)
    cpu = torch.device("cpu")
    for kind in ("dp", "tp", "stage", "replica"):
        group = getattr(engine.groups, kind).group
        assert group._get_backend(cpu).options._timeout == datetime.timedelta(seconds=7), kind
    # this first Engine initialised the default group (spawn_ranks(init_process_group=False)): its timeout too
    default = torch.distributed.group.WORLD._get_backend(cpu).options._timeout
    assert default == datetime.timedelta(seconds=7), default


def _check_nonfinite_raises(rank: int, model, plan, data) -> None:
    engine = _engine(model, plan)
    engine.train_step(data[0])
    before = engine.state_dict()
    with pytest.raises(NonFiniteLossError, match=rf"^rank {rank}, step 1: the loss is nan \(the global-mean loss over "
                                                 r"every rank's samples, so every rank stops at this step\); the "
                                                 r"parameters are those before step 1.*on_nonfinite='skip'"):
        engine.train_step(_poisoned(data[1], math.nan))
    for key, value in engine.state_dict().items():
        assert_close(value, before[key], rtol=0, atol=0, msg=f"{key} changed by a NaN step")


def _check_nonfinite_raises_in_a_pipeline(rank: int, model, data) -> None:
    """Rank 0 runs stage 0 and never sees the loss itself: it gets the all-reduced global loss."""
    graphs = capture(model, (torch.randn(2, 6), torch.randn(2, CLASSES)))
    layers = list(range(len(graphs.layers)))
    plan = dataclasses.replace(make_plan(model, [[5], [5]]), global_batch_size=5,
                               stages=[StagePlan(0, [0], layers[:2], "replicate(1)"),
                                       StagePlan(1, [0], layers[2:], "replicate(1)")])
    plan.workers = [dataclasses.replace(w, stage=w.rank, dp_index=0) for w in plan.workers]
    engine = _engine(model, plan)
    with pytest.raises(NonFiniteLossError, match=rf"^rank {rank}, step 0: the loss is nan"):
        engine.train_step(_poisoned(data[1], math.nan))
    assert type(engine.executor).__name__ == "PipelineExecutor"


def _check_nonfinite_skip(rank: int, model, plan, data) -> None:
    engine = _engine(model, plan, on_nonfinite="skip")
    poisoned = _poisoned(data[1], -math.inf)
    losses = [engine.train_step(batch) for batch in (data[0], poisoned, data[2])]
    assert torch.isinf(losses[1]) and engine.skipped_steps == [1]
    assert [s.skipped for s in engine.stats] == [False, True, False] and engine.step == 3
    reference_losses, final = train_reference(model, [data[0], data[2]], ADAMW, F.cross_entropy)
    assert_close(losses[0], reference_losses[0])
    assert_close(losses[2], reference_losses[1])
    for key, value in engine.state_dict().items():
        assert_close(value, final[key], msg=f"skip: final {key}")


def _check_batch_fingerprint(rank: int, model, plan, data) -> None:
    engine = _engine(model, plan, batch_check_every=2)
    other = batches(plan.global_batch_size, seed=7)
    mine = (lambda step: other[step]) if rank == 1 else (lambda step: data[step])
    with pytest.raises(BatchMismatchError, match=rf"^rank {rank}, step 0: every rank must pass the same global batch, "
                                                 r"but rank 1 passed a batch different from rank 0's .*same seed and "
                                                 r"the same sampler on every rank.*runtime.data.Share.*every 2 steps"):
        engine.train_step(mine(0))
    engine.train_step(data[0])     # step 0 again, the same batch everywhere
    engine.train_step(mine(1))     # step 1 is not checked (and trains on the mixed batch)
    with pytest.raises(BatchMismatchError, match=rf"^rank {rank}, step 2: .*but rank 1 passed"):
        engine.train_step(mine(2))
    assert engine.step == 2


def _check_empty_share_no_overrun(rank: int, model, plan, data) -> None:
    """Rank 1 gets no samples (a short last batch): its empty forward and backward are segments
    with no modeled work. Share steps are not fingerprinted (the ranks' shares differ by design)."""
    (x, z), y = data[0]
    engine = _engine(model, plan, emulation=Emulation(base_gflops=0.05), batch_check_every=1,
                     example_args=(x[:2], z[:2]))   # capture on a non-empty batch
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("runtime.engine").addHandler(handler)
    try:
        for step in range(2):
            mine = slice(0, 3) if rank == 0 else slice(3, 3)
            engine.train_step(Share((x[mine], z[mine]), y[mine], global_size=3))
    finally:
        logging.getLogger("runtime.engine").removeHandler(handler)
    if rank == 1:
        assert [s.segments for s in engine.stats] == [2, 2] and [s.overruns for s in engine.stats] == [0, 0]
        assert not [w for w in warnings if "longer than modeled" in w], warnings


def _ranks(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Net()
    plan = make_plan(model, SHARES)
    data = batches(plan.global_batch_size, seed=0)
    _check_options(model, plan)
    _check_nonfinite_raises(rank, model, plan, data)
    _check_nonfinite_raises_in_a_pipeline(rank, model, data)
    _check_nonfinite_skip(rank, model, plan, data)
    _check_batch_fingerprint(rank, model, plan, data)
    _check_empty_share_no_overrun(rank, model, plan, data)


def test_guards_on_two_ranks():
    run_ranks(_ranks, WORLD, init_process_group=False, timeout_s=300)


def test_fingerprint_sees_shapes_dtypes_bytes_and_structure():
    x, y = torch.arange(12.0).reshape(3, 4), torch.tensor([0, 1, 2])
    base = fingerprint((x, None), y)
    assert base == fingerprint((x.clone(), None), y.clone())
    changed = x.clone()
    changed[2, 3] = -0.0 + 11.5
    variants = [((changed, None), y), ((x.reshape(4, 3), None), y), ((x.double(), None), y),
                ((x,), y), ((x, 1), y), ((x, None), y[:2]), (([x, None],), y)]
    prints = {fingerprint(inputs, targets) for inputs, targets in variants}
    assert base not in prints and len(prints) == len(variants)
    assert fingerprint((x.bfloat16(),), y) == fingerprint((x.bfloat16(),), y)   # no numpy dtype needed
    assert fingerprint((x.t(),), y) == fingerprint((x.t().contiguous(),), y)     # values, not strides
    assert -2 ** 63 <= base < 2 ** 63
