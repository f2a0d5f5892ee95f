"""Changing a running plan: re-plans from measured speeds, state moves, SEMI-migration.

replan.py re-runs the planner's decisions on measured speeds keeping every worker in place;
state_moves.py (``Slab``, ``plan_moves``) owns what state lives where, for re-plans and
checkpoints alike; semi_migration.py is FlexTP's Eq. 1-3 and Algorithm 2. Invariant: pure,
deterministic functions, ties broken by rank, so every rank decides alike without communicating.
"""
