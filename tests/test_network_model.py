"""planner.devices.network against closed-form link, queueing and ring-collective times."""
from __future__ import annotations

import math

import pytest

from planner.devices.network import (INTER_HOST, INTRA_HOST, SAME_DEVICE, NetworkError, NetworkModel, Transfer)
from whalelike.cluster import Cluster
from whalelike.errors import SpecError

INTRA, INTER, LATENCY_US = 100.0, 10.0, 5.0    # GB/s, GB/s, microseconds
LATENCY_MS = LATENCY_US * 1e-3
MB = 1e6


def two_hosts(per_host: int = 2, **kwargs) -> NetworkModel:
    """Devices a0.. on host a, b0.. on host b."""
    hosts = {f"{h}{i}": h for h in "ab" for i in range(per_host)}
    return NetworkModel(INTRA, INTER, LATENCY_US, hosts, **kwargs)


def wire_ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e6)


def test_links_by_placement():
    net = two_hosts()
    assert net.link("a0", "a0").kind == SAME_DEVICE and net.transfer_ms(MB, "a0", "a0") == 0.0
    assert net.link("a0", "a1").kind == INTRA_HOST
    assert net.link("a0", "b1").kind == INTER_HOST
    assert (net.link("a0", "b1").src_host, net.link("a0", "b1").dst_host) == ("a", "b")


@pytest.mark.parametrize("src,dst,gbps", [("a0", "a1", INTRA), ("a0", "b0", INTER), ("b1", "a0", INTER)])
def test_transfer_time_is_latency_plus_bytes_over_bandwidth(src, dst, gbps):
    net = two_hosts()
    assert net.transfer_ms(8 * MB, src, dst) == pytest.approx(LATENCY_MS + wire_ms(8 * MB, gbps))
    assert net.transfer_ms(0, src, dst) == 0.0


def test_a_host_nic_override_slows_only_its_transfers():
    net = two_hosts(nic_gbps={"b": 2.5})
    assert net.link("a0", "b0").gbps == 2.5 and net.link("b0", "a0").gbps == 2.5
    assert net.link("a0", "a1").gbps == INTRA


def test_a_nic_shared_by_two_sends_takes_twice_as_long():
    net = two_hosts()
    alone = net.schedule([Transfer("a0", "b0", 4 * MB)])[0]
    both = net.schedule([Transfer("a0", "b0", 4 * MB), Transfer("a1", "b1", 4 * MB)])
    assert alone.end_ms == pytest.approx(LATENCY_MS + wire_ms(4 * MB, INTER))
    assert max(t.end_ms for t in both) == pytest.approx(2 * alone.end_ms)
    assert [t.start_ms for t in both] == pytest.approx([0.0, alone.end_ms])
    assert both[1].queued_ms == pytest.approx(alone.end_ms)


def test_one_sender_host_feeding_two_receiver_hosts_queues_on_its_outgoing_nic():
    hosts = {"a0": "a", "b0": "b", "c0": "c", "c1": "c"}
    net = NetworkModel(INTRA, INTER, LATENCY_US, hosts)
    one = LATENCY_MS + wire_ms(MB, INTER)
    timed = net.schedule([Transfer("a0", "b0", MB), Transfer("a0", "c0", MB), Transfer("b0", "c1", MB, ready_ms=0.0)])
    # a's outgoing NIC serves b, then c; b -> c does not wait behind the blocked a -> c (its own
    # NICs are free), and a -> c then finds both of its NICs free at once
    assert [t.start_ms for t in timed] == pytest.approx([0.0, one, 0.0])
    assert [t.end_ms for t in timed] == pytest.approx([one, 2 * one, one])


def test_intra_host_and_later_transfers_do_not_queue():
    net = two_hosts()
    one = LATENCY_MS + wire_ms(MB, INTER)
    timed = net.schedule([Transfer("a0", "a1", MB), Transfer("a1", "a0", MB), Transfer("a0", "b0", MB),
                          Transfer("a1", "b1", MB, ready_ms=5 * one)])
    assert [t.start_ms for t in timed] == pytest.approx([0.0, 0.0, 0.0, 5 * one])
    assert timed[3].queued_ms == 0.0


