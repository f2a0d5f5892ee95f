"""Dynamic balancing end to end: an emulated straggler forces re-plans mid-run, training stays exact.

Each exact scenario trains a float64 model under ``runtime.Engine`` on emulated devices whose
cluster spec schedules a straggler (``emulation.stragglers``) and the same model in one process on
the same batches (``tests/reference.py``): every step's loss and the final parameters must be
equal although the plan changed under the run (SGD with momentum and AdamW each). Exact
scenarios: data parallel (shares move; also fed by ``UnevenLoader.follow``), a two-stage pipeline
(layers move with their parameters and optimizer state; also with a weight tied across the
stages), tensor parallel (lossless migration, then
a permanent re-shard; migration alone), split inside replicate, and a hybrid (a data-parallel
stage feeding a second stage; and a pipeline whose shares ``Engine.apply_plan`` changes in place,
twice, keeping the executor object). Approximate scenarios (ZERO-resizing, SEMI with two stragglers,
SEMI in a hybrid plan) must train and mark their steps and events approximate. Detection is
checked on the events: a rank slowed 2x is flagged within 3 steps of the onset, a 5% slowdown
triggers nothing, and the policy ``"off"`` only records. Bad input: invalid policy, thresholds out
of range, a schedule naming a missing rank. One 2-rank, one 3-rank and one 4-rank spawn; before
each, a warm-up (``_warm``) captures its models once, so that the ranks' captures are cache hits.
"""
from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import planner
import whalelike as wl
from dist_utils import run_ranks
from reference import OPTIMIZERS, assert_engine_trains_like_reference
from runtime.balance.rebalance import BalanceConfig
from whalelike.graphs.capture import capture
from whalelike.cluster import Cluster, Device, Emulation, Network, Straggler
from whalelike.errors import SpecError

WIDTH, BATCH, STEPS, ONSET, VOCAB = 32, 16, 10, 5, 24
BALANCE = BalanceConfig(warmup_steps=2, window=3)   # the speeds in force are measured over steps 2-4


