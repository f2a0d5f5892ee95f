"""The ``ragged`` replica sync: ZeRO stages 1 and 2 with memory-proportional (ragged) state shards.

Why not FSDP2 (:mod:`runtime.replicas.fsdp_sync`): FSDP2 cuts every parameter into even chunks
(``torch.chunk``), padded to the largest, so each rank holds 1/n of the state whatever its memory;
ragged shards are an open request upstream (pytorch issue 169320, "RaggedShard"). Here rank ``r``
holds a fraction ``f_r`` of every parameter's rows (``StagePlan.state_fractions``, chosen by the
planner from the memory each device has left after its activations, as Cephalo does), so a 16 GiB
device next to 80 GiB ones holds a fifth of what they hold.

How it runs (one data-parallel group, a single-stage plan):

* The module keeps its parameters whole (the forward and backward run as under DDP). Each rank also
  holds its rows of each parameter as a parameter of its own (``shards``): the optimizer steps those
  (:meth:`parameters`), so its state is ``f_r`` of the whole. Element-wise optimizers (SGD, Adam,
  AdamW) are exact on any cut of a tensor; one that reads whole tensors (LAMB's trust ratio,
  Adafactor's factored moments) is not, and is not offered.
* Gradients: a hook after each parameter's gradient is accumulated reduce-scatters it (summed: the
  losses carry ``n_i / B``, so the sum is the global-batch mean's gradient) into the rank's rows
  and frees the full gradient. Stage 1 does it only in the syncing backward (every micro-batch but
  the rank's last accumulates the full gradient, so ranks may run different micro-batch counts);
  stage 2 in every backward (every rank runs the same number of micro-batches).
* Parameters: before a forward, if the optimizer changed any shard (its version counter moved), the
  rows are all-gathered back into the whole parameters.
* The collectives are ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` of each parameter's
  rows padded to the largest rank's (one collective per parameter; the padding is the largest
  share minus each rank's: cheap when the fractions are close, up to n-fold traffic when one rank
  holds almost everything).

What a rank holds (:meth:`named_state`): each parameter's rows as a dim-0
:class:`~planner.balance.state_moves.Slab` on its shard tensor (nothing when it holds no row), each
buffer whole; so checkpoints and re-plans move ragged holdings like any others.

Invariant: the whole parameters always equal the concatenation of the shards before any forward
(refreshed lazily), the shards are the state of record (optimizer, checkpoints, clipping), and every
rank of the group issues the same collectives in the same order (parameters in module order).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.balance.state_moves import Slab
from runtime.emulation.compute import Emulator
from runtime.replicas.held_state import NamedState, module_state
from whalelike.errors import WhaleError


class RaggedSyncError(WhaleError):
    """A ragged ZeRO sync cannot be built as the plan asks."""


def ragged_rows(rows: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Each rank's ``[start, stop)`` of ``rows`` rows in proportion to ``fractions`` (largest
    remainder; a rank may get none), in rank order."""
    total = sum(fractions)
    exact = [rows * f / total for f in fractions]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[:rows - sum(counts)]:
        counts[i] += 1
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


