"""One backward in two halves: the input gradients first, the weight gradients afterwards.

Why: a pipeline stage's backward has two products, the gradients of the values it received (which
the previous stage waits for) and its parameters' gradients (which nobody needs before the
optimizer step). Computing the first half, posting its sends, and only then the second half lets
the send overlap compute (paper 001's eager-1F1B with delayed weight gradients; zero-bubble's B/W).

How, without running the backward twice: the *input half* is ``torch.autograd.grad`` from the
roots to the received tensors, so autograd runs only the nodes on a path to them (set I) and each
node computes only the gradients on such paths (a Linear computes dX, not dW). Pre-hooks keep the
incoming gradient of every I node with an edge into the rest of the graph that leads to a parameter
(the *seeds*). The *weight half* restarts at the seeds with those gradients (a Linear's node runs
again, now computing only dW) and at the roots outside I, with ``torch.autograd.backward(...,
inputs=parameters)``: the parameters' ``AccumulateGrad`` nodes run, so ``.grad`` accumulates and
every hook on them fires (DDP's reducer all-reduces on this half). Invariant: the sum of the two
halves is exactly the plain ``torch.autograd.backward(roots, grads)`` (up to floating-point summation
order), each parameter's ``AccumulateGrad`` runs once per backward, and no node outside I runs in
the input half.

Seeds are grouped by the weight-side nodes they reach (union-find), one engine call per group, so
a chain of Linears re-runs each Linear's node for its own dW only and nothing else. Within a group,
a seed reachable from another seed through I (a parameter shared by two layers of the stage) would
receive its gradient twice; a pre-hook replaces its incoming gradient by the kept one (exact, at
the price of recomputing the I path between them: only for parameters used several times).

Why not ``torch.distributed.pipelining._backward`` (``stage_backward_input``/``stage_backward_weight``):
it finds the seeds only through the received tensors, so a stage whose inputs need no gradient
(the first stage) or a parameter feeding a root that never meets them (a second output ``w * c``)
gets no weight gradient; it computes the weight gradients with ``autograd.grad`` and assigns
``.grad`` by hand, so ``AccumulateGrad`` never runs and DDP's reducer never fires; it detaches the
stage's outputs in place; and its groups' engine calls free nodes another group still needs (a
weight shared by two ``F.linear`` calls with their own biases fails with "backward through the
graph a second time"; torch 2.13, checked by hand).

Limit: custom ``autograd.Function`` nodes cannot skip unrequested gradients (``needs_input_grad`` is
fixed at forward) and re-run whole in the weight half, collectives inside them included; so
:mod:`runtime.parallel.pipeline` keeps the one-pass backward on tensor-parallel stages and with synchronised
BatchNorm, whose backward nodes are such functions.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Iterable, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def backward_inputs(roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                    inputs: Sequence[torch.Tensor], params: Iterable[torch.Tensor],
                    ) -> tuple[list[Optional[torch.Tensor]], "WeightGradients"]:
    """The input half of ``torch.autograd.backward(roots, grads)``: the gradient of each of
    ``inputs`` (None where it needs none or is unused), and the weight half still to run
    (:meth:`WeightGradients.run` accumulates into ``params``' ``.grad``). A ``None`` grad is allowed
    for a single-element root (a loss), as in autograd. Nothing is accumulated into ``.grad`` here."""
    pairs = [(r, _root_grad(r, g, i)) for i, (r, g) in enumerate(zip(roots, grads, strict=True)) if r.requires_grad]
    live = [(i, x) for i, x in enumerate(inputs) if x.requires_grad]
    graph = _Graph([get_gradient_edge(r).node for r, _ in pairs])
    input_nodes = {get_gradient_edge(x).node for _, x in live}
    param_nodes = {}
    for p in params:
        if p.requires_grad:
            node = get_gradient_edge(p).node
            if node in graph.children:     # used by this backward
                param_nodes[node] = p
    on_input_path = graph.ancestors(input_nodes)
    on_weight_path = graph.ancestors(set(param_nodes)) - on_input_path
    seeds = [n for n in on_input_path if any(c in on_weight_path for c in graph.children[n])]

    kept: dict[Node, tuple] = {}
    hooks = [seed.register_prehook(_keeper(kept, seed)) for seed in seeds]
    result: list[Optional[torch.Tensor]] = [None] * len(inputs)
    try:
        if live and pairs:
            computed = torch.autograd.grad([r for r, _ in pairs], [x for _, x in live], [g for _, g in pairs],
                                           retain_graph=True, allow_unused=True)
            for (i, _), g in zip(live, computed):
                result[i] = g
    finally:
        for h in hooks:
            h.remove()
    root_edges = [(get_gradient_edge(r), g) for r, g in pairs]
    roots_outside = [(edge, g) for edge, g in root_edges if edge.node in on_weight_path]
    weights = WeightGradients(graph, on_weight_path, param_nodes, kept, roots_outside, [r for r, _ in pairs])
    return result, weights


class WeightGradients:
    """The weight half of one split backward (made by :func:`backward_inputs`); run it once."""

    def __init__(self, graph: "_Graph", on_weight_path: set, param_nodes: dict, kept: dict[Node, tuple],
                 roots_outside: list[tuple[GradientEdge, torch.Tensor]], roots: list[torch.Tensor]):
        self._roots = roots          # keeps the graph alive until the weight half has run
        self._groups = _group(graph, on_weight_path, param_nodes, kept, roots_outside)

    def run(self) -> None:
        """Accumulate the parameters' gradients into ``.grad`` through their ``AccumulateGrad``
        nodes (their hooks fire), one engine call per independent group of seeds."""
        groups, self._groups = self._groups, []
        for edges, grads, params, seeds in groups:
            # a seed also reachable from another seed through the input path takes its kept gradient only
            hooks = [node.register_prehook(lambda _grads, kept=kept: kept) for node, kept in seeds] if len(seeds) > 1 else []
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
            finally:
                for h in hooks:
                    h.remove()
        self._roots = []


def _root_grad(root: torch.Tensor, grad: Optional[torch.Tensor], index: int) -> torch.Tensor:
    if grad is not None:
        return grad
    if root.numel() != 1:
        raise RuntimeError(f"root {index} of the backward has shape {tuple(root.shape)} and no gradient; "
                           f"pass its gradient (only a single-element root, a loss, may have None)")
    return torch.ones_like(root)


def _keeper(kept: dict, node: Node):
    def keep(grad_outputs):
        kept[node] = tuple(grad_outputs)
    return keep


class _Graph:
    """The autograd graph reachable from some nodes: each node's children (next functions) and parents."""

    def __init__(self, starts: list[Node]):
        self.children: dict[Node, list[Node]] = {}
        self.parents: dict[Node, list[Node]] = defaultdict(list)
        queue = deque(n for n in dict.fromkeys(starts) if n is not None)
        for n in queue:
            self.children[n] = []
        while queue:
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                self.children[node].append(child)
                self.parents[child].append(node)
                if child not in self.children:
                    self.children[child] = []
                    queue.append(child)

    def ancestors(self, targets: set) -> set:
        """The targets in the graph and every node with a path to one of them."""
        found = {t for t in targets if t in self.children}
        queue = deque(found)
        while queue:
            for parent in self.parents[queue.popleft()]:
                if parent not in found:
                    found.add(parent)
                    queue.append(parent)
        return found


def _group(graph: _Graph, on_weight_path: set, param_nodes: dict, kept: dict[Node, tuple],
           roots_outside: list[tuple[GradientEdge, torch.Tensor]]) -> list[tuple]:
    """Seeds (kept input-path nodes, roots off it) that reach a common weight-side node share one
    engine call. Returns per group: root edges, their gradients, the parameters, the kept seeds."""
    starts: list[tuple[object, list[Node]]] = [(node, [c for c in graph.children[node] if c in on_weight_path])
                                               for node in kept]
    starts += [(edge, [edge.node]) for edge, _ in roots_outside]
    owner: dict[Node, int] = {}
    parent = list(range(len(starts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for index, (_, entry) in enumerate(starts):
        queue = deque(entry)
        while queue:
            node = queue.popleft()
            if node in owner:
                parent[find(owner[node])] = find(index)
                continue
            owner[node] = index
            queue.extend(c for c in graph.children[node] if c in on_weight_path)
    groups: dict[int, tuple] = {}
    root_grads = {id(edge): g for edge, g in roots_outside}
    for index, (start, _) in enumerate(starts):
        edges, grads, params, seeds = groups.setdefault(find(index), ([], [], [], []))
        if isinstance(start, GradientEdge):
            edges.append(start)
            grads.append(root_grads[id(start)])
        else:
            seeds.append((start, kept[start]))
            for slot, g in enumerate(kept[start]):
                if g is not None:
                    edges.append(GradientEdge(start, slot))
                    grads.append(g)
    for node, index in owner.items():
        if node in param_nodes:
            groups[find(index)][2].append(param_nodes[node])
    return [g for g in groups.values() if g[0] and g[2]]
