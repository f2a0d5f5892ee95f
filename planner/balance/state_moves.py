"""Which pieces of which tensors go from which rank to which, when a plan changes under training.

Re-planning at a step boundary (moving pipeline layers between stages, changing tensor-parallel
shard sizes) changes what each rank holds of the model: a layer that moves to the next stage must
arrive there with its parameters, buffers and optimizer state; a column projection resharded from
3:1 to 1:3 heads needs two heads to travel from rank 0 to rank 1. This module decides the moves,
purely from descriptions of what every rank holds before and after; :mod:`runtime.state.transfer`
executes them.

A rank's holding of a named tensor is a :class:`Slab`: the whole tensor, or a shard given by the
``[start, stop)`` ranges along one dimension it holds, in local order (one range for a plain
shard, one per part for a fused projection whose local slice is one piece of each of q, k and v).
:func:`plan_moves` returns :class:`Move` s in full-tensor coordinates.

Rules (the invariant: every entry each rank needs under the new plan has exactly one move, from a
rank that held it under the old plan):

* what a rank already holds stays local (a move with ``src == dst``: a local copy, no traffic);
* a piece held by several ranks is taken from the one that has sent the least so far (then the
  lowest rank), so data-parallel copies share the sending; the choice depends only on the
  descriptions, so every rank computes the same moves;
* a piece held by no rank is an error naming the tensor, the piece and the ranks that hold parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping, Optional

Range = tuple[int, int]


class StateMoveError(ValueError):
    """The old and new holdings do not fit together (a needed piece has no holder, shapes differ)."""


@dataclass(frozen=True)
class Slab:
    """What a rank holds of a tensor of full shape ``shape``: all of it (``dim`` None), or the
    ``ranges`` ``[start, stop)`` along ``dim``, concatenated in this order in its local tensor."""

    shape: tuple[int, ...]
    dim: Optional[int] = None
    ranges: tuple[Range, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "ranges", tuple((int(a), int(b)) for a, b in self.ranges))
        if self.dim is None:
            if self.ranges:
                raise StateMoveError(f"Slab{self.shape}: ranges {self.ranges} given without a dim; pass dim too")
            return
        if not 0 <= self.dim < len(self.shape):
            raise StateMoveError(f"Slab{self.shape}: dim {self.dim} is not a dimension of the tensor")
        full = self.shape[self.dim]
        if not self.ranges or any(not 0 <= a < b <= full for a, b in self.ranges):
            raise StateMoveError(f"Slab{self.shape}: ranges {self.ranges} along dim {self.dim} must be non-empty "
                                 f"[start, stop) within [0, {full})")
        ordered = sorted(self.ranges)
        if any(b > c for (_, b), (c, _) in zip(ordered, ordered[1:])):
            raise StateMoveError(f"Slab{self.shape}: ranges {self.ranges} along dim {self.dim} overlap")

    @property
    def whole(self) -> bool:
        return self.dim is None

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the local tensor holding this slab."""
        if self.dim is None:
            return self.shape
        return self.shape[:self.dim] + (sum(b - a for a, b in self.ranges),) + self.shape[self.dim + 1:]

    def pieces(self, dim: Optional[int]) -> tuple[Range, ...]:
        """The ranges held along ``dim`` (a whole tensor holds ``[0, size)``; 0-dim: ``[0, 1)``)."""
        if dim is None:
            return ((0, 1),)
        return self.ranges if self.dim is not None else ((0, self.shape[dim]),)

    def local_offset(self, dim: Optional[int], lo: int) -> int:
        """Where full-tensor position ``lo`` along ``dim`` sits in the local tensor."""
        if dim is None or self.dim is None:
            return lo
        offset = 0
        for a, b in self.ranges:
            if a <= lo < b:
                return offset + lo - a
            offset += b - a
        raise StateMoveError(f"Slab{self.shape}: position {lo} along dim {dim} is not held (ranges {self.ranges})")


@dataclass(frozen=True)
class Move:
    """Entries ``[lo, hi)`` along ``dim`` of tensor ``name`` (full-tensor coordinates, every other
    dimension whole) go from rank ``src`` to rank ``dst``; ``dim`` None is a 0-dim tensor (lo 0,
    hi 1). ``elements`` is the number of entries moved."""

    name: str
    src: int
    dst: int
    dim: Optional[int]
    lo: int
    hi: int
    elements: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


