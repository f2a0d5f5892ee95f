"""Gradient clipping by the global norm of the whole model, over a plan whose ranks each hold a part.

Why not ``torch.nn.utils.clip_grad_norm_``: on one rank it computes the norm of that rank's
gradients, and on a plan those are not the model's. A rank of a later pipeline stage holds other
parameters than the first stage's; data-parallel replicas hold copies of the same ones (counted
once, not once per replica); a tensor-parallel stage holds shards of its sharded weights and
copies of its replicated pieces (layer norms, embeddings); a tied weight sits on two stages. Each
rank clipping by its own norm would scale the replicas of one parameter differently. FSDP2 and
torchtitan solve it for DTensors (the norm of a sharded DTensor is reduced over its mesh); our
shards are uneven and partly fused, neither DTensors nor ShardedTensors.

How: every rank's holding of every parameter is already described, the way live re-plans and
checkpoints describe it (:class:`planner.balance.state_moves.Slab`, from the executor's
``named_state()``). :class:`GlobalGradNorm` gathers those descriptions once per executor and gives
each element of each parameter one owner: the lowest rank that holds it (a whole tensor, or the
part of a shard no lower rank holds). Each step every rank sums the squares of the gradient
elements it owns, one all-reduce over the plan adds them, and the square root is the norm of the
whole model's gradient: each element counted exactly once. Every rank then scales every gradient
it holds (owned or not: copies must stay equal) by the same coefficient, the one
``clip_grad_norm_`` uses: ``min(1, max_norm / (norm + 1e-6))``.

Invariant: the owners partition the elements of every parameter that has a gradient; the norm is
the same on every rank (one all-reduce), so every copy of a parameter is scaled alike.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.balance.state_moves import Slab
from runtime.replicas.held_state import NamedState, local
from whalelike.errors import WhaleError

EPS = 1e-6   # clip_grad_norm_'s: max_norm / (norm + EPS)


class ClippingError(WhaleError):
    """A clipping norm or holding that cannot be clipped; the message names it and the fix."""


def check_max_norm(max_norm) -> Optional[float]:
    """``max_norm`` as a float (None: no clipping); a clear error for a negative, zero, NaN or
    non-number norm."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not math.isfinite(max_norm) \
            or max_norm <= 0:
        raise ClippingError(f"clip_grad_norm must be a positive finite number (the largest global gradient norm, "
                            f"1.0 in most recipes) or None for no clipping, got {max_norm!r}")
    return float(max_norm)


def _canonical(name: str) -> str:
    return name.split("@", 1)[0]


def _intervals(slab: Slab, dim: Optional[int]) -> list[tuple[int, int]]:
    """What ``slab`` holds along ``dim`` (all of it when whole)."""
    if slab.dim is None:
        return [(0, slab.shape[dim])] if dim is not None else [(0, 1)]
    return list(slab.ranges)


def _subtract(pieces: list[tuple[int, int]], covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``pieces`` outside every interval of ``covered``."""
    out = []
    for a, b in pieces:
        cuts = [(a, b)]
        for c, d in covered:
            cuts = [part for lo, hi in cuts for part in ((lo, min(hi, c)), (max(lo, d), hi)) if part[0] < part[1]]
        out.extend(cuts)
    return out


class GlobalGradNorm:
    """The global gradient norm of the parameters in ``held`` (this rank's ``named_state()``) and
    those of every other rank of ``group`` (see the module docstring). Collective to build (one
    ``all_gather_object``) and per :meth:`clip_` (one all-reduce)."""

    def __init__(self, held: NamedState, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        rank = dist.get_rank(group)
        mine = {name: slab for name, (t, slab) in held.items()
                if isinstance(t, nn.Parameter) and "@" not in name}
        described: list[dict] = [None] * dist.get_world_size(group)
        dist.all_gather_object(described, mine, group=group)
        # every local tensor of a parameter (copies "name@key" too) is scaled; owned parts are counted
        self.params = [tensor for tensor, _ in held.values() if isinstance(tensor, nn.Parameter)]
        self.owned: list[tuple[nn.Parameter, Optional[int], list[tuple[int, int]]]] = []
        for name, slab in mine.items():
            holders = [(r, d[name]) for r, d in enumerate(described) if name in d]
            dims = {s.dim for _, s in holders if s.dim is not None}
            if len(dims) > 1:
                raise ClippingError(f"parameter {name} is sharded along dimensions {sorted(dims)} by different "
                                    "ranks; clip_grad_norm cannot count its elements once (plan it with one "
                                    "shard dimension)")
            dim = dims.pop() if dims else None
            covered = [iv for r, s in holders if r < rank for iv in _intervals(s, dim)]
            own = _subtract(_intervals(slab, dim), covered)
            if own:
                self.owned.append((held[name][0], dim, self._local(slab, dim, own)))

    @staticmethod
    def _local(slab: Slab, dim: Optional[int], own: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``own`` (full-tensor intervals along ``dim``) as intervals of the local tensor, which
        concatenates the slab's ranges in order."""
        if dim is None:
            return [(0, 1)]
        local, offset = [], 0
        for a, b in _intervals(slab, dim):
            for c, d in own:
                lo, hi = max(a, c), min(b, d)
                if lo < hi:
                    local.append((offset + lo - a, offset + hi - a))
            offset += b - a
        return local

    def norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (float32, float64 for a float64 model; equal on
        every rank; collective)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        wide = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        squares = torch.zeros((), dtype=wide, device=device)
        for param, dim, pieces in self.owned:
            grad = param.grad
            if grad is None:
                continue
            grad = local(grad)
            for lo, hi in pieces:
                part = grad if dim is None else grad.narrow(dim, lo, hi - lo)
                squares += torch.linalg.vector_norm(part, 2, dtype=wide) ** 2
        if dist.get_backend(self.group) == "nccl" and squares.device.type != "cuda":
            squares = squares.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt()

    @torch.no_grad()
    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient this rank holds so the whole model's norm is at most ``max_norm``;
        returns the norm before clipping (a non-finite norm scales nothing: the step is skipped)."""
        total = self.norm()
        coef = torch.clamp(max_norm / (total + EPS), max=1.0)
        if torch.isfinite(total):
            for param in self.params:
                if param.grad is not None:
                    local(param.grad).mul_(coef.to(param.grad.device))
        return total
