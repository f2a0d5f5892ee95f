"""Dynamic balancing while training: measure, re-plan, draw the run.

straggler_monitor.py measures each rank's speed, rebalance.py runs the after-step loop and its
policies (the state they move is runtime.state's: migration.py, FlexTP's lightweight migration, and
the executors' transfers), flextp_resizing.py FlexTP's ZERO-resizing (the one approximate remedy
besides P-Reduce), semi_pretest.py SEMI's pre-test, sync_policy.py chooses between exact
re-planning and P-Reduce by how long slowdowns last, memory_check.py compares each rank's measured
peak memory with the plan's prediction and re-prices the plan for a miss, run_timeline.py draws the
run. Invariant: every rank takes the same decision at the same step boundary from the same reduced
measurements.
"""
