"""The ``split`` analysis: which projections of a block shard together, proven exact.

analysis.py drives it (attention by heads, grouped-query by key/value heads, MLPs by features,
lone projections, a class-sharded classifier, fallbacks), propagation.py carries a "sharded
dimension" through each operator and refuses what it cannot prove, groups.py is the plain-data
``ShardGroup`` the planner sizes. Invariant: what cannot be proven exact falls back to gathering,
never silently wrong.
"""
