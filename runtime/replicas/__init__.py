"""Keeping a stage's replicas in step: the replica-sync seam and its implementations.

The workers that hold the same parameters (a stage's workers of one ``tp_index`` in every replica)
form a data-parallel group; how that group keeps its copies in step is one protocol
(replica_sync.py), which both step executors use and nothing else. Implementations: ddp_sync.py
(torch DDP, every rank holds everything), fsdp_sync.py (ZeRO stages 1-3 on torch's FSDP2, state
sharded evenly over the group), ragged_sync.py (ZeRO stages 1-3 with memory-proportional shards),
partial_sync.py (Prague's P-Reduce, approximate: each worker steps alone, then averages its
parameters with a group that group_generator.py forms); sync_parts.py holds what several share.
held_state.py describes what a rank holds (as ``Slab``s) for re-plans and
checkpoints; the sync in use says it, because the sync decides what a replica keeps.
Invariant: every worker of a data-parallel group builds the same implementation from the same plan
data (``StagePlan.replica_sync``, ``StagePlan.zero_stage``), so their collectives match, and the
gradient it leaves is the sum over the group of the ranks' weighted-loss gradients (the gradient of
the global-batch mean loss), except under P-Reduce, which is labelled approximate everywhere.
"""
