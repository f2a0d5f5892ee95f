"""The resharding planner on large layouts (issue 21, item 6): exact, close to the bound, bounded work.

A stage boundary between two big stage groups is a resharding of thousands of unit tasks: an
all-to-all change of layout (64 devices batch-split to feature-split over 8 hosts, the layout a
sequence- or expert-parallel boundary makes) is 4096 transfers whose host interfaces are all
saturated. The searches that append each transfer after the last one on its resources left such a
plan at 8x its lower bound; :func:`planner.resharding.order.first_fit_search` fills the gaps.

Properties, on random layouts of pipeline boundaries with more than
:data:`planner.resharding.order.LARGE_PLAN` unit tasks (2-8 hosts a side, 2-8 devices a host,
batch-split, feature-split or batch x feature grids with uneven or padded sizes, meshes on the same
devices or on others): every destination device receives exactly its box (the checks of
``tests/test_resharding_plan.py``), the predicted time is within 1.2x of
:func:`planner.resharding.cost.lower_bound_ms`, and the work the searches report stays within
their budgets (counted, not timed: the same on every machine). The ratio is a property of the
searches and of the bound's looseness, measured rather than proven: over about 1,100 random
layouts the largest was 1.143, and one the CI's search drew (64 x 256 x 512, broadcast) was
1.157; the issue's all-to-all is held to 1.15x below.
"""
from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.devices.network import NetworkModel
from planner.resharding.order import FIRST_FIT_WORK_PER_NODE, LARGE_PLAN, LARGE_PLAN_WORK
from planner.resharding.reshard import ShardingSpec, plan_resharding
from planner.resharding.spec import padded_sizes
from planner.resharding.tasks import unit_tasks
from test_resharding_plan import check_plan

HOSTS = tuple(f"h{i}" for i in range(16))
# the paper's testbed figures: NVLink-class inside a host, 10 Gbps between hosts, 5 us per message
LINKS = NetworkModel.of_hosts(intra_host_gbps=100.0, inter_host_gbps=1.25, latency_us=5.0, hosts=HOSTS)
ITEMSIZE = 2
MAX_NODES = 20_000   # plan_resharding's default search budget
RANDOM_LAYOUT_RATIO = 1.2   # predicted / lower bound on random large layouts (module docstring)
WORK_PER_PROBE_SLOT = 64   # first-fit probes per (route, resource) pair a pass may spend, at most


def mesh(hosts, per_host: int, tag: str) -> list[tuple[str, str]]:
    return [(f"{host}-{tag}{i}", host) for host in hosts for i in range(per_host)]


def work_limit(plan, src: ShardingSpec, dst: ShardingSpec) -> int:
    """What the searches of a large plan may spend, per strategy searched (at most four): greedy
    tries every route once; the randomized search and the DFS stop near LARGE_PLAN_WORK (the last
    round of the first, one pass over the transfers, may overrun it); first fit's first two passes
    and its last may each spend WORK_PER_PROBE_SLOT probes per (route, resource) pair, its others
    FIRST_FIT_WORK_PER_NODE per search node."""
    from planner.resharding.cost import STRATEGIES, transfers
    slots = 0
    for name in STRATEGIES:
        pieces = [p for task in plan.tasks for p in transfers(task, name, src.device_hosts, dst.device_hosts,
                                                              LINKS, ITEMSIZE)]
        slots = max(slots, sum(len(r.resources) + 1 for p in pieces for r in p.routes))
    count = len(plan.transfers)
    per_strategy = (slots + (LARGE_PLAN_WORK + 8 * count) + (LARGE_PLAN_WORK + count)
                    + 3 * WORK_PER_PROBE_SLOT * slots + FIRST_FIT_WORK_PER_NODE * MAX_NODES + count)
    return 4 * per_strategy


@st.composite
def sizes_for(draw, length: int, parts: int) -> list[int]:
    if draw(st.booleans()):
        return padded_sizes(length, parts)
    weights = draw(st.lists(st.integers(1, 3), min_size=parts, max_size=parts))
    sizes = [length * w // sum(weights) for w in weights]
    sizes[-1] += length - sum(sizes)
    return sizes


@st.composite
def layout(draw, shape: tuple[int, ...], hosts, per_host: int, tag: str) -> ShardingSpec:
    devices = mesh(hosts, per_host, tag)
    rows = [devices[i:i + per_host] for i in range(0, len(devices), per_host)]
    last = len(shape) - 1
    kind = draw(st.sampled_from(["batch", "feature", "batch x feature", "feature x batch"]))
    if kind == "batch":
        return ShardingSpec.split(shape, devices, dim=0, sizes=draw(sizes_for(shape[0], len(devices))))
    if kind == "feature":
        return ShardingSpec.split(shape, devices, dim=last, sizes=draw(sizes_for(shape[last], len(devices))))
    if kind == "batch x feature":   # data-parallel slots over hosts, a tensor-parallel group inside each
        return ShardingSpec.grid(shape, rows, row=(0, draw(sizes_for(shape[0], len(rows)))),
                                 col=(last, draw(sizes_for(shape[last], per_host))))
    return ShardingSpec.grid(shape, rows, row=(last, draw(sizes_for(shape[last], len(rows)))),
                             col=(0, draw(sizes_for(shape[0], per_host))))


@st.composite
def large_cases(draw):
    shape = (draw(st.sampled_from([32, 64, 128])), draw(st.sampled_from([256, 1024])),
             draw(st.sampled_from([512, 1024, 4096])))
    src_hosts = HOSTS[:draw(st.integers(2, 8))]
    same = draw(st.booleans())   # the destination on the same devices (an all-to-all) or on other hosts
    dst_hosts = src_hosts if same else HOSTS[8:8 + draw(st.integers(2, 8))]
    per_host = draw(st.sampled_from([2, 4, 8]))
    src = draw(layout(shape, src_hosts, per_host, "s"))
    dst = draw(layout(shape, dst_hosts, per_host if same else draw(st.sampled_from([2, 4, 8])), "s" if same else "r"))
    return src, dst


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(large_cases())
def test_large_random_layouts_are_exact_close_to_the_bound_and_bounded(case):
    src, dst = case
    assume(len(unit_tasks(src, dst)) > LARGE_PLAN)
    plan = plan_resharding(src, dst, LINKS, itemsize=ITEMSIZE, max_nodes=MAX_NODES)
    check_plan(plan, src, dst)
    assert plan.predicted_ms <= RANDOM_LAYOUT_RATIO * plan.lower_bound_ms, \
        (plan.predicted_ms / plan.lower_bound_ms, plan.algorithm)
    assert 0 < plan.search_work <= work_limit(plan, src, dst)


def test_all_to_all_over_eight_hosts_is_within_the_bound():
    """The issue's case: 64 devices on 8 hosts, batch-split to feature-split on the same devices
    (4096 unit tasks, 448 leave every host): within 1.15x of the bound (it was 8x), exact."""
    shape = (64, 1024, 1024)
    devices = mesh(HOSTS[:8], 8, "d")
    src = ShardingSpec.split(shape, devices, dim=0, sizes=[1] * 64)
    dst = ShardingSpec.split(shape, devices, dim=2, sizes=[16] * 64)
    plan = plan_resharding(src, dst, LINKS, itemsize=4)
    assert len(plan.tasks) == 4096
    check_plan(plan, src, dst)
    assert plan.predicted_ms <= 1.15 * plan.lower_bound_ms
    assert plan.search_work <= work_limit(plan, src, dst)