class RaggedSync:
    """:class:`runtime.replicas.replica_sync.ReplicaSync` with ragged ZeRO shards at ``stage`` 1 or 2
    (see the module docstring). ``fractions``: the group's state fractions in group rank order."""

    name = "ragged"
    syncs = True

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup], *, stage: int,
                 fractions: Sequence[float], emulator: Optional[Emulator] = None,
                 devices: Optional[Sequence[str]] = None, reduce_dtype: Optional[torch.dtype] = None):
        group = group if group is not None else dist.group.WORLD
        n = dist.get_world_size(group)
        if stage not in (1, 2):
            raise RaggedSyncError(f"StagePlan.zero_stage is {stage!r} for the 'ragged' replica sync; ragged shards run "
                                  "at ZeRO stages 1 and 2 (stage 3: replica_sync 'fsdp', even shards)")
        if len(fractions) != n or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
            raise RaggedSyncError(f"StagePlan.state_fractions {list(fractions)} must be {n} fractions >= 0 summing to 1 "
                                  f"(one per worker of the data-parallel group); make the plan with `whalelike plan`")
        if reduce_dtype is not None:
            raise RaggedSyncError("grad_reduce_dtype='bf16' is not available with ZeRO (replica_sync 'ragged'); leave it "
                                  "unset")
        self.inner, self.group, self.stage = module, group, stage
        self.size, self.rank = n, dist.get_rank(group)
        self.emulator = emulator or Emulator.disabled()
        network = self.emulator.network if self.emulator.enabled and devices is not None else None
        self.ring = network.ring(tuple(devices)) if network is not None else None
        self.network = network
        _broadcast(module, group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.rows = {id(p): ragged_rows(p.shape[0] if p.dim() else 1, fractions) for p in self.params}
        self.shards: list[nn.Parameter] = []
        with torch.no_grad():
            for p in self.params:
                a, b = self.rows[id(p)][self.rank]
                flat = p.reshape(p.shape[0] if p.dim() else 1, -1)
                self.shards.append(nn.Parameter(flat[a:b].reshape((b - a,) + tuple(p.shape[1:])).clone()))
        self._versions = [s._version for s in self.shards]
        self._syncing = True
        self._passenger: Optional[tuple[torch.Tensor, Optional[Callable]]] = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._reduce) for p in self.params]
        self._hooks.append(module.register_forward_pre_hook(lambda _m, _a: self.refresh()))
        self._index = {id(p): i for i, p in enumerate(self.params)}

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.inner

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: this rank's rows of each parameter."""
        return list(self.shards)

    def no_sync(self) -> AbstractContextManager:
        """Stage 1: accumulate full gradients (no collective). Stage 2: every backward reduce-scatters."""
        return self._held() if self.stage == 1 else _null()

    @contextmanager
    def _held(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        self._syncing = True

    def carry(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        self._passenger = (tensor, fill)

    def flush(self) -> None:
        if self._passenger is not None:
            (tensor, fill), self._passenger = self._passenger, None
            if fill is not None:
                fill(tensor)
            dist.all_reduce(tensor, group=self.group)

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
        """Each parameter's rows (its shard tensor, a dim-0 Slab; none when it holds no row), buffers whole."""
        out: NamedState = {}
        shard_of = {id(p): s for p, s in zip(self.params, self.shards)}
        for name, (tensor, slab) in module_state(self.inner, names).items():
            if id(tensor) in shard_of:
                a, b = self.rows[id(tensor)][self.rank]
                if b <= a:
                    continue
                if tensor.dim() == 0:
                    out[name] = (shard_of[id(tensor)], Slab(()))
                    continue
                out[name] = (shard_of[id(tensor)], Slab(tuple(tensor.shape), 0, ((a, b),)))
            else:
                out[name] = (tensor, slab)
        return out

    def current(self) -> None:
        """Make the whole parameters current (after an optimizer step or a load of the shards)."""
        self.refresh()

    @torch.no_grad()
    def loaded(self) -> None:
        """The whole parameters were overwritten (every rank the same values): take the shards from them."""
        for p, shard in zip(self.params, self.shards):
            a, b = self.rows[id(p)][self.rank]
            flat = p.reshape(p.shape[0] if p.dim() else 1, -1)
            shard.copy_(flat[a:b].reshape(shard.shape))
        self._versions = [s._version for s in self.shards]

    def release(self) -> nn.Module:
        """The whole parameters made current, every hook removed; this sync is not used again."""
        self.refresh(force=True)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        return self.inner

    # -- the work -------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, force: bool = False) -> None:
        """All-gather the shards into the whole parameters if the optimizer (or a load) changed any."""
        versions = [s._version for s in self.shards]
        if not force and versions == self._versions:
            return
        for p, shard in zip(self.params, self.shards):
            rows = self.rows[id(p)]
            widest = max(b - a for a, b in rows)
            if widest == 0:
                continue
            inner = p.numel() // (p.shape[0] if p.dim() else 1)
            padded = torch.zeros(widest, inner, dtype=p.dtype, device=p.device)
            padded[: shard.shape[0] if shard.dim() else 1].copy_(shard.detach().reshape(-1, inner))
            out = torch.empty(self.size * widest, inner, dtype=p.dtype, device=p.device)
            dist.all_gather_into_tensor(out, padded, group=self.group)
            self._pad("allgather", out)
            flat = p.data.reshape(-1, inner)
            for r, (a, b) in enumerate(rows):
                if b > a:
                    flat[a:b].copy_(out[r * widest: r * widest + b - a])
        self._versions = [s._version for s in self.shards]

    @torch.no_grad()
    def _reduce(self, p: torch.Tensor) -> None:
        """After ``p``'s gradient is accumulated: in a syncing backward, reduce-scatter it (summed) into
        this rank's shard's gradient and free it."""
        if not self._syncing or p.grad is None:
            return
        shard = self.shards[self._index[id(p)]]
        rows = self.rows[id(p)]
        widest = max(b - a for a, b in rows)
        inner = p.numel() // (p.shape[0] if p.dim() else 1)
        grad = p.grad.reshape(-1, inner)
        padded = torch.zeros(self.size * widest, inner, dtype=grad.dtype, device=grad.device)
        for r, (a, b) in enumerate(rows):
            if b > a:
                padded[r * widest: r * widest + b - a].copy_(grad[a:b])
        out = torch.empty(widest, inner, dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, padded, group=self.group)
        self._pad("allgather", padded)
        a, b = rows[self.rank]
        mine = out[: b - a].reshape(shard.shape)
        if shard.grad is None:
            shard.grad = mine.clone()
        else:
            shard.grad.add_(mine)
        p.grad = None

    def _pad(self, kind: str, tensor: torch.Tensor) -> None:
        """Under the emulated network: sleep the collective's modeled ring time."""
        if self.ring is None:
            return
        import time
        seconds = self.ring.allgather_ms(tensor.numel() * tensor.element_size()) * 1e-3
        self.network.stats.allreduces += 1
        self.network.stats.allreduce_modeled_s += seconds
        time.sleep(seconds)


@contextmanager
def _null():
    yield


@torch.no_grad()
def _broadcast(module: nn.Module, group: dist.ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)
