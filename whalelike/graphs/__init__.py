"""Capture: a model and example inputs in, costed TaskGraphs out."""
