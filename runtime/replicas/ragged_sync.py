"""The ``ragged`` replica sync: ZeRO stages 1, 2 and 3 with memory-proportional (ragged) state shards.

Why not FSDP2 (:mod:`runtime.replicas.fsdp_sync`): FSDP2 cuts every parameter into even chunks
(``torch.chunk``), padded to the largest, so each rank holds 1/n of the state whatever its memory;
ragged shards are an open request upstream (pytorch issue 169320, "RaggedShard"). Here rank ``r``
holds a fraction ``f_r`` of every parameter's rows (``StagePlan.state_fractions``, chosen by the
planner from the memory each device has left after its activations, as Cephalo does), so a 16 GiB
device next to 80 GiB ones holds a fifth of what they hold.

How it runs (one data-parallel group: a data-parallel plan's, or one pipeline stage's):

* At stages 1 and 2 the module keeps its parameters whole (the forward and backward run as under DDP). Each rank also
  holds its rows of each parameter as a parameter of its own (``shards``): the optimizer steps those
  (:meth:`parameters`), so its state is ``f_r`` of the whole. Element-wise optimizers (SGD, Adam,
  AdamW) are exact on any cut of a tensor; one that reads whole tensors (LAMB's trust ratio,
  Adafactor's factored moments) is not, and is not offered.
* Gradients: hooks after each parameter's gradient is accumulated reduce-scatter its bucket once
  complete (summed: the losses carry ``n_i / B``, so the sum is the global-batch mean's gradient)
  into the rank's rows, and free the whole gradients. Stage 1 does it only in the syncing backward (every micro-batch but
  the rank's last accumulates the full gradient, so ranks may run different micro-batch counts);
  stage 2 in every backward (every rank runs the same number of micro-batches).
* Parameters: before the first forward after an optimizer step over the shards (a hook on every
  optimizer's step; every rank steps at once) or after the shards were handed out (``named_state``: a checkpoint load or a state move
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

Stage 3 (parameters sharded too): the whole parameters hold no storage between uses
(``untyped_storage().resize_(0)``, as FSDP does; autograd's saved references see the storage come
back). The units are the module's layers (``layers``: module paths, as FSDP2's units at stage 3;
a layer sharing a parameter with the rest of the model, as tied embeddings do, is none,
:func:`runtime.replicas.sync_parts.own_units`) and a root unit of the parameters in no layer. A layer unit is all-gathered (one padded
collective) before its forward and freed after it, gathered again when the backward reaches its
outputs (a hook on them) and freed once its gradients are reduce-scattered; the root unit is
gathered before the module's forward and stays until its gradients are reduced (its embedding
is the backward's last). A forward run again inside the backward (activation checkpointing) frees
nothing. Every micro-batch reduce-scatters, one unit per collective (equal micro-batch counts, as at
stage 2). No prefetch: the next unit's gather is issued when its forward starts (gloo's collectives
run on the calling thread; overlapping them would need a second stream of work, which CPU ranks
do not have), so the gathers are on the step's critical path (the planner prices them so).
A transient of one whole unit plus its padded buffer (``n * max(f)`` times the unit) is what a
rank holds beyond its fraction.

Invariant: at stages 1-2 the whole parameters always equal the concatenation of the shards before any forward
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
from torch.optim.optimizer import register_optimizer_step_post_hook

from planner.balance.state_moves import Slab
from planner.devices.memory import RAGGED_BUCKET_BYTES
from runtime.emulation.compute import Emulator
from runtime.replicas.held_state import NamedState, compute_device, is_materialised, module_state, place, place_one
from runtime.replicas.sync_parts import Exact, OwnPassenger, own_units
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
# at 41% for the largest, next to a 20 MiB device) while still merging a model's many small parameters;
# the planner's memory model prices the same buckets (one constant, owned there)
BUCKET_BYTES = RAGGED_BUCKET_BYTES


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


class RaggedSync(Exact, OwnPassenger):
    """:class:`runtime.replicas.replica_sync.ReplicaSync` with ragged ZeRO shards at ``stage`` 1, 2 or 3
    (see the module docstring). ``fractions``: the group's state fractions in group rank order;
    ``layers``: module paths of ``module``'s layers, the units of stage 3 (none: one unit);
    ``keep_whole``: parameters left whole and unsynced (the caller sums their gradients: weights
    tied to another pipeline stage, :mod:`runtime.parallel.tied_weights`)."""

    name = "ragged"
    gradients_in_place = gradients_as_views = False
    syncs = True

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup], *, stage: int,
                 fractions: Sequence[float], emulator: Optional[Emulator] = None,
                 devices: Optional[Sequence[str]] = None, reduce_dtype: Optional[torch.dtype] = None,
                 layers: Sequence[str] = (), keep_whole: Sequence[nn.Parameter] = (),
                 device: Optional[torch.device] = None):
        group = group if group is not None else dist.group.WORLD
        n = dist.get_world_size(group)
        if stage not in (1, 2, 3):
            raise RaggedSyncError(f"StagePlan.zero_stage is {stage!r} for the 'ragged' replica sync; ragged shards run "
                                  "at ZeRO stages 1, 2 and 3 (stage 0: replica_sync 'ddp')")
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
        # a module on the meta device: its whole parameters get storage (at stage 3 one at a time,
        # freed at once: they hold none between uses), its shards are made empty; the values come
        # from a checkpoint or an init written into the shards (named_state), gathered before use
        empty = self._empty = not is_materialised(module)
        device = compute_device(module, device)
        if not empty:
            place(module, device)
            _broadcast(module, group)
        elif stage == 3:
            for p in module.parameters():
                if p.is_meta:
                    place_one(p, device)
                    if not any(p is q for q in keep_whole):
                        p.untyped_storage().resize_(0)
            place(module, device)     # the buffers
        else:
            place(module, device)
        # parameters the caller syncs itself (tied to another pipeline stage) stay whole, outside the shards
        self.whole = [p for p in module.parameters() if any(p is q for q in keep_whole)]
        self.params = [p for p in module.parameters() if p.requires_grad and not any(p is q for q in keep_whole)]
        self.rows = {id(p): ragged_rows(p.shape[0] if p.dim() else 1, fractions) for p in self.params}
        self.shards: list[nn.Parameter] = []
        with torch.no_grad():
            for p in self.params:
                a, b = self.rows[id(p)][self.rank]
                shape = (b - a,) + tuple(p.shape[1:])
                if empty:
                    self.shards.append(nn.Parameter(torch.empty(shape, dtype=p.dtype, device=device)))
                    continue
                flat = p.reshape(p.shape[0] if p.dim() else 1, -1)
                self.shards.append(nn.Parameter(flat[a:b].reshape(shape).clone()))
        # the whole parameters need the shards gathered before the next forward: after an optimizer
        # step over the shards and after the shards were handed out by named_state()
        # (a checkpoint load or a state move may write them); the same events on every rank, so every
        # rank refreshes at the same forward (a rank's own view, such as version counters, would not
        # be: a rank holding no rows sees no change)
        self._stale = False
        self.inner_sizes = [p.numel() // (p.shape[0] if p.dim() else 1) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = []
        if stage == 3:
            # the units (module docstring): layers in reverse forward order, then the root's rest, so
            # the buckets complete in the order the backward produces their gradients
            self.buckets, unit_modules = self._units(module, layers)
        else:
            unit_modules = {}
            # the buckets of the collectives: parameters in reverse order (as their gradients become
            # ready), cut at BUCKET_BYTES of whole parameters at stage 1, one parameter each at stage 2
            # (each full gradient freed as soon as it is produced: the memory model's u,
            # planner.devices.memory.parameter_share)
            cap = BUCKET_BYTES if stage == 1 else 0
            self.buckets = []
            current: list[int] = []
            for i in reversed(range(len(self.params))):
                current.append(i)
                if sum(self.params[j].numel() * self.params[j].element_size() for j in current) >= cap:
                    self.buckets.append(_Layout(self, current))
                    current = []
            if current:
                self.buckets.append(_Layout(self, current))
        # stage 3: bucket -> the module whose forward gathers it (the layer units, then the root)
        self.unit_modules: dict[int, nn.Module] = unit_modules
        self._bucket_of = {i: b for b, layout in enumerate(self.buckets) for i in layout.indices}
        self._ready: list[set] = [set() for _ in self.buckets]
        self._next_bucket = 0
        self._callback_queued = False
        self._syncing = True
        self._hooks += [p.register_post_accumulate_grad_hook(self._reduce) for p in self.params]
        # an optimizer step over the shards changes them: gather again before the next use (every
        # rank steps at once, a rank holding no rows too: its empty shards are the optimizer's)
        self._shard_ids = {id(s) for s in self.shards}
        self._hooks.append(register_optimizer_step_post_hook(self._stepped))
        self._gathered: set[int] = set()       # stage 3: the buckets whose whole parameters hold storage
        if stage == 3:
            for b in range(len(self.buckets)):
                self._free(b)
            for b, unit in unit_modules.items():
                self._hooks.append(unit.register_forward_pre_hook(lambda _m, _a, b=b: self._gather(b)))
                self._hooks.append(unit.register_forward_hook(
                    lambda _m, _a, out, b=b, root=unit is module: self._after_forward(b, out, root)))
        else:
            self._hooks.append(module.register_forward_pre_hook(lambda _m, _a: self.refresh()))

    # -- the protocol ---------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.inner

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: this rank's rows of each parameter (and the parameters kept whole)."""
        return list(self.shards) + list(self.whole)

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
        self._invalidate()            # the caller may write the shards (a checkpoint load, a state move)
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
        """Make the whole parameters current (after an optimizer step or a load of the shards); at
        stage 3 they are gathered, and stay so until the next forward's units free them."""
        if self.stage == 3:
            for b in range(len(self.buckets)):
                self._gather(b)
        else:
            self.refresh()

    @torch.no_grad()
    def loaded(self) -> None:
        """The whole parameters were overwritten (every rank the same values; at stage 3 after
        :meth:`current` gave them storage): take the shards from them."""
        for p, shard in zip(self.params, self.shards):
            a, b = self.rows[id(p)][self.rank]
            flat = p.reshape(p.shape[0] if p.dim() else 1, -1)
            shard.copy_(flat[a:b].reshape(shard.shape))
        self._stale = False

    def release(self) -> nn.Module:
        """The whole parameters made current, every hook removed; this sync is not used again."""
        if self.stage == 3:
            self._invalidate()
            self.current()
        else:
            self.refresh(force=True)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        return self.inner

    # -- the work -------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, force: bool = False) -> None:
        """Stages 1-2: all-gather the shards into the whole parameters (one padded collective per
        bucket) when they may have changed (see ``_stale``), or always with ``force``."""
        if not (force or self._stale):
            return
        for layout in self.buckets:
            self._gather_layout(layout)
        self._stale = False

    @torch.no_grad()
    def _gather_layout(self, layout: "_Layout") -> None:
        """All-gather every rank's rows of ``layout``'s parameters into the whole parameters."""
        if not layout.width:
            return
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

    # -- stage 3: units gathered for use and freed after --------------------------------------------
    def _units(self, module: nn.Module, layers: Sequence[str]) -> tuple[list["_Layout"], dict[int, nn.Module]]:
        """Stage 3's buckets, one per unit (each layer's parameters not claimed by an earlier one, in
        reverse order, then the rest: the root), and the module whose forward gathers each."""
        claimed: set[int] = set()
        units: list[tuple[nn.Module, list[int]]] = []
        for path in own_units(module, layers):     # a tied weight's layers leave it to the root unit
            sub = module.get_submodule(path)
            indices = [self._index[id(p)] for p in sub.parameters() if id(p) in self._index and id(p) not in claimed]
            claimed.update(id(self.params[i]) for i in indices)
            if indices and sub is not module:
                units.append((sub, indices))
        rest = [i for i, p in enumerate(self.params) if id(p) not in claimed]
        storages: dict[int, str] = {}
        for i, p in enumerate(self.params if not self._empty else ()):   # fresh storages share nothing
            key = p.untyped_storage().data_ptr()
            if p.numel() and key in storages:
                raise RaggedSyncError(f"parameters {storages[key]} and #{i} of {type(module).__name__} share one storage; "
                                      "ZeRO stage 3 frees each parameter's storage between uses: give each parameter "
                                      "its own (or plan zero_stage 2)")
            storages[key] = f"#{i}"
        buckets, modules = [], {}
        for sub, indices in reversed(units):
            modules[len(buckets)] = sub
            buckets.append(_Layout(self, indices))
        modules[len(buckets)] = module         # the root: its forward gathers the rest
        buckets.append(_Layout(self, rest))
        return buckets, modules

    @torch.no_grad()
    def _gather(self, b: int) -> None:
        """Give bucket ``b``'s whole parameters storage and gather them, unless they hold it."""
        if b in self._gathered:
            return
        layout = self.buckets[b]
        for i in layout.indices:
            p = self.params[i]
            p.untyped_storage().resize_(p.numel() * p.element_size())
        self._gather_layout(layout)
        self._gathered.add(b)

    def _free(self, b: int) -> None:
        """Free bucket ``b``'s whole parameters' storage (stage 3)."""
        for i in self.buckets[b].indices:
            self.params[i].untyped_storage().resize_(0)
        self._gathered.discard(b)

    def _stepped(self, optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        if any(id(p) in self._shard_ids for group in optimizer.param_groups for p in group["params"]):
            self._invalidate()

    def _invalidate(self) -> None:
        """The shards may change next (an optimizer step, a load): gather again before use."""
        self._stale = True
        if self.stage == 3:
            for b in list(self._gathered):
                self._free(b)

    def _after_forward(self, b: int, output, root: bool) -> None:
        """After unit ``b``'s forward: free a layer's parameters (not in a forward run again inside
        the backward, which needs them next), and have the backward gather them again when it
        reaches the unit's outputs."""
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if tensors:
            fired = [False]

            def gather_for_backward(grad, b=b):
                if not fired[0]:
                    fired[0] = True
                    self._gather(b)
                return grad
            for t in tensors:
                t.register_hook(gather_for_backward)
        if not root and torch._C._current_graph_task_id() == -1:
            self._free(b)

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
        _reduce_scatter(out, padded, group=self.group)
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
        if self.stage == 3:
            self._free(b)
        self._next_bucket = b + 1

    def _pad(self, tensor: torch.Tensor) -> None:
        """Under the emulated network: sleep the collective's modeled ring time."""
        if self.ring is None:
            return
        seconds = self.ring.allgather_ms(tensor.numel() * tensor.element_size()) * 1e-3
        self.network.stats.allreduces += 1
        self.network.stats.allreduce_modeled_s += seconds
        time.sleep(seconds)


# torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single; older torch has only the former
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists, dicts and ModelOutputs of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@torch.no_grad()
def _broadcast(module: nn.Module, group: dist.ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)
