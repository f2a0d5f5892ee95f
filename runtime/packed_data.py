"""Documents from local files, tokenized and packed into next-token windows: a corpus in the
formats people keep text in (plain text, JSON lines, parquet) with a tokenizer of their own.

What it does (torchtitan's recipe): load the files as a Hugging Face ``datasets.Dataset``
(:func:`load_documents`), tokenize every document with a tokenizer saved in a local directory
(:func:`load_tokenizer`, ``transformers.AutoTokenizer``) in a batched ``Dataset.map`` (cached), put
the tokenizer's EOS after each document and concatenate them into one token stream, then cut the
stream into the windows of :class:`runtime.text_data.TokenWindows`: window ``i`` is tokens
``[i*L, i*L + L + 1)`` as ``(input_ids, targets)``, ``targets`` the inputs shifted by one
(:class:`PackedTokenDataset`). :func:`load_packed` does all of it and returns the train and
validation splits: the last ``val_fraction`` of the stream (by position, as the byte-level dataset
splits; no window crosses the cut), or other files (``val_files``).

Document boundaries: exactly one EOS after every non-empty document (the tokenizer's own special
tokens are not added: ``add_special_tokens=False``, so a boundary is that one EOS and nothing
else); empty documents add nothing. Windows do not stop at boundaries: a window holding the end of
one document and the start of the next attends across the EOS, as in torchtitan's and Hugging
Face's ``run_clm`` packing; the EOS is the model's cue that a new document starts, and no token is
padded or dropped inside the stream (only the tail shorter than a window). Resetting positions or
masking attention at each EOS (``position_ids`` restarting per document) is not done: the
workloads' models take token ids only.

A :class:`PackedTokenDataset` is a map-style dataset like :class:`runtime.text_data.ByteTextDataset`,
so :class:`runtime.text_data.PlanBatches` serves it unchanged: on a data-parallel plan each rank
reads only its share of every global batch and follows re-planned shares; on pipeline and
tensor-parallel plans every rank reads the whole global batch; the position
(:class:`runtime.text_data.DataPosition`) is counted in windows, so a resume onto another plan
reads what the uninterrupted run would. The token stream lives in memory (4 bytes a token); every
rank tokenizes nothing twice on one host (the map's cache) but holds the stream, and reads windows
of it by index. Streaming corpora larger than memory (``datasets``' ``streaming=True``) is not
offered: a map-style dataset is what gives positions counted in samples.

Why ``datasets`` and ``tokenizers``/``transformers`` and not readers of our own: ``datasets`` reads
text, JSON lines and parquet (compressed too, globs, many files) into memory-mapped Arrow tables, and
fingerprints each ``map`` by its input, function and arguments, so a second run or a second rank
of the host loads the tokenized table from its cache under a file lock instead of tokenizing again;
``AutoTokenizer`` reads any tokenizer saved with ``save_pretrained`` (BPE, SentencePiece, WordPiece)
and runs the Rust ``tokenizers`` library batched. Both are imported only by the functions that load
files (the ``[data]`` extra): the byte-level default (``examples/data/``) needs neither.

Invariant: the token stream is a function of the files' contents and order and of the tokenizer
alone, so every rank builds the same windows without communicating, and a window's index names the
same tokens in every run on the same files.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union

import torch

from runtime.text_data import SPLITS, TextDataError, TokenWindows, split_by_position

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = ["PackedTokenDataset", "PackedSplits", "load_packed", "load_documents", "load_tokenizer",
           "tokenize_documents", "FORMATS"]

log = logging.getLogger(__name__)

# file extension -> the datasets builder that reads it
FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz")   # datasets decompresses these (text and JSON lines) on reading
SAMPLE_BY = ("document", "paragraph", "line")
DEFAULT_VAL_FRACTION = 0.1
# what save_pretrained writes (one of them at least), for fast and slow tokenizers
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model"}

Files = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


class PackedTokenDataset(TokenWindows):
    """The ``split`` of a packed token stream as non-overlapping next-token windows of ``seq_len``
    (see the module docstring); built by :func:`load_packed`, or from any stream of token ids.

    ``tokens``: the stream (documents with an EOS after each); ``source``: what it was read from
    (errors and ``repr`` name it); ``total_tokens``: the whole stream's length before the split (for
    the error message); ``val_fraction``: the share kept for validation (0 when the split is its
    own files). Raises :class:`runtime.text_data.TextDataError` when the split holds no window.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, source: str, split: str = "train",
                 eos_token_id: Optional[int] = None, total_tokens: Optional[int] = None, val_fraction: float = 0.0,
                 documents: Optional[int] = None):
        _check_seq_len(seq_len)
        if split not in SPLITS:
            raise TextDataError(f"PackedTokenDataset: split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.tokens, self.seq_len, self.split = tokens, seq_len, split
        self.path = source              # what runtime.text_data.PlanBatches names in its errors
        self.eos_token_id, self.documents = eos_token_id, documents
        total = tokens.numel() if total_tokens is None else total_tokens
        if tokens.numel() < seq_len + 1:
            kept = f" ({val_fraction:g} kept for validation)" if val_fraction else ""
            raise TextDataError(f"{source}: the {split} split holds {tokens.numel()} tokens of {total}{kept}, fewer "
                                f"than one window of seq_len {seq_len} + 1; give more text or a shorter seq_len "
                                "(--seq-len)")

    def __repr__(self) -> str:
        docs = f" of {self.documents} documents" if self.documents is not None else ""
        return (f"PackedTokenDataset({self.path!r}, seq_len={self.seq_len}, split={self.split!r}: "
                f"{len(self)} windows of {self.tokens.numel()} tokens{docs})")


class PackedSplits(NamedTuple):
    """What :func:`load_packed` returns: the training windows and the validation windows (None
    when nothing is kept for validation)."""

    train: PackedTokenDataset
    val: Optional[PackedTokenDataset]


def load_packed(files: Files, tokenizer: Union[str, os.PathLike, "PreTrainedTokenizerBase"], seq_len: int, *,
                val_fraction: Optional[float] = None, val_files: Optional[Files] = None,
                format: Optional[str] = None, text_field: str = "text", sample_by: str = "document",
                cache_dir: Optional[str] = None, vocab_size: Optional[int] = None,
                num_proc: Optional[int] = None) -> PackedSplits:
    """``files`` tokenized and packed into windows of ``seq_len`` tokens: the train and validation
    splits (see the module docstring).

    ``files``: paths or glob patterns of local files, in order (each pattern's matches sorted);
    ``format``: ``"text"``, ``"json"`` (JSON lines too) or ``"parquet"`` (default: from the
    extension, :data:`FORMATS`); ``text_field``: the column holding each document's text (JSON and
    parquet); ``sample_by``: what a document is in a text file, ``"document"`` (the whole file,
    default), ``"paragraph"`` or ``"line"``. ``tokenizer``: a directory written by
    ``save_pretrained`` (:func:`load_tokenizer`) or a tokenizer object; it must have an EOS token.
    ``val_fraction``: the last share of the stream kept for validation (default 0.1; 0: no
    validation split); ``val_files``: files that are the validation split instead (then
    ``val_fraction`` must be left out). ``cache_dir``: where ``datasets`` keeps the Arrow tables and
    the tokenized cache (default: its own, ``HF_DATASETS_CACHE``). ``vocab_size``: every token id is
    checked to be below it (the model's vocabulary). ``num_proc``: processes for tokenizing.
    """
    _check_seq_len(seq_len)
    if val_files is not None and val_fraction is not None:
        raise TextDataError(f"load_packed: both val_files and val_fraction {val_fraction!r} were given; the "
                            "validation split is either other files or the stream's last share: give one")
    if val_fraction is None:
        val_fraction = 0.0 if val_files is not None else DEFAULT_VAL_FRACTION
    if not 0.0 <= val_fraction < 1.0:
        raise TextDataError(f"load_packed: val_fraction must be in [0, 1) (the share of the tokens kept for "
                            f"validation), got {val_fraction!r}")
    tok = tokenizer if not isinstance(tokenizer, (str, os.PathLike)) else load_tokenizer(tokenizer)
    options = dict(format=format, text_field=text_field, sample_by=sample_by, cache_dir=cache_dir)

    def stream(which: Files) -> tuple[torch.Tensor, int, str]:
        paths = _expand(which)
        documents = load_documents(paths, **options)
        tokens = tokenize_documents(documents, tok, text_field=_field(documents, text_field, paths),
                                    num_proc=num_proc)
        source = _describe(paths)
        if tokens.numel() == 0:
            where = "" if _format_of(paths, format) == "text" else f" in their {text_field!r} field"
            raise TextDataError(f"{source} holds no text ({len(documents)} documents, 0 tokens); give files with "
                                f"text{where}")
        if vocab_size is not None and int(tokens.max()) >= vocab_size:
            raise TextDataError(f"{source}: token id {int(tokens.max())} does not fit the model's vocabulary of "
                                f"{vocab_size}; the tokenizer has {len(tok)} tokens: give the model a vocabulary "
                                "of at least that many, or the tokenizer it was made for")
        return tokens, len(documents), source

    tokens, documents, source = stream(files)
    eos = tok.eos_token_id
    if val_files is not None:
        train = PackedTokenDataset(tokens, seq_len, source=source, split="train", eos_token_id=eos,
                                   documents=documents)
        val_tokens, val_documents, val_source = stream(val_files)
        return PackedSplits(train, PackedTokenDataset(val_tokens, seq_len, source=val_source, split="val",
                                                      eos_token_id=eos, documents=val_documents))
    splits = {split: PackedTokenDataset(split_by_position(tokens, split, val_fraction), seq_len, source=source,
                                        split=split, eos_token_id=eos, total_tokens=tokens.numel(),
                                        val_fraction=val_fraction, documents=documents)
              for split in (("train", "val") if val_fraction > 0 else ("train",))}
    return PackedSplits(splits["train"], splits.get("val"))


def load_tokenizer(path: Union[str, os.PathLike]) -> "PreTrainedTokenizerBase":
    """The tokenizer saved in directory ``path`` (``tokenizer.save_pretrained(path)``), read with
    ``transformers.AutoTokenizer`` from the directory alone (nothing downloaded). It must have an
    EOS token: packing puts one after every document."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "no such directory"
        raise TextDataError(f"tokenizer {path}: {what}; give the directory a tokenizer was saved to with "
                            "save_pretrained (holding tokenizer.json or tokenizer_config.json)")
    found = sorted(os.listdir(path))
    if not set(found) & TOKENIZER_FILES:
        raise TextDataError(f"tokenizer {path} holds no tokenizer files ({', '.join(found) or 'nothing'}; a saved "
                            f"tokenizer has tokenizer.json or tokenizer_config.json): save one there with "
                            "tokenizer.save_pretrained")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TextDataError(f"tokenizer {path}: AutoTokenizer cannot read it ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}); save a tokenizer there with "
                            "tokenizer.save_pretrained") from None
    if tokenizer.eos_token_id is None:
        raise TextDataError(f"tokenizer {path} has no EOS token, which packing puts between documents; set one "
                            "(tokenizer.eos_token = '<|endoftext|>', a token of its vocabulary) and save_pretrained "
                            "it again")
    return tokenizer


def load_documents(files: Files, *, format: Optional[str] = None, text_field: str = "text",
                   sample_by: str = "document", cache_dir: Optional[str] = None) -> "datasets.Dataset":
    """``files`` (paths or glob patterns) as one ``datasets.Dataset`` of documents, in file order;
    see :func:`load_packed` for the arguments. Empty files are left out (``datasets`` cannot read
    an empty JSON file); every file missing, a directory, or of an unknown format is an error."""
    paths = _expand(files)
    kind = _format_of(paths, format)
    if sample_by not in SAMPLE_BY:
        raise TextDataError(f"sample_by must be one of {', '.join(SAMPLE_BY)} (what a document is in a text "
                            f"file), got {sample_by!r}")
    empty = [p for p in paths if os.path.getsize(p) == 0]
    if empty:
        log.warning("leaving out %d empty file(s): %s", len(empty), ", ".join(empty))
    paths = [p for p in paths if p not in empty]
    if not paths:
        raise TextDataError(f"{_describe(empty)}: every file is empty (0 bytes); give files that hold text")
    import datasets

    options = {"sample_by": sample_by} if kind == "text" else {}
    try:
        documents = datasets.load_dataset(kind, data_files=paths, split="train", cache_dir=cache_dir, **options)
    except Exception as e:   # datasets raises many kinds (ArrowInvalid, DatasetGenerationError, ...): one line
        cause = e.__cause__ or e
        raise TextDataError(f"{_describe(paths)}: datasets cannot read it as {kind} ({type(cause).__name__}: "
                            f"{' '.join(str(cause).split())[:300]}); check the files' format (format=)") from None
    _field(documents, text_field, paths)
    return documents


def tokenize_documents(documents: "datasets.Dataset", tokenizer: "PreTrainedTokenizerBase", *,
                       text_field: str = "text", num_proc: Optional[int] = None) -> torch.Tensor:
    """Every document's token ids followed by the tokenizer's EOS (none for an empty document),
    concatenated in order: one flat tensor (int32, or int64 for ids beyond its range). Tokenized
    by a batched ``Dataset.map``, cached by ``datasets`` under the documents' cache directory."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TextDataError(f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)} has no EOS "
                            "token, which packing puts between documents; set tokenizer.eos_token")
    ids = documents.map(_tokenize, batched=True, remove_columns=documents.column_names, num_proc=num_proc,
                        fn_kwargs={"tokenizer": tokenizer, "text_field": text_field, "eos": eos},
                        desc="tokenizing")
    import pyarrow.compute as pc

    flat = pc.list_flatten(ids.with_format("arrow")[:].column("input_ids")).to_numpy()
    if flat.size and int(flat.max()) >= 2**31:
        return torch.from_numpy(flat.astype("int64"))
    return torch.from_numpy(flat.astype("int32"))


