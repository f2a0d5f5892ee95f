"""Tensor."""