def test_queueing_follows_ready_time_not_list_order():
    net = two_hosts()
    one = LATENCY_MS + wire_ms(MB, INTER)
    late, early = net.schedule([Transfer("a0", "b0", MB, ready_ms=0.5 * one), Transfer("a1", "b1", MB)])
    assert early.start_ms == 0.0 and late.start_ms == pytest.approx(one)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_costs_match_the_textbook_formula_on_a_uniform_ring(n):
    net = NetworkModel(INTRA, INTER, LATENCY_US, {f"d{i}": "h" for i in range(n)})
    devices = [f"d{i}" for i in range(n)]
    nbytes = 64 * MB
    assert net.ring_allreduce_ms(nbytes, devices) == pytest.approx(
        2 * (n - 1) / n * wire_ms(nbytes, INTRA) + 2 * (n - 1) * LATENCY_MS)
    for gather in (net.ring_allgather_ms, net.ring_reduce_scatter_ms):
        assert gather(nbytes, devices) == pytest.approx((n - 1) / n * wire_ms(nbytes, INTRA) + (n - 1) * LATENCY_MS)
    assert net.ring_allreduce_ms(nbytes, devices[:1]) == 0.0 and net.ring_allreduce_ms(0, devices) == 0.0


@pytest.mark.parametrize("per_host", [1, 2, 4])
def test_a_host_contiguous_cross_host_ring_is_bounded_by_the_inter_host_link(per_host):
    net = two_hosts(per_host)
    devices = list(net.device_hosts)
    n, nbytes = len(devices), 64 * MB
    assert net.ring_allreduce_ms(nbytes, devices) == pytest.approx(
        2 * (n - 1) / n * wire_ms(nbytes, INTER) + 2 * (n - 1) * LATENCY_MS)


def test_a_priced_ring_is_reused_for_many_messages():
    net = two_hosts(2)
    ring = net.ring(["a0", "a1", "b0", "b1"])
    assert (ring.size, ring.latency_ms, ring.ms_per_byte) == pytest.approx((4, LATENCY_MS, wire_ms(1, INTER)))
    for nbytes in (0, 1.0, 25 * MB):
        assert ring.allreduce_ms(nbytes) == net.ring_allreduce_ms(nbytes, ["a0", "a1", "b0", "b1"])
    assert net.ring(["a0"]).allreduce_ms(MB) == 0.0


def test_an_interleaved_ring_shares_each_nic_between_its_hops():
    net = two_hosts(2)
    contiguous = net.ring_allreduce_ms(64 * MB, ["a0", "a1", "b0", "b1"])
    interleaved = net.ring_allreduce_ms(64 * MB, ["a0", "b0", "a1", "b1"])
    # two hops leave each host per step: each gets half the NIC
    assert interleaved == pytest.approx(6 / 4 * wire_ms(64 * MB, INTER / 2) + 6 * LATENCY_MS)
    assert interleaved > contiguous


def test_of_cluster_agrees_with_the_cost_model_on_a_preset():
    from planner.devices.cost_model import CommModel

    cluster = Cluster.preset("whale-v100-p100")
    net = NetworkModel.of_cluster(cluster)
    comm = CommModel(cluster.network)
    names = [d.name for d in cluster.devices]
    assert net.ring_allreduce_ms(300 * MB, names) == pytest.approx(comm.allreduce_ms(300 * MB, cluster.devices))
    one_host = [d for d in cluster.devices if d.host == cluster.devices[0].host]
    assert net.ring_allreduce_ms(300 * MB, [d.name for d in one_host]) == pytest.approx(
        comm.allreduce_ms(300 * MB, one_host))
    assert net.transfer_ms(MB, names[0], names[-1]) == pytest.approx(comm.p2p_ms(MB, cluster.devices[0],
                                                                                  cluster.devices[-1]))


def test_a_measured_collective_floor_slows_rings_and_never_speeds_them():
    """``Network.collective_latency_us`` / ``collective_gbps`` (whalelike profile's ring all-reduce) are a
    floor under every ring: a ring step is the slower of the links' and the measured one, point to point
    transfers are left alone, and the cost model and the network model agree on it."""
    import dataclasses

    from planner.devices.cost_model import CommModel

    names = ["a0", "a1"]
    plain = two_hosts()
    floored = two_hosts(collective_latency_us=1000.0, collective_gbps=1.0)
    assert floored.ring(names).latency_ms == pytest.approx(1.0)
    assert floored.ring(names).ms_per_byte == pytest.approx(1 / 1e6)
    assert floored.ring_allreduce_ms(MB, names) > plain.ring_allreduce_ms(MB, names)
    assert floored.transfer_ms(MB, "a0", "b0") == plain.transfer_ms(MB, "a0", "b0")
    # a floor below the links changes nothing
    low = two_hosts(collective_latency_us=0.1, collective_gbps=1e5)
    assert low.ring_allreduce_ms(MB, ["a0", "a1", "b0"]) == pytest.approx(plain.ring_allreduce_ms(MB, ["a0", "a1", "b0"]))
    cluster = Cluster.preset("whale-v100-p100")
    cluster = dataclasses.replace(cluster, network=dataclasses.replace(cluster.network, collective_latency_us=500.0,
                                                                       collective_gbps=0.5))
    net, comm = NetworkModel.of_cluster(cluster), CommModel(cluster.network)
    assert net.ring_allreduce_ms(300 * MB, [d.name for d in cluster.devices]) == pytest.approx(
        comm.allreduce_ms(300 * MB, cluster.devices))
    assert Cluster.from_dict(cluster.to_dict()) == cluster   # the spec keeps the floor


