"""Cluster specs: presets, YAML loading, round trips, and one test per kind of bad input."""
from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import yaml

from whalelike import Cluster, Device, Network, SpecError
from whalelike.cluster import Emulation, Straggler

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "clusters").glob("*.yaml"))

GOOD = {
    "name": "lab",
    "network": {"intra_host_gbps": 24.0, "inter_host_gbps": 3.0, "latency_us": 10.0},
    "hosts": [
        {"name": "a", "devices": [{"kind": "V100-32GB", "count": 2, "peak_tflops": 15.7, "memory_gib": 32}]},
        {"name": "b", "devices": [{"kind": "P100-16GB", "count": 3, "peak_tflops": 9.3, "memory_gib": 16},
                                  {"kind": "T4-16GB", "peak_tflops": 8.1, "memory_gib": 16, "measured_tflops": 5.0}]},
    ],
}


def spec(**edits) -> dict:
    """GOOD with ``edits`` applied: keys are dotted paths, e.g. ``hosts.1.devices.0.memory_gib``."""
    d = copy.deepcopy(GOOD)
    for path, value in edits.items():
        *parents, last = path.split(".")
        target = d
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        key = int(last) if isinstance(target, list) else last
        if value is _DELETE:
            del target[key]
        else:
            target[key] = value
    return d


_DELETE = object()


# -- presets and round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("name", Cluster.preset_names())
def test_every_preset_loads_round_trips_and_summarizes(name):
    cluster = Cluster.preset(name)
    assert cluster.name == name
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(cluster.to_dict()))) == cluster
    text = cluster.summary()
    assert all(d.name in text for d in cluster.devices) and "GB/s" in text


def test_required_presets_exist_with_the_papers_device_counts():
    def counts(name):
        out: dict[str, int] = {}
        for d in Cluster.preset(name).devices:
            out[d.kind] = out.get(d.kind, 0) + 1
        return out

    assert counts("whale-v100-p100") == {"V100-32GB": 8, "P100-16GB": 8}
    assert counts("poplar-a") == {"A100-80GB": 4, "A100-40GB": 4}
    assert counts("poplar-b") == {"V100-16GB": 2, "T4-16GB": 2}
    assert counts("poplar-c") == {"A800-80GB": 4, "V100S-32GB": 4}
    assert len(Cluster.preset("whale-v100-p100").hosts) == 2


@pytest.mark.parametrize("name,speeds,memories", [
    ("emulated-4", [1, 1, 0.5, 0.25], [4, 4, 2, 1]),
    ("emulated-4-equal", [1, 1, 1, 1], [4, 4, 4, 4]),
    ("emulated-2", [1, 0.5], [4, 2]),
])
def test_emulated_presets_spec_sheets_predict_the_emulated_speed(name, speeds, memories):
    """The planner reads only the spec sheet (peak TFLOPS at its default efficiency); for the
    emulated presets that must come out as the speed the emulator really models."""
    from planner.devices.cost_model import device_tflops

    cluster = Cluster.preset(name)
    assert [d.emulated_speed for d in cluster.devices] == speeds
    assert [d.memory_gib for d in cluster.devices] == memories
    base = cluster.emulation.base_gflops
    for d in cluster.devices:
        assert device_tflops(d) * 1000 == pytest.approx(d.emulated_speed * base)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_cluster_files_load_and_round_trip(path):
    cluster = Cluster.load(path)
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_devices_are_in_rank_order_with_unique_readable_names():
    cluster = Cluster.from_dict(GOOD)
    assert [d.name for d in cluster.devices] == ["v100-0", "v100-1", "p100-0", "p100-1", "p100-2", "t4-0"]
    assert [d.host for d in cluster.devices] == ["a", "a", "b", "b", "b", "b"]
    assert cluster.hosts == ["a", "b"]
    assert cluster.device("t4-0").measured_tflops == 5.0


def test_kinds_sharing_a_short_name_get_their_full_kind_in_device_names():
    names = [d.name for d in Cluster.preset("poplar-a").devices]
    assert names[0] == "a100-80gb-0" and names[-1] == "a100-40gb-3"


def test_load_accepts_a_preset_name_or_a_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    assert Cluster.load(str(path)) == Cluster.from_dict(GOOD)
    assert Cluster.load("emulated-2") == Cluster.preset("emulated-2")


