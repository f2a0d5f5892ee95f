"""Executing data and pipeline parallelism on one rank: the step executors and what they share.

data_parallel.py (one stage) and pipeline.py (several stages) are the executors (their replicas are
kept in step by runtime.replicas); stage_split.py cuts the captured graph into stage modules; boundaries.py and resharding.py move values and
gradients between stage groups; split_backward.py splits a backward into input and weight halves;
tied_weights.py and sync_batchnorm.py keep tied copies and BatchNorm statistics in step.
Invariant: an exact plan computes the gradient of the global-batch mean loss (losses weighted by
samples / global batch, gradients summed), and each rank runs the plan's action list as is.
"""
