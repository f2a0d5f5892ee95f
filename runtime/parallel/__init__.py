"""Parallel."""
