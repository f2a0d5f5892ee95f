"""The training recipe (runtime.training) through the Engine, against a single-process reference
with the same recipe: the same autocast, the same clipping (``torch.nn.utils.clip_grad_norm_`` on
the whole model), the same schedule, torch's own ``GradScaler`` for fp16.

One 4-rank spawn runs: data parallel with uneven shares, a 2-stage pipeline, an uneven
tensor-parallel stage after a data-parallel one, and a tied embedding/head across stages with a
sharded head; each with clipping whose norm is dominated by a different part (a pipeline stage, a
tensor-parallel shard, the tied weight: the reference asserts the domination), a warm-up + cosine
schedule, in fp32 (exact: ``assert_close`` defaults) and bf16 / fp16 (tolerances below); an fp16
overflow on one rank's samples only (every rank skips, every rank halves the scale); a schedule
through a re-plan, a skipped NaN step and a resume onto another plan; bad inputs. The spawn's warm-up
(dist_utils' ``warm``) captures each model at the ranks' batch sizes once, so their captures are cache hits.

Tolerances for bf16 and fp16: a parallel run computes each sample exactly as the reference does,
but the reductions over samples (weight gradients: one matmul over the global batch in the
reference, one per micro-batch and rank here, each rounded to the low-precision dtype before the
float32 sum) round at other places. bf16 keeps 8 significant bits, so a rounded gradient term is
off by up to 2**-8 (0.4%) of itself; fp16 keeps 11 (0.05%). Steps use SGD, whose update is linear in
the gradient, so the parameter error after three steps stays a small multiple of lr times that:
rtol/atol 2e-2 (bf16) and 5e-3 (fp16) on losses, gradients' effect on parameters and norms.
Everything in fp32 is checked with the default (float32) tolerances.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import math
import tempfile
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import plans
import whalelike as wl
from dist_utils import run_ranks
from test_runtime_tp import Hybrid   # replicate(2) features, a split(2) classifier of 10 classes
from planner.plan import Plan, StagePlan
from runtime import Engine, checkpoint
from runtime.training.clipping import ClippingError
from runtime.training.precision import Precision, PrecisionError
from runtime.training.schedules import ScheduleError, lr_factor, lr_schedule
from whalelike.cluster import Cluster, Device, Network
from whalelike.errors import SpecError
from whalelike.graphs.capture import capture

WORLD = 4
DIN, HIDDEN, CLASSES, VOCAB, DIM, POSITIONS = 6, 16, 5, 24, 16, 4
STEPS = 3
SGD = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)          # noqa: E731
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)  # noqa: E731
SCHEDULE = lr_schedule("cosine", warmup_steps=2, total_steps=6, min_ratio=0.1)
TOLERANCE = {"fp32": {}, "bf16": {"rtol": 2e-2, "atol": 2e-2}, "fp16": {"rtol": 5e-3, "atol": 5e-3}}
DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.head = nn.Linear(DIN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        with wl.replicate(2):
            self.wte, self.h0, self.h1 = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        with wl.split(2):
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.h1(torch.tanh(self.h0(self.wte(ids))))))


def cluster() -> Cluster:
    devices = tuple(Device(f"emu-{i}", "emu", "localhost", peak_tflops=1.0, memory_gib=4) for i in range(WORLD))
    return Cluster("test-4", devices, Network(2.0, 2.0, 50.0), None)


def _graphs(model, example):
    return capture(model, example)


def dp_plan(model, sizes=([8], [8], [4], [2])) -> Plan:
    graphs = _graphs(model, (torch.randn(2, DIN),))
    return plans.make_plan([StagePlan(0, [0], list(range(len(graphs.layers))), f"replicate({WORLD})")],
                           [plans.worker(r, 0, r, sizes=list(m)) for r, m in enumerate(sizes)],
                           model_fingerprint=graphs.fingerprint, cluster="test-4")


def pipeline_plan(model, cut: int = 2, sizes=([3, 2], [1, 2], [2, 2], [2, 2])) -> Plan:
    """Stage 0 (layers before ``cut``) on ranks 0-1, stage 1 on ranks 2-3, two micro-batches of 8."""
    graphs = _graphs(model, (torch.randn(2, DIN),))
    layers = list(range(len(graphs.layers)))
    return plans.make_plan([StagePlan(0, [0], layers[:cut], "replicate(2)"), StagePlan(1, [0], layers[cut:], "replicate(2)")],
                           [plans.worker(r, r // 2, r % 2, sizes=list(m)) for r, m in enumerate(sizes)],
                           model_fingerprint=graphs.fingerprint, cluster="test-4", num_micro_batch=2)


def split_plan(model, example, shard_path: str, shards: list[int]) -> Plan:
    """TaskGraph 0 data parallel on ranks 0-1 (shares 3+2 and 1+2), TaskGraph 1 split 2 ways unevenly on 2-3."""
    graphs = _graphs(model, example)
    stages = [StagePlan(s, [s], [l.index for l in graphs.layers if l.taskgraph == s], strategy,
                        {shard_path: shards} if s == 1 else {})
              for s, strategy in enumerate(("replicate(2)", "split(2)"))]
    workers = [plans.worker(0, 0, 0, sizes=[3, 2]), plans.worker(1, 0, 1, sizes=[1, 2]),
               plans.worker(2, 1, 0, 0, 2, sizes=[4, 4]), plans.worker(3, 1, 0, 1, 2, sizes=[4, 4])]
    return plans.make_plan(stages, workers, model_fingerprint=graphs.fingerprint, cluster="test-4", num_micro_batch=2)


def batches(n: int, seed: int, steps: int = STEPS, tokens: bool = False):
    g = torch.Generator().manual_seed(seed)
    if tokens:
        return [((torch.randint(0, VOCAB, (n, POSITIONS), generator=g),), torch.randint(0, VOCAB, (n, POSITIONS), generator=g))
                for _ in range(steps)]
    return [((torch.randn(n, DIN, generator=g),), torch.randint(0, CLASSES, (n,), generator=g)) for _ in range(steps)]


def reference(model, data, make_opt, loss_fn, precision="fp32", clip=None, schedule=None):
    """The recipe on one process: per step the loss, the gradient norm before clipping, the learning
    rate used, whether the step was skipped (fp16 overflow); and the final state."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    sched = schedule(opt) if schedule is not None else None
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None   # the Engine's defaults: 2**16, 2000
    out = {"loss": [], "norm": [], "lr": [], "skipped": [], "scale": []}
    for inputs, targets in data:
        opt.zero_grad()
        out["lr"].append(opt.param_groups[0]["lr"])
        out["scale"].append(scaler.get_scale() if scaler else None)
        with torch.autocast("cpu", dtype=DTYPE[precision], enabled=DTYPE[precision] is not None):
            loss = loss_fn(model(*inputs), targets)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
        skipped = not all(torch.isfinite(g).all() for g in grads)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None and not skipped:
            sched.step()
        out["loss"].append(loss.detach().float())
        out["norm"].append(None if norm is None else float(norm))
        out["skipped"].append(skipped)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def grad_share(model, data, loss_fn, names) -> float:
    """The share of the squared gradient norm of the first batch that parameters ``names`` hold."""
    model = copy.deepcopy(model)
    (inputs, targets) = data[0]
    loss_fn(model(*inputs), targets).backward()
    total = sum(p.grad.square().sum() for p in model.parameters())
    part = sum(p.grad.square().sum() for n, p in model.named_parameters() if n in names)
    return float(part / total)