def test_stragglers_and_emulation_load():
    d = spec(emulation={"base_gflops": 2.0, "stragglers": [{"rank": 2, "factor": 3, "start_step": 1, "end_step": 4}]})
    for host in d["hosts"]:
        for dev in host["devices"]:
            dev["emulated_speed"] = 1.0
    cluster = Cluster.from_dict(d)
    assert cluster.emulation.stragglers == (Straggler(rank=2, factor=3.0, start_step=1, end_step=4),)
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_matmul_stragglers_load_round_trip_and_show():
    d = Cluster.preset("emulated-2").to_dict()
    d["emulation"]["stragglers"] = [{"rank": 1, "factor": 8, "start_step": 2, "ops": "matmul"},
                                    {"rank": 0, "factor": 2}]
    cluster = Cluster.from_dict(d)
    assert cluster.emulation.stragglers == (Straggler(rank=1, factor=8.0, start_step=2, ops="matmul"),
                                            Straggler(rank=0, factor=2.0))
    assert cluster.emulation.stragglers[1].ops == "all"
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(cluster.to_dict()))) == cluster
    assert cluster.to_dict()["emulation"]["stragglers"][0]["ops"] == "matmul"
    text = cluster.summary()
    assert "straggler: rank 1 x8 (matmuls only) from step 2" in text and "straggler: rank 0 x2 from step 0" in text


# -- bad input: each a clear one-line error naming the file, the field path, the value, the fix ----
def write(tmp_path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, """\
        name: lab
        network: {intra_host_gbps: 1, inter_host_gbps: 1, latency_us: 1
        hosts: []
        """)
    with pytest.raises(SpecError, match=r"cluster\.yaml: line \d+, column \d+: malformed YAML") as e:
        Cluster.from_yaml(path)
    assert "\n" not in str(e.value)


def test_missing_file_lists_presets(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.yaml: no such cluster file.*emulated-4"):
        Cluster.from_yaml(tmp_path / "nope.yaml")


def test_empty_file(tmp_path):
    with pytest.raises(SpecError, match=r"cluster\.yaml: the top level must be a mapping .* got an empty file"):
        Cluster.from_yaml(write(tmp_path, ""))


def test_unknown_key_suggests_the_close_match(tmp_path):
    d = spec(**{"hosts.1.devices.0.memory_gb": 16, "hosts.1.devices.0.memory_gib": _DELETE})
    path = write(tmp_path, yaml.safe_dump(d))
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value) == f"{path}: hosts[1].devices[0].memory_gb: unknown key; did you mean 'memory_gib'?"


def test_unknown_key_without_close_match_lists_allowed_keys():
    with pytest.raises(SpecError, match=r"<x>: network\.colour: unknown key; allowed keys: intra_host_gbps, "):
        Cluster.from_dict(spec(**{"network.colour": "blue"}), origin="<x>")


def test_negative_memory(tmp_path):
    path = write(tmp_path, yaml.safe_dump(spec(**{"hosts.0.devices.0.memory_gib": -16})))
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value) == f"{path}: hosts[0].devices[0].memory_gib must be > 0, got -16"


@pytest.mark.parametrize("edit,message", [
    ({"hosts.0.devices.0.peak_tflops": "fast"}, r"hosts\[0\]\.devices\[0\]\.peak_tflops must be a number .*got 'fast'"),
    ({"hosts.0.devices.0.count": 2.5}, r"hosts\[0\]\.devices\[0\]\.count must be an integer .*got 2\.5"),
    ({"hosts.0.devices.0.count": True}, r"hosts\[0\]\.devices\[0\]\.count must be an integer .*got True"),
    ({"hosts.0.devices.0.count": 0}, r"hosts\[0\]\.devices\[0\]\.count must be > 0, got 0"),
    ({"network.latency_us": -1}, r"network\.latency_us must be >= 0, got -1"),
    ({"network.inter_host_gbps": float("nan")}, r"network\.inter_host_gbps must be a number"),
    ({"name": ""}, r"name must be a non-empty string"),
    ({"hosts": []}, r"hosts must be a non-empty list of hosts"),
    ({"hosts.0.devices": {"kind": "x"}}, r"hosts\[0\]\.devices must be a non-empty list of devices"),
    ({"network": [1, 2]}, r"network must be a mapping with keys intra_host_gbps, inter_host_gbps, latency_us"),
])
def test_wrong_types_and_bounds(edit, message):
    with pytest.raises(SpecError, match=r"^cluster\.yaml: " + message):
        Cluster.from_dict(spec(**edit), origin="cluster.yaml")


@pytest.mark.parametrize("edit,message", [
    ({"hosts.1.devices.0.kind": _DELETE}, r"hosts\[1\]\.devices\[0\]: missing required key 'kind' \(device model"),
    ({"network": _DELETE}, r"the top level: missing required key 'network'"),
    ({"network.latency_us": _DELETE}, r"network: missing required key 'latency_us'"),
    ({"hosts.0.name": _DELETE}, r"hosts\[0\]: missing required key 'name'"),
])
def test_missing_fields(edit, message):
    with pytest.raises(SpecError, match=r"^cluster\.yaml: " + message):
        Cluster.from_dict(spec(**edit), origin="cluster.yaml")


