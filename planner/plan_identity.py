"""What identifies a plan file: the format version it is written in and the model it was made for.

:class:`planner.plan.Plan` records both (``schema_version``, ``model_fingerprint``);
:mod:`planner.assemble` fills them in and :mod:`planner.plan_checks` compares them, so they live
below both (``planner.plan`` re-exports them).
"""
from __future__ import annotations

import hashlib
import json

SCHEMA_VERSION = 1


def fingerprint_of(graphs) -> str:
    """A stable hash of what the plan depends on in a model's TaskGraphs (structure and costs):
    ``graphs.fingerprint`` when it has one (:attr:`whalelike.graphs.taskgraph.TaskGraphs.fingerprint`),
    else a hash of the TaskGraphs, layers and boundaries the planner reads."""
    own = getattr(graphs, "fingerprint", None)
    if own is not None:
        return own
    payload = {
        "graphs": [
            [tg.index, tg.strategy.structure, list(tg.layers), tg.forward_flops, tg.backward_flops, tg.param_bytes,
             tg.optimizer_state_bytes, tg.activation_bytes_per_sample, sorted(tg.shardable.items())]
            for tg in graphs.graphs
        ],
        "layers": [
            [l.index, l.name, l.taskgraph, l.forward_flops, l.backward_flops, l.param_bytes,
             l.activation_bytes_per_sample, l.cut_bytes_per_sample]
            for l in graphs.layers
        ],
        "boundaries": [[b.src, b.dst, [[t.name, list(t.shape), t.dtype] for t in b.tensors]] for b in graphs.boundaries],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
