"""Suite-wide settings: the collection order that lets the xdist workers finish together.

``make test`` runs the suite on three pytest-xdist workers on two cores (``pyproject.toml``: the
third keeps the cores busy while torchrun jobs start and emulated steps sleep), each of which
spawns its own ranks (free ports from the OS, a network-emulation ledger per launcher process, so
two workers never share either). ``--dist worksteal`` hands each worker a contiguous share of the
collection, then moves the tail of the busiest one's queue to a worker that runs dry. So the
order below puts the long tests (a timed run's ``--durations``, in seconds) at the *head of each
share*, longest first, and the short ones behind them, where stealing evens out the end. With
three or more workers (:func:`_chunked`) the long groups are dealt longest first to the share with
the fewest seconds so far; with two:

* the first half starts with the tests that keep both cores busy (ranks training real models);
* the second half starts with the tests that mostly wait (emulated slow steps, torchrun restarts,
  hung ranks timing out) or run on one core, so that the other worker's ranks have the cores
  their waiting leaves idle.

A prefix ending in ``::`` keeps its module together (so that its module-scoped fixtures and
per-process caches serve all its tests). Nothing is skipped and a module's own order is kept; a
name that no longer exists is ignored (a renamed test then only loses its head start). Without
xdist the long tests simply run first.
"""
from __future__ import annotations

import itertools
import os

# the pytest workers themselves run single-threaded, as the spawned ranks do (tests/dist_utils.py):
# two workers on two cores, each with its ranks, must not oversubscribe the cores with intra-op threads
os.environ.setdefault("OMP_NUM_THREADS", "1")