class Mlp(nn.Module):
    """Six tanh layers; ``strategies`` annotates the first three and the last three."""

    def __init__(self, first=None, second=None):
        super().__init__()
        torch.manual_seed(0)
        layers = []
        for scope in (first, second):
            with scope() if scope is not None else _nothing():
                layers += [nn.Linear(WIDTH, WIDTH) for _ in range(3)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class TiedNet(nn.Module):
    """A token embedding tied to the output head across two movable stages (GPT-2's tie)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        with wl.replicate(1):
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.lower = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        with wl.replicate(1):
            self.upper = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in [*self.lower, *self.upper]:
            x = torch.tanh(layer(x))
        return self.head(x)


def token_loss(out, target):
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def token_batches():
    g = torch.Generator().manual_seed(1)
    return [((torch.randint(0, VOCAB, (BATCH, 4), generator=g),), torch.randint(0, VOCAB, (BATCH, 4), generator=g))
            for _ in range(STEPS)]


class Block(nn.Module):
    """A Megatron MLP block (column then row projection) under ``split(ways)``, after an optional
    ``replicate`` Linear (a hybrid: a data-parallel stage feeding the tensor-parallel one)."""

    def __init__(self, ways: int = 2, stem: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.stem = None
        if stem:
            with wl.replicate(1):
                self.stem = nn.Linear(WIDTH, WIDTH)
        with wl.split(ways):
            self.up = nn.Linear(WIDTH, 8 * WIDTH)
            self.down = nn.Linear(8 * WIDTH, WIDTH)

    def forward(self, x):
        if self.stem is not None:
            x = torch.tanh(self.stem(x))
        return x + self.down(torch.tanh(self.up(x)))


@contextlib.contextmanager
def _nothing():
    yield


def loss_fn(out, target):
    return F.mse_loss(out, target)


def cluster(speeds, stragglers=(), base_gflops=0.01) -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=base_gflops * s / 1000 / 0.4,
                           memory_gib=4, emulated_speed=s) for i, s in enumerate(speeds))
    return Cluster("dyn", devices, Network(2.0, 2.0, 50.0), Emulation(base_gflops=base_gflops,
                                                                       stragglers=tuple(stragglers)))


def batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),),
             torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def scenario(model: nn.Module, spec: Cluster, num_micro_batch: int = 1, balance=BALANCE, data=None,
             loss=loss_fn) -> dict:
    """Plan ``model`` on ``spec``, train it exactly with both optimizers; the events of the last."""
    model = model.double()
    data = data if data is not None else batches()
    graphs = capture(model, data[0][0])
    plan = planner.plan(graphs, spec, wl.Config(global_batch_size=BATCH, num_micro_batch=num_micro_batch))
    events, lines = {}, {}
    for name, make_opt in OPTIMIZERS.items():
        engine, _, _ = assert_engine_trains_like_reference(model, plan, data, make_opt, loss, spec,
                                                           f"{name}", balance=balance)
        events[name] = [(e.step, e.action, e.exact, [c.rank for c in e.changes]) for e in engine.replans]
        # what a failed assertion shows: each event's line, each step's emulation overruns
        lines[name] = [e.line() for e in engine.replans] + [f"overruns by step: {[s.overruns for s in engine.stats]}"]
    return {"events": events, "first": plan, "last": engine.plan, "lines": lines}


def _two_ranks(rank: int, world_size: int) -> dict:
    slow = lambda factor, ops="all": (Straggler(rank=1, factor=factor, start_step=ONSET, ops=ops),)  # noqa: E731
    return {
        "dp": scenario(Mlp(), cluster([1.0, 1.0], slow(2.0)), num_micro_batch=1),
        "dp_loader": loader_scenario(Mlp(), cluster([1.0, 1.0], slow(2.0))),
        "dp_noise": scenario(Mlp(), cluster([1.0, 1.0], slow(1.05))),
        "dp_off": scenario(Mlp(), cluster([1.0, 1.0], slow(3.0)), balance=BalanceConfig(policy="off")),
        "pp": scenario(Mlp(wl.replicate, wl.replicate), cluster([1.0, 1.0], slow(2.0)), num_micro_batch=2),
        "pp_tied": scenario(TiedNet(), cluster([1.0, 1.0], slow(2.0)), num_micro_batch=2, data=token_batches(),
                            loss=token_loss),
        # tensor parallel: lossless migration first, a permanent re-shard once it has lasted 2 steps
        "tp": scenario(Block(), cluster([1.0, 1.0], slow(3.0, "matmul")),
                       balance=BalanceConfig(warmup_steps=2, window=3, persist_steps=2)),
        "tp_migrate": scenario(Block(), cluster([1.0, 1.0], slow(3.0, "matmul")),
                               balance=BalanceConfig(warmup_steps=2, window=3, tp_lossless="migrate")),
        "tp_resize": approximate_run(Block(), cluster([1.0, 1.0], slow(3.0, "matmul")), "resize"),
        # SEMI, one straggler: the pre-test prices resizing's loss and migrates what costs too much
        "tp_semi": approximate_run(Block(), cluster([1.0, 1.0], slow(3.0, "matmul")), "semi"),
    }


def loader_scenario(model: nn.Module, spec: Cluster) -> dict:
    """Data parallel through ``UnevenLoader.follow(engine)``: after the re-plan each rank reads its
    new share of every global batch; the union of the shares is the same global batch the single
    process trains on (the sampler's seeded permutation), so the run stays exact."""
    from torch.testing import assert_close
    from torch.utils.data import TensorDataset

    from reference import train_reference
    from runtime import Engine, UnevenLoader

    model = model.double()
    g = torch.Generator().manual_seed(3)
    xs, ys = (torch.randn(STEPS * BATCH, WIDTH, generator=g, dtype=torch.float64) for _ in range(2))
    plan = planner.plan(capture(model, (xs[:2],)), spec, wl.Config(global_batch_size=BATCH))
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(5)).tolist()   # UnevenSampler's
    chunks = [order[k * BATCH:(k + 1) * BATCH] for k in range(STEPS)]
    losses, final = train_reference(model, [((xs[c],), ys[c]) for c in chunks], OPTIMIZERS["sgd"], loss_fn)
    engine = Engine(model, plan, optimizer=OPTIMIZERS["sgd"], loss_fn=loss_fn, cluster=spec, balance=BALANCE)
    loader = UnevenLoader(TensorDataset(xs, ys), plan, engine.rank, seed=5).follow(engine)
    sizes = []
    for step, share in enumerate(loader):
        sizes.append(int(share.targets.shape[0]))
        assert_close(engine.train_step(share), losses[step], msg=lambda m: f"loader, step {step}: {m}")
    state = engine.state_dict()
    for key, value in final.items():
        assert_close(state[key], value, msg=lambda m: f"loader, final {key}: {m}")
    return {"sizes": sizes, "events": [(e.step, e.action) for e in engine.replans]}


def approximate_run(model: nn.Module, spec: Cluster, policy: str, num_micro_batch: int = 1,
                    **balance) -> dict:
    """ZERO-resizing is approximate by design: the run must train (finite, falling losses), mark its
    resized steps and events approximate, and prune only the straggler. ``balance``: more
    BalanceConfig fields."""
    from runtime import Engine

    model = model.double()
    graphs = capture(model, batches()[0][0])
    plan = planner.plan(graphs, spec, wl.Config(global_batch_size=BATCH, num_micro_batch=num_micro_batch))
    engine = Engine(model, plan, optimizer=OPTIMIZERS["adamw"], loss_fn=loss_fn, cluster=spec,
                    balance=BalanceConfig(policy=policy, warmup_steps=2, window=3, **balance))
    losses = [float(engine.train_step(b)) for b in batches()]
    return {"losses": losses, "events": [(e.step, e.action, e.exact) for e in engine.replans],
            "details": [e.detail for e in engine.replans],
            "approximate": [s.approximate for s in engine.stats], "rank": engine.rank}


def _three_ranks(rank: int, world_size: int) -> dict:
    two = lambda: wl.replicate(2)  # noqa: E731
    spec = cluster([1.0, 1.0, 2.0], (Straggler(rank=0, factor=3.0, start_step=ONSET),))
    # the paper's multi-straggler case: two stragglers of different skew in one tensor-parallel group
    skewed = cluster([1.0, 1.0, 1.0], (Straggler(rank=1, factor=6.0, start_step=ONSET, ops="matmul"),
                                       Straggler(rank=2, factor=1.5, start_step=ONSET, ops="matmul")))
    # SEMI in a hybrid: a replicate stage on rank 0 feeding a split(2) stage on ranks 1-2
    mixed = cluster([1.0, 1.0, 1.0], (Straggler(rank=2, factor=3.0, start_step=ONSET, ops="matmul"),))
    return {"hybrid": scenario(Mlp(two, wl.replicate), spec, num_micro_batch=2),
            "shares_in_place": shares_in_place(rank),
            "semi_two_stragglers": approximate_run(Block(ways=3), skewed, "semi"),
            # accuracy not priced (semi_loss_budget inf): Eq. 2 on time alone resizes the straggler
            "semi_hybrid": approximate_run(Block(ways=2, stem=True), mixed, "semi", num_micro_batch=2,
                                           semi_loss_budget=math.inf)}


def shares_in_place(rank: int) -> dict:
    """A pipeline (``replicate(2)`` on ranks 0 and 2 feeding rank 1) whose shares change mid-run:
    ``Engine.apply_plan`` with the plan :func:`planner.balance.replan.rebalance` makes for rank 0
    slowed 3x (layers kept: shares only) after step 3, and back to the first plan after step 6.
    Each step equals the single-process reference, with SGD and AdamW; the executor and optimizer
    objects are the ones built at the first step; the boundary programs of the first shares are
    reused when they return; ``set_plan`` refuses a plan that moves layers, naming them."""
    from torch.testing import assert_close

    from planner.balance.replan import plan_changes, rebalance
    from planner.plan import PlanError
    from reference import train_reference
    from runtime import Engine

    model = Mlp(lambda: wl.replicate(2), wl.replicate).double()
    spec, data = cluster([1.0, 1.0, 2.0]), batches(seed=2)
    graphs = capture(model, data[0][0])
    first = planner.plan(graphs, spec, wl.Config(global_batch_size=BATCH, num_micro_batch=2))
    slowed = rebalance(first, graphs, spec, [1e7 / 3, 1e7, 2e7], move_layers=False)
    changes = plan_changes(first, slowed)
    assert changes.kinds == {"shares"}, changes.describe()
    moved = rebalance(first, graphs, spec, [1e7, 2e7, 1e7])   # stage 1 twice as fast: a layer moves to it
    out = {"sizes": [], "programs": []}
    for name, make_opt in OPTIMIZERS.items():
        losses, final = train_reference(model, data, make_opt, loss_fn)
        engine = Engine(copy.deepcopy(model), first, optimizer=make_opt, loss_fn=loss_fn, cluster=spec,
                        balance=BalanceConfig(policy="off"))
        built = None
        for step, batch in enumerate(data):
            if step in (3, 6):
                out["programs"].append(engine.executor.boundaries.program_count)
                assert engine.apply_plan(slowed if step == 3 else first) is None   # nothing moved
                assert engine.executor is built[0] and engine.optimizer is built[1], f"{name}: rebuilt at step {step}"
                out["sizes"].append(engine.executor.worker.micro_batch_sizes)
            assert_close(engine.train_step(batch), losses[step], msg=lambda m: f"{name}: loss of step {step}: {m}")
            built = built or (engine.executor, engine.optimizer)
        out["programs"].append(engine.executor.boundaries.program_count)
        with pytest.raises(PlanError, match=r"set_plan: stages\[0\]\.layers is \[0, 1, 2, 3\] in the new plan, "
                                            r"\[0, 1, 2, 3, 4\] in the running one.*Engine\.apply_plan"):
            engine.executor.set_plan(moved)
        assert not engine.executor.takes_in_place(moved) and engine.executor.plan is first
        state = engine.state_dict()
        for key, value in final.items():
            assert_close(state[key], value, msg=lambda m: f"{name}: final {key}: {m}")
    out["expected"] = [slowed.worker(rank).micro_batch_sizes, first.worker(rank).micro_batch_sizes]
    return out


class ReplicatedSplit(nn.Module):
    """``split(2)`` inside ``replicate(2)``: two tensor-parallel groups, each shard synced by DDP
    across the groups (4 ranks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        with wl.replicate(2), wl.split(2):
            self.up = nn.Linear(WIDTH, 8 * WIDTH)
            self.down = nn.Linear(8 * WIDTH, WIDTH)
            self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return self.norm(x + self.down(torch.tanh(self.up(x))))


def _four_ranks(rank: int, world_size: int) -> dict:
    spec = cluster([1.0] * 4, (Straggler(rank=3, factor=3.0, start_step=ONSET, ops="matmul"),))
    return {"replicated_split": scenario(ReplicatedSplit(), spec,
                                         balance=BalanceConfig(warmup_steps=2, window=3, persist_steps=2))}


def _warm(spawn: str) -> None:
    """The float64 models a spawn's ranks capture, on the batches they capture them with, once,
    before the ranks fork (dist_utils' ``warm``): the ranks' captures are cache hits."""
    models = {"two": [(Mlp, ()), (lambda: Mlp(wl.replicate, wl.replicate), ()), (Block, ())],
              "three": [(lambda: Mlp(lambda: wl.replicate(2), wl.replicate), ()), (Block, (3,)), (Block, (2, True))],
              "four": [(ReplicatedSplit, ())]}[spawn]
    for make, args in models:
        capture(make(*args).double(), batches()[0][0])
    if spawn == "two":
        capture(TiedNet().double(), token_batches()[0][0])
        # loader_scenario's plan (on 2 samples) and the Engine's capture of each rank's share
        spec = cluster([1.0, 1.0], (Straggler(rank=1, factor=2.0, start_step=ONSET),))
        model = Mlp().double()
        g = torch.Generator().manual_seed(3)
        xs = torch.randn(STEPS * BATCH, WIDTH, generator=g, dtype=torch.float64)
        plan = planner.plan(capture(model, (xs[:2],)), spec, wl.Config(global_batch_size=BATCH))
        for w in plan.workers:
            capture(model, (xs[:sum(w.micro_batch_sizes)],))


@pytest.fixture(scope="module")
def four():
    return run_ranks(_four_ranks, 4, timeout_s=600, warm=(_warm, ("four",)))[0]


@pytest.fixture(scope="module")
def two():
    return run_ranks(_two_ranks, 2, timeout_s=600, warm=(_warm, ("two",)))[0]


@pytest.fixture(scope="module")
def three():
    return run_ranks(_three_ranks, 3, timeout_s=600, warm=(_warm, ("three",)))[0]


def _first(result: dict) -> tuple:
    for name, events in result["events"].items():
        assert events, f"{name}: no re-plan happened"
    return result["events"]["sgd"][0]


def test_data_parallel_shares_follow_a_straggler_exactly(two):
    """A rank slowed 2x is flagged within 3 steps of the onset, and the shares move off it."""
    step, action, exact, ranks = _first(two["dp"])
    assert ONSET <= step <= ONSET + 2 and action == "shares" and exact and ranks == [1]
    shares = [w.batch_share for w in two["dp"]["last"].workers]
    assert shares[0] > shares[1], shares


def test_uneven_loader_follows_the_engine_re_plans_exactly(two):
    run = two["dp_loader"]   # rank 0's view: its share grows after the straggler (rank 1) is re-planned
    (step, action), *_ = run["events"]
    assert action == "shares" and run["sizes"][:step + 1] == [BATCH // 2] * (step + 1)
    assert all(n > BATCH // 2 for n in run["sizes"][step + 1:]), run


def test_noise_below_the_threshold_and_policy_off_change_nothing(two):
    assert two["dp_noise"]["events"] == {"sgd": [], "adamw": []}
    step, action, exact, ranks = _first(two["dp_off"])
    assert action == "none" and 1 in ranks
    assert [w.batch_share for w in two["dp_off"]["last"].workers] == [w.batch_share for w in two["dp_off"]["first"].workers]


def test_pipeline_moves_layers_off_a_slow_stage_exactly(two):
    step, action, exact, ranks = _first(two["pp"])
    assert "layers" in action and exact, two["pp"]["lines"]
    first, last = two["pp"]["first"], two["pp"]["last"]
    assert len(last.stages[1].layers) < len(first.stages[1].layers), (first.stages, last.stages)


def test_layers_move_between_stages_that_share_a_tied_weight_exactly(two):
    step, action, exact, ranks = _first(two["pp_tied"])
    assert action == "layers" and exact
    assert len(two["pp_tied"]["last"].stages[1].layers) < len(two["pp_tied"]["first"].stages[1].layers)


def test_tensor_parallel_migrates_then_reshards_a_slow_rank_exactly(two):
    actions = [e[1] for e in two["tp"]["events"]["sgd"]]
    assert actions[:2] == ["migrate", "reshard"] and all(e[2] for e in two["tp"]["events"]["sgd"]), actions
    step, action, exact, ranks = _first(two["tp_migrate"])
    assert action == "migrate" and exact and 1 in ranks
    assert two["tp_migrate"]["last"] == two["tp_migrate"]["first"]   # the plan in force keeps the state
    first, last = two["tp"]["first"], two["tp"]["last"]
    (path, sizes), = [(p, s) for p, s in last.stages[0].shard_sizes.items() if s != first.stages[0].shard_sizes[p]][:1]
    assert sizes[1] < first.stages[0].shard_sizes[path][1]


def test_split_inside_replicate_migrates_then_reshards_exactly(four):
    """The compute layout's DDP syncs each migrated shard across the replicas; the owners' state
    stays exact through the migration and the permanent re-shard."""
    actions = [e[1] for e in four["replicated_split"]["events"]["adamw"]]
    assert actions[:2] == ["migrate", "reshard"], actions
    first, last = four["replicated_split"]["first"], four["replicated_split"]["last"]
    assert last.stages[0].shard_sizes != first.stages[0].shard_sizes


def test_zero_resizing_marks_its_steps_and_events_approximate(two):
    run = two["tp_resize"]
    (step, action, exact), *_ = run["events"]
    assert action == "resize" and not exact
    assert not any(run["approximate"][:step + 1]) and any(run["approximate"][step + 1:])
    assert all(math.isfinite(x) for x in run["losses"]) and run["losses"][-1] < run["losses"][0]


def test_hybrid_data_parallel_stage_and_pipeline_rebalance_exactly(three):
    """A re-plan moves work off the straggler, rank 0, and every re-plan that changes the plan is
    exact. On a loaded host the emulation can overrun segments of the first steps on any rank (the
    run says so): a rank whose first steps overran is measured faster once they stop, and the
    re-planner may then move work onto it before the straggler's onset (a real change of measured
    speed, re-planned exactly), so the straggler's re-plan is looked for among all of them, not
    only the first."""
    _first(three["hybrid"])
    changing = [e for e in three["hybrid"]["events"]["sgd"] if e[1] != "none"]
    assert changing and all(exact for _, _, exact, _ in changing), three["hybrid"]["lines"]
    assert any(0 in ranks for _, _, _, ranks in changing), three["hybrid"]["lines"]


def test_pipeline_shares_change_in_place_exactly(three):
    """Shares-only re-plans of a pipeline keep the executor (checked on every rank in the spawn,
    with the losses and final state against the reference); the sizes are the new plan's, and the
    first shares' boundary programs serve again when they return (none compiled after step 6)."""
    run = three["shares_in_place"]
    assert run["sizes"] == run["expected"] * 2, run
    for before, middle, after in (run["programs"][:3], run["programs"][3:]):
        assert before < middle == after, run["programs"]


def test_what_a_pipeline_takes_in_place_is_sizes_and_counts_only():
    """The one rule (``runtime.parallel.pipeline.in_place_differences``), on planner-made plans:
    micro-batch sizes and counts are adopted in place; a moved layer, another ZeRO stage or
    another schedule is named, with both values."""
    from runtime.parallel.pipeline import in_place_differences

    model = Mlp(lambda: wl.replicate(2), wl.replicate).double()
    graphs = capture(model, batches()[0][0])
    first = planner.plan(graphs, cluster([1.0, 1.0, 2.0]), wl.Config(global_batch_size=BATCH, num_micro_batch=2))
    more = copy.deepcopy(first)   # four micro-batches of other sizes, the predictions left stale
    more.num_micro_batch = 4
    for w, sizes in zip(more.workers, ([1, 1, 1, 1], [4, 4, 4, 4], [3, 3, 3, 3])):
        w.micro_batch_sizes, w.forward_ms, w.backward_ms = sizes, w.forward_ms[:1] * 4, w.backward_ms[:1] * 4
    for b in more.boundaries:
        b.transfer_ms = b.transfer_ms[:1] * 4
    more.validate(graphs=graphs)
    assert in_place_differences(first, more) == []
    other = copy.deepcopy(first)
    other.stages[1].layers, other.stages[0].layers = [4, 5], [0, 1, 2, 3]
    other.stages[0].zero_stage, other.schedule = 1, "gpipe"
    assert in_place_differences(first, other) == [
        "schedule is 'gpipe' in the new plan, '1f1b' in the running one",
        "stages[0].layers is [0, 1, 2, 3] in the new plan, [0, 1, 2, 3, 4] in the running one",
        "stages[0].zero_stage is 1 in the new plan, 0 in the running one",
        "stages[1].layers is [4, 5] in the new plan, [5] in the running one"]


def test_semi_migrates_the_worst_straggler_and_resizes_the_mild_one(three):
    run = three["semi_two_stragglers"]
    # both stragglers start at ONSET, but under load the window that first flags the 6x one may not yet
    # show the 1.5x one past the trigger: its work then migrates alone (exact), and the mild one is
    # resized when it is flagged. Whatever the timing: nothing is resized before the first event that
    # resizes, that event also migrates, and it prunes the mild straggler (rank 2) only.
    acting = [(e, d) for e, d in zip(run["events"], run["details"]) if e[1] != "none"]
    first = next(i for i, ((_, action, _), _) in enumerate(acting) if "resize" in action)
    assert all(action == "migrate" and exact for (_, action, exact), _ in acting[:first]), run["events"]
    (step, action, exact), detail = acting[first]
    assert action == "migrate+resize" and not exact and step >= ONSET, run["events"]
    assert "gamma rank 2" in detail and "gamma rank 1" not in detail, detail
    assert all(math.isfinite(x) for x in run["losses"]) and run["losses"][-1] < run["losses"][0]


def test_semi_pre_test_migrates_a_single_straggler_whose_resizing_costs_accuracy(two):
    """Algorithm 2 line 1: before splitting a single straggler's excess, SEMI measures what resizing
    costs in loss (and both sides in time). Resizing the Eq. 1 ratio here raises the loss of the last
    batches far past the 0.5% budget, so most of the straggler's work migrates (exact) and it prunes
    at most the fraction whose measured loss stays within the budget; the event names the pre-test,
    its measured losses and its decision."""
    run = two["tp_semi"]
    acting = [(e, d) for e, d in zip(run["events"], run["details"]) if e[1] != "none"]
    ((step, action, exact), detail), *_ = acting
    assert step >= ONSET and action.startswith("migrate"), (run["events"], detail)
    assert "pre-test rank 1" in detail and "against budget 0.50%" in detail, detail
    samples = [tuple(float(v.rstrip("%")) for v in x.split(": "))
               for x in detail.split("{")[1].split("}")[0].split(", ")]   # (pruned fraction, loss in %)
    migrate, resize = (float(detail.split(f"{what} ")[1].split(",")[0].split(";")[0]) for what in ("migrate", "resize"))
    (fraction, loss), *_ = samples
    assert loss > 0.5 and migrate > resize, detail   # resizing the whole excess would cost accuracy
    assert (resize - 0.0005) * loss / fraction <= 0.5, detail   # the resized part (printed to 3 places) fits the budget
    assert exact == (resize == 0) and any(run["approximate"]) == (resize > 0), (run["events"], detail)
    assert all(math.isfinite(x) for x in run["losses"]) and run["losses"][-1] < run["losses"][0]


def test_semi_in_a_hybrid_plan_resizes_inside_the_tensor_parallel_group_only(three):
    run = three["semi_hybrid"]
    # a rank's noise may cross the trigger before the straggler does: the monitor then records an event
    # whose reaction is "none" (nothing moved, exact); the first event that acts resizes
    quiet = [e for e in run["events"] if e[1] == "none"]
    assert all(exact for _, _, exact in quiet), run["events"]
    (step, action, exact), *_ = [e for e in run["events"] if e[1] != "none"]
    assert "resize" in action and not exact and step >= ONSET, run["events"]
    assert all(math.isfinite(x) for x in run["losses"])


def test_bad_balance_settings_name_the_value():
    with pytest.raises(SpecError, match="policy must be one of exact, semi, resize, off, got 'fast'"):
        BalanceConfig(policy="fast")
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(SpecError, match="threshold must be a fraction in \\(0, 1\\)"):
            BalanceConfig(threshold=bad)
    with pytest.raises(SpecError, match="window must be an integer >= 1, got 0"):
        BalanceConfig(window=0)
    with pytest.raises(SpecError, match="takes a policy name"):
        BalanceConfig.of(3)
    spec = cluster([1.0, 1.0]).to_dict()
    spec["emulation"]["stragglers"] = [{"rank": 5, "factor": 2.0}]
    with pytest.raises(SpecError, match="straggler rank 5 does not exist"):
        Cluster.from_dict(spec)
