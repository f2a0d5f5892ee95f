"""Network emulation (runtime.emulation.network): transfers padded to their modeled time, NICs shared.

One spawn of 4 gloo ranks on an emulated cluster of three hosts: A holds ranks 0 and 1, B rank 2,
C rank 3. Modeled times are ~50-200 ms. Each padded time, measured on the wall clock, must be at
least its modeled time; that it is not padded longer is read from the emulator's own record of
each round (what it priced, what it queued behind a busy NIC, what the receiver slept), not from
the wall clock, which a loaded host stretches by any amount. Received tensors must equal the sent
ones (the real transfer happens).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from dist_utils import run_ranks
from planner.devices.network import NetworkError, NetworkModel
from whalelike.cluster import Emulation
import torch.fx as fx
import torch.nn.functional as F

import test_pipeline as pipeline_case
from runtime.replicas.ddp_sync import wrap_ddp
from runtime.groups import group_ranks
from runtime.parallel.pipeline import PipelineExecutor
from runtime.emulation.compute import Emulator
from runtime.emulation.network import LEDGER_ENV, NetworkEmulationError, NetworkEmulator, price_group
import runtime.emulation.network as network_module
from runtime.tensor.layers import reduce_from_region

MB = 1_000_000                       # bytes per message: 125,000 float64
INTER_GBPS, INTRA_GBPS, LATENCY_US = 0.01, 0.02, 1000.0   # 1 MB: 101 ms between hosts, 51 ms inside one
DEVICE_HOSTS = {"a0": "A", "a1": "A", "b0": "B", "c0": "C"}
DEVICES = list(DEVICE_HOSTS)         # rank r runs device DEVICES[r]


def _model() -> NetworkModel:
    return NetworkModel(INTRA_GBPS, INTER_GBPS, LATENCY_US, DEVICE_HOSTS)


def _payload(rank: int) -> torch.Tensor:
    return torch.arange(MB // 8, dtype=torch.float64) + 1000.0 * rank


def _exchange(network: NetworkEmulator, rank: int, sends: dict[int, int]) -> dict:
    """One round: every sender in ``sends`` (sender -> receiver) posts its payload at once after a
    barrier; returns this rank's post time, or its receive completion time and what it got."""
    dist.barrier()
    receivers = {dst: src for src, dst in sends.items()}
    before = copy.copy(network.stats)
    if rank in sends:
        posted = time.monotonic()
        ops = network.stamp_sends([dist.P2POp(dist.isend, _payload(rank), sends[rank], tag=7)], [DEVICES[sends[rank]]])
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return {"posted": posted, "record": _since(before, network.stats)}
    if rank in receivers:
        buffer = torch.empty(MB // 8, dtype=torch.float64)
        ops, arrival = network.stamp_receives([dist.P2POp(dist.irecv, buffer, receivers[rank], tag=7)])
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        arrival.wait()
        return {"done": time.monotonic(), "got": buffer, "from": receivers[rank], "record": _since(before, network.stats)}
    return {}


def _since(before, after) -> dict:
    """The emulator's record of one round: each counter's growth since ``before``."""
    return {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)}


WIDTH, LAYERS = 128, 4              # DDP buckets of one 128x128 float64 weight each: 131,072 bytes
BACKWARD_S = 0.1                     # modeled backward: 1e8 FLOPs at 1 GFLOP/s


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))