def check(label, model, plan, data, make_opt, loss_fn, precision="fp32", clip=None, schedule=SCHEDULE,
          reduce_tolerance=None, grad_reduce_dtype="fp32"):
    tol = reduce_tolerance or TOLERANCE[precision]
    ref, final = reference(model, data, make_opt, loss_fn, precision, clip, schedule)
    engine = Engine(copy.deepcopy(model), plan, optimizer=make_opt, loss_fn=loss_fn, cluster=cluster(), timeout_s=60,
                    precision=precision, clip_grad_norm=clip, scheduler=schedule, grad_reduce_dtype=grad_reduce_dtype)
    for step, batch in enumerate(data):
        loss = engine.train_step(batch)
        stats = engine.stats[-1]
        assert_close(loss.float(), ref["loss"][step], **tol, msg=lambda m: f"{label}: loss of step {step}: {m}")
        assert stats.lr == pytest.approx(ref["lr"][step]), f"{label}: lr of step {step}"
        assert stats.skipped == ref["skipped"][step], f"{label}: skipped at step {step}"
        if clip is not None and not ref["skipped"][step]:
            assert stats.grad_norm == pytest.approx(ref["norm"][step], rel=tol.get("rtol", 1e-5)), \
                f"{label}: norm of step {step}: {stats.grad_norm} vs {ref['norm'][step]}"
        if precision == "fp16":
            assert stats.loss_scale == ref["scale"][step], f"{label}: loss scale of step {step}"
    state = engine.state_dict()
    for key, value in final.items():
        assert_close(state[key], value, **tol, msg=lambda m: f"{label}: final {key}: {m}")
    return engine


