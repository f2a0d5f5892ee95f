"""Built-in cluster specs (YAML), loaded with ``whalelike.Cluster.preset(name)``."""
