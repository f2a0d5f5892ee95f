"""Unequal hardware on a CPU machine: the hidden truth the planner never reads.

compute.py pads compute segments to their modeled time (speeds, stragglers, calibration);
network.py pads transfers and collectives to the network model's time, with host interfaces
shared across processes through a /dev/shm ledger. Invariant: only this package reads
``emulated_speed`` and the cluster's ``emulation`` block; modeled time never comes from measured
wall time.
"""
