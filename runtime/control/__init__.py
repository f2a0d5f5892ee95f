"""What reacts at a step boundary: controllers that read the step and return plan changes as values.

protocol.py declares a controller (what it may send in the step-end exchange, what it reads, the
change it may return, what it is told afterwards) and the changes; exchange.py is the one vector
summed in the collective that ends a step, each controller's share of it; board.py runs the
controllers of an Engine in their fixed order and picks the step's change; step_log.py is a small
controller of its own (each step's figures as JSON lines), the model for new ones. The controllers
of dynamic balancing, P-Reduce's policy and leaving live with their subjects
(runtime/balance/rebalance.py, runtime/balance/sync_policy.py, runtime/elastic/departure.py).

Invariant: every controller decides from values identical on every rank (the summed exchange, the
plan, the step, its own state built from those), so every rank returns the same change at the same
boundary, and at most one change is applied per step, in the order of the board.
"""
