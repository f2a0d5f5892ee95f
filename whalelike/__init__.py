"""whalelike: train one PyTorch model across unequal accelerators.

Public face (docs/ARCHITECTURE.md section 2): ``replicate``/``split`` scopes, ``annotate``, ``capture``,
``Cluster``, ``Config``. This floor is what a user touches: scopes, annotation, specs, validation,
output files and the CLI; ``graphs/`` captures a model into TaskGraphs and ``sharding/`` proves what
a ``split`` region can shard. Invariant: ``whalelike`` imports neither ``planner`` nor ``runtime``
(except the CLI, inside the commands that need the planner), and every user error is a
``WhaleError`` naming the thing, the bad value and the fix.
"""
from whalelike.annotate import annotate
from whalelike.graphs.capture import capture
from whalelike.config import Config
from whalelike.cluster import Cluster, Device, Network
from whalelike.errors import AnnotationError, CaptureError, SpecError, WhaleError
from whalelike.losses import token_cross_entropy
from whalelike.strategy import Strategy, replicate, set_default_strategy, split
from whalelike.workload import Workload, empty_weights
from whalelike.graphs.taskgraph import Boundary, Layer, TaskGraph, TaskGraphs, TensorSpec

__all__ = [
    "Config", "Cluster", "Device", "Network",
    "AnnotationError", "CaptureError", "SpecError", "WhaleError",
    "Strategy", "replicate", "split", "set_default_strategy", "annotate", "capture",
    "Workload", "empty_weights", "token_cross_entropy", "Boundary", "Layer", "TaskGraph", "TaskGraphs", "TensorSpec",
]
