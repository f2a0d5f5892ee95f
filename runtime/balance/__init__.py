"""Dynamic balancing while training: measure, re-plan, move state, draw the run.

straggler_monitor.py measures each rank's speed, rebalance.py runs the after-step loop and its
policies, state_transfer.py moves parameters and optimizer state between two executors,
migration.py is FlexTP's lightweight migration, flextp_resizing.py FlexTP's ZERO-resizing (the one
approximate remedy besides P-Reduce), sync_policy.py chooses between exact re-planning and P-Reduce
by how long slowdowns last, run_timeline.py draws the run. Invariant: every rank takes the same decision
at the same step boundary from the same reduced measurements.
"""
