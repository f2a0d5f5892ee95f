"""Resharding."""