def _ddp_overlap(network: NetworkEmulator, rank: int, world_size: int) -> dict:
    """Two steps of DDP over every rank (the first builds DDP's buckets); the second's backward
    time from its start to the all-reduce's padded end, and the gradients against a reference."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).double()
    reference = copy.deepcopy(model)
    emulator = Emulator(1.0, Emulation(base_gflops=1.0), rank, network=network)
    ddp = wrap_ddp(model, None, emulator, devices=DEVICES, bucket_cap_mb=WIDTH * WIDTH * 8 / 2**20)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = ddp(_inputs(rank)).pow(2).mean()
        before = network.stats.allreduces
        dist.barrier()
        start = time.monotonic()
        emulator.begin(BACKWARD_S * 1e9, 8)
        loss.backward()
        emulator.wait_deadline()
        emulator.wait_communication()
        done = time.monotonic()
    sum(reference(_inputs(r)).pow(2).mean() for r in range(world_size)).backward()
    return {"measured": done - start, "start": start, "end": network.last_allreduce_end,
            "buckets": network.stats.allreduces - before,
            "grads": [p.grad for p in model.parameters()], "reference": [p.grad for p in reference.parameters()]}


def _pipeline(rank: int, ledger_root: str) -> dict:
    """test_pipeline's 'straddling-2x2' (stage 0 on ranks 0-1 of host A, stage 1 on ranks 2 and 3 of
    hosts B and C, DDP inside each stage) on the emulated network: losses and final state against
    the single-process reference."""
    schedule, cut, workers, _ = pipeline_case.SCENARIOS["straddling-2x2"]
    hosts = {f"cpu{r}": host for r, host in enumerate("AABC")}
    plan = pipeline_case._plan(schedule, workers)
    plan = dataclasses.replace(plan, workers=[dataclasses.replace(w, host=hosts[w.device]) for w in plan.workers])
    model = NetworkModel(1.0, 0.5, 500.0, hosts)
    network = NetworkEmulator(model, f"cpu{rank}", ledger_root=ledger_root)
    torch.manual_seed(0)
    net = pipeline_case.SkipNet()
    reference = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(plan.global_batch_size, pipeline_case.DIN, generator=g),
                torch.randn(plan.global_batch_size, pipeline_case.CLASSES, generator=g),
                torch.randint(0, pipeline_case.CLASSES, (plan.global_batch_size,), generator=g)) for _ in range(2)]
    dp_group = None
    for ranks in group_ranks(plan, "dp").values():
        created = dist.new_group(list(ranks))
        dp_group = created if rank in ranks else dp_group
    gm = fx.symbolic_trace(net)
    emulator = Emulator(1.0 if rank % 2 else 0.5, Emulation(base_gflops=10.0), rank, network=network)
    pipe = PipelineExecutor(gm, pipeline_case._cut(gm, cut), plan, F.cross_entropy, emulator=emulator,
                            stage_flops=[(2e3, 4e3)] * 2, dp_group=dp_group)
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, reference))
    losses, ref_losses = [], []
    for x, z, y in batches:
        optimizer.zero_grad()
        losses.append(pipe.train_step((x, z), y))
        optimizer.step()
        ref_optimizer.zero_grad()
        loss = F.cross_entropy(reference(x, z), y)
        loss.backward()
        ref_optimizer.step()
        ref_losses.append(loss.detach())
    state = pipe.full_state_dict()
    network.close()
    return {"losses": losses, "ref_losses": ref_losses, "state": state, "ref_state": reference.state_dict(),
            "stats": network.stats}


def _tensor_parallel(network: NetworkEmulator, rank: int) -> dict:
    """A tensor-parallel all-reduce (runtime.tensor.layers' region op) between hosts A and B (ranks 0
    and 2) on a priced group: the real sum, padded to the ring's modeled time."""
    group = dist.new_group([0, 2])   # every rank creates every group
    if rank not in (0, 2):
        return {}
    price_group(group, network, ["a0", "b0"])
    dist.barrier(group=group)
    before = copy.copy(network.stats)
    start = time.monotonic()
    total = reduce_from_region(_payload(rank), group)
    return {"elapsed": time.monotonic() - start, "sum": total,
            "padded": (network.stats.allreduces - before.allreduces,
                       network.stats.allreduce_waited_s - before.allreduce_waited_s)}


def _scenarios(rank: int, world_size: int, ledger_root: str) -> dict:
    network = NetworkEmulator(_model(), DEVICES[rank], ledger_root=ledger_root)
    out = {"directory": network.ledger.directory}
    out["alone"] = _exchange(network, rank, {0: 2})             # A -> B, NICs idle
    out["intra"] = _exchange(network, rank, {0: 1})             # inside host A
    out["shared"] = _exchange(network, rank, {0: 2, 1: 3})      # A -> B and A -> C: one outgoing NIC
    out["stats"] = copy.copy(network.stats)
    out["ddp"] = _ddp_overlap(network, rank, world_size)
    out["pipeline"] = _pipeline(rank, ledger_root)
    out["tp"] = _tensor_parallel(network, rank)
    signal = NetworkEmulator(_model(), DEVICES[rank], ledger_root=ledger_root, signal_bytes=1)
    out["signal"] = _exchange(signal, rank, {0: 2})             # A -> B priced as one byte
    out["signal_stats"] = copy.copy(signal.stats)
    dist.barrier()
    signal.close()
    network.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ledger"))
    return run_ranks(_scenarios, 4, args=(root,), env={"OMP_NUM_THREADS": "1"}, timeout_s=120)


def _elapsed(results, scenario: str, receiver: int) -> float:
    got = results[receiver][scenario]
    return got["done"] - results[got["from"]][scenario]["posted"]


def test_received_tensors_equal_the_sent_ones(results):
    for scenario, receivers in (("alone", [2]), ("intra", [1]), ("shared", [2, 3])):
        for receiver in receivers:
            got = results[receiver][scenario]
            assert_close(got["got"], _payload(got["from"]), rtol=0, atol=0)