def _clipping_and_precision(rank: int) -> dict:
    seen = {}
    torch.manual_seed(0)
    net = Net()
    # data parallel, uneven shares: fp32 exact with clipping and the schedule (SGD and AdamW); bf16; fp16
    for name, make_opt in (("sgd", SGD), ("adamw", ADAMW)):
        check(f"dp/fp32/{name}", net, dp_plan(net), batches(22, 1), make_opt, F.cross_entropy, clip=0.05)
    for precision in ("bf16", "fp16"):
        check(f"dp/{precision}", net, dp_plan(net), batches(22, 1), SGD, F.cross_entropy, precision, clip=0.05)
    # gradients summed in bf16 (half the bytes): each rank's part rounded once, within bf16's tolerance
    reduced = check("dp/fp32/bf16-reduce", net, dp_plan(net), batches(22, 1), SGD, F.cross_entropy, clip=0.05,
                    reduce_tolerance=TOLERANCE["bf16"], grad_reduce_dtype="bf16")
    assert reduced.executor.sync.ddp._whalelike_hook_state.reduce_dtype is torch.bfloat16
    check("pipeline/bf16/bf16-reduce", net, pipeline_plan(net), batches(8, 2), SGD, F.cross_entropy, "bf16",
          clip=0.1, grad_reduce_dtype="bf16")

    # a pipeline whose second stage (the head) holds the gradient that dominates the norm: a small
    # head weight shrinks the gradients flowing back into the first stage, not its own
    dominated = copy.deepcopy(net)
    with torch.no_grad():
        dominated.head.weight.mul_(0.05)
    share = grad_share(dominated, batches(8, 2), F.cross_entropy, {"head.weight", "head.bias"})
    assert share > 0.9, share
    for precision in ("fp32", "bf16"):
        check(f"pipeline/{precision}", dominated, pipeline_plan(dominated), batches(8, 2), SGD, F.cross_entropy,
              precision, clip=0.1)
    seen["pipeline_share"] = share

    # uneven tensor parallel: the classifier's shards (6 + 4 of 10 classes) dominate the norm
    torch.manual_seed(1)
    hybrid = Hybrid()
    with torch.no_grad():
        hybrid.classifier.weight.mul_(0.02)
    data = batches(8, 3)
    share = grad_share(hybrid, data, F.cross_entropy, {"classifier.weight", "classifier.bias"})
    assert share > 0.9, share
    plan = split_plan(hybrid, (torch.randn(2, DIN),), "classifier", [6, 4])
    for precision in ("fp32", "bf16"):
        check(f"tensor-parallel/{precision}", hybrid, plan, data, SGD, F.cross_entropy, precision, clip=0.5)

    # a tied embedding / sharded head on two stages: the tied weight dominates, counted once
    torch.manual_seed(2)
    tied = TiedLM()
    with torch.no_grad():   # a small head weight shrinks the gradients flowing back into h0 and h1
        tied.wte.weight.mul_(0.05)
    data = batches(8, 4, tokens=True)
    share = grad_share(tied, data, wl.token_cross_entropy, {"wte.weight"})
    assert share > 0.9, share
    plan = split_plan(tied, data[0][0], "lm_head", [14, 10])
    for precision in ("fp32", "bf16"):
        check(f"tied/{precision}", tied, plan, data, SGD, wl.token_cross_entropy, precision, clip=0.2)
    return seen


