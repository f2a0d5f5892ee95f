"""ZERO-resizing (FlexTP, Wang et al., section III; ``/work/shared/papers/000_017342dbf97b3232.txt``):
a straggling tensor-parallel rank temporarily drops a fraction of the inner (contraction)
dimension of its local matmuls so it keeps pace, at the price of an approximate step.

Why not torch's pruning (``torch.nn.utils.prune``): that masks weights permanently and still does
the full matmul. Here nothing is removed from the model: for the steps a straggler is resized,
its :class:`~runtime.tensor.layers.ParallelLinear` multiplies ``x[..., keep] @ W[:, keep]^T`` (the
matmul is smaller, and under emulation its segment counts only the FLOPs done, so the rank is
modeled faster), and backward restores full-sized gradients.

The pieces, as the paper defines them:

* **dual pruning** (III-A): the same columns ``P`` are cut from the input and from the weight, in
  forward and in backward; the output keeps its shape ``[..., out]``.
* **zero imputation** (III-A): ``grad_weight[:, P]`` and ``grad_input[..., P]`` are zeros, put
  back at their positions through the lineage, so the optimizer and the previous layer see
  normal-sized gradients.
* **lineage table** (III-A): ``<layer_name, matrix_name, P>`` for the weight and the input of
  every pruned matmul (:attr:`ZeroResizer.lineage`), the only record of which columns are missing.
* **priority pruning** (III-B): per column the mean ``|w_t - w_{t-1}|`` over the rows, measured
  every ``stats_every`` optimizer steps (the paper's coarse "epoch" granularity); columns that
  changed least are pruned first, and the statistics of columns pruned in the last period are
  kept, not re-measured (their zero gradients would make them look idle forever).
* **differentiated ratios** (Algorithm 1 lines 3-15): a layer's candidates are its columns with
  ``delta < theta = stats_every * theta_iter``; its ratio is ``max(candidates / L, alpha * gamma)``
  for the rank's uniform ``gamma`` of Eq. (1) (:func:`planner.balance.semi_migration.pruning_ratio`).

Where the paper is ambiguous, and what is chosen here:

* The text defines ``pri_list`` as the ``L * gamma`` columns to prune; Algorithm 1 lines 12-13
  keep the ``L * (1 - gamma_k)`` columns of largest change. Both prune the same columns; the
  lineage here stores the pruned ones (``P``), sorted ascending (line 14).
* Line 9 counts ``delta > theta`` as kept, the text ``delta < theta`` as candidates: the text's
  strict inequality is used (a column exactly at ``theta`` is kept).
* Before any statistics exist (fewer than ``stats_every`` steps observed) there is no priority:
  the uniform ratio of III-A is used with columns spread evenly, as in Fig. 2 (``hs = 4``,
  ``gamma = 0.5`` prunes columns 2 and 4). Columns never measured count as changing most (never
  candidates, pruned last), which makes the schedule round-robin as the paper intends.
* Pruned column counts round to the nearest integer, at most ``L - 1`` (a matmul keeps one
  column), and a layer's ratio is capped at ``max_gamma``; the paper bounds neither.
* Line 6 preserves the statistics of indexes "not in pri_list": with pri_list the kept columns
  (lines 12-13) those are the pruned ones, as the text says. Line 11 lets a layer with few
  candidates prune only ``alpha * gamma`` (< gamma): kept as written, so a resized straggler may
  stay a little slower than Eq. (1) aims for.
* Algorithm 1 recomputes the lists once per epoch; here at :meth:`set_ratio` and after every
  statistics update while active.
* The pruned copies of input and weight are kept for backward (as any Linear keeps its input),
  rather than re-pruned from the full tensors through the lineage; the results are identical.
* Statistics need the weights of the previous period: one detached copy of each local weight.

Invariant: with ``gamma == 0`` (or no pruned column) every matmul is the exact one, bit for bit;
``ZeroResizer.active`` says whether steps run now are approximate (the Engine marks their losses).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch
import torch.nn as nn

from runtime.emulation.compute import Emulator
from runtime.tensor.layers import ParallelLinear, local_linear
from whalelike.errors import WhaleError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineageEntry:
    """One row of the lineage table: ``pruned`` columns of ``matrix_name`` ("weight" or "input")
    in ``layer_name``'s local matmul, whose full inner dimension is ``size``."""

    layer_name: str
    matrix_name: str
    pruned: tuple[int, ...]
    size: int

    @cached_property
    def kept(self) -> tuple[int, ...]:
        pruned = set(self.pruned)
        return tuple(i for i in range(self.size) if i not in pruned)

    def __post_init__(self):
        # built now, where the entry is made (set_ratio, outside any FakeTensorMode): an index
        # made lazily inside the pipeline's fake-tensor shape run would be a FakeTensor, and a
        # real forward indexed with it would produce fake values (and skip its all-reduce)
        object.__setattr__(self, "kept_index", torch.tensor(self.kept, dtype=torch.long))

    def restore(self, pruned_grad: torch.Tensor) -> torch.Tensor:
        """Zero imputation: ``pruned_grad`` (last dimension ``size - len(pruned)``) put back at the
        kept positions of a zero tensor whose last dimension is ``size``."""
        kept = self.kept_index.to(pruned_grad.device)
        if pruned_grad.shape[-1] != len(kept):
            raise WhaleError(f"{self.layer_name}.{self.matrix_name}: lineage keeps {len(kept)} of {self.size} "
                             f"columns but the gradient has {pruned_grad.shape[-1]}")
        full = pruned_grad.new_zeros(*pruned_grad.shape[:-1], self.size)
        return full.index_copy_(-1, kept, pruned_grad)


