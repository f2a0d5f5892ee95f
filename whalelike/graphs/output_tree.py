"""Keep the type of a model output that torch.fx would turn into a plain dict (Hugging Face ``ModelOutput``).

``fx.Tracer`` stores a returned container as a plain ``dict``/``tuple``: a model returning
``CausalLMOutput(logits=...)`` comes out of ``symbolic_trace`` returning ``{'logits': ...}``, and a
loss written as ``out.logits`` then fails on the captured graph. ``torch.export`` keeps the type
through pytree: its graph returns the flat leaves and its codegen rebuilds the structure with the
``out_spec``. This module does the same for fx captures: :func:`flatten_output` turns such an
output into its leaves while tracing and records the spec; :func:`rebuild_output` makes the graph
module return the original type again. Downstream passes (``runtime.parallel.stage_split`` reading
``pytree_info.out_spec``) then see one convention for both front ends.

Only containers registered with ``torch.utils._pytree`` outside Python and torch themselves are
flattened (ModelOutput registers every subclass); tuples, lists, dicts and named tuples keep fx's own
handling.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch.fx as fx
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, tree_flatten

_BUILTIN_MODULES = ("builtins", "collections", "torch")


def is_foreign_tree(value: Any) -> bool:
    """A pytree container fx would not keep: registered by a library other than Python and torch."""
    kind = type(value)
    return kind in SUPPORTED_NODES and kind.__module__.split(".")[0] not in _BUILTIN_MODULES


def flatten_output(value: Any, create_arg: Callable[[Any], Any]) -> tuple[tuple, TreeSpec]:
    """The fx argument for ``value``'s leaves (``create_arg`` of each) and ``value``'s spec."""
    leaves, spec = tree_flatten(value)
    return tuple(create_arg(leaf) for leaf in leaves), spec


class _OutputTreeCodeGen(_PyTreeCodeGen):
    """Plain positional inputs (as fx traced them), the output rebuilt from ``out_spec``."""

    def gen_fn_def(self, *args, **kwargs):
        return CodeGen.gen_fn_def(self, *args, **kwargs)

    def process_inputs(self, *inputs: Any) -> Any:
        return inputs


def rebuild_output(gm: fx.GraphModule, flat: Optional[tuple], out_spec: Optional[TreeSpec]) -> None:
    """Make ``gm`` return the structure ``out_spec`` when its output is ``flat`` (what
    :func:`flatten_output` gave for the returned value; a tree passed to an operator inside the
    model is left alone)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    if out_spec is None or output.args[0] != flat:
        return
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    gm.graph._codegen = _OutputTreeCodeGen(_PyTreeInfo(names, None, out_spec))
    gm.recompile()
