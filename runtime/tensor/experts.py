"""Expert parallelism with uneven expert counts: a ``split`` group's ranks each hold their own experts of a MoE layer.

:func:`whalelike.sharding.experts.find_experts` recognises a mixture-of-experts layer in a stage
graph (its capture-time twin priced it as one shard group of experts); :func:`shard_experts`
replaces the layer's inlined operators by one :class:`ExpertParallel` call and cuts each stacked
expert weight (``gate_up_proj``/``up_proj``, ``down_proj``, their biases; state-dict keys kept) to
this rank's experts: a contiguous range, ``StagePlan.shard_sizes[path][tp_index]`` of them, so a
device twice as fast holds twice the experts (Megatron and torchtitan give every rank the same
number). Everything else of the layer (the router, the shared expert, the residual) is what the
rest of the ``split`` region does with it.

One forward, on every rank of the group alike (every rank holds the same tokens: the block's
input is replicated, and the router runs whole on each, so every rank knows where every
(token, expert) pair goes without asking):

1. **dispatch**: the pairs whose expert this rank holds, their token rows gathered from its own
   copy of the hidden states. Moving a row to a rank that already has it would be waste, so the
   forward all-to-all of the usual expert parallelism (transformers' ``AllToAllEP``) is a local
   gather here; its backward is the all-to-all: each pair's row gradient goes to the rank that owns
   its token, which sums them per token, and an all-gather of the owners' rows makes the input
   gradient whole again on every rank.
2. **experts**: this rank's experts on their pairs, expert by expert (each matmul an emulation
   segment, :func:`runtime.tensor.layers.local_linear`), with the module's own activation (its
   ``act_fn`` operators, copied from the graph) between them, unweighted.
3. **combine**: an all-to-all sends each pair's output to the rank owning its token (tokens are
   cut into ``n`` equal consecutive slices, one per rank); the owner weights its pairs by the
   router's ``top_k_weights`` and sums each token's ``k`` of them (in the order the unsharded layer
   does), and an all-gather of the slices gives every rank the whole output. Backward: each
   owner's pair gradients go back by the reverse all-to-all, and the routing weights' gradients,
   computed by the owners, are all-gathered. So the router and its auxiliary loss (computed from
   the replicated router logits on every rank) get exactly the unsharded gradients.

Only routed pairs cross the network: a rank sends about ``T k (n-1) / n^2`` rows and the slices'
all-gather ``T (n-1) / n``, where summing partial outputs (transformers' ``AllReduceEP``) moves
``2 T (n-1) / n`` whatever the routing: the all-to-all is the cheaper one from ``n > k`` (two
ranks of a top-2 layer move the same either way). Collective: gloo's ``alltoall`` refuses
uneven lists of tensors (``all_to_all``) but runs ``all_to_all_single`` with uneven split sizes,
which is what this uses (nccl takes both). The split sizes come from the routing every rank
computed, so no counts are exchanged. On an emulated network each all-to-all is padded to the
ring time of its busiest rank's traffic (:func:`runtime.emulation.network.pad_collective`, as an
all-gather in which every member sends that much), the all-gathers as the region ops' are.

Capacity: the ``transformers`` MoE layers are dropless (no expert capacity, no token dropped), so
the only per-rank capacity is how many experts it holds; the plan makes it uneven by speed.

Invariant: exact against the unsharded layer (float rounding aside): every pair is computed once,
by the rank holding its expert; every rank ends with the whole output and, backward, the whole
gradients of its replicated inputs; each expert's weight gradient is complete on its one holder.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from runtime.emulation.compute import Emulator
from runtime.emulation.network import pad_collective
from runtime.tensor.layers import ProcessGroup, all_gather_uneven, local_linear
from whalelike.errors import WhaleError
from whalelike.graphs.nodes import attribute
from whalelike.sharding.experts import ExpertsLayout, FoundExperts, act_inputs, find_experts

log = logging.getLogger(__name__)


# -- the routing every rank computes alike ---------------------------------------------------------
@dataclass
class _Routes:
    """Where the pairs of one forward go, from this rank's point of view (``r`` of ``n``)."""

    k: int
    token_sizes: list[int]    # tokens per rank's slice (equal consecutive slices)
    start: int                # this rank's first token
    local: torch.Tensor       # pair ids (t * k + j) whose expert this rank holds, ascending
    local_expert: torch.Tensor  # their expert, as this rank's local index
    send: list[int]           # local pairs per destination rank (the owner of their token)
    recv: list[int]           # pairs of this rank's slice per source rank (the holder of their expert)
    recv_pairs: torch.Tensor  # the pair ids received, in arrival order (by source rank, ascending)
    busiest_rows: int         # rows the busiest rank sends or receives over the network

    @classmethod
    def of(cls, index: torch.Tensor, counts: Sequence[int], rank: int) -> "_Routes":
        tokens, k = index.shape
        n, device = len(counts), index.device
        owner = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(counts, device=device))
        sizes = [tokens // n + (i < tokens % n) for i in range(n)]
        token_owner = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(sizes, device=device))
        flat = index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= owner.numel()):
            raise WhaleError(f"expert parallel: the router chose experts {int(flat.min())}..{int(flat.max())}, but "
                             f"the layer has {owner.numel()}; the plan's expert counts {list(counts)} must sum to them")
        src = owner[flat]
        dest = token_owner.repeat_interleave(k)
        matrix = torch.bincount(src * n + dest, minlength=n * n).view(n, n).tolist()
        local = torch.nonzero(src == rank).squeeze(1)
        start = sum(sizes[:rank])
        own = torch.arange(start * k, (start + sizes[rank]) * k, device=device)
        recv_pairs = own[torch.sort(src[own], stable=True).indices]
        busiest = max(max(sum(matrix[r]) - matrix[r][r], sum(row[r] for row in matrix) - matrix[r][r]) for r in range(n))
        return cls(k, sizes, start, local, flat[local] - sum(counts[:rank]), matrix[rank],
                   [row[rank] for row in matrix], recv_pairs, busiest)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup, busiest: int) -> torch.Tensor:
    """Rows of ``x`` (``send[i]`` for rank ``i``, in rank order) to their ranks; ``recv[i]`` come
    back from rank ``i``. Padded on an emulated network to the busiest rank's ``busiest`` rows."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    n = len(send)
    if n > 1 and busiest:
        row = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        # an all-gather of n * b / (n - 1) bytes in all has every member send b: the busiest rank's traffic
        pad_collective(group, "allgather", int(busiest * row * n / (n - 1)))
    return out


def _gather_slices(x: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    out = all_gather_uneven(x, sizes, 0, group)
    pad_collective(group, "allgather", out.numel() * out.element_size())
    return out


class _Dispatch(torch.autograd.Function):
    """This rank's pairs' token rows, gathered from the replicated hidden states (no communication);
    backward: the rows' gradients to their tokens' owners (all-to-all), summed per token, then
    all-gathered so every rank holds the whole input gradient."""

    @staticmethod
    def forward(ctx, hidden, routes: _Routes, group):
        ctx.routes, ctx.group, ctx.shape = routes, group, hidden.shape
        return hidden.index_select(0, torch.div(routes.local, routes.k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):
        r: _Routes = ctx.routes
        rank = dist.get_rank(ctx.group)
        received = _all_to_all(grad, r.send, r.recv, ctx.group, r.busiest_rows)
        mine = grad.new_zeros((r.token_sizes[rank],) + tuple(ctx.shape[1:]))
        mine.index_add_(0, torch.div(r.recv_pairs, r.k, rounding_mode="floor") - r.start, received)
        return _gather_slices(mine, r.token_sizes, ctx.group), None, None


class _Combine(torch.autograd.Function):
    """This rank's pair outputs to their tokens' owners (all-to-all); each owner weights and sums
    its tokens' ``k`` pairs as the unsharded layer does, and the slices are all-gathered. Backward:
    the owners' pair gradients back (reverse all-to-all), the routing weights' gradients all-gathered."""

    @staticmethod
    def forward(ctx, outputs, top_k_weights, routes: _Routes, group):
        rank = dist.get_rank(group)
        rows = routes.token_sizes[rank]
        received = _all_to_all(outputs, routes.send, routes.recv, group, routes.busiest_rows)
        order = torch.argsort(routes.recv_pairs)      # the k pairs of each own token, in slot order
        pairs = received.index_select(0, order).view(rows, routes.k, -1)
        weights = top_k_weights[routes.start: routes.start + rows]
        ctx.save_for_backward(pairs, weights, order)
        ctx.routes, ctx.group, ctx.weights_dtype = routes, group, top_k_weights.dtype
        ctx.weights_shape = top_k_weights.shape
        mine = (pairs * weights.unsqueeze(-1)).sum(dim=1)
        return _gather_slices(mine, routes.token_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        pairs, weights, order = ctx.saved_tensors
        r: _Routes = ctx.routes
        rows = r.token_sizes[dist.get_rank(ctx.group)]
        mine = grad[r.start: r.start + rows]
        grad_pairs = (weights.unsqueeze(-1) * mine.unsqueeze(1)).reshape(rows * r.k, -1)
        grad_weights = (pairs * mine.unsqueeze(1)).sum(dim=-1).to(ctx.weights_dtype)
        received = torch.empty_like(grad_pairs)
        received[order] = grad_pairs
        grad_outputs = _all_to_all(received, r.recv, r.send, ctx.group, r.busiest_rows)
        grad_all_weights = _gather_slices(grad_weights.contiguous(), r.token_sizes, ctx.group)
        return grad_outputs, grad_all_weights.view(ctx.weights_shape), None, None


# -- the layer -------------------------------------------------------------------------------------
class ExpertParallel(nn.Module):
    """A recognised experts module on one rank of its ``split`` group: experts
    ``[first, first + counts[tp_index])`` of ``layout.experts``. Holds no parameter of its own:
    the stage graph passes the (cut) stacked weights, which stay under their state-dict keys
    (``targets``: parameter name -> its attribute path in the stage module). ``last_pairs``: the
    pairs its experts ran in the last forward (the load the routing gave this rank)."""

    def __init__(self, layout: ExpertsLayout, counts: Sequence[int], tp_index: int, group: ProcessGroup,
                 act: fx.GraphModule, targets: Mapping[str, str], emulator: Optional[Emulator] = None):
        super().__init__()
        self.layout, self.counts, self.tp_index, self.group = layout, list(counts), tp_index, group
        self.first = sum(self.counts[:tp_index])
        self.act, self.targets, self.emulator = act, dict(targets), emulator
        self.last_pairs = 0     # (token, expert) pairs this rank's experts ran in the last forward

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                up: torch.Tensor, down: torch.Tensor, up_bias: Optional[torch.Tensor] = None,
                down_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        held = [p for p in (up, down, up_bias, down_bias) if p is not None]
        if isinstance(hidden, FakeTensor):
            # the pipeline's fake run for its boundary shapes: the routing is data-dependent, and only
            # the output's shape, dtype and requires_grad are asked for (every rank skips it alike)
            return (hidden + sum(p.sum() for p in held) * 0 + top_k_weights.sum() * 0).to(hidden.dtype)
        routes = _Routes.of(top_k_index, self.counts, self.tp_index)
        self.last_pairs = int(routes.local.numel())
        x = _Dispatch.apply(hidden, routes, self.group)
        order = torch.sort(routes.local_expert, stable=True).indices
        per_expert = torch.bincount(routes.local_expert, minlength=self.counts[self.tp_index]).tolist()
        outputs = []
        for e, rows in enumerate(x.index_select(0, order).split(per_expert)):
            if rows.shape[0]:
                outputs.append(self._expert(rows, e, up, down, up_bias, down_bias))
        # every rank runs both collectives' backward, and every held weight gets a gradient (zero
        # for an expert no token chose, as unsharded), even when no pair came here
        touch = x.sum() + sum(p.sum() for p in held)
        sorted_out = torch.cat(outputs) if outputs else x.new_zeros((0, self.layout.hidden))
        sorted_out = sorted_out + touch * 0
        local = sorted_out.index_select(0, torch.argsort(order))
        # the unsharded layer returns its input's dtype (under autocast the weighted sum is float32)
        return _Combine.apply(local, top_k_weights, routes, self.group).to(hidden.dtype)

    def _expert(self, x, e, up, down, up_bias, down_bias):
        lay = self.layout
        h = local_linear(x, up[e].t() if lay.transposed else up[e], None if up_bias is None else up_bias[e], self.emulator)
        if lay.gated:
            gate, value = h.chunk(2, dim=-1)     # transformers' _default_apply_gate
            h = self.act(gate) * value
        else:
            h = self.act(h)
        return local_linear(h, down[e].t() if lay.transposed else down[e],
                            None if down_bias is None else down_bias[e], self.emulator)

    # -- what the state dict holds ----------------------------------------------------------------
    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked weight (also used to load a full state dict)."""
        return full.narrow(0, self.first, self.counts[self.tp_index]).clone()

    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """The stacked weight of every expert from each rank's ``local`` (a collective over the group)."""
        return all_gather_uneven(local.detach().contiguous(), self.counts, 0, self.group)

    def extra_repr(self) -> str:
        return (f"{self.layout.path}: experts [{self.first}, {self.first + self.counts[self.tp_index]}) of "
                f"{self.layout.experts}, counts={self.counts}, top_k={self.layout.top_k}")