def plan_moves(old: Mapping[int, Mapping[str, Slab]], new: Mapping[int, Mapping[str, Slab]]) -> list[Move]:
    """Moves that give every rank what ``new`` says it holds, from what ``old`` says the ranks held.

    ``old``/``new``: rank -> tensor name -> :class:`Slab`. Tensors in ``old`` that ``new`` does not
    name are dropped. Deterministic: the same input gives the same list, in (name, dst, position) order.
    """
    holders: dict[str, list[tuple[int, Slab]]] = {}
    for rank in sorted(old):
        for name, slab in old[rank].items():
            holders.setdefault(name, []).append((rank, slab))
    sent: dict[int, int] = {}
    moves: list[Move] = []
    for name in sorted({n for held in new.values() for n in held}):
        wanted = [(rank, new[rank][name]) for rank in sorted(new) if name in new[rank]]
        have = holders.get(name)
        if not have:
            raise StateMoveError(f"tensor {name!r} is needed by rank(s) {[r for r, _ in wanted]} under the new plan "
                                 "but no rank holds it under the old one; the old executor must describe every "
                                 "tensor the new one holds (named_state), under the model's names")
        dim = _common_dim(name, have + wanted)
        for dst, slab in wanted:
            mine = dict(have).get(dst)
            for lo, hi in slab.pieces(dim):
                for piece in _cover(name, dst, dim, lo, hi, slab, mine, have, sent):
                    if moves and _extends(moves[-1], piece, have, slab, dim):
                        last = moves[-1]
                        moves[-1] = Move(name, last.src, dst, dim, last.lo, piece.hi,
                                         last.elements + piece.elements)
                    else:
                        moves.append(piece)
    return moves


def _common_dim(name: str, slabs: list[tuple[int, Slab]]) -> Optional[int]:
    """The one dimension the holders shard ``name`` along (the first for an unsharded tensor, None for 0-dim)."""
    shapes = {s.shape for _, s in slabs}
    if len(shapes) != 1:
        raise StateMoveError(f"tensor {name!r} has different full shapes on different ranks: "
                             f"{ {r: s.shape for r, s in slabs} }; the plans must be of the same model")
    (shape,) = shapes
    dims = {s.dim for _, s in slabs if s.dim is not None}
    if len(dims) > 1:
        raise StateMoveError(f"tensor {name!r} is sharded along different dimensions {sorted(dims)} by the old and "
                             f"new plans ({ {r: s.dim for r, s in slabs} }); a move between those layouts is not "
                             "supported: keep each projection's column/row role when re-planning")
    if dims:
        return dims.pop()
    return 0 if shape else None


def _cover(name: str, dst: int, dim: Optional[int], lo: int, hi: int, want: Slab, mine: Optional[Slab],
           have: list[tuple[int, Slab]], sent: dict[int, int]) -> list[Move]:
    """Moves covering ``[lo, hi)`` for ``dst``: cut at every holder's range boundary, each segment
    from ``dst`` itself if it held it, else from the holder that has sent the least."""
    cuts = {lo, hi}
    for _, slab in have:
        for a, b in slab.pieces(dim):
            cuts.update(c for c in (a, b) if lo < c < hi)
    points = sorted(cuts)
    per_entry = 1 if dim is None else prod(want.shape) // want.shape[dim]
    out = []
    for a, b in zip(points, points[1:]):
        if mine is not None and _holds(mine, dim, a, b):
            src = dst
        else:
            candidates = [r for r, slab in have if _holds(slab, dim, a, b)]
            if not candidates:
                holding = {r: s.pieces(dim) for r, s in have}
                raise StateMoveError(f"tensor {name!r}: rank {dst} needs [{a}, {b}) along dim {dim} under the new "
                                     f"plan, but no rank holds it under the old plan (holders: {holding}); the "
                                     "old plan's shards must cover the whole tensor")
            src = min(candidates, key=lambda r: (sent.get(r, 0), r))
            sent[src] = sent.get(src, 0) + (b - a) * per_entry
        out.append(Move(name, src, dst, dim, a, b, (b - a) * per_entry))
    return out


def _holds(slab: Slab, dim: Optional[int], lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b in slab.pieces(dim))


def _extends(last: Move, piece: Move, have: list[tuple[int, Slab]], want: Slab, dim: Optional[int]) -> bool:
    """Whether ``piece`` continues ``last`` contiguously in both the source's and the destination's
    local tensors (inside one range of each), so the two are one move."""
    if (last.name, last.src, last.dst) != (piece.name, piece.src, piece.dst) or last.hi != piece.lo:
        return False
    source = dict(have)[piece.src]
    return _holds(source, dim, last.lo, piece.hi) and _holds(want, dim, last.lo, piece.hi)
