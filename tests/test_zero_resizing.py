"""ZERO-resizing (runtime/balance/flextp_resizing.py): dual pruning forward and backward against the masked
dense computation, zero imputation through the lineage, priority selection from weight-change
statistics, differentiated ratios with alpha, emulated FLOPs; and one 2-rank tensor-parallel MLP
(column + row, float64, gloo) where rank 1 is resized at gamma = 0.5 for 3 steps with SGD and
AdamW, against a single-process dense model with the same masks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest
from torch.testing import assert_close

from dist_utils import run_ranks
from runtime.emulation.compute import Emulator
from runtime.tensor.layers import ColumnParallelLinear, RowParallelLinear
from runtime.balance.flextp_resizing import LineageEntry, ZeroResizer, dual_pruned_linear, spread_columns
from whalelike.cluster import Emulation
from whalelike.errors import WhaleError

DTYPE = torch.float64


def _masked_reference(x, weight, bias, pruned):
    mask = torch.ones(weight.shape[1], dtype=weight.dtype)
    mask[list(pruned)] = 0
    return F.linear(x * mask, weight * mask, bias)


@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8)])
def test_dual_pruning_matches_masked_dense(shape):
    torch.manual_seed(0)
    pruned = (1, 3, 6)
    keep = [i for i in range(8) if i not in pruned]
    x = torch.randn(*shape, dtype=DTYPE, requires_grad=True)
    weight = torch.randn(3, 8, dtype=DTYPE, requires_grad=True)
    bias = torch.randn(3, dtype=DTYPE, requires_grad=True)
    entries = LineageEntry("fc", "weight", pruned, 8), LineageEntry("fc", "input", pruned, 8)
    y = dual_pruned_linear(x, weight, bias, *entries)
    assert y.shape == (*shape[:-1], 3)
    assert_close(y, x[..., keep] @ weight[:, keep].t() + bias, rtol=0, atol=0)
    grad_out = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight, bias), grad_out)
    expected = torch.autograd.grad(_masked_reference(x, weight, bias, pruned), (x, weight, bias), grad_out)
    for got, want in zip(grads, expected):
        assert_close(got, want)
    grad_x, grad_w, _ = grads
    assert grad_w.shape == weight.shape and grad_x.shape == x.shape
    assert (grad_w[:, list(pruned)] == 0).all() and (grad_x[..., list(pruned)] == 0).all()
    assert (grad_w[:, keep] != 0).all()


def test_lineage_restores_shapes_with_zeros():
    entry = LineageEntry("mlp.fc1", "weight", (0, 2), 5)
    assert entry.kept == (1, 3, 4)
    full = entry.restore(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    assert_close(full, torch.tensor([[0.0, 1.0, 0.0, 2.0, 3.0], [0.0, 4.0, 0.0, 5.0, 6.0]]))
    with pytest.raises(WhaleError, match="keeps 3 of 5"):
        entry.restore(torch.ones(2, 4))
    assert spread_columns(4, 2) == (1, 3)      # Fig. 2: hs = 4, gamma = 0.5 prunes columns 2 and 4
    assert spread_columns(6, 3) == (1, 3, 5) and spread_columns(5, 1) == (4,) and spread_columns(5, 0) == ()


class _Column(nn.Module):
    def __init__(self, inner=4, out=3):
        super().__init__()
        torch.manual_seed(1)
        self.fc = ColumnParallelLinear(nn.Linear(inner, out).to(DTYPE), [out], 0, gather_output=False)


def test_resizer_hooks_the_parallel_linear_and_turns_off_exactly():
    model = _Column()
    layer = model.fc
    x = torch.randn(5, 4, dtype=DTYPE)
    exact = layer.local(x, bias=True)
    resizer = ZeroResizer(model)
    assert not resizer.active and resizer.lineage == {}
    resizer.set_ratio(0.5)                      # no statistics yet: spread as in Fig. 2
    assert resizer.active and resizer.ratios == {"fc": 0.5}
    assert resizer.lineage == {("fc", "weight"): LineageEntry("fc", "weight", (1, 3), 4),
                               ("fc", "input"): LineageEntry("fc", "input", (1, 3), 4)}
    assert_close(layer.local(x, bias=True), x[:, [0, 2]] @ layer.weight[:, [0, 2]].t() + layer.bias,
                 rtol=0, atol=0)
    resizer.set_ratio(0)
    assert not resizer.active and layer.zero_resizing is None
    assert_close(layer.local(x, bias=True), exact, rtol=0, atol=0)
    with pytest.raises(WhaleError, match="gamma must be in"):
        resizer.set_ratio(1.5)
    with pytest.raises(WhaleError, match="no tensor-parallel Linear"):
        ZeroResizer(nn.Linear(2, 2))
    with pytest.raises(WhaleError, match="alpha"):
        ZeroResizer(model, alpha=2)


class Conv1D(nn.Module):
    """GPT-2's Conv1D (recognised by name): ``y = x @ W + b`` with ``W`` stored ``[in, out]``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=DTYPE))
        self.bias = nn.Parameter(torch.randn(nf, dtype=DTYPE))