# -- the graph rewrite ----------------------------------------------------------------------------
def shard_experts(gm: fx.GraphModule, region: set[str], shard_sizes: Mapping[str, Sequence[int]], tp_index: int,
                  group: ProcessGroup, emulator: Optional[Emulator]) -> dict[str, str]:
    """Replace every recognised experts module of ``gm``'s ``split`` region by :class:`ExpertParallel`
    with the plan's expert counts, in place; log the ones left whole. Returns ``{path: "experts"}``."""
    found, skipped = find_experts(gm, region)
    for path, why in skipped.items():
        log.info("split: the mixture-of-experts layer %s stays whole on every rank (not recognised: %s)", path, why)
    roles = {}
    for i, f in enumerate(found):
        path = f.layout.path
        counts = _counts(f.layout, shard_sizes, group)
        layer = ExpertParallel(f.layout, counts, tp_index, group, _act_module(f), {}, emulator)
        for name, node in f.params.items():
            full = attribute(gm, node.target)
            local = nn.Parameter(layer.shard_of(full.detach()), requires_grad=full.requires_grad)
            owner, _, leaf = node.target.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, leaf, local)
            layer.targets[name] = node.target
        name = f"_wl_experts_{i}"
        gm.add_module(name, layer)
        with gm.graph.inserting_before(f.output):
            call = gm.graph.call_module(name, (f.hidden, f.index, f.weights,
                                               *(f.params[p] for p in f.layout.param_names)))
        call.meta = dict(f.output.meta)
        f.output.replace_all_uses_with(call)
        _erase(gm, f)
        roles[path] = "experts"
        log.info("split: %s is expert parallel: tensor-parallel rank %d holds experts [%d, %d) of %d (counts %s)",
                 path, tp_index, layer.first, layer.first + counts[tp_index], f.layout.experts, counts)
    if found:
        gm.graph.lint()
        gm.recompile()
    return roles


