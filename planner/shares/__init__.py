"""Who gets how much: data-parallel batch shares, tensor-parallel shard sizes, the sample layout.

batch_shares.py splits each micro-batch by speed (Whale's Algorithm 1, Poplar's per-device
accumulation), shard_sizes.py gives each tensor-parallel rank whole units by speed within memory,
layout.py (``SampleLayout``) is the one owner of which rank processes which samples,
state_fractions.py gives each ZeRO worker its fraction of the state by free memory (ragged shards), and
batchnorm_statistics.py warns when uneven shares change BatchNorm statistics. Invariant: every
sample of a global batch is processed by exactly one slot of every stage.
"""
