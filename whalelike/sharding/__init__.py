"""The split analysis."""
