"""What one step does, in order, and how long it takes: schedules, their proof, the simulator.

actions.py has the action kinds (compute F, B, BI, BW; transfers SEND_F, RECV_F, SEND_B, RECV_B) and
builds per-stage compute lists (GPipe, 1F1B, eager-1F1B, ZB-H1, accumulation); program.py lowers them
onto a plan's boundaries, every transfer written out and each stage's backward whole or split;
deadlock.py proves the programs complete, matched and deadlock-free in one process; simulator.py
runs them with the runtime's communication (gradient_buckets.py: DDP's buckets; boundary_traffic.py:
each boundary's resharding) and timeline.py draws the result. Invariant: what is simulated is what
the runtime runs: both run the same lowering of the same schedule, proven before either runs it.
"""
