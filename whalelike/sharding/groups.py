"""Shard groups: the projections a ``split`` region shards together, as plain data.

A ``split`` TaskGraph shards whole transformer blocks Megatron-style: an attention block's q/k/v
projections are column-sharded and its output projection row-sharded *by heads*; an MLP's
up/gate projections column-sharded and its down projection row-sharded *by features*. Every
member of a group must be cut at the same places, or the activations between them (heads,
SwiGLU products) would not line up. So a group is described by

* ``units``: how many indivisible pieces the group has (attention: heads, or for grouped-query
  attention one key/value head with its query heads; multi-query attention: query heads, its k/v
  projections replicated and no members; an MLP: its hidden features), and
* per member, ``per_unit``: how many elements of its sharded dimension one unit holds
  (q_proj: ``head_dim`` times the query heads per unit; an MLP's up_proj: 1).

A plan gives every tensor-parallel rank a whole number of units, ``n_i`` with ``sum(n_i) ==
units``, and each member the sizes ``n_i * per_unit`` (``StagePlan.shard_sizes`` stays ``module
path -> size per rank``). A lone projection (its output needed whole, or a class-sharded
classifier) is a group of one member with ``per_unit`` 1. ``flops_per_sample`` is the forward and
backward work the group shards (its projections and every operator between them, attention
included), so the planner prices only that work as divided among ranks. Likewise
``activation_bytes_per_sample`` (captured at float32) and ``autocast_activation_bytes_per_sample``
(under bf16/fp16 autocast; 0 when not measured) are the saved activations the group divides: what
its column projections output and every operator between them makes, but not a column's input (or
autocast's cast of it) nor a row's all-reduced output, which every rank of the group holds whole.

Plain data without torch, so the planner can read it; :mod:`whalelike.sharding.analysis` finds the groups.
"""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class ShardMember:
    """One projection of a group. ``role`` "column" shards its output features, "row" its input
    features; ``pieces`` > 1 is a fused projection (GPT-2's ``c_attn``: q, k and v side by side),
    each piece cut into the group's units alike."""

    path: str
    role: str
    per_unit: int
    pieces: int = 1


@dataclass(frozen=True)
class ShardGroup:
    """Projections cut together into ``units`` (see the module docstring)."""

    units: int
    members: tuple[ShardMember, ...]
    kind: str = "mlp"
    flops_per_sample: float = 0.0
    activation_bytes_per_sample: float = 0.0
    autocast_activation_bytes_per_sample: float = 0.0

    def dim(self, member: ShardMember) -> int:
        """The full size of ``member``'s sharded dimension."""
        return self.units * member.per_unit

    def sizes(self, units_per_rank) -> dict[str, list[int]]:
        """``StagePlan.shard_sizes`` entries of the members for ``units_per_rank`` (one count per rank)."""
        return {m.path: [n * m.per_unit for n in units_per_rank] for m in self.members}

    def units_of(self, path: str, sizes) -> list[int] | None:
        """Units per rank that ``sizes`` of member ``path`` stand for, or None if not whole units."""
        member = next(m for m in self.members if m.path == path)
        if any(s % member.per_unit for s in sizes):
            return None
        return [s // member.per_unit for s in sizes]

    def structure(self) -> list:
        """The group without its costs (for fingerprints)."""
        return [self.units, self.kind, [[m.path, m.role, m.per_unit, m.pieces] for m in self.members]]

    def to_dict(self) -> dict:
        return {"units": self.units, "kind": self.kind, "flops_per_sample": self.flops_per_sample,
                "activation_bytes_per_sample": self.activation_bytes_per_sample,
                "autocast_activation_bytes_per_sample": self.autocast_activation_bytes_per_sample,
                "members": [[m.path, m.role, m.per_unit, m.pieces] for m in self.members]}

    @classmethod
    def from_dict(cls, data: dict) -> "ShardGroup":
        return cls(int(data["units"]), tuple(ShardMember(p, r, int(u), int(k)) for p, r, u, k in data["members"]),
                   data.get("kind", "mlp"), float(data.get("flops_per_sample", 0.0)),
                   float(data.get("activation_bytes_per_sample", 0.0)),
                   float(data.get("autocast_activation_bytes_per_sample", 0.0)))

    def describe(self) -> str:
        members = ", ".join(f"{m.path} ({m.role})" for m in self.members)
        return f"{self.kind} group of {self.units} units: {members}"


WHAT_SPLIT_SHARDS = (
    "nn.Linear and GPT-2 Conv1D projections: column/row pairs through elementwise operators (MLPs, "
    "gated MLPs such as SwiGLU), attention blocks by heads (q/k/v column, output projection row; "
    "grouped-query attention by key/value heads; multi-query attention by query heads, k/v whole), "
    "a lone projection (its output gathered), and a "
    "classifier whose logits go to F.cross_entropy / nn.CrossEntropyLoss / wl.token_cross_entropy"
)
