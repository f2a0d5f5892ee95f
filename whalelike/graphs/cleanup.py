"""Export-graph hygiene: drop metadata asserts and dead nodes before regions are assigned.

``torch.export`` leaves nodes that compute nothing the model uses: runtime checks of tensor metadata
(``aten._assert_tensor_metadata`` before each ``.to``), symbolic-shape asserts, and values the
model computed and dropped (a mask branch it did not take, a parameter read for an op that was
rewritten). Each would be given a scope like any node, and a dead node whose module is annotated
differently from its neighbours forms a TaskGraph of its own (a stage with no work). They are
removed here; the graph computes exactly what it computed before.

Why not only ``Graph.eliminate_dead_code``: it keeps impure nodes, and the asserts are impure by
definition (they may raise), so they must be named and removed first. In-place updates (a
BatchNorm's running statistics) are impure too and stay.
"""
from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten

# Operators that only check metadata; their results are never used.
ASSERT_OPERATORS = frozenset(op for op in (
    getattr(_aten, "_assert_tensor_metadata", None),
    getattr(_aten, "_assert_scalar", None),
    getattr(_aten, "_assert_async", None),
    getattr(_aten, "sym_constrain_range", None),
    getattr(_aten, "sym_constrain_range_for_size", None),
    getattr(_aten, "_functional_assert_scalar", None),
    getattr(_aten, "_functional_assert_async", None),
) if op is not None)


def _is_assert(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    return packet in ASSERT_OPERATORS or target in ASSERT_OPERATORS


def remove_asserts_and_dead_code(gm: fx.GraphModule) -> int:
    """Erase metadata asserts, then every node whose value nothing uses; returns how many went."""
    before = len(gm.graph.nodes)
    for node in reversed(list(gm.graph.nodes)):
        if _is_assert(node) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return before - len(gm.graph.nodes)
