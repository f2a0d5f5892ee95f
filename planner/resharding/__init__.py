"""Cross-mesh resharding plans (paper 001): how a tensor leaving one stage's devices reaches the next's.

spec.py says which box each device holds, tasks.py cuts the transfer into unit tasks, cost.py
prices the strategies (send/recv, all-gather inside the host, pipelined broadcast) and the lower
bound, order.py load-balances and orders them, reshard.py is the entry point. Invariant: every
device receives exactly its box and no slice enters a host twice under broadcast or all-gather;
plans are pure data the runtime executes (runtime/parallel/resharding.py).
"""
