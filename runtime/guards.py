"""Guards of a training step: a non-finite loss, and ranks that pass different global batches.

Both faults corrupt training silently: a NaN or inf loss turns every parameter into NaN at the next
optimizer step, and a rank whose data loader was seeded differently trains on samples the other
ranks never see, with no error anywhere. :class:`runtime.Engine` checks for both (its options
``on_nonfinite`` and ``batch_check_every``).

**Non-finite loss.** Invariant: every step executor returns the *global*-mean loss, reduced over
every rank's samples in the step's own collective, so it is the same value on every rank, and a
NaN or inf in any rank's part makes it non-finite on every rank. The decision (raise, or skip the
step) is therefore the same everywhere without a collective of its own, and it is taken before the
optimizer step, so the parameters and the optimizer state never see the bad gradients. Reading the
loss's finiteness is one device-to-host sync per step.

**Batch fingerprint.** A whole-global-batch step assumes every rank passes the same batch (each
takes its own slice of it). On the first step and every ``batch_check_every`` steps each rank
hashes its batch (structure, shapes, dtypes and bytes: a 64-bit BLAKE2b digest of a CPU copy) and
the ranks all-gather the digests: 8 bytes per rank, one small collective on check steps only.
Why not compare the tensors: that would move the whole batch; the digest finds the same mismatch.
Steps on :class:`runtime.data.Share` (rank-local batches) are not checked: they differ by design; nor
is a world of one rank: there is no other batch to differ from.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist

from whalelike.errors import WhaleError

ON_NONFINITE = ("raise", "skip")
DEFAULT_BATCH_CHECK_EVERY = 100


class NonFiniteLossError(WhaleError):
    """A training step's global loss is NaN or infinite; raised on every rank before the optimizer
    step (the parameters are those of the step before)."""


class BatchMismatchError(WhaleError):
    """Ranks passed different global batches to a whole-global-batch step; raised on every rank."""


def check_options(on_nonfinite: str, batch_check_every: int) -> None:
    """Raise a WhaleError naming the option, the bad value and the choices (local: every rank alike)."""
    if on_nonfinite not in ON_NONFINITE:
        raise WhaleError(f"runtime.Engine: on_nonfinite must be 'raise' (stop at a NaN or inf loss) or 'skip' "
                         f"(drop that step on every rank), got {on_nonfinite!r}")
    if isinstance(batch_check_every, bool) or not isinstance(batch_check_every, int) or batch_check_every < 0:
        raise WhaleError(f"runtime.Engine: batch_check_every must be a whole number of steps >= 0 (0 turns the "
                         f"check off; default {DEFAULT_BATCH_CHECK_EVERY}), got {batch_check_every!r}")


# -- non-finite loss ---------------------------------------------------------------------------------
def is_finite(loss: Any) -> bool:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:   # the usual scalar: one read, no kernels
        return math.isfinite(loss.item())
    return bool(torch.isfinite(torch.as_tensor(loss).detach()).all())


def loss_text(loss: Any) -> str:
    """The loss as a message shows it (``nan``, ``inf``, or the list of a non-scalar loss)."""
    value = torch.as_tensor(loss).detach().float().cpu()
    return f"{value.item():g}" if value.numel() == 1 else str(value.tolist())


def nonfinite_error(loss: Any, step: int, rank: int) -> NonFiniteLossError:
    shown = loss_text(loss)
    return NonFiniteLossError(
        f"rank {rank}, step {step}: the loss is {shown} (the global-mean loss over every rank's samples, so "
        f"every rank stops at this step); the parameters are those before step {step}, the optimizer did not "
        f"step. Look for NaN or inf in that step's batch, lower the learning rate or clip gradients, or pass "
        f"runtime.Engine(on_nonfinite='skip') (train.py: --on-nonfinite skip) to drop such steps on "
        f"every rank and go on")


# -- batch fingerprint -------------------------------------------------------------------------------
def batch_check_due(step: int, every: int) -> bool:
    """Whether ``step`` checks the batch fingerprint: the first step and every ``every`` steps
    (never when ``every`` is 0). The same answer on every rank."""
    return every > 0 and step % every == 0


def fingerprint(inputs: tuple, targets: Any) -> int:
    """A 64-bit digest of a batch's structure, shapes, dtypes and bytes (a signed int64 value)."""
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, (tuple(inputs), targets))
    return int.from_bytes(digest.digest(), "little", signed=True)


def _feed(digest, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        digest.update(f"tensor{tuple(tensor.shape)}{tensor.dtype};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (tuple, list)):
        digest.update(f"{type(value).__name__}[{len(value)}](".encode())
        for item in value:
            _feed(digest, item)
        digest.update(b")")
    elif isinstance(value, dict):
        digest.update(f"dict[{len(value)}](".encode())
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _feed(digest, value[key])
        digest.update(b")")
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def check_same_batch(inputs: tuple, targets: Any, step: int, rank: int, every: int) -> None:
    """Collective over the default group: raise :class:`BatchMismatchError` on every rank when some
    rank's batch differs from rank 0's."""
    mine = torch.tensor([fingerprint(inputs, targets)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    prints = [int(t.item()) for t in gathered]
    differ = [r for r, value in enumerate(prints) if value != prints[0]]
    if not differ:
        return
    shown = ", ".join(f"rank {r} {value & (2 ** 64 - 1):016x}" for r, value in enumerate(prints))
    raise BatchMismatchError(
        f"rank {rank}, step {step}: every rank must pass the same global batch, but rank"
        f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} passed a batch different from rank 0's "
        f"(fingerprints of inputs and targets: {shown}). Use the same seed and the same sampler on every rank "
        f"(not DistributedSampler: each rank takes its share of the global batch itself), or give each rank "
        f"only its own samples as runtime.data.Share (runtime.data.UnevenLoader). Checked at the first step and "
        f"every {every} steps (runtime.Engine(batch_check_every=...), 0 turns it off)")


def check_timeout(timeout_s: Any) -> float:
    """``timeout_s`` as a float, or a WhaleError: it must be a positive, finite number of seconds."""
    valid = (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
             and math.isfinite(timeout_s) and timeout_s > 0)
    if not valid:
        raise WhaleError(f"runtime.Engine: timeout_s must be a positive, finite number of seconds (how long a "
                         f"collective may wait for a peer before the step fails), got {timeout_s!r}; "
                         f"e.g. timeout_s=300")
    return float(timeout_s)
