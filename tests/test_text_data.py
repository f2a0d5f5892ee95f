"""Real text as training data (``runtime.text_data``), in one process.

The dataset: non-overlapping windows whose targets are the inputs shifted by one, the train/val
split by position, a tokenizer's ids, and an error naming the file, the size, ``seq_len`` and the
fix for every file that cannot feed a run. The shipped text is what its README says. The streams
a plan's ranks read (``PlanBatches``): on a data-parallel plan ``UnevenLoader`` gives disjoint
shares that make up each global batch and cover each epoch exactly once; on a pipeline plan every
rank reads the same whole global batches (an epoch's short last batch dropped) from the same
permutation. A stream resumed from a saved position reads what the uninterrupted stream reads
next: on the same plan, on a plan with other shares, on a plan of the other kind, across epochs.
The samplers' resume offset (``set_epoch(epoch, start)``) is checked here too. The multi-rank run
through ``examples/train.py --data`` is in ``test_examples_train.py``; a data-parallel stream follows
re-planned shares from the next step.
"""
from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch

from planner.plan import StagePlan
from plans import make_plan, worker
from runtime.data import UnevenLoader, UnevenSampler, WholeBatchSampler, epoch_order
from runtime.text_data import ByteTextDataset, DataPosition, PlanBatches, TextDataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")


def _text(tmp_path, data: bytes, name: str = "t.txt") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def dp_plan(shares: list[int]):
    """A single-stage data-parallel plan on ``len(shares)`` ranks with these shares."""
    n = len(shares)
    return make_plan([StagePlan(0, [0], [0], f"replicate({n})")],
                     [worker(r, 0, r, sizes=[s]) for r, s in enumerate(shares)])