def _overflow_on_one_rank(rank: int) -> dict:
    """One sample of rank 3's share is huge: only rank 3's fp16 weight gradients overflow (at a
    scale of 2**16: the head's weight gradient is the loss gradient times a ReLU output of about
    1e3), the loss stays finite; every rank skips the step and halves the scale."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    data = batches(22, 5)
    (x,), y = data[0]
    x[21] = 3e3                        # the last sample: rank 3's share (samples 20-21)
    engine = check("fp16-overflow", net, dp_plan(net), data, SGD, F.cross_entropy, "fp16", clip=1.0)
    stats = engine.stats
    assert stats[0].overflow and stats[0].skipped and not stats[1].skipped, stats
    assert stats[1].loss_scale == stats[0].loss_scale / 2
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, [(s.overflow, s.loss_scale) for s in stats])
    assert all(g == gathered[0] for g in gathered), gathered
    # the scale (halved, and its growth tracker) is in checkpoints: a resumed fp16 Engine goes on with it
    with tempfile.TemporaryDirectory() as tmp:
        directory = [tmp]
        dist.broadcast_object_list(directory)
        saved = checkpoint.save(engine, directory[0])
        resumed = Engine(copy.deepcopy(net), dp_plan(net), optimizer=SGD, loss_fn=F.cross_entropy, cluster=cluster(),
                         timeout_s=60, precision="fp16", example_args=data[0][0])
        assert resumed.scaler.current() == 2.0 ** 16
        checkpoint.load(resumed, saved)
        dist.barrier()
    assert resumed.scaler.state_dict() == engine.scaler.state_dict() and resumed.scaler.current() == 2.0 ** 15
    return {"scales": [s.loss_scale for s in stats]}


def _schedule_through_replans_skips_and_resume(rank: int) -> dict:
    torch.manual_seed(0)
    net = Net()
    data = batches(8, 6, steps=6)
    # the uninterrupted reference, with step 2 dropped (its batch is NaN in the run below)
    kept = [b for i, b in enumerate(data) if i != 2]
    ref, final = reference(net, kept, SGD, F.cross_entropy, clip=1.0, schedule=SCHEDULE)
    engine = Engine(copy.deepcopy(net), pipeline_plan(net), optimizer=SGD, loss_fn=F.cross_entropy, cluster=cluster(),
                    timeout_s=60, clip_grad_norm=1.0, scheduler=SCHEDULE, on_nonfinite="skip")
    lrs = []
    nan_batch = ((torch.full((8, DIN), float("nan")),), data[2][1])
    for step in range(2):
        engine.train_step(data[step])
        lrs.append(engine.stats[-1].lr)
    # a re-plan that moves a layer between the stages (parameters and optimizer state move)
    moved = pipeline_plan(net, cut=1)
    engine.apply_plan(moved)
    engine.train_step(nan_batch)                   # skipped: the schedule must not advance
    assert engine.stats[-1].skipped and engine.scheduler.last_epoch == 2
    engine.train_step(data[3])
    lrs.append(engine.stats[-1].lr)
    with tempfile.TemporaryDirectory() as tmp:
        directory = [tmp]
        dist.broadcast_object_list(directory)
        saved = checkpoint.save(engine, directory[0])
        # resume onto another plan: data parallel over the 4 ranks, other shares
        resumed = Engine(copy.deepcopy(net), dp_plan(net, sizes=([2], [2], [3], [1])), optimizer=SGD,
                         loss_fn=F.cross_entropy, cluster=cluster(), timeout_s=60, clip_grad_norm=1.0,
                         scheduler=SCHEDULE, example_args=data[0][0])
        checkpoint.load(resumed, saved)
        dist.barrier()
    assert resumed.scheduler.last_epoch == 3
    for step in (4, 5):
        loss = resumed.train_step(data[step])
        lrs.append(resumed.stats[-1].lr)
        assert_close(loss, ref["loss"][step - 1], msg=f"resumed: loss of step {step}")
    assert lrs == pytest.approx(ref["lr"]), (lrs, ref["lr"])
    for key, value in resumed.state_dict().items():
        assert_close(value, final[key], msg=f"resumed: final {key}")
    return {"lrs": lrs}


def _bad_inputs(rank: int) -> None:
    net = Net()

    def raising(optimizer):
        raise ValueError("no schedule today")

    engine = Engine(copy.deepcopy(net), dp_plan(net), optimizer=SGD, loss_fn=F.cross_entropy, cluster=cluster(),
                    timeout_s=60, scheduler=raising)
    with pytest.raises(ScheduleError, match=r"Engine\(scheduler=.*raising\) raised ValueError: no schedule today; "
                                            r"the factory gets the Engine's optimizer"):
        engine.train_step(batches(22, 7)[0])
    # a precision a device of the plan cannot run: refused on every rank before any step
    lacking = dataclasses.replace(cluster(), devices=tuple(
        dataclasses.replace(d, kind="V100-16GB", peak_tflops=15.7, dtype_tflops={"fp16": 125.0})
        for d in cluster().devices))
    with pytest.raises(SpecError, match=r"V100-16GB cannot run bf16 .*plan with precision fp16"):
        Engine(copy.deepcopy(net), dp_plan(net), optimizer=SGD, loss_fn=F.cross_entropy, cluster=lacking,
               timeout_s=60, precision="bf16")


def _measured_memory(rank: int) -> dict:
    """Every step records this rank's measured peak: at least the parameters, their gradients and
    AdamW's two moments (all alive at the optimizer step), on a data-parallel and a pipeline plan."""
    torch.manual_seed(0)
    net = Net()
    peaks = {}
    for name, plan in (("dp", dp_plan(net)), ("pipeline", pipeline_plan(net))):
        engine = Engine(copy.deepcopy(net), plan, optimizer=ADAMW, loss_fn=F.cross_entropy, cluster=cluster(),
                        timeout_s=60, measure_memory=True)
        unmeasured = Engine(copy.deepcopy(net), plan, optimizer=ADAMW, loss_fn=F.cross_entropy, cluster=cluster(),
                            timeout_s=60)
        for batch in batches(plan.global_batch_size, 8):
            assert_close(engine.train_step(batch), unmeasured.train_step(batch), rtol=0, atol=0)
        state = sum(p.numel() * p.element_size() for p in engine.executor_module().parameters())
        assert all(s.peak_memory_bytes >= 4 * state for s in engine.stats[1:]), (engine.stats, state)
        assert all(s.peak_memory_bytes is None for s in unmeasured.stats)
        peaks[name] = [s.peak_memory_bytes for s in engine.stats]
        # a dropped Engine goes at once, not at the next cyclic collection (a GPU peak counts every
        # tensor alive): its rebalancer refers to it weakly
        gc.disable()
        try:
            gone = weakref.ref(engine)
            del engine
            assert gone() is None, "a dropped Engine is kept alive by a reference cycle"
        finally:
            gc.enable()
    return peaks


