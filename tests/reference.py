"""The single-process reference every distributed-training test compares against.

Same initial weights, same data, the whole global batch in one process: ``train_reference``
returns the loss of each step and the final state, which a parallel run must reproduce
(``torch.testing.assert_close``). ``OPTIMIZERS`` are the two the acceptance criteria name: SGD
with momentum (gradients enter linearly) and AdamW (normalised updates, so a wrong gradient scale
that SGD would show only in magnitude still changes the parameters).
"""
from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn as nn

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def train_reference(model: nn.Module, batches: Sequence[tuple[tuple, torch.Tensor]], make_opt: Callable,
                    loss_fn: Callable) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Train a copy of ``model`` on each ``(inputs, targets)`` batch; the losses and the final state."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_once(model: nn.Module, batches: Sequence[tuple[tuple, torch.Tensor]], make_opt: Callable,
                   loss_fn: Callable) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`train_reference`, computed on rank 0 of the default process group and broadcast to the
    others (every rank would compute the same values: the ranks of a test share the machine's cores,
    so one computation instead of one per rank); computed here when no group exists."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return train_reference(model, batches, make_opt, loss_fn)
    payload = [train_reference(model, batches, make_opt, loss_fn) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def warm_capture(model: nn.Module, inputs: tuple):
    """What a rank's first pipeline step would work out for ``model`` on batches shaped like
    ``inputs``, done once (a warm-up before ranks fork, ``dist_utils.spawn_ranks(warm=)``): its
    capture (the capture cache's entry) and the fake values of every node at two batch sizes, kept
    with that entry (``runtime.parallel.stage_split.fake_node_values``), which every Engine's
    pipeline split of the same architecture reads to tell its boundary values' batch dimensions.
    Returns the capture."""
    import whalelike as wl
    from runtime.parallel.stage_split import fake_node_values

    graphs = wl.capture(model, inputs)
    fake_node_values(graphs.graph_module, tuple(inputs))
    return graphs


def assert_engine_trains_like_reference(model: nn.Module, plan, batches: Sequence[tuple[tuple, torch.Tensor]],
                                        make_opt: Callable, loss_fn: Callable, cluster, label: str,
                                        timeout_s: float = 120, **engine_kwargs):
    """Train a copy of ``model`` under ``plan`` with ``runtime.Engine`` and another in one process
    (:func:`train_reference`, once for all ranks: :func:`reference_once`) from the same weights on
    the same ``batches``; assert each step's loss and the final full state are equal
    (``engine_kwargs`` go to the Engine, e.g. ``balance``).
    Returns the engine, its losses and the reference's final state, for further checks."""
    from torch.testing import assert_close

    from runtime import Engine

    engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=loss_fn, cluster=cluster,
                    timeout_s=timeout_s, **engine_kwargs)
    got = [engine.train_step(batch) for batch in batches]
    losses, final = reference_once(model, batches, make_opt, loss_fn)
    for step, loss in enumerate(got):
        assert_close(loss, losses[step], msg=lambda m: f"{label}: loss of step {step}: {m}")
    state = engine.state_dict()
    assert state.keys() == final.keys(), f"{label}: state keys differ: {sorted(set(state) ^ set(final))}"
    for key, value in final.items():
        assert_close(state[key], value, msg=lambda m: f"{label}: final {key}: {m}")
    return engine, got, final


def case_model(cases: dict, name: str, dtype: torch.dtype = torch.float32):
    """``cases[name][0]()`` (a model factory) built from seed 0, in ``dtype``: a case table's model."""
    torch.manual_seed(0)
    return cases[name][0]().to(dtype)


def case_batches(cases: dict, name: str, seed: int, steps: int, dtype: torch.dtype = torch.float32) -> list:
    """``steps`` batches of ``cases[name][1](generator)`` (inputs, targets) from ``seed``, floating
    inputs in ``dtype``: a case table's data."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        inputs, targets = cases[name][1](gen)
        out.append((tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs), targets))
    return out