def pipeline_plan(global_batch: int, micro_batches: int = 2):
    """A two-stage pipeline, one rank per stage: both take whole global batches."""
    sizes = [global_batch // micro_batches] * micro_batches
    return make_plan(2, [worker(0, 0, sizes=sizes), worker(1, 1, sizes=sizes)])


# -- the dataset -------------------------------------------------------------------------------------
def test_windows_do_not_overlap_and_targets_are_the_inputs_shifted(tmp_path):
    data = bytes(range(200)) + bytes(range(100))   # 300 bytes; val_fraction 0: all of it is train
    d = ByteTextDataset(_text(tmp_path, data), seq_len=8, val_fraction=0.0)
    assert len(d) == (300 - 1) // 8 == 37
    for i in range(len(d)):
        x, y = d[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
        assert bytes(x.tolist()) == data[8 * i:8 * i + 8]
        assert bytes(y.tolist()) == data[8 * i + 1:8 * i + 9]
    # every byte but the first is a target exactly once, up to the tail too short for a window
    targets = torch.cat([d[i][1] for i in range(len(d))])
    assert bytes(targets.tolist()) == data[1:1 + 8 * len(d)]
    assert d[-1][0].tolist() == d[len(d) - 1][0].tolist()
    with pytest.raises(IndexError, match="window 37 of 37"):
        d[37]


def test_the_split_is_by_position_and_no_window_crosses_it(tmp_path):
    data = bytes(i % 251 for i in range(1000))
    path = _text(tmp_path, data)
    train = ByteTextDataset(path, seq_len=10, split="train", val_fraction=0.2)
    val = ByteTextDataset(path, seq_len=10, split="val", val_fraction=0.2)
    assert (train.tokens.numel(), val.tokens.numel()) == (800, 200)
    assert (len(train), len(val)) == (79, 19)
    assert bytes(train[78][1].tolist()) == data[781:791]       # the train split's last window stays in it
    assert bytes(val[0][0].tolist()) == data[800:810]          # the val split starts after the cut


def test_a_tokenizer_gives_its_ids(tmp_path):
    path = _text(tmp_path, "ab ba abba".encode())
    vocab = {" ": 0, "a": 1, "b": 2}
    d = ByteTextDataset(path, seq_len=3, val_fraction=0.0, tokenizer=lambda text: [vocab[c] for c in text],
                        vocab_size=3)
    assert d.tokens.tolist() == [1, 2, 0, 2, 1, 0, 1, 2, 2, 1]
    assert [d[i][0].tolist() for i in range(len(d))] == [[1, 2, 0], [2, 1, 0], [1, 2, 2]]
    assert d[2][1].tolist() == [2, 2, 1]
    as_tensor = ByteTextDataset(path, seq_len=3, val_fraction=0.0,
                                tokenizer=lambda text: torch.tensor([vocab[c] for c in text], dtype=torch.int32))
    assert as_tensor.tokens.dtype == torch.int64 and as_tensor.tokens.tolist() == d.tokens.tolist()


@pytest.mark.parametrize("make, kwargs, pattern", [
    (lambda p: str(p / "missing.txt"), {}, r"missing\.txt: no such file; give a plain text file"),
    (lambda p: str(p), {}, r"is a directory; give a plain text file"),
    (lambda p: _text(p, b""), {}, r"t\.txt is empty \(0 bytes\)"),
    (lambda p: _text(p, b"x" * 40), {"seq_len": 64, "val_fraction": 0.0},
     r"t\.txt: the train split holds 40 bytes of 40 \(0 kept for validation\), fewer than one window of seq_len 64 "
     r"\+ 1; use a longer file or a shorter seq_len \(--seq-len\)"),
    (lambda p: _text(p, b"x" * 100), {"seq_len": 16, "split": "val", "val_fraction": 0.1},
     r"the val split holds 10 bytes of 100 \(0.1 kept for validation\), fewer than one window of seq_len 16"),
    (lambda p: _text(p, b"x" * 100), {"seq_len": 0}, r"seq_len must be a positive number of tokens, got 0"),
    (lambda p: _text(p, b"x" * 100), {"split": "test"}, r"split must be one of train, val, got 'test'"),
    (lambda p: _text(p, b"x" * 100), {"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\)"),
    (lambda p: _text(p, b"x" * 100), {"val_fraction": float("nan")}, r"val_fraction must be in \[0, 1\)"),
    (lambda p: _text(p, b"x" * 100), {"split": "val", "val_fraction": 0.0},
     r"split 'val' of .*t\.txt is empty with val_fraction 0; give a val_fraction above 0"),
    (lambda p: _text(p, b"x" * 100), {"vocab_size": 64},
     r"token id 120 does not fit the model's vocabulary of 64 \(byte-level text needs a vocabulary of at least 256\)"),
    (lambda p: _text(p, b"ok \xff\xfe"), {"tokenizer": list},
     r"t\.txt is not UTF-8 text \(byte 3: b'\\xff'\); a tokenizer reads text: convert the file to UTF-8"),
    (lambda p: _text(p, b"x" * 100), {"tokenizer": lambda text: [-1] * len(text)},
     r"the tokenizer returned -1; it must return non-negative int token ids"),
    (lambda p: _text(p, b"x" * 100), {"tokenizer": lambda text: [0.5] * len(text)},
     r"the tokenizer returned a torch.float32 tensor of shape \(100,\); it must return a flat sequence of int token"),
])
def test_unusable_files_are_errors_naming_the_file_and_the_fix(tmp_path, make, kwargs, pattern):
    kwargs = {"seq_len": 8, **kwargs}
    with pytest.raises(TextDataError, match=pattern):
        ByteTextDataset(make(tmp_path), **kwargs)


def test_the_shipped_text_is_what_its_readme_says():
    with open(SHIPPED, "rb") as f:
        data = f.read()
    with open(os.path.join(ROOT, "examples", "data", "README.md")) as f:
        readme = f.read()
    assert data.decode("ascii") and b"\r" not in data                      # plain 7-bit ASCII, \n line ends
    assert f"{len(data):,} bytes" in readme and hashlib.sha256(data).hexdigest() in readme
    assert re.search(rf"{len(set(data))}\s+distinct byte values", readme)
    assert data.startswith(b"First Citizen:\n") and data.endswith(b"\n")
    d = ByteTextDataset(SHIPPED, seq_len=64)                                 # the example's default
    assert len(d) == (round(len(data) * 0.9) - 1) // 64
    assert f"{len(d):,} training windows" in readme


# -- the samplers' resume offset ---------------------------------------------------------------------
def test_samplers_resume_inside_an_epoch_at_a_sample_position():
    order = epoch_order(30, seed=3, epoch=1)
    assert sorted(order) == list(range(30)) and order != epoch_order(30, seed=3, epoch=0)
    s = UnevenSampler(30, [5, 3], 1, seed=3)
    s.set_epoch(1, start=12)
    # global batches [12, 20) and [20, 28) split 5/3, then the short [28, 30) split in proportion (1/1)
    assert list(s) == [order[17:20], order[25:28], order[29:30]]
    w = WholeBatchSampler(30, 8, seed=3)
    w.set_epoch(1, start=12)
    assert list(w) == [order[12:20], order[20:28]] and len(w) == 2   # [28, 30) is short: dropped
    with pytest.raises(ValueError, match=r"start must be a sample position in \[0, 30\].*got 31"):
        w.set_epoch(0, start=31)


# -- the streams a plan's ranks read -----------------------------------------------------------------
@pytest.fixture(scope="module")
def shakespeare():
    return ByteTextDataset(SHIPPED, seq_len=16)


def _rows(dataset, indices) -> torch.Tensor:
    return torch.stack([dataset[i][0] for i in indices]) if indices else torch.empty(0, dataset.seq_len)


def test_uneven_loader_over_text_gives_disjoint_shares_making_up_each_global_batch(shakespeare):
    plan = dp_plan([5, 3, 2])
    small = torch.utils.data.Subset(shakespeare, range(47))   # 4 global batches of 10, then 7
    loaders = [UnevenLoader(small, plan, rank, seed=9) for rank in range(3)]
    for loader in loaders:
        loader.set_epoch(2)
    order = epoch_order(47, seed=9, epoch=2)
    steps = list(zip(*loaders))
    assert len(steps) == 5
    for step, shares in enumerate(steps):
        chunk = order[10 * step:10 * step + 10]
        assert {s.global_size for s in shares} == {len(chunk)}
        torch.testing.assert_close(torch.cat([s.inputs[0] for s in shares]), _rows(small, chunk), rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([s.targets for s in shares]),
                                   torch.stack([small[i][1] for i in chunk]), rtol=0, atol=0)
        if len(chunk) == 10:
            assert [s.targets.shape[0] for s in shares] == [5, 3, 2]


def _global_batches(plan, dataset, steps: int, position=None, seed: int = 4):
    """Per step, the global batch's input rows as the plan's ranks read them together, and each
    rank's position after the last step."""
    streams = [PlanBatches(dataset, plan, rank, seed=seed, position=position) for rank in range(plan.world_size)]
    iters = [iter(s) for s in streams]
    out = []
    for _ in range(steps):
        batches = [next(it) for it in iters]
        if streams[0].whole:
            first = batches[0]
            for other in batches[1:]:   # every rank reads the same whole global batch
                torch.testing.assert_close(other[0][0], first[0][0], rtol=0, atol=0)
                torch.testing.assert_close(other[1], first[1], rtol=0, atol=0)
            out.append(first[0][0])
        else:
            out.append(torch.cat([b.inputs[0] for b in batches]))
    positions = {s.position for s in streams}
    assert len(positions) == 1
    return out, positions.pop()


def test_the_pipeline_path_reads_whole_global_batches_from_the_same_permutation(shakespeare):
    small = torch.utils.data.Subset(shakespeare, range(30))
    plan = pipeline_plan(8)
    batches, position = _global_batches(plan, small, steps=7)   # 3 whole batches per epoch (6 dropped)
    for step, rows in enumerate(batches):
        epoch, k = divmod(step, 3)
        torch.testing.assert_close(rows, _rows(small, epoch_order(30, 4, epoch)[8 * k:8 * k + 8]), rtol=0, atol=0)
    assert position == DataPosition(epoch=2, sample=8, seed=4, num_samples=30)
    # the data-parallel path reads the same global batches (and the short one the pipeline drops)
    dp, _ = _global_batches(dp_plan([6, 2]), small, steps=4)
    for a, b in zip(dp[:3], batches[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert dp[3].shape[0] == 6


@pytest.mark.parametrize("first, then", [
    ("dp 5/3", "dp 5/3"),          # the same plan
    ("dp 5/3", "dp 2/2/4"),        # other shares, other ranks
    ("dp 5/3", "pipeline"),        # a plan of the other kind
    ("pipeline", "dp 1/7"),
])
def test_a_resumed_stream_reads_what_the_uninterrupted_one_reads_next(shakespeare, first, then):
    plans = {"dp 5/3": dp_plan([5, 3]), "dp 2/2/4": dp_plan([2, 2, 4]), "dp 1/7": dp_plan([1, 7]),
             "pipeline": pipeline_plan(8)}
    small = torch.utils.data.Subset(shakespeare, range(40))   # 5 global batches of 8 per epoch
    whole, _ = _global_batches(plans[first], small, steps=12)
    head, position = _global_batches(plans[first], small, steps=7)    # into the second epoch
    assert position.epoch == 1 and position.sample == 16
    saved = DataPosition.from_dict(position.to_dict())
    tail, _ = _global_batches(plans[then], small, steps=5, position=saved, seed=99)   # the position's seed wins
    for a, b in zip(whole, head + tail):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_position_from_another_dataset_or_too_short_a_text_is_an_error(shakespeare):
    small = torch.utils.data.Subset(shakespeare, range(40))
    with pytest.raises(TextDataError, match="saved on a dataset of 41 samples, this one has 40; resume with the "
                                            "same data file and --seq-len"):
        PlanBatches(small, dp_plan([5, 3]), 0, position=DataPosition(0, 8, 0, 41))
    with pytest.raises(TextDataError, match="holds 40 samples, fewer than one global batch of 64 .*use a longer "
                                            "text, a shorter --seq-len or a smaller global batch"):
        PlanBatches(small, pipeline_plan(64), 0)
    with pytest.raises(TextDataError, match="needs integer epoch, sample, seed and num_samples"):
        DataPosition.from_dict({"epoch": 1})


# -- train.py's --data inputs ------------------------------------------------------------------------
def _train_py():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("example_train", os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_train_py_data_inputs_are_checked_before_training(tmp_path):
    import torch.nn as nn

    from whalelike.errors import WhaleError
    from whalelike.workload import Workload

    train = _train_py()
    lm = Workload(nn.Linear(2, 2), (torch.zeros(1, 2),), vocab_size=256, seq_len=32)
    args = train.parse_args(["m.py:build", "--plan", "p.yaml", "--data", SHIPPED])
    assert len(train.text_dataset(args, lm)) == (round(os.path.getsize(SHIPPED) * 0.9) - 1) // 32
    args = train.parse_args(["m.py:build", "--plan", "p.yaml", "--data", SHIPPED, "--seq-len", "100"])
    assert train.text_dataset(args, lm).seq_len == 100
    assert train.text_dataset(train.parse_args(["m.py:build", "--plan", "p.yaml"]), lm) is None
    with pytest.raises(WhaleError, match=r"--data trains a language model on token ids, and m\.py:build does not "
                                         r"say it is one: its Workload must set vocab_size"):
        train.text_dataset(args, Workload(nn.Linear(2, 2), (torch.zeros(1, 2),)))
    args = train.parse_args(["m.py:build", "--plan", "p.yaml", "--data", SHIPPED])
    with pytest.raises(WhaleError, match=r"--seq-len is required: m\.py:build's Workload sets no seq_len"):
        train.text_dataset(args, Workload(nn.Linear(2, 2), (torch.zeros(1, 2),), vocab_size=256))
    args = train.parse_args(["m.py:build", "--plan", "p.yaml", "--data", str(tmp_path / "gone.txt")])
    with pytest.raises(WhaleError, match=r"^--data .*gone\.txt: no such file"):
        train.text_dataset(args, lm)
    with pytest.raises(SystemExit):
        train.parse_args(["m.py:build", "--plan", "p.yaml", "--seq-len", "8"])   # --seq-len without --data


def test_the_data_parallel_stream_follows_re_planned_shares_from_the_next_step(shakespeare):
    """``engine=``: after a step whose Engine re-planned (here a stand-in holding ``.plan``), the next
    share is cut by the new plan; the global batches go on where they were."""
    class Engine:
        plan = dp_plan([5, 3])

    small = torch.utils.data.Subset(shakespeare, range(40))
    order = epoch_order(40, 4, 0)
    engines = [Engine(), Engine()]
    streams = [iter(PlanBatches(small, e.plan, rank, seed=4, engine=e)) for rank, e in enumerate(engines)]
    for step, shares in enumerate([(5, 3), (5, 3), (2, 6), (2, 6)]):
        batches = [next(s) for s in streams]
        assert tuple(b.targets.shape[0] for b in batches) == shares
        torch.testing.assert_close(torch.cat([b.inputs[0] for b in batches]),
                                   _rows(small, order[8 * step:8 * step + 8]), rtol=0, atol=0)
        if step == 1:   # the re-plan happens during step 1: step 2 reads under the new shares
            for e in engines:
                e.plan = dp_plan([2, 6])
