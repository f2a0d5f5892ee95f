"""Tokenized, packed documents from local files (``runtime.packed_data``), in one process.

Nothing is downloaded: the corpus is written here (JSON lines, a JSON array, plain text, parquet, a
gzipped JSON-lines file) and the tokenizer is a small byte-level BPE trained here with
``tokenizers``, wrapped as a ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``, then
read back through ``AutoTokenizer`` as a user's would be.

Packing: the stream is every non-empty document's tokens followed by one EOS, in file order (cut
at the EOS tokens it decodes back to the documents); windows do not overlap, their targets are the
inputs shifted by one, and every token of the stream but the first is a target exactly once; an
epoch of a plan's streams reads every window exactly once. Every format gives the same stream; the
validation split is the stream's last share or other files; the tokenized table is cached and the
windows' fingerprint names them. Shares: on a data-parallel plan each
rank's stream reads (``__getitem__``) only the windows of its share and follows a re-plan from the
next step. Resume: a stream resumed from a saved position onto other shares, or a plan of the other
kind, reads what the uninterrupted stream reads. Errors name the file or directory, the bad value and
the fix: a missing file, a directory, a missing or unreadable tokenizer directory, a tokenizer
without EOS, an empty file, files without text, ``seq_len`` beyond the corpus, an unknown
extension, mixed formats, a missing or non-text field, conflicting validation options.
"""
from __future__ import annotations

import gzip
import json
import os
import random

import pytest
import torch
from torch.utils.data import Dataset

from runtime.data import epoch_order
from runtime.packed_data import PackedTokenDataset, load_documents, load_packed, load_tokenizer
from runtime.text_data import DataPosition, PlanBatches, TextDataError
from test_text_data import _global_batches, dp_plan, pipeline_plan

EOS = "<|endoftext|>"
SEQ_LEN = 8
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial "
         "king and queen of old castles near rivers under grey skies").split()


def corpus_documents(n: int = 48, seed: int = 0) -> list[str]:
    """``n`` one-line documents of random words; every eighth is empty."""
    rng = random.Random(seed)
    return ["" if i % 8 == 7 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))).capitalize() + "."
            for i in range(n)]


