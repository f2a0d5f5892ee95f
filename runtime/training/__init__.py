"""The training recipe around a step: precision and loss scaling, global-norm gradient clipping,
learning-rate schedules, activation checkpointing and measured memory.

The step executors (:mod:`runtime.parallel`) compute a global batch's gradients; what users put
around that computation in every recipe (torchtitan's autocast, clipping at 1.0, warm-up and
cosine decay, activation checkpointing) lives here, one module per concern, and the Engine
(:mod:`runtime.engine`) applies them at its seams: the autocast context around the executor's step,
the loss scale at the loss, the clipping and the schedule around the optimizer step.

Invariant: every decision these modules take that changes the update (a skipped fp16 step, a
loss scale, a clipping coefficient, a learning rate) is the same on every rank of the plan, taken
from values every rank holds alike or from one collective over all ranks, so the ranks never
diverge; and each is exact against the same recipe on one process, to the rounding of the sums.
"""
