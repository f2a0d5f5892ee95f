"""What a model factory returns: the model, example inputs, and (for training) a loss and data.

The CLI's ``MODEL`` argument is ``path/to/file.py:factory``; ``factory()`` takes no arguments and
returns a :class:`Workload` (or a ``(model, example_args)`` tuple, enough for ``inspect`` and
``plan``). ``example_args`` is a tuple of tensors whose first dimension is the batch.

A language model that takes one tensor of token ids and predicts the next token at every position
may say so with ``vocab_size`` (and ``seq_len``, the window length it was built and planned for):
then ``examples/train.py --data FILE`` can train it on a text file (``runtime.text_data``), byte by
byte (token ids 0-255, so ``vocab_size`` must be at least 256) or through ``tokenizer`` (a callable
from the file's text to a sequence of token ids below ``vocab_size``). Other workloads leave the
three fields ``None``; nothing else reads them.

:func:`empty_weights` builds a model whose parameters are on the meta device (no storage) while its
buffers stay real: ``runtime.Engine`` then gives each rank storage for what its part of the plan
holds and nothing more, and fills it from a checkpoint (``Engine(weights=...)``).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from whalelike.errors import WhaleError


@dataclass
class Workload:
    """What a model factory returns (see the module docstring): the model and example inputs, and
    for training a ``loss_fn(outputs, targets)`` returning the mean loss over the batch's samples
    and a ``make_batch(num_samples, generator)`` returning ``(inputs tuple, targets)``.
    ``vocab_size``, ``seq_len`` and ``tokenizer`` describe a next-token language model on token
    ids; other workloads leave them None."""

    model: nn.Module
    example_args: tuple
    example_kwargs: dict = field(default_factory=dict)
    # loss_fn(outputs, targets) -> scalar mean loss over the samples of the batch
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None
    # make_batch(num_samples, generator) -> (inputs tuple, targets) for training and benchmarks
    make_batch: Optional[Callable[[int, torch.Generator], tuple[tuple, torch.Tensor]]] = None
    # a next-token language model on token ids (see the module docstring): its vocabulary, the
    # sequence length it was built for, and optionally text -> token ids (default: the bytes)
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    tokenizer: Optional[Callable[[str], Sequence[int]]] = None


def counting_tokens(vocab_size: int, seq_len: int) -> Callable[[int, torch.Generator], tuple[tuple, torch.Tensor]]:
    """A ``make_batch`` for next-token language models: each sequence counts up from a random token,
    modulo the vocabulary (inputs, and the same shifted by one as targets). Easy to learn, so a loss
    visibly falls within a few dozen steps; the examples' synthetic stream."""
    def make_batch(num_samples: int, generator: torch.Generator) -> tuple[tuple, torch.Tensor]:
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
        tokens = (start + torch.arange(seq_len + 1)) % vocab_size
        return (tokens[:, :-1],), tokens[:, 1:]

    return make_batch


