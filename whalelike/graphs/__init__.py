"""Capture: a model and example inputs in, costed TaskGraphs out (``wl.capture``).

The passes run in one order (capture.py): trace the model into one flat fx graph (tracing, leaves,
cleanup, output_tree), give every node a TaskGraph and a Layer (regions), copy the values that
depend on no input value into each Layer that uses them (constant_copies), measure FLOPs,
activations and shapes on fake tensors (costs), record training-mode BatchNorms (batchnorm_layers),
and hand the planner plain data (taskgraph). Invariant: every pass leaves the graph computing what
the model computes, and no tensor is allocated (costs come from fake tensors). Imports neither
planner nor runtime.
"""
