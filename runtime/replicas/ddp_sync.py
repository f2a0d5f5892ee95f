"""The ``ddp`` replica sync: torch DDP with uneven shares, summed gradients and an emulated network.

What torch does and we reuse: DDP (parameter broadcast at construction, bucketed gradient
all-reduce overlapped with backward, ``no_sync`` for gradient accumulation, the reducer that a
pipeline arms by hand for its last backward). What it cannot do: DDP averages gradients over ranks,
which is the global-batch mean only when every rank holds the same number of samples. Here rank
``i`` holds ``n_i`` of the ``B`` samples of a step, so the executors weight its loss by ``n_i / B``
and the comm hook *sums*: the summed gradient is then exactly the gradient of the global-batch mean
loss, whatever the shares (Whale's load balancing, Poplar's per-device micro-batch sizes).

The gradients are views of DDP's buckets (``gradient_as_bucket_view``): one copy of them, not a
``.grad`` per parameter beside a bucket holding the same bytes (a third more memory on a rank of
AdamW's state, measured). :attr:`DDPSync.gradients_in_place` tells the Engine to zero them in place
between steps (set to None, the next backward would allocate them anew beside the buckets), once DDP
has rebuilt its buckets after the first backward. Before that, in the step whose forward rebuilds
them, either way holds one gradient copy more somewhere: zeroed in place, the first buckets stay
beside the new ones until each gradient is copied over (in the forward, when little else is held);
set to None, a rank that accumulates over micro-batches makes each gradient a tensor of its own
through the step's backward, beside the new buckets. So they are zeroed in place from the first step
when the rank accumulates (``gradients_as_views``; the executor decides), else set to None until
the rebuild. Measured on bf16 runs: accumulating over 4 micro-batches, that step peaked at 4.58 MiB
set to None and 4.14 zeroed in place (the later steps' peak); one micro-batch, 15.9 MiB set to None
(the later steps' peak), 17.2 zeroed in place (``tests/test_recompute.py``).

The passenger (:meth:`DDPSync.carry`): a small tensor (the step's loss, the straggler monitor's
figures) summed with the last bucket: appended to it when that bucket is small, so a step costs one
collective, as plain DDP's does; beside it, in a tiny all-reduce of its own launched right after the
bucket's, when appending would copy a large bucket (:data:`JOIN_BYTES`).

Emulation enters here, at the seam, not in the executors: without an emulated network the comm
hook waits for the backward's modeled end before communicating, so modeled time never includes
waiting on peers (and all gradients go in one bucket: the backward is one modeled segment). With
one, each bucket's all-reduce overlaps the rest of the backward in modeled time
(:func:`_emulate_overlap`); only the last bucket waits for the deadline.

Invariant: the hook state is per wrapped module; :meth:`DDPSync.release` leaves no hook on the
parameters, so another executor (or another sync) can take them over.
"""
from __future__ import annotations

import inspect
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from runtime.replicas.held_state import NamedState, module_state
from runtime.replicas.sync_parts import Exact, WholeParameters
from runtime.emulation.compute import Emulator

# torch >= 2.13 renamed ``broadcast_buffers`` (which also skipped the sync at construction).
_NO_FORWARD_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
                           inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")


# The passenger joins the last bucket (one collective) when that bucket is at most this many bytes;
# a larger one is summed in place and the passenger in a second, tiny all-reduce launched right
# behind it: appending copies the whole bucket (and DDP copies the result back), a cost that grows
# with the bucket, where the second collective costs one small message's latency. The threshold is
# a judgement: bench/overhead.py's four ranks on two cores did not resolve either side of it.
JOIN_BYTES = 1 << 20


@dataclass
class _HookState:
    emulator: Emulator
    group: Optional[dist.ProcessGroup]
    average: bool
    passenger: Optional[torch.Tensor] = None
    fill: Optional[Callable[[torch.Tensor], None]] = None   # writes the passenger right before it is sent
    # network emulation: the group's devices in rank order (the ring), the gradient bytes of a
    # backward, and the bytes of this backward's buckets so far
    devices: Optional[tuple[str, ...]] = None
    total_bytes: int = 0
    launched_bytes: int = 0
    # the dtype gradients travel in (None: their own, float32): bf16 halves the bytes, rounds each rank's part
    reduce_dtype: Optional[torch.dtype] = None