def as_workload(obj: Any, origin: str) -> Workload:
    """Accept a Workload or a ``(model, example_args)`` tuple; anything else is a clear error."""
    if isinstance(obj, Workload):
        workload = obj
    elif isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], nn.Module):
        args = obj[1] if isinstance(obj[1], tuple) else (obj[1],)
        workload = Workload(model=obj[0], example_args=args)
    else:
        raise WhaleError(
            f"{origin} must return a whalelike.Workload or a (model, example_args) tuple, "
            f"got {type(obj).__name__}"
        )
    if not isinstance(workload.model, nn.Module):
        raise WhaleError(f"{origin}: Workload.model must be an nn.Module, got {type(workload.model).__name__}")
    if not isinstance(workload.example_args, tuple):
        workload.example_args = (workload.example_args,)
    for name in ("vocab_size", "seq_len"):
        value = getattr(workload, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise WhaleError(f"{origin}: Workload.{name} must be a positive int (or None: not a language model), "
                             f"got {value!r}")
    if workload.tokenizer is not None and not callable(workload.tokenizer):
        raise WhaleError(f"{origin}: Workload.tokenizer must be a callable from text to token ids, "
                         f"got {type(workload.tokenizer).__name__}")
    return workload


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build models whose parameters are on the meta device and whose buffers are real, e.g.
    ``with wl.empty_weights(): model = LlamaForCausalLM(config)``.

    Why not ``with torch.device("meta")``: it puts the buffers on meta too, and a buffer a module
    computes when it is built and saves nowhere (a rotary embedding's frequencies, ``persistent=False``)
    can then never get its values back. Here each parameter is moved to the meta device as the module
    registers it (Hugging Face ``accelerate``'s ``init_empty_weights`` does the same, keeping
    buffers): one parameter at a time has storage while the model is built, and the model ends with
    none. The initialisation a module runs on its parameters still runs; on meta it computes nothing.
    Invariant: the hook is removed when the block ends, an exception included."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def load_workload(spec: str):
    """Import ``path/to/file.py`` by path, call ``factory()``, and return its Workload.

    The file's directory goes on ``sys.path`` first, as when Python runs the file as a script, so
    it may import its neighbours. A file imported before in this process and unchanged since (same
    modification time and size) is not executed again: its factory is called again, on the same
    classes, so that a second model from it (a second Engine, a naive baseline, every rank of a test)
    is the architecture whalelike's capture cache already knows.
    """
    path_text, sep, factory_name = spec.rpartition(":")
    if not sep or not path_text or not factory_name:
        raise WhaleError(f"MODEL must be path/to/file.py:factory, got {spec!r}; e.g. examples/gpt.py:build")
    path = Path(path_text)
    if not path.is_file():
        raise WhaleError(f"{path_text}: no such file (MODEL is path/to/file.py:factory, relative to "
                         f"{os.getcwd()})")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"_whalelike_model_{path.stem}"
    stat = path.stat()
    identity = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    module = _imported.get(identity)
    if module is None or sys.modules.get(module_name) is not module:
        module = _import_file(path, path_text, module_name)
        _imported[identity] = module
    factory = getattr(module, factory_name, None)
    if factory is None:
        callables = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module_name)
        listed = f"; functions defined there: {', '.join(callables)}" if callables else ""
        raise WhaleError(f"{path_text} has no attribute {factory_name!r}{listed}")
    if not callable(factory):
        raise WhaleError(f"{spec}: {factory_name!r} is a {type(factory).__name__}, not a function; MODEL must "
                         "name a function that takes no arguments")
    try:
        result = factory()
    except WhaleError:
        raise
    except SystemExit as e:       # would end the command with the factory's status and no word
        raise WhaleError(f"{spec}(): called sys.exit({e.code!r}); a model factory must return a model (or a "
                         "Workload), or raise an exception that says what is wrong") from e
    except Exception as e:
        raise WhaleError(f"{spec}(): raised {type(e).__name__}: {e} (run with --debug for the traceback)") from e
    return as_workload(result, origin=f"{spec}()")


# the modules load_workload executed, by (resolved path, modification time, size)
_imported: dict[tuple, Any] = {}


def _import_file(path: Path, path_text: str, module_name: str):
    """Execute the file ``path`` as the module ``module_name`` (registered in ``sys.modules``)."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise WhaleError(f"{path_text}: cannot be imported as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    try:
        module_spec.loader.exec_module(module)
    except WhaleError:
        del sys.modules[module_name]
        raise
    except SystemExit as e:       # sys.exit() at import: a script's main guard missing, say so
        del sys.modules[module_name]
        raise WhaleError(f"{path_text}: importing it called sys.exit({e.code!r}); MODEL's file is imported, not "
                         "run: put script code under `if __name__ == \"__main__\":`") from e
    except Exception as e:
        del sys.modules[module_name]
        raise WhaleError(f"{path_text}: importing it failed: {type(e).__name__}: {e} (run with --debug "
                         "for the traceback)") from e
    return module
