"""What one step does, in order, and how long it takes: schedules, their proof, the simulator.

actions.py builds per-stage action lists (GPipe, 1F1B, eager-1F1B, accumulation); deadlock.py
proves them complete, matched and deadlock-free in one process; simulator.py runs them with the
runtime's communication (gradient_buckets.py: DDP's buckets; boundary_traffic.py: each boundary's
resharding) and timeline.py draws the result. Invariant: what is simulated is what the runtime
runs: both read the same action lists.
"""
