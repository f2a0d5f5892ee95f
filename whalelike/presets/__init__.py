"""Built-in cluster specs (YAML), loaded with ``whalelike.Cluster.preset(name)``.

Data only: each file is a cluster spec as a user would write it (Whale's, Poplar's, the emulated
ones). Invariant: every preset loads through the same strict reader and rules as a user's file
(``whalelike.cluster``), so a preset can never hold what a user's spec could not.
"""
