"""Tensor parallelism (``split``) with uneven shards: the graph pass, the layers, the sharded loss.

shard_pass.py swaps a stage's projections for parallel ones with the plan's shard sizes,
block_sharding.py localises the shape constants between them, layers.py holds the Megatron region
ops and column/row parallel Linears, sharded_loss.py computes the user's cross-entropy on
class-sharded logits. Invariant: a sharded block computes exactly its units' slice; what cannot be
proven exact was left gathered by the analysis (whalelike/sharding).
"""
