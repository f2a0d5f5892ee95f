"""Suite-wide settings: the longest tests start first, so the parallel workers finish together.

``make test`` runs the suite on two pytest-xdist workers (``pyproject.toml``), each of which
spawns its own ranks (free ports from the OS, a network-emulation ledger per launcher process, so
two workers never share either). With two workers, a 2-minute test that starts last keeps one core
busy while the other idles: the tests below (the slowest of a timed run, ``--durations``) are
moved to the front of the collection, in this order, and xdist's ``worksteal`` hands the rest
out as workers free up. Nothing is skipped or reordered within a module's own setup; a name that
no longer exists is ignored (a renamed test then only loses its head start).
"""
from __future__ import annotations

import os

# the pytest workers themselves run single-threaded, as the spawned ranks do (tests/dist_utils.py):
# two workers on two cores, each with its ranks, must not oversubscribe the cores with intra-op threads
os.environ.setdefault("OMP_NUM_THREADS", "1")

SLOWEST_FIRST = (
    "test_real_models.py::test_transformers_train_exactly_under_their_plans",
    "test_examples_train.py::test_examples_train_exactly_under_their_plans",
    "test_tp_transformers.py::test_transformer_blocks_split_unevenly_match_single_process",
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[memory]",
    "test_recompute.py::test_recomputing_stages_train_exactly_like_the_reference_and_measured_memory_drops_as_predicted",
    "test_tied_weights.py::test_tied_weights_across_stages_match_single_process_reference",
    "test_restart.py::test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_result",
    "test_examples_train.py::test_text_run_resumed_onto_other_shares_trains_like_the_uninterrupted_run",
    "test_checkpoint.py::",
    "test_dynamic_balance.py::",
    "test_boundary_resharding.py::",
    "test_batchnorm.py::test_synchronised_batchnorm_matches_single_process_reference",
    "test_sharded_loss.py::test_every_form_trains_exactly_and_recognised_forms_keep_the_head_sharded",
    "test_runtime_faults.py::",
    "test_runtime_dp.py::test_engine_data_parallel_matches_single_process",
    "test_runtime_tp.py::test_split_through_the_engine_matches_single_process",
    "test_pipeline.py::test_pipeline_matches_single_process_reference",
    "test_eager_pipeline.py::",
    "test_bench_smoke.py::",
)


def _rank(nodeid: str) -> int:
    name = nodeid.split("/")[-1]
    for i, prefix in enumerate(SLOWEST_FIRST):
        if name.startswith(prefix):
            return i
    return len(SLOWEST_FIRST)


def pytest_collection_modifyitems(session, config, items):
    items[:] = sorted(items, key=lambda item: _rank(item.nodeid))   # stable: the rest keep their order
