"""Two questions every capture pass asks of an fx node: what does a ``get_attr`` read, and does
this node write to one of its inputs. One answer each, shared by regions, recompute, leaves and
capture, so that a node the regions pass calls a mutation is one for the others too."""
from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}


def attribute(gm: fx.GraphModule, target: str) -> Any:
    """The tensor (or submodule) a ``get_attr`` node with ``target`` reads from ``gm``; None if absent."""
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name, None)


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes to an input: a mutable aten schema, an in-place Python operator, or a
    trailing-underscore method or function (``add_``, ``copy_``)."""
    target = node.target
    if target in _INPLACE_OPERATORS:
        return True
    if node.op == "call_method":
        return target.endswith("_") and not target.startswith("_")
    if node.op == "call_function":
        schema = getattr(target, "_schema", None)
        if schema is not None:
            return schema.is_mutable
        name = getattr(target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False
