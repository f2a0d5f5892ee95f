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
* Gradients: hooks after each parameter's gradient is accumulated reduce-scatter its bucket once
  complete (summed: the losses carry ``n_i / B``, so the sum is the global-batch mean's gradient)
  into the rank's rows, and free the whole gradients. Stage 1 does it only in the syncing backward (every micro-batch but
  the rank's last accumulates the full gradient, so ranks may run different micro-batch counts);
  stage 2 in every backward (every rank runs the same number of micro-batches).
* Parameters: before the first forward after a syncing backward (the optimizer steps the shards in
  between) or after the shards were handed out (``named_state``: a checkpoint load or a state move
  may write them), the rows are all-gathered back into the whole parameters; the same events on
  every rank, so every rank gathers at the same forward.
* The collectives are ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` of flat buffers in
  which each rank's rows of the parameters sit one after another, padded to the largest rank's
  segment, one all-gather and one reduce-scatter per bucket (at stage 1, 1 MiB of parameters in
  reverse order; at stage 2 one parameter, so each full gradient is freed as soon as it is produced;
  reduce-scatters launched as soon as the bucket's gradients are all accumulated, the backward's end
  flushing any left). The padding costs ``n * max(f) - 1`` of the traffic, and every rank
  holds a padded buffer of ``n * max(f)`` times a bucket while it runs (why buckets are small):
  nothing extra with even fractions, up to n-fold when one rank holds almost everything. Why not list collectives of
  uneven sizes: gloo has none for reduce-scatter, and one padded call per bucket measured faster
  than one call per parameter (BENCHMARKS.md, ``bench/zero_hetero.py``).

What a rank holds (:meth:`named_state`): each parameter's rows as a dim-0
:class:`~planner.balance.state_moves.Slab` on its shard tensor (nothing when it holds no row), each
buffer whole; so checkpoints and re-plans move ragged holdings like any others.

Invariant: the whole parameters always equal the concatenation of the shards before any forward
(refreshed lazily), the shards are the state of record (optimizer, checkpoints, clipping), and every
rank of the group issues the same collectives in the same order (parameters in module order).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from planner.balance.state_moves import Slab
from runtime.emulation.compute import Emulator
from runtime.replicas.held_state import NamedState, module_state
from runtime.replicas.sync_parts import OwnPassenger
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


# whole parameters per bucket at ZeRO 1: a bucket's collective needs a padded buffer of n * max(f) times its
# bytes on every rank, the smallest device's too, so buckets stay small (1 MiB: 1.6 MiB padded with 4 ranks
# at 41% for the largest, next to a 20 MiB device) while still merging a model's many small parameters
BUCKET_BYTES = 2**20


class _Layout:
    """Where each rank's rows of some parameters sit in one padded flat buffer: ``slots[r][i]`` is
    ``(offset, elements)`` of parameter ``i``'s rows of rank ``r`` in rank ``r``'s segment; every
    segment is ``width`` elements (the largest rank's)."""

    def __init__(self, sync: "RaggedSync", indices):
        self.indices = list(indices)
        self.slots: list[dict[int, tuple[int, int]]] = []
        for r in range(sync.size):
            offset, slots = 0, {}
            for i in self.indices:
                a, b = sync.rows[id(sync.params[i])][r]
                slots[i] = (offset, (b - a) * sync.inner_sizes[i])
                offset += (b - a) * sync.inner_sizes[i]
            self.slots.append(slots)
        self.width = max(max((o + n for o, n in slots.values()), default=0) for slots in self.slots)
        first = sync.params[self.indices[0]] if self.indices else None
        self.dtype = first.dtype if first is not None else torch.float32
        self.device = first.device if first is not None else torch.device("cpu")


class RaggedSync(OwnPassenger):
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
        # the whole parameters need the shards gathered before the next forward: after every syncing
        # backward (the optimizer steps next) and after the shards were handed out by named_state()
        # (a checkpoint load or a state move may write them); the same events on every rank, so every
        # rank refreshes at the same forward (a rank's own view, such as version counters, would not
        # be: a rank holding no rows sees no change)
        self._stale = False
        # the buckets of the collectives: parameters in reverse order (as their gradients become ready),
        # cut at BUCKET_BYTES of whole parameters at stage 1, one parameter each at stage 2 (each full
        # gradient freed as soon as it is produced: the memory model's u, planner.devices.memory.parameter_share)
        cap = BUCKET_BYTES if stage == 1 else 0
        self.inner_sizes = [p.numel() // (p.shape[0] if p.dim() else 1) for p in self.params]
        self.buckets: list[_Layout] = []
        current: list[int] = []
        for i in reversed(range(len(self.params))):
            current.append(i)
            if sum(self.params[j].numel() * self.params[j].element_size() for j in current) >= cap:
                self.buckets.append(_Layout(self, current))
                current = []
        if current:
            self.buckets.append(_Layout(self, current))
        self._bucket_of = {i: b for b, layout in enumerate(self.buckets) for i in layout.indices}
        self._ready: list[set] = [set() for _ in self.buckets]
        self._next_bucket = 0
        self._callback_queued = False
        self._syncing = True
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
        return self._held() if self.stage == 1 else nullcontext()

    @contextmanager
    def _held(self):
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        self._syncing = True

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
        """Each parameter's rows (its shard tensor, a dim-0 Slab; none when it holds no row), buffers whole."""
        out: NamedState = {}
        self._stale = True            # the caller may write the shards (a checkpoint load, a state move)
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
        self._stale = False

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
        """All-gather the shards into the whole parameters (one padded collective) when they may have
        changed (see ``_stale``), or always with ``force``."""
        if not (force or self._stale):
            return
        for layout in self.buckets:
            if not layout.width:
                continue
            mine = torch.zeros(layout.width, dtype=layout.dtype, device=layout.device)
            for i, (offset, size) in layout.slots[self.rank].items():
                if size:
                    mine[offset: offset + size].copy_(self.shards[i].detach().reshape(-1))
            out = torch.empty(self.size * layout.width, dtype=layout.dtype, device=layout.device)
            dist.all_gather_into_tensor(out, mine, group=self.group)
            self._pad(out)
            for r in range(self.size):
                base = r * layout.width
                for i, (offset, size) in layout.slots[r].items():
                    if size:
                        a, b = self.rows[id(self.params[i])][r]
                        flat = self.params[i].data.reshape(-1, self.inner_sizes[i])
                        flat[a:b].copy_(out[base + offset: base + offset + size].view(b - a, -1))
        self._stale = False

    @torch.no_grad()
    def _reduce(self, p: torch.Tensor) -> None:
        """After ``p``'s gradient is accumulated, in a syncing backward: when its bucket is complete,
        reduce-scatter the bucket (summed, one padded collective) into the shards' gradients and free
        the whole gradients; the backward's end flushes buckets whose parameters got no gradient."""
        if not self._syncing:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_buckets)
        i = self._index[id(p)]
        b = self._bucket_of[i]
        self._ready[b].add(i)
        while self._next_bucket < len(self.buckets) and \
                len(self._ready[self._next_bucket]) == len(self.buckets[self._next_bucket].indices):
            self._reduce_bucket(self._next_bucket)

    @torch.no_grad()
    def _flush_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            self._reduce_bucket(self._next_bucket)
        self._next_bucket, self._callback_queued = 0, False
        self._stale = True            # the optimizer steps the shards next (on every rank alike)
        self._ready = [set() for _ in self.buckets]

    @torch.no_grad()
    def _reduce_bucket(self, b: int) -> None:
        layout = self.buckets[b]
        if not layout.width:        # no rank holds a row of these parameters (cannot happen: rows >= 1)
            self._next_bucket = b + 1
            return
        padded = torch.zeros(self.size * layout.width, dtype=layout.dtype, device=layout.device)
        for r in range(self.size):
            base = r * layout.width
            for i, (offset, size) in layout.slots[r].items():
                grad = self.params[i].grad
                if size and grad is not None:
                    a, b_ = self.rows[id(self.params[i])][r]
                    padded[base + offset: base + offset + size].copy_(grad.reshape(-1, self.inner_sizes[i])[a:b_].reshape(-1))
        out = torch.empty(layout.width, dtype=layout.dtype, device=layout.device)
        dist.reduce_scatter_tensor(out, padded, group=self.group)
        self._pad(padded)
        for i, (offset, size) in layout.slots[self.rank].items():
            shard = self.shards[i]
            if size:
                mine = out[offset: offset + size].view(shard.shape)
                if shard.grad is None:
                    shard.grad = mine.clone()
                else:
                    shard.grad.add_(mine)
            self.params[i].grad = None
        self._next_bucket = b + 1

    def _pad(self, tensor: torch.Tensor) -> None:
        """Under the emulated network: sleep the collective's modeled ring time."""
        if self.ring is None:
            return
        seconds = self.ring.allgather_ms(tensor.numel() * tensor.element_size()) * 1e-3
        self.network.stats.allreduces += 1
        self.network.stats.allreduce_modeled_s += seconds
        time.sleep(seconds)


@torch.no_grad()
def _broadcast(module: nn.Module, group: dist.ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)