def test_duplicate_host_names():
    with pytest.raises(SpecError, match=r"hosts\[1\]\.name: duplicate host name 'a' \(also hosts\[0\]\)"):
        Cluster.from_dict(spec(**{"hosts.1.name": "a"}), origin="cluster.yaml")


def test_emulated_speed_needs_an_emulation_block():
    with pytest.raises(SpecError, match=r"device 'v100-0' sets emulated_speed but the cluster has no emulation block; "
                                        r"add `emulation: \{base_gflops: 2.0\}`"):
        Cluster.from_dict(spec(**{"hosts.0.devices.0.emulated_speed": 0.5}), origin="cluster.yaml")


def test_emulation_block_needs_every_emulated_speed():
    d = spec(emulation={"base_gflops": 2.0}, **{"hosts.0.devices.0.emulated_speed": 1.0})
    with pytest.raises(SpecError, match=r"^cluster\.yaml: .*device 'p100-0' has no emulated_speed"):
        Cluster.from_dict(d, origin="cluster.yaml")


def test_straggler_errors_name_their_path():
    d = Cluster.preset("emulated-2").to_dict()
    d["emulation"]["stragglers"] = [{"rank": 0, "factor": 2.0, "start_step": 5, "end_step": 5}]
    with pytest.raises(SpecError, match=r"emulation\.stragglers\[0\]: .*end_step must be > start_step \(5\), got 5"):
        Cluster.from_dict(d, origin="c.yaml")
    d["emulation"]["stragglers"] = [{"rank": 7, "factor": 2.0}]
    with pytest.raises(SpecError, match=r"straggler rank 7 does not exist; ranks are 0\.\.1"):
        Cluster.from_dict(d, origin="c.yaml")
    d["emulation"]["stragglers"] = [{"rank": 0, "factor": 2.0, "ops": "matmuls"}]
    with pytest.raises(SpecError, match=r"^c\.yaml: emulation\.stragglers\[0\]\.ops must be one of 'all', 'matmul' "
                                        r"\(which segments slow down: .*\), got 'matmuls'$"):
        Cluster.from_dict(d, origin="c.yaml")
    d["emulation"]["stragglers"] = [{"rank": 0, "factr": 2.0}]
    with pytest.raises(SpecError, match=r"emulation\.stragglers\[0\]\.factr: unknown key; did you mean 'factor'\?"):
        Cluster.from_dict(d, origin="c.yaml")


def test_unknown_preset_lists_presets():
    with pytest.raises(SpecError, match=r"unknown cluster preset 'emulated4'; did you mean 'emulated-4'\? "
                                        r"presets: emulated-2, emulated-4, .*whale-v100-p100"):
        Cluster.preset("emulated4")


# -- records built in Python are validated too -----------------------------------------------------
def test_records_validate_at_construction():
    with pytest.raises(SpecError, match=r"device 'p100-3': memory_gib must be > 0, got -16"):
        Device(name="p100-3", kind="P100", host="h", peak_tflops=9.3, memory_gib=-16)
    with pytest.raises(SpecError, match=r"network: intra_host_gbps must be > 0, got 0"):
        Network(intra_host_gbps=0, inter_host_gbps=1, latency_us=1)
    with pytest.raises(SpecError, match=r"emulation: base_gflops must be > 0"):
        Emulation(base_gflops=-1.0)
    with pytest.raises(SpecError, match=r"straggler of rank -1: rank must be >= 0"):
        Straggler(rank=-1, factor=2.0)
    with pytest.raises(SpecError, match=r"straggler of rank 1: ops must be one of 'all', 'matmul' .*got 'conv'"):
        Straggler(rank=1, factor=2.0, ops="conv")


def test_cluster_invariants():
    net = Network(10, 1, 5)
    a = Device("x-0", "X", "h0", 1.0, 1.0)
    b = Device("x-1", "X", "h1", 1.0, 1.0)
    with pytest.raises(SpecError, match=r"device name 'x-0' is used twice"):
        Cluster("c", (a, a), net)
    with pytest.raises(SpecError, match=r"devices of host 'h0' are not consecutive"):
        Cluster("c", (a, b, Device("x-2", "X", "h0", 1.0, 1.0)), net)
    with pytest.raises(SpecError, match=r"has no devices"):
        Cluster("c", (), net)