def _padded_once(results, scenario: str, sender: int, receiver: int, modeled: float) -> None:
    """The round took at least ``modeled`` on the wall clock; the emulator priced exactly ``modeled``
    for it, queued it behind nothing and slept the receiver no longer than that."""
    measured = _elapsed(results, scenario, receiver)
    sent, received = results[sender][scenario]["record"], results[receiver][scenario]["record"]
    assert measured >= modeled, (measured, modeled)
    assert sent["sent"] == 1 and sent["bytes"] == MB and sent["modeled_s"] == pytest.approx(modeled), sent
    assert sent["queued_s"] == 0, sent
    assert received["received"] == 1 and received["waited_s"] <= modeled, received


def test_transfer_takes_latency_plus_bytes_over_bandwidth(results):
    modeled = LATENCY_US * 1e-6 + MB / (INTER_GBPS * 1e9)
    assert _model().transfer_ms(MB, "a0", "b0") == pytest.approx(modeled * 1e3)
    _padded_once(results, "alone", 0, 2, modeled)


def test_transfer_inside_a_host_uses_the_intra_host_link(results):
    modeled = LATENCY_US * 1e-6 + MB / (INTRA_GBPS * 1e9)
    _padded_once(results, "intra", 0, 1, modeled)


def test_two_sends_sharing_a_nic_take_twice_as_long(results):
    one = LATENCY_US * 1e-6 + MB / (INTER_GBPS * 1e9)
    start = min(results[sender]["shared"]["posted"] for sender in (0, 1))   # the round starts at the first post
    first, second = sorted(results[receiver]["shared"]["done"] - start for receiver in (2, 3))
    assert one <= first and 2 * one <= second, (first, second, one)
    # one sender took the idle NIC, the other queued behind it (rank 1 sends only in this round), each
    # priced one transfer (how long it queued depends on when the two posted: not checked)
    records = sorted((results[r]["shared"]["record"] for r in (0, 1)), key=lambda r: r["queued_s"])
    assert [r["queued_s"] > 0 for r in records] == [False, True], records
    assert all(r["modeled_s"] == pytest.approx(one) for r in records), records


def test_signal_bytes_moves_the_real_data_and_pads_one_byte(results):
    """The "signal send/recv" bound: the 1 MB payload arrives whole, priced as one byte."""
    got = results[2]["signal"]
    assert_close(got["got"], _payload(0), rtol=0, atol=0)
    one_byte = _model().transfer_ms(1, "a0", "b0") * 1e-3
    stats = results[0]["signal_stats"]
    assert stats.bytes == MB and stats.modeled_s == pytest.approx(one_byte)
    assert _elapsed(results, "signal", 2) >= one_byte


def test_tensor_parallel_all_reduce_takes_its_ring_time(results):
    modeled = _model().ring(["a0", "b0"]).allreduce_ms(MB) * 1e-3
    for rank in (0, 2):
        assert_close(results[rank]["tp"]["sum"], _payload(0) + _payload(2), rtol=0, atol=0)
        # padded once, by the ring's modeled time (the wall time adds the real transfer, whatever the load)
        count, padded = results[rank]["tp"]["padded"]
        assert count == 1 and padded == pytest.approx(modeled), (results[rank]["tp"], modeled)
        assert results[rank]["tp"]["elapsed"] >= modeled, (results[rank]["tp"], modeled)


def test_ledger_is_removed_when_every_rank_has_closed(results):
    directories = {r["directory"] for r in results}
    assert len(directories) == 1
    assert not os.path.exists(directories.pop())


def test_ledger_directory_that_cannot_be_created_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(NetworkEmulationError) as error:
        NetworkEmulator(_model(), "a0", run_id="bad", ledger_root=str(blocker))
    message = str(error.value)
    assert str(blocker) in message and LEDGER_ENV in message


def test_ranks_on_several_machines_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(network_module, "ONE_MACHINE_WAIT_S", 0.2)   # ranks 1-7 never register here
    with pytest.raises(NetworkEmulationError, match="LOCAL_WORLD_SIZE=4"):
        NetworkEmulator(_model(), "a0", run_id="several", ledger_root=str(tmp_path))


