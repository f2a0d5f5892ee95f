"""Partition."""