class _Prune(torch.autograd.Function):
    """Forward: the kept columns (last dimension) of a tensor. Backward: the gradient restored to
    full size through the lineage entry, zeros in the pruned columns."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, kept: torch.Tensor, entry: LineageEntry):
        ctx.entry = entry
        return tensor.index_select(-1, kept)

    @staticmethod
    def backward(ctx, grad):
        return ctx.entry.restore(grad), None, None


def dual_pruned_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       weight_entry: LineageEntry, input_entry: LineageEntry,
                       emulator: Optional[Emulator] = None) -> torch.Tensor:
    """``x[..., keep] @ weight[:, keep]^T + bias`` (``weight`` is ``[out, in]``) with zero-imputed
    gradients; the matmul is :func:`runtime.tensor.layers.local_linear`, so an emulated segment counts
    only the kept columns' FLOPs."""
    if weight_entry.pruned != input_entry.pruned:
        raise WhaleError(f"{weight_entry.layer_name}: dual pruning cuts the same columns from weight and input, "
                         f"got {weight_entry.pruned} and {input_entry.pruned}")
    kept = weight_entry.kept_index.to(weight.device)
    return local_linear(_Prune.apply(x, kept, input_entry), _Prune.apply(weight, kept, weight_entry), bias, emulator)


class _LayerPruning:
    """The per-layer state of one resized :class:`ParallelLinear`: its statistics (``delta`` per
    column of the inner dimension, the weights of the last period) and its current pruned set.
    Installed as the layer's ``zero_resizing`` hook while it prunes something."""

    def __init__(self, name: str, module: ParallelLinear):
        self.name = name
        self.module = module
        self.reset()

    def reset(self) -> None:
        """Forget the statistics (a new layer, or one re-sharded to another shape)."""
        weight = self.weight()
        self.rows, self.columns = weight.shape
        self.delta = torch.full((self.columns,), float("inf"), dtype=torch.float64)
        self.measured = False
        self.previous = weight.detach().to(torch.float64).clone()
        self.ratio = 0.0
        self.pruned: tuple[int, ...] = ()
        self.entries: tuple[LineageEntry, LineageEntry] | None = None
        self.module.zero_resizing = None

    def weight(self) -> torch.Tensor:
        """The local weight as ``[rows, inner columns]`` (GPT-2 ``Conv1D`` keeps it transposed)."""
        return self.module.weight.t() if self.module.transposed else self.module.weight

    def update_statistics(self) -> None:
        """Algorithm 1 lines 4-8: ``delta_i = sum_j |w_ji^t - w_ji^{t-1}| / R``, except for the
        columns pruned in the last period, whose old value is kept (incremental update)."""
        current = self.weight().detach().to(torch.float64)
        if current.shape != self.previous.shape:   # re-sharded since: its history no longer applies
            log.info("ZERO-resizing: %s changed shape %s -> %s, statistics restart", self.name,
                     tuple(self.previous.shape), tuple(current.shape))
            self.reset()
            return
        fresh = (current - self.previous.to(current.device)).abs().mean(0).cpu()
        if self.pruned:
            fresh[list(self.pruned)] = self.delta[list(self.pruned)]
        self.delta = fresh
        self.measured = True
        self.previous = current.clone()

    def choose(self, gamma: float, alpha: float, theta: float, max_gamma: float) -> None:
        """Algorithm 1 lines 9-14: this layer's ratio and its pruned columns, ascending."""
        if gamma <= 0:
            self.ratio, self.pruned = 0.0, ()
        elif not self.measured:
            self.ratio = min(gamma, max_gamma)
            self.pruned = spread_columns(self.columns, self._count(self.ratio))
        else:
            candidates = int((self.delta < theta).sum())
            self.ratio = min(max(candidates / self.columns, alpha * gamma), max_gamma)
            count = self._count(self.ratio)
            order = torch.sort(self.delta, stable=True).indices[:count]   # smallest change first, ties by index
            self.pruned = tuple(sorted(order.tolist()))
        self.entries = None if not self.pruned else (
            LineageEntry(self.name, "weight", self.pruned, self.columns),
            LineageEntry(self.name, "input", self.pruned, self.columns))
        self.module.zero_resizing = self if self.pruned else None

    def _count(self, ratio: float) -> int:
        return min(int(round(ratio * self.columns)), self.columns - 1)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 emulator: Optional[Emulator]) -> torch.Tensor:
        weight_entry, input_entry = self.entries
        return dual_pruned_linear(x, weight, bias, weight_entry, input_entry, emulator)