def _counts(layout: ExpertsLayout, shard_sizes: Mapping[str, Sequence[int]], group: ProcessGroup) -> list[int]:
    if layout.path not in shard_sizes:
        raise WhaleError(
            f"split region: the mixture-of-experts layer {layout.path!r} has no entry in the plan's shard_sizes "
            f"(entries: {sorted(shard_sizes)}); re-plan with the current capture of the model")
    counts = [int(n) for n in shard_sizes[layout.path]]
    world = dist.get_world_size(group) if dist.is_initialized() else len(counts)
    if sum(counts) != layout.experts or min(counts) < 1 or len(counts) != world:
        raise WhaleError(
            f"split region: the plan's shard_sizes[{layout.path!r}] = {counts} must give each of the group's "
            f"{world} ranks at least one of the layer's {layout.experts} experts, summing to {layout.experts}; re-plan")
    return counts


def _act_module(found: FoundExperts) -> fx.GraphModule:
    """The layer's activation as a graph of its own: its ``act_fn`` operators, copied."""
    source, result = act_inputs(found.act)
    graph = fx.Graph()
    env = {source: graph.placeholder("x")}
    for node in found.act:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[result])
    return fx.GraphModule(nn.Module(), graph)


def _erase(gm: fx.GraphModule, found: FoundExperts) -> None:
    """The layer's operators, then the shape computations only they used."""
    for node in reversed(found.nodes):
        if not node.users:
            gm.graph.erase_node(node)
    path = found.layout.path
    for node in reversed(list(gm.graph.nodes)):
        where = node.meta.get("wl_path", "")
        if not node.users and node.op == "call_function" and (where == path or where.startswith(path + ".")) \
                and not isinstance(node.meta.get("val"), torch.Tensor):
            gm.graph.erase_node(node)


def experts_layers(module: nn.Module) -> list[tuple[str, ExpertParallel]]:
    """``(prefix of the module holding the stacked weights' paths, layer)`` of every :class:`ExpertParallel` in ``module``."""
    out = []
    for prefix, layer in module.named_modules():
        if isinstance(layer, ExpertParallel):
            parent = prefix.rpartition(".")[0]
            out.append((f"{parent}." if parent else "", layer))
    return out
