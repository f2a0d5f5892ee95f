"""whalelike: train one PyTorch model across unequal accelerators.

Public face (docs/ARCHITECTURE.md section 2): ``replicate``/``split`` scopes, ``annotate``, ``capture``,
``Cluster``, ``Config``.
"""
from .annotate import annotate
from .capture import capture
from .config import Config
from .cluster import Cluster, Device, Network
from .errors import AnnotationError, CaptureError, SpecError, WhaleError
from .losses import token_cross_entropy
from .strategy import Strategy, replicate, set_default_strategy, split
from .workload import Workload
from .taskgraph import Boundary, Layer, TaskGraph, TaskGraphs, TensorSpec

__all__ = [
    "Config", "Cluster", "Device", "Network",
    "AnnotationError", "CaptureError", "SpecError", "WhaleError",
    "Strategy", "replicate", "split", "set_default_strategy", "annotate", "capture",
    "Workload", "token_cross_entropy", "Boundary", "Layer", "TaskGraph", "TaskGraphs", "TensorSpec",
]