def test_transposed_conv1d_prunes_its_inner_rows():
    torch.manual_seed(4)
    model = nn.Module()
    model.proj = ColumnParallelLinear(Conv1D(3, 4), [3], 0, gather_output=False)
    weight = model.proj.weight                  # [in 4, out 3]
    resizer = ZeroResizer(model, stats_every=1)
    with torch.no_grad():
        weight += torch.tensor([[0.3], [0.0], [0.2], [0.1]], dtype=DTYPE)   # inner column i = stored row i
    resizer.observe_weights()
    assert resizer.layers[0].delta.tolist() == pytest.approx([0.3, 0.0, 0.2, 0.1])
    resizer.set_ratio(0.5)                      # candidates: column 1 (1/4); 0.8 * 0.5 = 0.4 -> 2 smallest: 1, 3
    assert resizer.lineage["proj", "weight"].pruned == (1, 3)
    x = torch.randn(5, 4, dtype=DTYPE, requires_grad=True)
    y = model.proj.local(x, bias=True)
    assert_close(y, x[:, [0, 2]] @ weight[[0, 2]] + model.proj.bias, rtol=0, atol=0)
    y.sum().backward()
    assert weight.grad.shape == (4, 3) and (weight.grad[[1, 3]] == 0).all() and (weight.grad[[0, 2]] != 0).all()
    assert (x.grad[:, [1, 3]] == 0).all()


def test_emulated_segment_counts_only_the_kept_columns():
    model = _Column(inner=8)
    model.fc.emulator = Emulator(1.0, Emulation(base_gflops=1000.0), rank=0)
    x = torch.randn(5, 8, dtype=DTYPE, requires_grad=True)
    model.fc.local(x, bias=True).sum().backward()
    full = model.fc.emulator.stats.modeled_s
    resizer = ZeroResizer(model)
    resizer.set_ratio(0.25)                     # 2 of 8 columns pruned
    before = model.fc.emulator.stats.snapshot()
    model.fc.local(x, bias=True).sum().backward()
    pruned = model.fc.emulator.stats.since(before).modeled_s
    assert pruned == pytest.approx(full * 6 / 8)    # modeled from FLOPs, not timed


def _shift_columns(layer, changes):
    """Add ``changes[i]`` to every row of inner column i (mean |w_t - w_{t-1}| over rows = changes[i])."""
    with torch.no_grad():
        layer.weight += torch.tensor(changes, dtype=DTYPE)


def test_priority_pruning_picks_the_smallest_changes_and_keeps_pruned_statistics():
    model = _Column(inner=6, out=4)
    resizer = ZeroResizer(model, stats_every=1, theta_iter=1e-3, alpha=0.8)
    _shift_columns(model.fc, [0.5, 1e-4, 0.3, 2e-4, 0.2, 0.1])
    resizer.observe_weights()
    # candidates (delta < theta = 1e-3): columns 1 and 3, 2/6 = 0.333
    resizer.set_ratio(0.6)      # max(0.333, 0.8 * 0.6 = 0.48) -> round(2.88) = 3 smallest: 1, 3, 5
    assert resizer.ratios["fc"] == pytest.approx(0.48)
    assert resizer.lineage["fc", "weight"].pruned == (1, 3, 5)
    resizer.set_ratio(0.2)      # max(0.333, 0.16) -> 2 columns: the candidates 1, 3
    assert resizer.ratios["fc"] == pytest.approx(2 / 6)
    assert resizer.lineage["fc", "input"].pruned == (1, 3)
    resizer.set_ratio(0.6)
    # the pruned columns 1, 3, 5 do not move this period (zero gradient); the others do.
    # Incremental update: 1, 3, 5 keep 1e-4, 2e-4, 0.1 (not 0), so 5 (0.1) is no longer among the
    # smallest: delta = [0.05, 1e-4, 0.04, 2e-4, 0.06, 0.1] -> 1, 2, 3
    _shift_columns(model.fc, [0.05, 0.0, 0.04, 0.0, 0.06, 0.0])
    resizer.observe_weights()
    assert resizer.lineage["fc", "weight"].pruned == (1, 2, 3)
    assert resizer.layers[0].delta.tolist() == pytest.approx([0.05, 1e-4, 0.04, 2e-4, 0.06, 0.1])


