"""Which layers each pipeline stage runs: the partitioner.

stage_layers.py picks the runs of adjacent plain-``replicate`` stages that may be re-partitioned;
solve.py is the entry point (solver choice, infeasibility errors) over problem.py's checked
records, pricing.py's exact dynamic program, order.py's search over group orders and ilp.py's
PuLP/CBC program. Invariant: pure and process-free; a ``split`` stage keeps its layers.
"""