def _deadline_allreduce(state: _HookState, bucket):  # no annotations: DDP checks them, and they are strings here
    """All-reduce the bucket (SUM, or AVG if asked), with the passenger appended to the last
    bucket. Under emulation without a network, wait out the backward's modeled time first; with
    one, overlap (:func:`_emulate_overlap`)."""
    network = state.emulator.network if state.devices is not None else None
    if network is None:
        state.emulator.wait_deadline()
    tensor = bucket.buffer()
    if state.average:
        tensor.div_(dist.get_world_size(state.group))
    passenger = state.passenger if bucket.is_last() else None
    if state.reduce_dtype is not None and state.reduce_dtype != tensor.dtype:
        return _low_precision_allreduce(state, bucket, tensor, passenger, network)
    if passenger is None:
        if network is not None:
            _emulate_overlap(state, bucket, tensor)
        work = dist.all_reduce(tensor, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    state.passenger = None
    if state.fill is not None:
        state.fill, fill = None, state.fill
        fill(passenger)
    if tensor.numel() * tensor.element_size() > JOIN_BYTES:
        return _beside(state, bucket, tensor, passenger, network)
    joint = torch.cat([tensor, passenger.reshape(-1).to(tensor.dtype)])
    if network is not None:
        _emulate_overlap(state, bucket, joint)
    work = dist.all_reduce(joint, group=state.group, async_op=True)

    def unpack(fut):
        # the sums go back into the bucket and the passenger here, and the joined copy's storage is released here
        # too (``set_()``): the backend's work object and this future still hold the tensor, and when they drop it
        # depends on when the backend's thread gets the CPU, often after the optimizer's update has begun; the
        # planner prices the copy only until the update (planner.devices.memory.DDP_JOIN_BYTES), and DDP
        # waits for this callback before the backward returns
        out = fut.value()[0]
        passenger.copy_(out[tensor.numel():].view_as(passenger))
        tensor.copy_(out[: tensor.numel()])
        out.set_()
        return tensor

    return work.get_future().then(unpack)


def _beside(state: _HookState, bucket, tensor: torch.Tensor, passenger: torch.Tensor, network) -> torch.futures.Future:
    """A large last bucket summed in place and the passenger in an all-reduce of its own, launched
    right behind it (see :data:`JOIN_BYTES`)."""
    if network is not None:
        _emulate_overlap(state, bucket, tensor)
    work = dist.all_reduce(tensor, group=state.group, async_op=True)
    carried = dist.all_reduce(passenger, group=state.group, async_op=True)
    # done when both are (no callback blocks a backend thread on the other)
    both = torch.futures.collect_all([work.get_future(), carried.get_future()])
    return both.then(lambda fut: fut.value()[0].value()[0])


def _low_precision_allreduce(state: _HookState, bucket, tensor: torch.Tensor, passenger: Optional[torch.Tensor],
                             network) -> torch.futures.Future:
    """The bucket summed in ``state.reduce_dtype`` (each rank's part rounded to it, the sum
    accumulated in it by the backend) and cast back; the passenger (a loss, speeds) keeps its own
    dtype in a second all-reduce of its own: rounding it would make the reported loss differ."""
    low = tensor.to(state.reduce_dtype)
    if network is not None:
        _emulate_overlap(state, bucket, low)
    work = dist.all_reduce(low, group=state.group, async_op=True)
    carried = None
    if passenger is not None:
        state.passenger = None
        if state.fill is not None:
            state.fill, fill = None, state.fill
            fill(passenger)
        carried = dist.all_reduce(passenger, group=state.group, async_op=True)

    def unpack(fut):
        # cast back into the bucket, and the low-precision copy's storage released here, as the joined
        # bucket's is (see _deadline_allreduce)
        if carried is not None:
            carried.wait()
        out = fut.value()[0]
        tensor.copy_(out)
        out.set_()
        return tensor

    return work.get_future().then(unpack)


def _emulate_overlap(state: _HookState, bucket, sent: torch.Tensor) -> None:
    """Under network emulation, record the bucket's modeled all-reduce before it is launched.

    DDP fills and launches buckets in index order as their gradients become ready (reverse layer
    order), so bucket ``k`` is modeled ready when the backward's modeled time has run the share of
    the gradient bytes of buckets ``0..k``; the last bucket closes the backward's compute segment
    first (at its modeled end), so no real waiting on peers falls inside it. Earlier buckets are
    launched for real at once (results stay exact); :meth:`Emulator.wait_communication` pads to the
    modeled end after the backward.
    """
    if bucket.index() == 0:
        state.launched_bytes = 0
    nbytes = sent.numel() * sent.element_size()
    state.launched_bytes += nbytes
    emulator = state.emulator
    if bucket.is_last():
        ready = emulator.segment_ready(1.0)   # the segment's modeled end, not when a loaded host woke
        emulator.wait_deadline()
    else:
        ready = emulator.segment_ready(state.launched_bytes / max(state.total_bytes, 1))
    emulator.network.allreduce_launched(time.monotonic() if ready is None else ready, nbytes, state.devices,
                                        state.group, sent.device)


def wrap_ddp(module: nn.Module, process_group: Optional[dist.ProcessGroup], emulator: Optional[Emulator] = None,
             *, average: bool = False, devices: Optional[Sequence[str]] = None,
             bucket_cap_mb: Optional[float] = None, reduce_dtype: Optional[torch.dtype] = None,
             idle: Sequence[nn.Parameter] = (), init_sync: bool = True) -> DistributedDataParallel:
    """DDP over ``process_group`` whose comm hook respects ``emulator``'s backward deadline.

    Gradients are summed (``average=False``): weight each rank's loss by its share of the global
    batch. ``average=True`` gives stock DDP semantics (equal shares), for peers in benchmarks.

    No buffer sync in forward (buffers are synced once, at construction): buffer broadcast is a
    collective inside every forward, which would fall inside the forward's compute segment (and a
    per-rank buffer such as BatchNorm statistics is computed from the rank's own share anyway,
    unless ``Plan.sync_batchnorm`` synchronises it: :mod:`runtime.parallel.sync_batchnorm`). Under
    emulation without a network, all gradients go in one bucket: the backward is one modeled
    segment, and a bucket fired early would either wait for the whole segment (then do the rest of
    the backward unpadded) or communicate inside it.

    With network emulation (``emulator.network``) and ``devices`` (the group's devices, in rank
    order), buckets keep DDP's sizes (``bucket_cap_mb``, default DDP's) and each all-reduce
    overlaps the rest of the backward in modeled time: bucket ``k`` is ready at its share of the
    backward (:func:`_emulate_overlap`), ends ``max(latest member's ready, bucket k-1's end) + ring
    cost`` (:class:`runtime.emulation.network.NetworkEmulator`); call
    ``emulator.wait_communication()`` after the backward to pad to the last end. Early buckets
    are launched for real at once (no real waiting inside the segment); only their modeled times
    overlap. ``bucket_cap_mb`` is DDP's (ignored under emulation without a network).
    ``reduce_dtype``: reduce gradients in this dtype (``torch.bfloat16``: half the bytes) instead of
    their own float32 (``Engine(grad_reduce_dtype="bf16")``, :mod:`runtime.training.precision`).
    ``idle``: parameters the forward never reads, left out of DDP (DDP's own list of parameters to
    ignore), which would otherwise wait for their gradients at every step.
    ``init_sync`` False: no broadcast of rank 0's values at construction (DDP's own option), for a
    module whose values are not there yet (built on the meta device: every replica is then filled
    from one source, equal without it; the broadcast would cost a flat copy of the module).
    """
    emulator = emulator or Emulator.disabled()
    idle_ids = {id(p) for p in idle}
    ignored = [n for n, p in module.named_parameters() if id(p) in idle_ids]
    # DDP's reducer spells a parameter of the root module ".name" (f"{module_name}.{param_name}"),
    # its parameter list "name": a root-level parameter is ignored only under both spellings
    ignored += ["." + n for n in ignored if "." not in n]
    if ignored:
        ignored += [n for n in getattr(module, "_ddp_params_and_buffers_to_ignore", ()) if n not in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in idle_ids]
    if not params:
        raise ValueError("wrap_ddp: the module has no trainable parameters; data parallelism has nothing to sync")
    # the gradients are views of the buckets (torch's option): one copy of them, not two (DDPSync
    # zeroes them in place: gradients_in_place)
    kwargs: dict[str, Any] = dict(process_group=process_group, init_sync=init_sync, gradient_as_bucket_view=True)
    kwargs[_NO_FORWARD_BUFFER_SYNC] = False
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    overlap = emulator.enabled and emulator.network is not None and devices is not None
    if emulator.enabled and not overlap:
        kwargs["bucket_cap_mb"] = total_bytes / 2**20 + 1.0
    elif bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if params[0].device.type == "cuda":
        kwargs["device_ids"] = [params[0].device]
    ddp = DistributedDataParallel(module, **kwargs)
    ddp._whalelike_hook_state = _HookState(emulator, process_group, average,
                                           devices=tuple(devices) if overlap else None, total_bytes=total_bytes,
                                           reduce_dtype=reduce_dtype)
    ddp.register_comm_hook(ddp._whalelike_hook_state, _deadline_allreduce)
    return ddp


def release_ddp(ddp: DistributedDataParallel) -> nn.Module:
    """Take ``ddp``'s hooks off its module's parameters (the reducer's autograd hooks, the
    post-accumulate hooks of the Python reducer) so another executor can own them; returns the module."""
    ddp._remove_autograd_hooks()
    for handle in getattr(ddp, "_accum_grad_hooks", []):
        handle.remove()
    return ddp.module


class DDPSync(Exact, WholeParameters):
    """:class:`runtime.replicas.replica_sync.ReplicaSync` on DDP (see the module docstring).

    ``module``: the stage module of this rank; ``group``: the ranks holding the same parameters
    (the stage's workers of this ``tp_index`` in every replica); ``devices``: their devices in
    rank order (the emulated network's ring); ``emulator``: this rank's.
    """

    name = "ddp"
    syncs = True

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup], *, emulator: Optional[Emulator] = None,
                 devices: Optional[Sequence[str]] = None, average: bool = False,
                 bucket_cap_mb: Optional[float] = None, reduce_dtype: Optional[torch.dtype] = None,
                 idle: Sequence[nn.Parameter] = (), init_sync: bool = True):
        self.inner = module
        self.group = group
        self.ddp: Optional[DistributedDataParallel] = wrap_ddp(module, group, emulator, average=average,
                                                               devices=devices, bucket_cap_mb=bucket_cap_mb,
                                                               reduce_dtype=reduce_dtype, idle=idle,
                                                               init_sync=init_sync)

    @property
    def module(self) -> nn.Module:
        """What forwards run through: the DDP wrapper (its forward prepares the reducer)."""
        return self.ddp

    def no_sync(self) -> AbstractContextManager:
        return self.ddp.no_sync()

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """The next backward from ``roots`` syncs, though its forward ran under :meth:`no_sync`
        (as ``torch.distributed.pipelining``'s stage arms DDP's reducer by hand)."""
        self.ddp.reducer.prepare_for_backward(list(_find_tensors(list(roots))))

    @property
    def gradients_in_place(self) -> bool:
        """The gradients are views of DDP's buckets (``wrap_ddp``): zeroed in place between steps once
        DDP has rebuilt its buckets in the order the first backward made the gradients ready (it does
        so in the second forward; gradients kept until then would hold the first buckets beside the
        new ones)."""
        return bool(getattr(self.ddp, "_has_rebuilt_buckets", True))

    # the gradients become views of the buckets (gradient_as_bucket_view): an executor that accumulates
    # zeroes them in place from the first step (the module docstring says why)
    gradients_as_views = True

    def carry(self, tensor: torch.Tensor, fill: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Sum ``tensor`` (in place) over the group in the gradient all-reduce of the next syncing
        backward, appended to its last bucket. Call it right before that backward; ``fill``, if
        given, writes ``tensor``'s content right before it is sent (after the backward's compute:
        the straggler monitor sends this step's compute time). :meth:`flush` after the backward."""
        state: _HookState = self.ddp._whalelike_hook_state
        state.passenger, state.fill = tensor, fill

    def flush(self) -> None:
        """If no bucket carried the passenger (nothing to sync), all-reduce it on its own."""
        state: _HookState = self.ddp._whalelike_hook_state
        if state.passenger is not None:
            passenger, state.passenger = state.passenger, None
            if state.fill is not None:
                state.fill, fill = None, state.fill
                fill(passenger)
            dist.all_reduce(passenger, group=state.group)

    def named_state(self, names: Optional[Mapping[str, Sequence[str]]] = None) -> NamedState:
        """Every replica holds the stage's state whole (its tensor-parallel shards, if any)."""
        return module_state(self.inner, names)

    def release(self) -> nn.Module:
        """Take DDP's hooks off the parameters; this sync is not used again."""
        if self.ddp is not None:
            release_ddp(self.ddp)
            self.ddp = None   # its buckets (a copy of the gradients) go with it
        return self.inner