def _ranks(rank: int, world_size: int) -> dict:
    return {"clipping": _clipping_and_precision(rank), "overflow": _overflow_on_one_rank(rank),
            "schedule": _schedule_through_replans_skips_and_resume(rank), "bad": _bad_inputs(rank),
            "memory": _measured_memory(rank)}


def _warm() -> None:
    """Each model the ranks train captured at the batch sizes their plans and Engines capture it at,
    once, before the ranks fork (dist_utils' ``warm``): the ranks' captures are then cache hits. So are
    the fake node values of the models the ranks run as pipelines (their first step's fake runs of the
    whole graph, ``runtime.parallel.stage_split.fake_node_values``), in fp32 and under bf16 autocast
    (the Engine's, ``Precision.autocast``), which keys its own."""
    overflowing = nn.Sequential(nn.Linear(DIN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    for model, sizes in ((Net(), (2, 22, 8)), (overflowing, (2, 22)), (Hybrid(), (2, 8))):
        for n in sizes:
            graphs = capture(model, batches(n, 0, steps=1)[0][0])
        if model is not overflowing:   # the pipelines' batch (8) is the last size
            _fill_fake_values(graphs, batches(8, 0, steps=1)[0][0])
    tied = batches(8, 0, steps=1, tokens=True)[0][0]
    _fill_fake_values(capture(TiedLM(), tied), tied)


def _fill_fake_values(graphs, inputs) -> None:
    from runtime.parallel.stage_split import fake_node_values

    fake_node_values(graphs.graph_module, tuple(inputs))
    with Precision("bf16").autocast(torch.device("cpu")):
        fake_node_values(graphs.graph_module, tuple(inputs))


def test_training_recipe_matches_single_process_reference():
    results = run_ranks(_ranks, WORLD, init_process_group=False, timeout_s=400, warm=_warm)
    scales = results[0]["overflow"]["scales"]
    assert scales[1] == scales[0] / 2 and scales[2] == scales[1]


# -- in-process ----------------------------------------------------------------------------------
def test_the_cpu_memory_counter_sees_every_storage_once_until_it_is_freed():
    from runtime.training.memory_meter import LiveBytes

    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(16, 32)
    counter = LiveBytes(model.parameters())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert counter.current == counter.peak == params
    with counter:
        y = model(x)
        view = y.view(-1)                       # a view: no new storage
        # each saved output: Linear 16x128, GELU 16x128, Linear 16x32 (float32)
        assert counter.current - params == 4 * 16 * (128 + 128 + 32)
        y.square().mean().backward()
        del y, view
    counter.close()
    grads = sum(p.grad.numel() * 4 for p in model.parameters())
    assert counter.current == params + grads   # activations freed, gradients alive
    assert counter.peak >= params + grads


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf"), "1.0", True])
def test_a_bad_clipping_norm_is_refused_before_any_rendezvous(bad):
    net = Net()
    with pytest.raises(ClippingError, match=r"clip_grad_norm must be a positive finite number .* got"):
        Engine(net, dp_plan(net), loss_fn=F.cross_entropy, cluster=cluster(), clip_grad_norm=bad)


def test_an_unknown_precision_is_refused():
    net = Net()
    with pytest.raises(PrecisionError, match=r"precision 'fp8' is not one of fp32, bf16, fp16"):
        Engine(net, dp_plan(net), loss_fn=F.cross_entropy, cluster=cluster(), precision="fp8")
    with pytest.raises(PrecisionError, match=r"grad_reduce_dtype 'fp16' is not one of fp32, bf16"):
        Engine(net, dp_plan(net), loss_fn=F.cross_entropy, cluster=cluster(), grad_reduce_dtype="fp16")
    assert Precision("bf16").dtype is torch.bfloat16 and Precision("fp32").dtype is None


def test_schedules_warm_up_then_decay_to_the_floor():
    assert [lr_factor(s, "cosine", 4, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, "cosine", 4, 12) == 1.0 and lr_factor(12, "cosine", 4, 12, 0.1) == pytest.approx(0.1)
    assert lr_factor(8, "cosine", 4, 12) == pytest.approx(0.5)
    assert lr_factor(8, "linear", 4, 12) == pytest.approx(0.5) and lr_factor(100, "constant", 4, 12) == 1.0
    assert math.isclose(lr_factor(20, "linear", 0, 12, 0.2), 0.2)
    with pytest.raises(ScheduleError, match="schedule 'step' is not one of cosine, linear, constant"):
        lr_schedule("step")
    with pytest.raises(ScheduleError, match="warmup_steps must be an integer >= 0, got -1"):
        lr_schedule("cosine", warmup_steps=-1)
