"""Elastic training: the job goes on when devices leave or join.

:mod:`runtime.elastic.membership` runs at each start of the workers under torchrun's elastic agent
(``torchrun --nnodes MIN:MAX --rdzv-backend c10d``): it finds which devices of the cluster spec are
present (the membership rule of :mod:`whalelike.cluster`), and when they differ from the plan to
resume it makes a new plan onto them (the captured TaskGraphs, the cluster spec, the old plan's
Config), which :func:`runtime.checkpoint.load` then reshards the newest checkpoint onto; when no
plan can hold the model on them, every rank stops with one line. :mod:`runtime.elastic.departure`
is leaving without a restart: a rank that gives notice (SIGTERM) hands its state to the others at
a step boundary and they go on under a plan for their devices, in the same processes.

Invariant: every rank of a start agrees on the devices present and on the plan (gathered and
broadcast from rank 0, never computed apart), so every rank runs the same plan or stops alike.
"""