@pytest.mark.parametrize("field,value", [("intra_host_gbps", 0), ("inter_host_gbps", -1.0),
                                         ("inter_host_gbps", math.nan), ("intra_host_gbps", math.inf),
                                         ("latency_us", -5.0), ("latency_us", math.nan)])
def test_bad_link_figures_name_the_field_and_value(field, value):
    figures = {"intra_host_gbps": INTRA, "inter_host_gbps": INTER, "latency_us": LATENCY_US, field: value}
    with pytest.raises(NetworkError, match=rf"network: {field} must be a finite number .* got {value!r}; fix"):
        NetworkModel(device_hosts={"a0": "a"}, **figures)


def test_bad_nic_figures_and_unknown_hosts_and_devices_are_named():
    with pytest.raises(NetworkError, match=r"nic_gbps\['b'\] must be a finite number > 0 .* got 0"):
        two_hosts(nic_gbps={"b": 0})
    with pytest.raises(NetworkError, match=r"nic_gbps names host 'c', which has no devices; hosts: a, b"):
        two_hosts(nic_gbps={"c": 5.0})
    net = two_hosts()
    with pytest.raises(NetworkError, match=r"device 'z9' is not in the cluster \(devices: a0, a1, b0, b1\)"):
        net.transfer_ms(MB, "a0", "z9")
    with pytest.raises(NetworkError, match=r"device 'z9' is not in the cluster"):
        net.ring_allreduce_ms(MB, ["z9"])
    with pytest.raises(NetworkError, match=r"devices \['a0'\] appear twice"):
        net.ring_allreduce_ms(MB, ["a0", "b0", "a0"])
    with pytest.raises(NetworkError, match=r"transfer a0 -> b0: bytes must be a finite number >= 0, got -1"):
        net.transfer_ms(-1, "a0", "b0")
    with pytest.raises(NetworkError, match=r"transfer 0 \(x\): ready_ms must be a finite number >= 0, got nan"):
        net.schedule([Transfer("a0", "b0", MB, ready_ms=math.nan, label="x")])
    with pytest.raises(NetworkError, match=r"no devices"):
        NetworkModel(INTRA, INTER, LATENCY_US, {})
    assert issubclass(NetworkError, SpecError)


def test_bandwidths_are_gigabytes_per_second():
    """A figure of 12.5 moves 12.5e6 bytes per millisecond (GB/s, not Gbit/s)."""
    net = NetworkModel(100.0, 12.5, 0.0, {"a0": "a", "b0": "b"})
    assert net.transfer_ms(12.5e6, "a0", "b0") == pytest.approx(1.0)
    assert net.link("a0", "b0").ms_per_byte == pytest.approx(1 / 12.5e6)


def test_host_level_view_prices_like_the_device_links():
    devices = two_hosts(nic_gbps={"b": 2.5})
    hosts = NetworkModel.of_hosts(INTRA, INTER, LATENCY_US, ["a", "b"], nic_gbps={"b": 2.5})
    for src, dst in [("a0", "a1"), ("a0", "b0"), ("b1", "a0")]:
        assert hosts.host_link(devices.host_of(src), devices.host_of(dst)) == devices.link(src, dst)
    assert hosts.nic_ms_per_byte("b") == pytest.approx(1 / 2.5e6) and hosts.nic_ms_per_byte("a") == pytest.approx(
        1 / (INTER * 1e6))
    assert hosts.key() != devices.key() and two_hosts().key() == two_hosts().key()
    hosts.check_placement({"anything": "a"}, "mesh")   # a host-level model checks hosts only
    with pytest.raises(NetworkError, match=r"mesh device 'x' is on host 'c', which the cluster does not have; "
                                           r"hosts are \['a', 'b'\]"):
        hosts.check_placement({"x": "c"}, "mesh")
    with pytest.raises(NetworkError, match=r"a transfer names host 'c', which has no devices; hosts: a, b"):
        hosts.host_link("a", "c")
    with pytest.raises(NetworkError, match=r"mesh device 'z9' is not in the cluster"):
        devices.check_placement({"z9": "a"}, "mesh")
    with pytest.raises(NetworkError, match=r"mesh device 'a0' is given on host 'b' but the cluster puts it on 'a'"):
        devices.check_placement({"a0": "b"}, "mesh")