def test_statistics_update_only_every_stats_every_steps():
    model = _Column(inner=4)
    resizer = ZeroResizer(model, stats_every=3)
    assert resizer.theta == pytest.approx(3e-3)
    for _ in range(2):
        _shift_columns(model.fc, [0.1, 0.0, 0.2, 0.3])
        resizer.observe_weights()
    assert not resizer.layers[0].measured
    resizer.observe_weights()                   # third step: |w_3 - w_0| summed over the period
    assert resizer.layers[0].delta.tolist() == pytest.approx([0.2, 0.0, 0.4, 0.6])


def test_differentiated_ratios_per_layer():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.a = ColumnParallelLinear(nn.Linear(6, 3).to(DTYPE), [3], 0, gather_output=False)
            self.b = ColumnParallelLinear(nn.Linear(6, 3).to(DTYPE), [3], 0, gather_output=False)
            self.c = ColumnParallelLinear(nn.Linear(6, 3).to(DTYPE), [3], 0, gather_output=False)

    model = Two()
    resizer = ZeroResizer(model, stats_every=2, theta_iter=1e-3, alpha=0.8, max_gamma=0.9)
    _shift_columns(model.a, [0.0, 0.1, 0.0, 0.1, 0.0, 0.1])     # half the columns idle
    _shift_columns(model.b, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])     # none idle
    _shift_columns(model.c, [0.0] * 6)                           # all idle
    resizer.observe_weights()
    resizer.observe_weights()
    resizer.set_ratio(0.5)
    # a: max(3/6, 0.4) = 0.5 -> 0, 2, 4; b: max(0, 0.4) = 0.4 -> round(2.4) = 2 smallest: 0, 1;
    # c: max(6/6, 0.4) = 1 capped at 0.9 -> round(5.4) = 5 columns (ties by index): 0..4
    assert resizer.ratios == pytest.approx({"a": 0.5, "b": 0.4, "c": 0.9})
    assert resizer.lineage["a", "weight"].pruned == (0, 2, 4)
    assert resizer.lineage["b", "weight"].pruned == (0, 1)
    assert resizer.lineage["c", "weight"].pruned == (0, 1, 2, 3, 4)
    assert resizer.pruned_work == pytest.approx((3 + 2 + 5) / 18)   # equal layers: pruned columns / all


# -- 2 ranks: column + row parallel MLP, rank 1 resized ------------------------------------------------
DIN, HIDDEN, DOUT, BATCH, STEPS = 6, 8, 3, 5, 3
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _dense_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DOUT)).to(DTYPE)


def _batches():
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, DIN, generator=generator, dtype=DTYPE),
             torch.randn(BATCH, DOUT, generator=generator, dtype=DTYPE)) for _ in range(STEPS)]


def _resized_tp_run(rank, world_size, state, batches):
    results = {}
    for name, make_opt in OPTIMIZERS.items():
        dense = _dense_mlp()
        dense.load_state_dict(state)
        model = nn.Module()
        model.fc1 = ColumnParallelLinear(dense[0], [4, 4], rank, gather_output=False)
        model.fc2 = RowParallelLinear(dense[2], [4, 4], rank)
        resizer = ZeroResizer(model, stats_every=1)
        resizer.set_ratio(0.5 if rank == 1 else 0.0)
        opt = make_opt(model.parameters())
        steps = []
        for x, target in batches:
            opt.zero_grad()
            active = resizer.active
            loss = F.mse_loss(model.fc2(torch.tanh(model.fc1(x))), target)
            loss.backward()
            steps.append({"loss": loss.detach(), "active": active,
                          "pruned": {layer: resizer.lineage[layer, "weight"].pruned if active else ()
                                     for layer in ("fc1", "fc2")},
                          "input_pruned": {layer: resizer.lineage[layer, "input"].pruned if active else ()
                                           for layer in ("fc1", "fc2")},
                          "grads": {k: p.grad.detach().clone() for k, p in model.named_parameters()}})
            opt.step()
            resizer.observe_weights()
        results[name] = {"steps": steps, "full": {layer: getattr(model, layer).full_tensors()
                                                  for layer in ("fc1", "fc2")}}
    return results