# node-id prefix -> seconds (a timed run on three workers, setup and call; a module's prefix: all its tests).
# The head of the first half: tests whose ranks compute throughout (two cores' worth or more).
COMPUTING = {
    "test_tp_transformers.py::test_transformer_blocks_split_unevenly_match_single_process": 65,
    "test_examples_train.py::test_examples_train_exactly_under_their_plans": 63,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[memory]": 74,
    "test_real_models.py::": 86,
    "test_zero.py::test_zero_stages_train_exactly_hold_their_rows_and_checkpoint_across_layouts": 53,
    "test_zero_memory.py::": 45,
    "test_expert_parallel.py::": 45,
    "test_sharding_forms.py::": 72,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[profile_vs_spec]": 13,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[profile_examples]": 21,
    "test_encoder_decoder.py::test_encoder_decoder_and_root_glue_train_exactly_under_their_plans": 26,
    "test_tied_weights.py::test_tied_weights_across_stages_match_single_process_reference": 69,
    "test_batchnorm.py::test_synchronised_batchnorm_matches_single_process_reference": 26,
    "test_sharded_loss.py::test_every_form_trains_exactly_and_recognised_forms_keep_the_head_sharded": 21,
    "test_recompute.py::test_recomputing_stages_train_exactly_like_the_reference_and_measured_memory_drops_as_predicted": 32,
    "test_boundary_resharding.py::": 13,
    "test_runtime_dp.py::test_engine_data_parallel_matches_single_process": 6,
    "test_training_recipe.py::test_training_recipe_matches_single_process_reference": 14,
    "test_runtime_tp.py::test_split_through_the_engine_matches_single_process": 12,
    "test_pipeline.py::test_pipeline_matches_single_process_reference": 10,
    "test_replica_sync.py::test_ddp_sync_keeps_uneven_replicas_in_step_on_two_ranks": 1,
    "test_state_transfer.py::test_switching_plans_mid_training_matches_single_process_reference": 8,
    "test_tensor_parallel.py::test_uneven_tensor_parallel_matches_single_process": 5,
    "test_eager_pipeline.py::": 8,
    "test_guards.py::test_guards_on_two_ranks": 2,
    "test_evaluation.py::": 7,   # three ranks train and evaluate under three plans
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[real_job]": 87,  # 4 ranks, then a 2-rank torchrun job
    "test_pretrained.py::test_each_rank_reads_its_uneven_pieces_and_any_plan_saves_what_from_pretrained_loads": 31,
    "test_few_devices.py::test_every_example_trains_on_one_device_like_the_plain_loop": 42,
    "test_capture_cache.py::": 75,   # one core: captures of transformers models, fresh and from the cache
    "test_empty_weights.py::": 16,
    "test_plan_candidates.py::": 20,
    "test_idle_state.py::": 20,
}
# The head of the second half: tests that mostly wait (emulated slow steps, torchrun launches and
# restarts, ranks timing out) or compute on one core, so they leave the other worker's ranks room.
WAITING = {
    "test_restart.py::": 29,
    "test_elastic.py::": 46,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[elastic]": 55,
    "test_profile.py::test_profile_recovers_what_the_emulation_was_given": 13,
    "test_partial_reduce.py::": 29,
    "test_dynamic_balance.py::": 53,
    "test_examples_train.py::test_text_run_resumed_onto_other_shares_trains_like_the_uninterrupted_run": 3,
    "test_runtime_faults.py::": 29,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[straggler_dp]": 11,
    "test_zero.py::test_an_emulated_device_enforces_its_memory": 3,   # a rank waits out its peer's timeout
    "test_zero_ragged_planning.py::": 21,
    "test_tp_blocks.py::": 26,
    "test_checkpoint.py::": 17,
    "test_cli.py::": 35,
    "test_packed_data.py::": 4,   # one core: imports datasets and transformers, trains a tokenizer
    "test_examples_train.py::test_train_py_runs_the_recipe_in_bf16_with_clipping_and_a_warm_cosine_schedule": 1,
    "test_dist_utils.py::": 18,   # ranks that hang until their timeout
    "test_import_graph.py::": 9,
    "test_bad_inputs.py::test_many_devices_plan_when_the_layer_is_wide_enough": 31,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[straggler_pp]": 11,
    "test_examples_capture.py::": 25,
    # the other benches' smoke runs at or above 8 s, then the rest together
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[gpu_check]": 26,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[pipeline_shares]": 26,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[checkpoint_cost]": 14,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[pipeline_comm]": 14,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[overhead]": 14,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[straggler_tp]": 13,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[lab_plans]": 12,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[zero_hetero]": 12,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[prague]": 10,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[precision]": 10,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[tp_moe]": 9,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[tp_transformer]": 9,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[pp_vs_pipelining]": 8,
    "test_bench_smoke.py::test_bench_smoke_run_ends_with_its_headline[tp_vs_dtensor]": 8,
    "test_bench_smoke.py::": 6,   # the other benches' smoke runs, about 5 s each
    "test_layout.py::": 6,
    "test_capture.py::test_fingerprint_stable_across_processes": 17,
    "test_launch.py::test_whalelike_train_runs_the_example_job_like_train_py": 5,   # two torchrun jobs
    "test_metrics.py::": 2,
    # each page on its own (its torchrun jobs and plans, in order), so the pages spread over the workers
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/training-recipe.md]": 93,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/quickstart.md]": 55,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/real-job.md]": 55,
    "test_docs_run.py::test_the_page_s_blocks_run[README.md]": 53,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/data.md]": 46,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/profiling.md]": 41,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/your-model.md]": 35,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/multi-node-elastic.md]": 24,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/troubleshooting.md]": 35,   # 41 commands, 10 torchrun jobs (a profile)
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/checkpoints.md]": 13,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/big-models.md]": 10,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/options.md]": 5,
    "test_docs_run.py::test_the_page_s_blocks_run[docs/guides/balancing.md]": 5,
}
# Before everything else in the second half: train.py's one-line usage errors, where the quiet rank
# waits at most 10 s for rank 0 to have printed, so they run while the other worker's first test is
# still planning in its own process (the least loaded moment of the run).
LOAD_SENSITIVE = {"test_restart.py::test_user_errors_are_one_line_per_job": 23}


def _group(nodeid: str, table: dict) -> str | None:
    name = nodeid.split("/")[-1]
    return next((prefix for prefix in table if name.startswith(prefix)), None)


def _ordered(items: list, table: dict) -> list:
    """The items of ``table``'s groups, longest group first (a module keeps its own order)."""
    groups = {prefix: [] for prefix in sorted(table, key=table.get, reverse=True)}
    for item in items:
        groups[_group(item.nodeid, table)].append(item)
    return [item for members in groups.values() for item in members]