def spread_columns(columns: int, count: int) -> tuple[int, ...]:
    """``count`` of ``columns`` indices spread evenly, the last one included (Fig. 2: 2 of 4 -> 1, 3)."""
    return tuple((j + 1) * columns // count - 1 for j in range(count)) if count > 0 else ()


class ZeroResizer:
    """ZERO-resizing for every :class:`~runtime.tensor.layers.ParallelLinear` in ``module``.

    ``set_ratio(gamma)`` with this rank's uniform ratio of Eq. (1) turns pruning on (0 turns it
    off); call ``observe_weights()`` after every optimizer step, on every rank (statistics are
    needed as soon as a rank becomes a straggler). ``alpha`` is the decay factor of the
    differentiated ratios (0.8 in the paper), ``theta_iter`` the per-step change below which a
    column is a pruning candidate (1e-3), ``stats_every`` the steps per statistics period (the
    paper's epoch; the candidate threshold is ``stats_every * theta_iter``).
    """

    def __init__(self, module: nn.Module, *, alpha: float = 0.8, theta_iter: float = 1e-3,
                 stats_every: int = 10, max_gamma: float = 0.9):
        if not 0 <= alpha <= 1:
            raise WhaleError(f"ZeroResizer: alpha must be in [0, 1] (the paper uses 0.8), got {alpha}")
        if not theta_iter >= 0:
            raise WhaleError(f"ZeroResizer: theta_iter must be >= 0 (the paper uses 1e-3), got {theta_iter}")
        if int(stats_every) != stats_every or stats_every < 1:
            raise WhaleError(f"ZeroResizer: stats_every must be a whole number of steps >= 1, got {stats_every}")
        if not 0 <= max_gamma < 1:
            raise WhaleError(f"ZeroResizer: max_gamma must be in [0, 1), got {max_gamma}")
        self.alpha, self.theta_iter, self.stats_every, self.max_gamma = alpha, theta_iter, int(stats_every), max_gamma
        self.module = module
        self.layers = [_LayerPruning(name, sub) for name, sub in module.named_modules()
                       if isinstance(sub, ParallelLinear)]
        if not self.layers:
            raise WhaleError(f"ZeroResizer: {type(module).__name__} has no tensor-parallel Linear to resize; "
                             "attach it to the module holding the ColumnParallelLinear/RowParallelLinear layers")
        self.gamma = 0.0
        self.observed = 0

    @property
    def theta(self) -> float:
        return self.stats_every * self.theta_iter

    @property
    def active(self) -> bool:
        """True while some matmul is pruned: steps run now are approximate."""
        return any(layer.pruned for layer in self.layers)

    @property
    def ratios(self) -> dict[str, float]:
        """Each layer's differentiated ratio ``gamma_k``."""
        return {layer.name: layer.ratio for layer in self.layers}

    @property
    def pruned_work(self) -> float:
        """The fraction of this rank's tensor-parallel matmul FLOPs pruned now (layers weighted by
        ``rows * columns``, i.e. per token): for :func:`planner.balance.semi_migration.unresized`."""
        total = sum(layer.rows * layer.columns for layer in self.layers)
        return sum(layer.rows * len(layer.pruned) for layer in self.layers) / total

    @property
    def lineage(self) -> dict[tuple[str, str], LineageEntry]:
        """The lineage table: ``(layer_name, matrix_name) -> LineageEntry`` for every pruned matrix."""
        return {(entry.layer_name, entry.matrix_name): entry
                for layer in self.layers if layer.entries for entry in layer.entries}

    def set_ratio(self, gamma: float) -> None:
        """Prune a uniform ``gamma`` of the inner dimension (Eq. 1), differentiated per layer."""
        if not 0 <= gamma <= 1:
            raise WhaleError(f"ZeroResizer.set_ratio: gamma must be in [0, 1] (0 turns resizing off), got {gamma}")
        self.gamma = float(gamma)
        self._choose()

    def observe_weights(self) -> None:
        """Count one optimizer step; every ``stats_every`` steps update the statistics (and the
        pruned columns, while active)."""
        self.observed += 1
        if self.observed % self.stats_every:
            return
        for layer in self.layers:
            layer.update_statistics()
        if self.gamma > 0:
            self._choose()

    def close(self) -> None:
        """Stop pruning and remove the hooks."""
        self.gamma = 0.0
        self._choose()

    def _choose(self) -> None:
        for layer in self.layers:
            layer.choose(self.gamma, self.alpha, self.theta, self.max_gamma)
