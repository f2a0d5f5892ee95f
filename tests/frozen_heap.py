"""Imported last by the ranks' forkserver (``dist_utils.PRELOAD``): moves everything the preloaded
imports made into the garbage collector's permanent generation (``gc.freeze``).

Why: every process forked from the server inherits that heap (torch, transformers, the library:
millions of objects), and each full collection in a rank walked all of it, touching (and so
copying, page by page) memory the rank otherwise shares with the server: over a second of CPU per
collection in a forked bench rank. Frozen, a collection walks only what the rank made; nothing the
rank creates is exempt. The warm-up process (``dist_utils.spawn_ranks(warm=)``) freezes again after
its warm-up, before it forks the ranks.
"""
import gc

gc.collect()
gc.freeze()