def pytest_collection_modifyitems(session, config, items):
    tables = (LOAD_SENSITIVE, COMPUTING, WAITING)
    table_of = {i.nodeid: next((t for t in tables if _group(i.nodeid, t)), None) for i in items}
    sensitive, computing, waiting = ([i for i in items if table_of[i.nodeid] is t] for t in tables)
    rest = [i for i in items if table_of[i.nodeid] is None]
    first, second = _ordered(computing, COMPUTING), _ordered(sensitive, LOAD_SENSITIVE) + _ordered(waiting, WAITING)
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2:   # one process: the long tests first
        items[:] = first + second + rest
        return
    if workers > 2:
        items[:] = _chunked(items, workers, sensitive, rest)
        return
    # worksteal gives the first worker items[:len(items) // 2]; its half starts with the computing
    # tests, the second half with the waiting ones, and the short tests fill both
    fill = max(0, len(items) // 2 - len(first))
    items[:] = first + rest[:fill] + second + rest[fill:]


def _chunked(items: list, workers: int, sensitive: list, rest: list) -> list:
    """More than two workers: worksteal hands worker ``i`` the ``i``-th of ``workers`` contiguous
    chunks (sizes as :meth:`xdist.scheduler.worksteal.WorkStealingScheduling.check_schedule` cuts
    them); each chunk starts with its share of the long groups, dealt longest first to the chunk
    with the least seconds so far (a module's group stays whole), the load-sensitive ones at the
    head of the last chunk; the short tests fill the chunks up."""
    sizes, left = [], len(items)
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    heads: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    heads[-1].extend(sensitive)
    load[-1] += sum(LOAD_SENSITIVE.values())
    table = {**COMPUTING, **WAITING}
    members: dict[str, list] = {prefix: [] for prefix in sorted(table, key=table.get, reverse=True)}
    for item in items:
        prefix = _group(item.nodeid, table)
        if prefix is not None and item not in sensitive:
            members[prefix].append(item)
    for prefix, group in members.items():
        if group:
            least = min(range(workers), key=lambda i: load[i])
            heads[least].extend(group)
            load[least] += table[prefix]
    fill = iter(rest)
    out = []
    for size, head in zip(sizes, heads):
        out += head + list(itertools.islice(fill, max(0, size - len(head))))
    return out + list(fill)


# -- CPU accounting -------------------------------------------------------------------------------------
# The budget is CPU on two cores, and wall time under three workers says little about what one test
# costs. Each test's CPU seconds (setup and call): its own process's, its subprocesses' (torchrun jobs,
# benches: children's usage once they are waited for, theirs included) and its spawned ranks'
# (tests/dist_utils.py reports them). The summary lists the most expensive; WHALELIKE_TEST_CPU=FILE
# writes every test's figure as JSON; WHALELIKE_RANK_PROFILE=FOLDER runs every spawned rank under
# cProfile (one .prof per rank and test, tests/dist_utils.py) to see where a test's CPU goes.
import json
import resource


import pytest

_CPU_KEY = pytest.StashKey[float]()
_cpu_by_test: dict[str, float] = {}


def _cpu_now() -> float:
    import dist_utils
    import warm_python

    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + dist_utils.RANK_CPU_S[0]
            + warm_python.cpu_s())


def _measured(item):
    start = _cpu_now()
    yield
    item.stash[_CPU_KEY] = item.stash.get(_CPU_KEY, 0.0) + _cpu_now() - start


pytest_runtest_setup = pytest.hookimpl(hookwrapper=True)(_measured)
pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(_measured)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "call":
        item.user_properties.append(("cpu_s", round(item.stash.get(_CPU_KEY, 0.0), 2)))
    yield


def pytest_runtest_logreport(report):
    if report.when == "call":
        cpu = dict(report.user_properties).get("cpu_s")
        if cpu is not None:
            _cpu_by_test[report.nodeid] = cpu


def pytest_terminal_summary(terminalreporter):
    if not _cpu_by_test:
        return
    top = sorted(_cpu_by_test.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"CPU seconds (process, subprocesses, ranks): {sum(_cpu_by_test.values()):.0f} "
                                    f"in all, the 15 largest")
    for nodeid, cpu in top[:15]:
        terminalreporter.write_line(f"{cpu:8.1f}s  {nodeid}")
    path = os.environ.get("WHALELIKE_TEST_CPU")
    if path:
        with open(path, "w") as f:
            json.dump(dict(top), f, indent=1)