def _tokenize(batch: dict, tokenizer, text_field: str, eos: int) -> dict:
    """``Dataset.map``'s function (module level: ``datasets`` fingerprints it for its cache)."""
    texts = [t if t is not None else "" for t in batch[text_field]]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return {"input_ids": [x + [eos] if x else [] for x in ids]}


def _check_seq_len(seq_len) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise TextDataError(f"PackedTokenDataset: seq_len must be a positive number of tokens, got {seq_len!r}")


def _expand(files: Files) -> list[str]:
    """Paths and glob patterns as a list of existing regular files, in order; errors name the
    missing one."""
    items = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not items:
        raise TextDataError("no data files were given; give text, JSON lines or parquet files")
    out: list[str] = []
    for item in map(os.fspath, items):
        if glob.has_magic(item):
            matches = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matches:
                raise TextDataError(f"{item}: no file matches; give existing text, JSON lines or parquet files")
            out += matches
        elif os.path.isdir(item):
            raise TextDataError(f"{item} is a directory; give its files, e.g. {os.path.join(item, '*.jsonl')}")
        elif not os.path.isfile(item):
            raise TextDataError(f"{item}: no such file; give existing text, JSON lines or parquet files")
        else:
            out.append(item)
    return list(dict.fromkeys(out))


def _format_of(paths: Sequence[str], format: Optional[str]) -> str:
    builders = sorted(set(FORMATS.values()))
    if format is not None:
        if format not in builders:
            raise TextDataError(f"format must be one of {', '.join(builders)}, got {format!r}")
        return format
    kinds = {}
    for p in paths:
        stem = p[:-len(c)] if (c := next((c for c in COMPRESSIONS if p.endswith(c)), "")) else p
        ext = os.path.splitext(stem)[1].lower()
        if ext not in FORMATS:
            raise TextDataError(f"{p}: cannot tell its format from the extension {ext or '(none)'!r}; name it "
                                f"{', '.join(FORMATS)}, or give format= ({', '.join(builders)})")
        kinds.setdefault(FORMATS[ext], p)
    if len(kinds) > 1:
        raise TextDataError(f"the data files mix formats ({', '.join(f'{k}: {p}' for k, p in kinds.items())}); "
                            "give files of one format")
    return next(iter(kinds))


def _field(documents: "datasets.Dataset", text_field: str, paths: Sequence[str]) -> str:
    """``text_field``, checked to be a text column of ``documents``."""
    if text_field not in documents.column_names:
        raise TextDataError(f"{_describe(paths)} has no field {text_field!r} (its fields: "
                            f"{', '.join(documents.column_names)}); give text_field= the one holding the text")
    dtype = getattr(documents.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise TextDataError(f"{_describe(paths)}: field {text_field!r} holds {documents.features[text_field]}, not "
                            "text; give text_field= the one holding the text")
    return text_field


def _describe(paths: Sequence[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} (and {len(paths) - 1} more files)"