def train_tokenizer(folder, documents: list[str], eos: str | None = EOS) -> str:
    """A byte-level BPE of 320 tokens trained on ``documents``, saved with ``save_pretrained`` to
    ``folder``; its EOS ``eos`` (None: none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    kwargs = {"eos_token": eos} if eos is not None else {}
    PreTrainedTokenizerFast(tokenizer_object=bpe, **kwargs).save_pretrained(str(folder))
    return str(folder)


def write_jsonl(path, documents: list[str], field: str = "text") -> str:
    with open(path, "w") as f:
        for d in documents:
            f.write(json.dumps({field: d, "id": len(d)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("packed")
    docs = corpus_documents()
    tok = train_tokenizer(folder / "tokenizer", docs)
    files = {"jsonl": write_jsonl(folder / "docs.jsonl", docs), "text": str(folder / "docs.txt")}
    (folder / "docs.txt").write_text("\n".join(docs) + "\n")
    (folder / "array.json").write_text(json.dumps([{"text": d} for d in docs]))
    files["json"] = str(folder / "array.json")
    with gzip.open(folder / "docs.jsonl.gz", "wt") as f:
        f.write((folder / "docs.jsonl").read_text())
    files["jsonl.gz"] = str(folder / "docs.jsonl.gz")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), folder / "docs.parquet")
    files["parquet"] = str(folder / "docs.parquet")
    os.makedirs(folder / "parts")
    write_jsonl(folder / "parts" / "a.jsonl", docs[:20])
    write_jsonl(folder / "parts" / "b.jsonl", docs[20:])
    return {"folder": folder, "docs": docs, "tokenizer": tok, "files": files, "cache": str(folder / "cache")}


def _load(corpus, files=None, **kwargs):
    kwargs = {"val_fraction": 0.0, "cache_dir": corpus["cache"], **kwargs}
    return load_packed(files if files is not None else corpus["files"]["jsonl"], corpus["tokenizer"],
                       kwargs.pop("seq_len", SEQ_LEN), **kwargs)


@pytest.fixture(scope="module")
def packed(corpus) -> PackedTokenDataset:
    return _load(corpus).train


# -- packing ----------------------------------------------------------------------------------------
def test_documents_are_packed_with_one_eos_after_each_and_cut_into_shifted_windows(corpus, packed):
    tok = load_tokenizer(corpus["tokenizer"])
    eos = tok.eos_token_id
    kept = [d for d in corpus["docs"] if d]
    expected = [i for d in kept for i in [*tok(d, add_special_tokens=False)["input_ids"], eos]]
    stream = packed.tokens.tolist()
    assert stream == expected and packed.eos_token_id == eos and packed.documents == len(corpus["docs"])
    # the boundaries: one EOS after every non-empty document; the stream cut at them decodes back to them
    assert stream.count(eos) == len(kept) and stream[-1] == eos
    pieces, start = [], 0
    for at in (i for i, t in enumerate(stream) if t == eos):
        pieces.append(tok.decode(stream[start:at]))
        start = at + 1
    assert pieces == kept
    # non-overlapping windows, targets shifted by one; every token but the first a target exactly once
    assert len(packed) == (len(stream) - 1) // SEQ_LEN > 100
    for i in range(len(packed)):
        x, y = packed[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (SEQ_LEN,)
        at = i * SEQ_LEN
        assert x.tolist() == stream[at:at + SEQ_LEN] and y.tolist() == stream[at + 1:at + SEQ_LEN + 1]
    targets = torch.cat([packed[i][1] for i in range(len(packed))]).tolist()
    assert targets == stream[1:1 + SEQ_LEN * len(packed)]
    with pytest.raises(IndexError, match=f"PackedTokenDataset: window {len(packed)} of {len(packed)}"):
        packed[len(packed)]


def test_every_format_gives_the_same_stream(corpus, packed):
    files = corpus["files"]
    for name in ("json", "jsonl.gz", "parquet"):
        got = _load(corpus, files[name]).train
        assert torch.equal(got.tokens, packed.tokens), name
    # plain text: a document per line here (default: the whole file is one document)
    assert torch.equal(_load(corpus, files["text"], sample_by="line").train.tokens, packed.tokens)
    whole = _load(corpus, files["text"]).train
    assert whole.documents == 1 and whole.tokens.tolist().count(packed.eos_token_id) == 1
    # a glob of two files: their documents in name order, the same stream
    parts = _load(corpus, str(corpus["folder"] / "parts" / "*.jsonl")).train
    assert torch.equal(parts.tokens, packed.tokens) and parts.path.endswith("a.jsonl (and 1 more files)")


def test_the_validation_split_is_the_streams_last_share_or_other_files(corpus, packed):
    train, val = _load(corpus, val_fraction=0.2)
    n = packed.tokens.numel()
    assert val.tokens.numel() == round(n * 0.2) and torch.equal(torch.cat([train.tokens, val.tokens]), packed.tokens)
    assert (train.split, val.split) == ("train", "val") and len(train) == (train.tokens.numel() - 1) // SEQ_LEN
    assert _load(corpus).val is None                                   # val_fraction 0: no validation split
    assert load_packed(corpus["files"]["jsonl"], corpus["tokenizer"], SEQ_LEN,
                       cache_dir=corpus["cache"]).val.tokens.numel() == round(n * 0.1)   # the default: 0.1
    train, val = load_packed(corpus["files"]["jsonl"], corpus["tokenizer"], SEQ_LEN, cache_dir=corpus["cache"],
                             val_files=str(corpus["folder"] / "parts" / "b.jsonl"))
    assert torch.equal(train.tokens, packed.tokens)
    assert val.documents == len(corpus["docs"]) - 20 and torch.equal(val.tokens, packed.tokens[-val.tokens.numel():])


def test_tokenizing_is_cached(corpus, packed):
    def cached() -> list[str]:
        return sorted(p for _, _, fs in os.walk(corpus["cache"]) for p in fs if p.startswith("cache-"))

    before = cached()
    assert before                                    # the map wrote its table to the cache
    again = _load(corpus).train
    assert cached() == before and torch.equal(again.tokens, packed.tokens)
    # the same windows, the same fingerprint; other windows of the same data, another
    assert again.fingerprint() == packed.fingerprint() != _load(corpus, seq_len=SEQ_LEN + 1).train.fingerprint()


# -- errors --------------------------------------------------------------------------------------------
def _no_eos_tokenizer(corpus) -> str:
    return train_tokenizer(corpus["folder"] / "no-eos", corpus["docs"], eos=None)


def _broken_tokenizer(corpus) -> str:
    folder = corpus["folder"] / "broken-tokenizer"
    os.makedirs(folder, exist_ok=True)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": "nonsense"}')
    return str(folder)


def _file(corpus, name: str, text: str) -> str:
    path = corpus["folder"] / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case, pattern", [
    ("missing file", r"gone\.jsonl: no such file; give existing text, JSON lines or parquet files"),
    ("glob matching nothing", r"nothing-\*\.jsonl: no file matches"),
    ("directory", r"parts is a directory; give its files, e\.g\. .*parts/\*\.jsonl"),
    ("missing tokenizer", r"tokenizer .*no-tokenizer: no such directory; give the directory a tokenizer was saved to "
                          r"with save_pretrained"),
    ("tokenizer directory without one", r"tokenizer .*parts holds no tokenizer files \(a\.jsonl, b\.jsonl; a saved "
                                        r"tokenizer has tokenizer\.json or tokenizer_config\.json\): save one there"),
    ("unreadable tokenizer", r"tokenizer .*broken-tokenizer: AutoTokenizer cannot read it \(\w+: .*\); save a "
                             r"tokenizer there with tokenizer\.save_pretrained"),
    ("tokenizer without eos", r"tokenizer .*no-eos has no EOS token, which packing puts between documents; set one"),
    ("empty file", r"empty\.jsonl: every file is empty \(0 bytes\); give files that hold text"),
    ("empty documents", r"blank\.jsonl holds no text \(3 documents, 0 tokens\); give files with text in their 'text' "
                        r"field"),
    ("seq_len beyond the corpus", r"docs\.jsonl: the train split holds \d+ tokens of \d+, fewer than one window of "
                                  r"seq_len 100000 \+ 1; give more text or a shorter seq_len"),
    ("val split too short", r"docs\.jsonl: the val split holds \d+ tokens of \d+ \(0\.001 kept for validation\), fewer "
                            r"than one window of seq_len 8 \+ 1"),
    ("unknown extension", r"docs\.csv: cannot tell its format from the extension '\.csv'; name it \.txt, .*or give "
                          r"format="),
    ("mixed formats", r"the data files mix formats \(json: .*docs\.jsonl, parquet: .*docs\.parquet\); give files of "
                      r"one format"),
    ("missing field", r"docs\.jsonl has no field 'body' \(its fields: text, id\); give text_field= the one holding"),
    ("non-text field", r"docs\.jsonl: field 'id' holds Value\('int64'\), not text; give text_field="),
    ("both validation options", r"both val_files and val_fraction 0\.1 were given; .*give one"),
    ("bad val_fraction", r"val_fraction must be in \[0, 1\) \(the share of the tokens kept for validation\), got 1\.0"),
    ("bad seq_len", r"seq_len must be a positive number of tokens, got 0"),
    ("bad sample_by", r"sample_by must be one of document, paragraph, line \(what a document is in a text file\), "
                      r"got 'page'"),
    ("vocabulary too small", r"docs\.jsonl: token id \d+ does not fit the model's vocabulary of 100; the tokenizer has "
                             r"\d+ tokens"),
])
def test_unusable_inputs_are_one_line_errors_naming_the_thing_and_the_fix(corpus, case, pattern):
    folder, jsonl = corpus["folder"], corpus["files"]["jsonl"]
    args = {
        "missing file": lambda: ([str(folder / "gone.jsonl")], {}),
        "glob matching nothing": lambda: ([str(folder / "nothing-*.jsonl")], {}),
        "directory": lambda: ([str(folder / "parts")], {}),
        "missing tokenizer": lambda: ([jsonl], {"tokenizer": str(folder / "no-tokenizer")}),
        "tokenizer directory without one": lambda: ([jsonl], {"tokenizer": str(folder / "parts")}),
        "unreadable tokenizer": lambda: ([jsonl], {"tokenizer": _broken_tokenizer(corpus)}),
        "tokenizer without eos": lambda: ([jsonl], {"tokenizer": _no_eos_tokenizer(corpus)}),
        "empty file": lambda: ([_file(corpus, "empty.jsonl", "")], {}),
        "empty documents": lambda: ([_file(corpus, "blank.jsonl", '{"text": ""}\n{"text": null}\n{"text": ""}\n')], {}),
        "seq_len beyond the corpus": lambda: ([jsonl], {"seq_len": 100_000}),
        "val split too short": lambda: ([jsonl], {"val_fraction": 0.001}),
        "unknown extension": lambda: ([_file(corpus, "docs.csv", "text\nhello\n")], {}),
        "mixed formats": lambda: ([jsonl, corpus["files"]["parquet"]], {}),
        "missing field": lambda: ([jsonl], {"text_field": "body"}),
        "non-text field": lambda: ([jsonl], {"text_field": "id"}),
        "both validation options": lambda: ([jsonl], {"val_fraction": 0.1, "val_files": jsonl}),
        "bad val_fraction": lambda: ([jsonl], {"val_fraction": 1.0}),
        "bad seq_len": lambda: ([jsonl], {"seq_len": 0}),
        "bad sample_by": lambda: ([corpus["files"]["text"]], {"sample_by": "page"}),
        "vocabulary too small": lambda: ([jsonl], {"vocab_size": 100}),
    }[case]()
    files, kwargs = args
    kwargs = {"tokenizer": corpus["tokenizer"], "seq_len": SEQ_LEN, "cache_dir": corpus["cache"],
              **({"val_fraction": 0.0} if "val_files" not in kwargs else {}), **kwargs}
    with pytest.raises(TextDataError, match=pattern) as raised:
        load_packed(files, kwargs.pop("tokenizer"), kwargs.pop("seq_len"), **kwargs)
    assert "\n" not in str(raised.value)


def test_load_documents_leaves_out_empty_files(corpus):
    empty = _file(corpus, "also-empty.jsonl", "")
    docs = load_documents([empty, corpus["files"]["jsonl"]], cache_dir=corpus["cache"])
    assert list(docs["text"]) == corpus["docs"]


# -- shares, epochs and resuming -----------------------------------------------------------------------
class Recording(Dataset):
    """A dataset that records which windows were read."""

    def __init__(self, inner: Dataset):
        self.inner, self.read = inner, []
        self.path = getattr(inner, "path", "recording")

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.inner[index]


def test_each_rank_reads_only_its_share_and_follows_a_re_plan(packed):
    """On a data-parallel plan a rank's stream reads only the windows of its share of each global
    batch; after a step whose Engine re-planned (a stand-in holding ``.plan``), the next share is cut
    by the new plan, the global batches going on where they were."""
    class Engine:
        plan = dp_plan([5, 3])

    engines, datasets = [Engine(), Engine()], [Recording(packed), Recording(packed)]
    streams = [iter(PlanBatches(d, e.plan, rank, seed=5, engine=e))
               for rank, (d, e) in enumerate(zip(datasets, engines))]
    order = epoch_order(len(packed), 5, 0)
    for step, shares in enumerate([(5, 3), (5, 3), (2, 6), (2, 6)]):
        before = [len(d.read) for d in datasets]
        batches = [next(s) for s in streams]
        chunk, lo = order[8 * step:8 * step + 8], 0
        for rank, (d, share) in enumerate(zip(datasets, shares)):
            assert d.read[before[rank]:] == chunk[lo:lo + share], (step, rank)
            assert torch.equal(batches[rank].inputs[0], torch.stack([packed[i][0] for i in chunk[lo:lo + share]]))
            assert batches[rank].global_size == 8
            lo += share
        if step == 1:   # the re-plan happens during step 1: step 2 reads under the new shares
            for e in engines:
                e.plan = dp_plan([2, 6])


def _steps_per_epoch(plan, n: int) -> int:
    """Global batches of 8 in an epoch of ``n`` windows: a data-parallel plan reads the short last
    one too, a whole-batch plan drops it."""
    return n // 8 if plan.kind != "data_parallel" else -(-n // 8)


@pytest.mark.parametrize("plan", ["dp 5/2/1", "pipeline"])
def test_an_epoch_reads_every_window_once(packed, plan):
    """No window lost or read twice in an epoch: on a data-parallel plan the ranks' shares together
    read every window exactly once (a rank whose share of the short last batch is empty reads one
    window as the template of its empty batch, and uses none of it); on a pipeline plan every rank
    reads every whole global batch, the epoch's short tail dropped."""
    plan = dp_plan([5, 2, 1]) if plan == "dp 5/2/1" else pipeline_plan(8)
    datasets = [Recording(packed) for _ in range(plan.world_size)]
    streams = [PlanBatches(d, plan, rank, seed=1) for rank, d in enumerate(datasets)]
    iters = [iter(s) for s in streams]
    used: list[list[int]] = [[] for _ in datasets]
    for _ in range(_steps_per_epoch(plan, len(packed))):
        for rank, (d, it) in enumerate(zip(datasets, iters)):
            before = len(d.read)
            batch = next(it)
            rows = (batch.targets if not streams[rank].whole else batch[1]).shape[0]
            assert rows == len(d.read) - before or (rows == 0 and len(d.read) - before == 1)
            used[rank] += d.read[before:] if rows else []
    assert {s.position.epoch for s in streams} == {0}
    if streams[0].whole:
        for read in used:
            assert read == epoch_order(len(packed), 1, 0)[:len(packed) - len(packed) % 8]
    else:
        assert sorted(i for read in used for i in read) == list(range(len(packed)))


@pytest.mark.parametrize("first, then", [
    ("dp 5/3", "dp 2/2/4"),        # other shares, other ranks
    ("dp 5/3", "pipeline"),        # a plan of the other kind
    ("pipeline", "dp 1/7"),
])
def test_a_resumed_stream_reads_what_the_uninterrupted_one_reads_next(packed, first, then):
    plans = {"dp 5/3": dp_plan([5, 3]), "dp 2/2/4": dp_plan([2, 2, 4]), "dp 1/7": dp_plan([1, 7]),
             "pipeline": pipeline_plan(8)}
    epoch = _steps_per_epoch(plans[first], len(packed))
    whole, _ = _global_batches(plans[first], packed, steps=epoch + 4)
    head, position = _global_batches(plans[first], packed, steps=epoch + 1)    # into the second epoch
    assert position.epoch == 1 and position.sample == 8
    saved = DataPosition.from_dict(position.to_dict())
    tail, _ = _global_batches(plans[then], packed, steps=3, position=saved, seed=99)   # the position's seed wins
    for a, b in zip(whole, head + tail):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