def test_agents_on_one_machine_share_the_emulated_network(monkeypatch, tmp_path):
    """Two torchrun agents on one machine (runtime.elastic's tests): every rank registers in this
    machine's ledger directory, so rank 0 finds the other agent's ranks there and goes on."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    ranks = tmp_path / "whalelike-agents" / "ranks"
    ranks.mkdir(parents=True)
    for rank in (1, 2, 3):
        (ranks / str(rank)).touch()
    emulator = NetworkEmulator(_model(), "a0", run_id="agents", ledger_root=str(tmp_path))
    assert emulator.ledger is not None and (ranks / "0").exists()


def test_ddp_all_reduce_overlaps_backward_bucket_by_bucket(results):
    ring = _model().ring(DEVICES).allreduce_ms(WIDTH * WIDTH * 8) * 1e-3
    end = 0.0
    for k in range(LAYERS):   # equal buckets, bucket k ready at (k+1)/LAYERS of the backward
        end = max(BACKWARD_S * (k + 1) / LAYERS, end) + ring
    assert end < BACKWARD_S + LAYERS * ring   # what waiting for the whole backward would cost
    latest = max(result["ddp"]["start"] for result in results)   # the ring waits for its last member
    for rank, result in enumerate(results):
        ddp = result["ddp"]
        assert ddp["buckets"] == LAYERS
        # the emulator's own end of the overlapped all-reduces (bucket by bucket, below the serial
        # BACKWARD_S + LAYERS * ring asserted above), from the last member's start (ranks leave the
        # barrier apart under load; the monotonic clock is one for every process of the machine), and
        # the step really waited for it; no wall-clock upper bound: under load the real compute
        # overruns, which says nothing about the overlap
        assert ddp["end"] - latest == pytest.approx(end, abs=0.01), rank
        assert end <= ddp["measured"] + 0.01, (rank, ddp["measured"], end)
        for got, want in zip(ddp["grads"], ddp["reference"]):
            assert_close(got, want)


def test_pipeline_on_the_emulated_network_matches_the_reference(results):
    for rank, result in enumerate(results):
        got = result["pipeline"]
        assert_close(torch.stack(got["losses"]), torch.stack(got["ref_losses"]))
        assert got["state"].keys() == got["ref_state"].keys()
        for key, want in got["ref_state"].items():
            assert_close(got["state"][key], want, msg=f"rank {rank}: {key}")
        stats = got["stats"]
        # stage 0 (ranks 0-1) sends activations and receives gradients, stage 1 the reverse; each
        # stage's gradients are all-reduced once per step, overlapping the last backward
        assert stats.sent > 0 and stats.received > 0 and stats.allreduces >= 2, (rank, stats)


def test_device_not_in_the_cluster_is_a_clear_error(tmp_path):
    with pytest.raises(NetworkError, match="'z9' is not in the cluster"):
        NetworkEmulator(_model(), "z9", run_id="unknown", ledger_root=str(tmp_path))


def test_ledger_of_a_run_that_died_is_removed_by_the_next(tmp_path):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "whalelike-crashed"
    stale.mkdir()
    (stale / f"member-{int(dead.stdout)}-1").write_text("")
    (stale / "0-A.out").write_bytes(b"\0" * 8)
    network = NetworkEmulator(_model(), "a0", run_id="next", ledger_root=str(tmp_path))
    assert not stale.exists()
    network.close()
    assert list(tmp_path.iterdir()) == []


def test_signal_bytes_prices_every_message_as_that_many_bytes(tmp_path):
    """The benchmark bound (bench/pipeline_comm.py's "signal send/recv"): a 1 MB message between
    hosts is priced as one byte, its NICs are held that long only, and the message itself is
    the same emulator without it prices the size. (The message still moves: the spawn's "signal" round.)"""
    model = _model()
    signal = NetworkEmulator(model, "a0", run_id="signal", ledger_root=str(tmp_path), signal_bytes=1)
    ready = time.monotonic() + 100.0   # later than anything in the ledger: no queueing before it
    one_byte = model.transfer_ms(1, "a0", "b0") * 1e-3
    assert signal.schedule_send(MB, "b0", ready) == pytest.approx(ready + one_byte)
    # the second message through A's outgoing NIC waits for the first's one-byte slot only
    assert signal.schedule_send(MB, "c0", ready) == pytest.approx(ready + 2 * one_byte)
    assert signal.stats.bytes == 2 * MB and signal.stats.modeled_s == pytest.approx(2 * one_byte)
    signal.signal_bytes = None          # settable on a live emulator; off prices by size again
    full = model.transfer_ms(MB, "a0", "b0") * 1e-3
    later = ready + 100.0
    assert signal.schedule_send(MB, "b0", later) == pytest.approx(later + full)
    signal.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_signal_bytes_that_is_not_a_size_is_a_clear_error(tmp_path, bad):
    with pytest.raises(NetworkEmulationError, match=f"signal_bytes must be an int >= 0.*got {bad!r}"):
        NetworkEmulator(_model(), "a0", run_id="bad-signal", ledger_root=str(tmp_path), signal_bytes=bad)
