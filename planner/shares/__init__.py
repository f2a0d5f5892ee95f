"""Shares."""
