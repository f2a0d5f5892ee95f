"""Real text as training data: a text file cut into next-token windows, and the per-step stream of
batches a plan's ranks read from it, with a position that resumes exactly.

Why byte-level: a byte is a token. Any text file is a corpus with a vocabulary of 256 and no
tokenizer files, merges or downloads, so the examples and tests train on real text out of the box
(``examples/data/``). A workload that brings its own tokenizer (``Workload.tokenizer``: text ->
token ids) gets its ids instead; nothing else changes. The byte-level text stays the default; a
corpus of documents in files (plain text, JSON lines, parquet) with a saved tokenizer is
:class:`runtime.packed_data.PackedTokenDataset`, cut into the same windows (:class:`TokenWindows`)
and read through the same :class:`PlanBatches`.

:class:`ByteTextDataset` (like every :class:`TokenWindows`) is a map-style dataset of
``(input_ids, targets)`` pairs of ``seq_len`` token ids each, ``targets`` being the inputs shifted
by one (the next token at every position). The windows do not overlap: window ``i`` reads tokens
``[i*L, i*L + L + 1)`` (``L = seq_len``), so each token is a target exactly once and neighbouring
windows share only the token one predicts and the other starts with. The split is by position
(:func:`split_by_position`): the last ``val_fraction`` of the tokens is ``"val"``, the rest
``"train"``, each cut into windows on its own, so no window crosses the split.

:class:`PlanBatches` is what ``examples/train.py --data`` iterates: per step, the batch to pass to
``Engine.train_step``. On a single-stage data-parallel plan each rank reads only its share
(:class:`runtime.data.UnevenLoader`, following the Engine's re-plans); on pipeline and
tensor-parallel plans every rank reads the whole global batch (:class:`runtime.data.WholeBatchSampler`
in a ``DataLoader``), the same on every rank. Epochs roll over by themselves.

Invariant: every window is read at most once per epoch, in the order of the epoch's permutation
(:func:`runtime.data.epoch_order`, seeded by ``seed + epoch``); exactly once on data-parallel plans
(a short last batch is read too), while whole-batch plans drop the epoch's last
``len(dataset) % global_batch_size`` windows of the permutation.

The data position (:class:`DataPosition`: epoch, samples of the epoch's permutation read, seed) is
counted in samples, not steps: a run resumed from it reads next exactly the samples the
uninterrupted run would have read, onto the same plan, onto a plan with other shares (the same
global batches, split differently), or onto a plan of another kind. Only a different global batch
size changes which samples form each later batch (they still come in the same order), and each kind
of plan ends an epoch its own way (a data-parallel plan reads the short last batch, a whole-batch
plan drops it). A resumed stream takes the seed from the position, not from its caller.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from planner.plan import Plan
from runtime.data import UnevenLoader, WholeBatchSampler
from whalelike.errors import WhaleError

__all__ = ["TextDataError", "TokenWindows", "ByteTextDataset", "DataPosition", "PlanBatches", "BYTE_VOCAB_SIZE",
           "split_by_position"]

BYTE_VOCAB_SIZE = 256
SPLITS = ("train", "val")


class TextDataError(WhaleError, ValueError):
    """A text file or data position that cannot feed the run (a user-facing error)."""


class TokenWindows(Dataset):
    """A flat token stream ``tokens`` as non-overlapping next-token windows of ``seq_len`` (the
    module docstring): window ``i`` is ``tokens[i*L : i*L + L + 1]`` cut into ``(input_ids, targets)``.
    The windowing both datasets share; subclasses set ``tokens`` and ``seq_len`` and check them."""

    tokens: torch.Tensor
    seq_len: int

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"{type(self).__name__}: window {index} of {len(self)}")
        index %= len(self)
        window = self.tokens[index * self.seq_len:(index + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]

    def fingerprint(self) -> str:
        """A digest of the windows (the token ids, as int64, and ``seq_len``): store it beside a
        :class:`DataPosition`, which names only the number of windows, and refuse a resume onto data
        whose fingerprint differs (another corpus, tokenizer or split of the same size)."""
        digest = hashlib.sha256(f"{self.seq_len}:".encode())
        digest.update(self.tokens.to(torch.int64).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


def split_by_position(tokens: torch.Tensor, split: str, val_fraction: float) -> torch.Tensor:
    """The ``split`` part of ``tokens``: the last ``round(n * val_fraction)`` tokens are ``"val"``,
    the rest ``"train"``."""
    cut = tokens.numel() - round(tokens.numel() * val_fraction)
    return tokens[:cut] if split == "train" else tokens[cut:]


class ByteTextDataset(TokenWindows):
    """``path`` as non-overlapping next-token windows of ``seq_len`` (see the module docstring).

    ``split``: ``"train"`` (the first ``1 - val_fraction`` of the tokens) or ``"val"`` (the rest).
    ``tokenizer``: text -> token ids (default: the file's bytes, ids 0-255); the file is then read
    as UTF-8. ``vocab_size``: if given, every token id is checked to be below it.
    """

    def __init__(self, path: str | os.PathLike, seq_len: int, split: str = "train", val_fraction: float = 0.1,
                 tokenizer: Optional[Callable[[str], Sequence[int]]] = None, vocab_size: Optional[int] = None):
        self.path = os.fspath(path)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise TextDataError(f"ByteTextDataset: seq_len must be a positive number of tokens, got {seq_len!r}")
        if split not in SPLITS:
            raise TextDataError(f"ByteTextDataset: split must be one of {', '.join(SPLITS)}, got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise TextDataError(f"ByteTextDataset: val_fraction must be in [0, 1) (the share of the text kept for "
                                f"validation), got {val_fraction!r}")
        if split == "val" and val_fraction == 0.0:
            raise TextDataError(f"ByteTextDataset: split 'val' of {self.path} is empty with val_fraction 0; "
                                "give a val_fraction above 0 (e.g. 0.1)")
        self.seq_len, self.split, self.val_fraction = seq_len, split, val_fraction
        tokens = self._read(tokenizer)
        if vocab_size is not None and tokens.numel() and int(tokens.max()) >= vocab_size:
            raise TextDataError(f"{self.path}: token id {int(tokens.max())} does not fit the model's vocabulary of "
                                f"{vocab_size}" + (" (byte-level text needs a vocabulary of at least 256)"
                                                   if tokenizer is None else "; check the tokenizer"))
        self.tokens = split_by_position(tokens, split, val_fraction)
        if self.tokens.numel() < seq_len + 1:
            unit = "bytes" if tokenizer is None else "tokens"
            raise TextDataError(f"{self.path}: the {split} split holds {self.tokens.numel()} {unit} of "
                                f"{tokens.numel()} ({val_fraction:g} kept for validation), fewer than one window of "
                                f"seq_len {seq_len} + 1; use a longer file or a shorter seq_len (--seq-len)")

    def _read(self, tokenizer) -> torch.Tensor:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise TextDataError(f"{self.path}: no such file; give a plain text file (e.g. "
                                "examples/data/tinyshakespeare.txt)") from None
        except IsADirectoryError:
            raise TextDataError(f"{self.path} is a directory; give a plain text file") from None
        if not data:
            raise TextDataError(f"{self.path} is empty (0 bytes); give a text file of at least a few windows")
        if tokenizer is None:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextDataError(f"{self.path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                                "a tokenizer reads text: convert the file to UTF-8") from None
        ids = tokenizer(text)
        try:
            tokens = torch.as_tensor(ids if isinstance(ids, torch.Tensor) else list(ids))
        except (TypeError, ValueError, RuntimeError) as e:
            raise TextDataError(f"{self.path}: the tokenizer returned {type(ids).__name__} ({e}); it must return a "
                                "sequence of int token ids") from None
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TextDataError(f"{self.path}: the tokenizer returned a {tokens.dtype} tensor of shape "
                                f"{tuple(tokens.shape)}; it must return a flat sequence of int token ids")
        if tokens.numel() and int(tokens.min()) < 0:
            raise TextDataError(f"{self.path}: the tokenizer returned {int(tokens.min())}; it must return "
                                "non-negative int token ids")
        return tokens.to(torch.int64)

    def __repr__(self) -> str:
        return (f"ByteTextDataset({self.path!r}, seq_len={self.seq_len}, split={self.split!r}: "
                f"{len(self)} windows of {self.tokens.numel()} tokens)")


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its data: epoch ``epoch``, of whose permutation ``sample`` samples are read;
    ``seed`` seeds the permutations; ``num_samples`` is the dataset's size (a position is only
    meaningful on the same dataset)."""

    epoch: int = 0
    sample: int = 0
    seed: int = 0
    num_samples: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        try:
            return cls(**{k: int(d[k]) for k in ("epoch", "sample", "seed", "num_samples")})
        except (KeyError, TypeError, ValueError) as e:
            raise TextDataError(f"a data position needs integer epoch, sample, seed and num_samples, got {d!r} "
                                f"({e})") from None


class PlanBatches:
    """Per step, the batch for ``Engine.train_step`` under ``plan`` on ``rank`` (module docstring):
    a :class:`runtime.data.Share` on a data-parallel plan, ``(inputs, targets)`` of the whole global
    batch otherwise. Infinite: epochs roll over. :attr:`position` is the position after the last
    batch drawn (save it with the step that trained on it); ``position=`` resumes from one.
    ``engine``: follow its re-plans (data-parallel plans change shares)."""

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, seed: int = 0,
                 position: Optional[DataPosition] = None, engine=None):
        self.dataset, self.plan, self.rank = dataset, plan, rank
        n = len(dataset)
        if position is None:
            position = DataPosition(seed=seed, num_samples=n)
        if position.num_samples != n:
            raise TextDataError(f"the data position was saved on a dataset of {position.num_samples} samples, this "
                                f"one has {n}; resume with the same data file and --seq-len (or start afresh)")
        if not 0 <= position.sample <= n or position.epoch < 0:
            raise TextDataError(f"data position {position} is outside a dataset of {n} samples")
        self.position = position
        self.whole = plan.kind != "data_parallel"
        if self.whole:
            if n < plan.global_batch_size:
                raise TextDataError(f"{_name(dataset)} holds {n} samples, fewer than one global batch of "
                                    f"{plan.global_batch_size} (a pipeline or tensor-parallel plan reads whole "
                                    "global batches); use a longer text, a shorter --seq-len or a smaller global batch")
            self._sampler = WholeBatchSampler(n, plan.global_batch_size, position.seed)
            self._loader = DataLoader(dataset, batch_sampler=self._sampler)
        else:
            self._loader = UnevenLoader(dataset, plan, rank, position.seed)
            if engine is not None:
                self._loader.follow(engine)

    def __iter__(self) -> Iterator:
        while True:
            p = self.position
            if p.sample >= p.num_samples or (self.whole and p.num_samples - p.sample < self.plan.global_batch_size):
                p = self.position = DataPosition(p.epoch + 1, 0, p.seed, p.num_samples)
            (self._sampler if self.whole else self._loader).set_epoch(p.epoch, p.sample)
            for batch in self._loader:
                if self.whole:
                    inputs, targets = batch
                    size = targets.shape[0]
                    batch = (tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,), targets)
                else:
                    size = batch.global_size
                self.position = DataPosition(p.epoch, self.position.sample + size, p.seed, p.num_samples)
                yield batch


def _name(dataset) -> str:
    return getattr(dataset, "path", type(dataset).__name__)
