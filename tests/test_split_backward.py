"""runtime.parallel.split_backward: the input half then the weight half equal one plain backward (float64).

Each case builds a stage-like computation (received tensors -> roots), runs plain
``torch.autograd.backward`` on one copy and the split backward on an identical copy, and compares
the received tensors' gradients and every parameter's ``.grad``. It also checks the halves do what
their names say: no parameter's ``AccumulateGrad`` runs in the input half (its post-accumulate hook,
where DDP's reducer hooks in, fires only in the weight half, once per parameter), and the input
half leaves every ``.grad`` untouched.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from runtime.parallel.split_backward import backward_inputs



@pytest.fixture(autouse=True)
def float64():
    """float64 for this module's tests only (a module-level setting would leak into every later module)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


class Chain(nn.Module):
    """Linears with tanh: the common stage; two roots (the last two activations)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        h1 = torch.tanh(self.layers[0](x))
        h2 = torch.tanh(self.layers[1](h1))
        return [self.layers[2](h2), h2 * 2.0]


class Shared(nn.Module):
    """One Linear applied three times (a parameter used by several layers), one between them, a
    parameter on a branch joining the input's path (``+ self.offset * 3``), a LayerNorm, and a
    second root that never meets the inputs (``tanh(self.extra) * 2``)."""

    def __init__(self):
        super().__init__()
        self.shared, self.middle = nn.Linear(6, 6), nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.offset = nn.Parameter(torch.randn(6))
        self.extra = nn.Parameter(torch.randn(4, 6))

    def forward(self, x, y):
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.middle(h)) + y
        h = self.norm(self.shared(h))
        return [self.shared(h) + self.offset * 3, torch.tanh(self.extra) * 2]


class SharedWeightOwnBiases(nn.Module):
    """One weight in two ``F.linear`` calls, each with its own bias (torch's stage_backward_weight
    fails here: its per-group engine calls free nodes the next group needs)."""

    def __init__(self):
        super().__init__()
        self.b1, self.b3 = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))
        self.weight = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x):
        h = torch.tanh(nn.functional.linear(x, self.weight, self.b1))
        return [nn.functional.linear(h, self.weight, self.b3)]


class NoParams(nn.Module):
    def forward(self, x, y):
        return [torch.tanh(x) * y, x.sum(1, keepdim=True) * y]


class Loss(nn.Module):
    """A last stage: the root is a scalar loss with no given gradient."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return [nn.functional.cross_entropy(self.head(torch.tanh(x)), torch.tensor([0, 2, 1, 1]))]


def _inputs(module: nn.Module, needs_grad: list[bool]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 6, generator=g).requires_grad_(flag) for flag in needs_grad]


CASES = {
    "chain, two roots": (Chain, [True], "given"),
    "chain, input needs no gradient (first stage)": (Chain, [False], "given"),
    "shared parameter and a branch off the input path": (Shared, [True, True], "given"),
    "shared parameter, second input needs no gradient": (Shared, [True, False], "given"),
    "weight shared by two linears with their own biases": (SharedWeightOwnBiases, [True], "given"),
    "no parameters": (NoParams, [True, True], "given"),
    "last stage: loss with no gradient": (Loss, [True], None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_split_backward_equals_plain_backward(name):
    make, needs_grad, grads_kind = CASES[name]
    torch.manual_seed(0)
    plain_module = make()
    split_module = copy.deepcopy(plain_module)
    g = torch.Generator().manual_seed(5)

    def run(module):
        inputs = _inputs(module, needs_grad)
        roots = module(*inputs)
        grads = [torch.randn(r.shape, generator=g) if grads_kind else None for r in roots]
        return inputs, roots, grads

    inputs, roots, grads = run(plain_module)
    torch.autograd.backward(roots, grads)
    g.manual_seed(5)
    split_inputs, split_roots, split_grads = run(split_module)
    params = list(split_module.parameters())
    accumulated: list[str] = []
    for n, p in split_module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: accumulated.append(n))

    input_grads, weights = backward_inputs(split_roots, split_grads, split_inputs, params)
    assert accumulated == [] and all(p.grad is None for p in params), "the input half touched .grad"
    for x, got in zip(inputs, input_grads):
        assert (got is None) == (x.grad is None), name
        if got is not None:
            assert_close(got, x.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: input gradient: {m}")
    weights.run()
    assert sorted(accumulated) == sorted(n for n, p in plain_module.named_parameters() if p.grad is not None), name
    for (n, expected), got in zip(plain_module.named_parameters(), params):
        assert expected.grad is not None and got.grad is not None, f"{name}: {n} has no gradient"
        assert_close(got.grad, expected.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {n}: {m}")


def test_weight_half_accumulates_onto_existing_gradients_and_root_without_gradient_errors():
    torch.manual_seed(0)
    module = Chain()
    expected = copy.deepcopy(module)
    for p in [*module.parameters(), *expected.parameters()]:
        p.grad = torch.ones_like(p)
    x = _inputs(module, [True])
    roots = expected(*x)
    torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    x = _inputs(module, [True])
    roots = module(*x)
    _, weights = backward_inputs(roots, [torch.ones_like(r) for r in roots], x, module.parameters())
    weights.run()
    for p, q in zip(module.parameters(), expected.parameters()):
        assert_close(p.grad, q.grad)
    with pytest.raises(RuntimeError, match=r"root 0 of the backward has shape \(4, 6\) and no gradient"):
        backward_inputs(module(*x), [None, None], x, module.parameters())


def test_halves_do_the_work_of_one_backward_once():
    """A chain of Linears: the two halves' FLOPs add up to one plain backward's (no node's matmul
    runs twice), half each; the input half of a first stage (input needs no gradient) does none."""
    from torch.utils.flop_counter import FlopCounterMode

    for needs_grad, expected_input_share in (([True], 0.5), ([False], 0.0)):
        torch.manual_seed(0)
        module = Chain()
        split = copy.deepcopy(module)
        x = _inputs(module, needs_grad)
        roots = module(*x)
        with FlopCounterMode(display=False) as plain:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        x = _inputs(split, needs_grad)
        roots = split(*x)
        with FlopCounterMode(display=False) as input_half:
            _, weights = backward_inputs(roots, [torch.ones_like(r) for r in roots], x, split.parameters())
        with FlopCounterMode(display=False) as weight_half:
            weights.run()
        total = plain.get_total_flops()
        assert input_half.get_total_flops() + weight_half.get_total_flops() == total
        assert input_half.get_total_flops() == expected_input_share * total