def _reference(state, batches, make_opt, pruned_per_step):
    """The dense MLP whose matmuls use the masks rank 1 used: rows 4..7 of fc1 lose their pruned
    input columns, fc2 loses hidden features 4 + p (rank 1's shard)."""
    dense = _dense_mlp()
    dense.load_state_dict(state)
    fc1, fc2 = dense[0], dense[2]
    opt = make_opt(dense.parameters())
    out = []
    for (x, target), pruned in zip(batches, pruned_per_step):
        mask1 = torch.ones_like(fc1.weight)
        mask1[4:, list(pruned["fc1"])] = 0
        mask2 = torch.ones_like(fc2.weight)
        mask2[:, [4 + p for p in pruned["fc2"]]] = 0
        opt.zero_grad()
        loss = F.mse_loss(F.linear(torch.tanh(F.linear(x, fc1.weight * mask1, fc1.bias)), fc2.weight * mask2,
                                   fc2.bias), target)
        loss.backward()
        out.append({"loss": loss.detach(), "grads": {"fc1.weight": fc1.weight.grad.clone(),
                                                     "fc1.bias": fc1.bias.grad.clone(),
                                                     "fc2.weight": fc2.weight.grad.clone(),
                                                     "fc2.bias": fc2.bias.grad.clone()}})
        opt.step()
    return out, {"fc1": {"weight": fc1.weight.detach(), "bias": fc1.bias.detach()},
                 "fc2": {"weight": fc2.weight.detach(), "bias": fc2.bias.detach()}}


def test_two_rank_tp_mlp_with_a_resized_straggler():
    state = _dense_mlp().state_dict()
    batches = _batches()
    # generous timeouts: on a loaded machine one rank may import torch long after the other
    ranks = run_ranks(_resized_tp_run, 2, args=(state, batches), timeout_s=400, pg_timeout_s=300)
    shards = {"fc1.weight": (slice(0, 4), slice(4, 8)), "fc1.bias": (slice(0, 4), slice(4, 8))}
    for name, make_opt in OPTIMIZERS.items():
        straggler = ranks[1][name]["steps"]
        assert all(step["active"] for step in straggler)
        assert not any(step["active"] for step in ranks[0][name]["steps"])
        pruned_per_step = [step["pruned"] for step in straggler]
        assert [step["input_pruned"] for step in straggler] == pruned_per_step   # the input shares the list
        assert pruned_per_step[0] == {"fc1": (1, 3, 5), "fc2": (1, 3)}           # no statistics yet: Fig. 2
        # after step 1 the columns pruned in it were never measured (infinite change): round-robin,
        # at alpha * gamma = 0.4 (no column moved less than theta): round(2.4) of fc1's measured 0, 2, 4
        assert len(pruned_per_step[1]["fc1"]) == 2 and set(pruned_per_step[1]["fc1"]) < {0, 2, 4}
        assert pruned_per_step[1]["fc2"] == (0, 2)
        reference, final = _reference(state, batches, make_opt, pruned_per_step)
        for step, want in enumerate(reference):
            for rank in (0, 1):
                got = ranks[rank][name]["steps"][step]
                assert_close(got["loss"], want["loss"], msg=f"{name} step {step} rank {rank} loss")
                for param, grad in got["grads"].items():
                    own = shards[param][rank] if param in shards else (
                        (slice(None), slice(4 * rank, 4 * rank + 4)) if param == "fc2.weight" else slice(None))
                    assert grad.shape == want["grads"][param][own].shape
                    assert_close(grad, want["grads"][param][own], msg=f"{name} step {step} rank {rank} {param}")
            grads = straggler[step]["grads"]
            pruned = straggler[step]["pruned"]
            assert (grads["fc1.weight"][:, list(pruned["fc1"])] == 0).all()
            assert (grads["fc2.weight"][:, list(pruned["fc2"])] == 0).all()
        for rank in (0, 1):
            for layer, tensors in final.items():
                for param, value in tensors.items():
                    assert_close(ranks[rank][name]["full"][layer][param], value, msg=f"{name} {layer}.{param}")
