"""Emulation."""
