"""Find BatchNorm in training mode in a captured graph, for the planner's warning and the runtime.

Why it matters: under ``replicate`` each data-parallel worker normalises with the statistics of its
own samples, so a model with BatchNorm trains differently from one device (``wl.Config(
sync_batchnorm=True)`` synchronises them, see ``runtime.parallel.sync_batchnorm``). Capture records, per Layer,
the BatchNorm modules it runs in training mode (``Layer.batchnorm``), so the planner can tell
which stages are affected without the live graph.

Forms recognised: an ``nn.BatchNorm*`` ``call_module`` leaf (torch.fx keeps torch's modules as
leaves) whose module is in training mode, and a batch-norm operator with ``training=True``
(``torch.export`` inlines the module as ``aten.batch_norm``; ``F.batch_norm`` in user code), whose
module path is the node's innermost module (``meta["wl_path"]``).
"""
from __future__ import annotations

import inspect

import torch.fx as fx
from torch.nn.modules.batchnorm import _BatchNorm


def is_training_batchnorm(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` normalises with batch statistics (a BatchNorm in training mode)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return isinstance(module, _BatchNorm) and (module.training or module.running_mean is None)
    if node.op != "call_function" or "batch_norm" not in getattr(node.target, "__name__", str(node.target)):
        return False
    return _training_argument(node)


def training_batchnorms(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> module path of every BatchNorm in training mode in ``gm``."""
    return {
        node.name: (node.target if node.op == "call_module" else node.meta.get("wl_path", "") or node.name)
        for node in gm.graph.nodes if is_training_batchnorm(gm, node)
    }


def _training_argument(node: fx.Node) -> bool:
    """The ``training`` argument of a batch-norm call (False when the operator has none)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:   # an aten operator
        for i, arg in enumerate(schema.arguments):
            if arg.name == "training":
                value = node.args[i] if i < len(node.args) else node.kwargs.get("training", arg.default_value)
                return bool(value)
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    bound.apply_defaults()
    return bool(bound.arguments.get("training", False))
