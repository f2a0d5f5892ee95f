"""One way to validate (whalelike.spec): the bad inputs of issue 10 that the readers and
``validate`` now refuse, each with its error text, its exception type, the CLI's exit status and no
file left behind; and ``validate`` running each check once per plan content."""
from __future__ import annotations

import contextlib

import copy
import dataclasses
import os
import pickle
import textwrap
import threading

import pytest
import yaml

import planner
import planner.plan_checks
import whalelike.spec
from planner import Plan, PlanError
from whalelike import Cluster, Config, SpecError, replicate
from whalelike.cluster import MAX_DEVICES, MAX_FILE_BYTES as CLUSTER_LIMIT
from whalelike.spec import Rule, StrictLoader, validate
from planner.plan import MAX_FILE_BYTES as PLAN_LIMIT

from synthetic import synthetic_cluster, synthetic_model
from test_cli import assert_one_line_error, run

CLUSTER = """\
name: lab
network: {intra_host_gbps: 24, inter_host_gbps: 3, latency_us: 10}
hosts:
  - name: a
    devices:
      - {kind: V100-32GB, count: 2, peak_tflops: 15.7, memory_gib: 32}
"""


@pytest.fixture(scope="module")
def setting():
    graphs = synthetic_model(4, [replicate(2), replicate(2)], hidden=64, seq=8)
    cluster = synthetic_cluster([(2, 20.0, 32), (2, 10.0, 16)], per_host=2)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16, num_micro_batch=4))
    return graphs, cluster, plan


@pytest.fixture
def plan_file(setting, tmp_path):
    path = tmp_path / "plan.yaml"
    setting[2].to_yaml(path)
    return path


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def edited_plan(tmp_path, plan: Plan, change) -> str:
    data = plan.to_dict()
    change(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


# -- files that are not UTF-8 ----------------------------------------------------------------------
def test_a_cluster_file_that_is_not_utf8_names_the_byte(capsys, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(CLUSTER.replace("lab", "l\xe4b").encode("latin-1"))   # 0xe4 at offset 7
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value) == (f"{path}: not UTF-8 text: byte 0xe4 at byte offset 7 (line 1) is not valid UTF-8; "
                            "save the cluster file as UTF-8")
    code, _, err = run(capsys, "cluster", str(path))
    assert_one_line_error(code, err, "not UTF-8 text: byte 0xe4 at byte offset 7")
    assert os.listdir(tmp_path) == ["cluster.yaml"]


def test_a_plan_file_that_is_not_utf8_names_the_byte(capsys, plan_file, tmp_path):
    data = plan_file.read_bytes()
    offset = data.index(b"cluster:") + len(b"cluster: ")
    plan_file.write_bytes(data[:offset] + b"\xff" + data[offset:])
    with pytest.raises(PlanError, match=rf"^{plan_file}: not UTF-8 text: byte 0xff at byte offset {offset} "
                                        r"\(line \d+\) is not valid UTF-8; save the plan file as UTF-8$"):
        Plan.from_yaml(plan_file)
    trace = tmp_path / "step.json"
    code, _, err = run(capsys, "simulate", str(plan_file), "--trace", str(trace))
    assert_one_line_error(code, err, f"byte 0xff at byte offset {offset}")
    assert os.listdir(tmp_path) == ["plan.yaml"]   # no trace, no temporary file


# -- files too large to parse ----------------------------------------------------------------------
def test_huge_files_are_refused_before_parsing(capsys, tmp_path, monkeypatch):
    def no_parsing(*args, **kwargs):
        raise AssertionError("the file was parsed")

    monkeypatch.setattr(yaml, "load", no_parsing)
    cluster = tmp_path / "big.yaml"
    with open(cluster, "wb") as f:
        f.truncate(50 * (1 << 20))   # 50 MiB, sparse: nothing is written or read
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(cluster)
    assert str(e.value).startswith(f"{cluster}: the file is 52,428,800 bytes (50.0 MiB), over the 1.0 MiB limit "
                                   "for cluster files (")
    code, _, err = run(capsys, "cluster", str(cluster))
    assert_one_line_error(code, err, "over the 1.0 MiB limit for cluster files")

    plan = tmp_path / "plan.yaml"
    with open(plan, "wb") as f:
        f.truncate(PLAN_LIMIT + 1)
    with pytest.raises(PlanError, match=rf"^{plan}: the file is 16,777,217 bytes \(16.0 MiB\), over the 16.0 MiB "
                                        r"limit for plan files \(room for 16,384 workers"):
        Plan.from_yaml(plan)
    assert sorted(os.listdir(tmp_path)) == ["big.yaml", "plan.yaml"]


def test_a_file_at_the_limit_is_read(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER + "#" * (CLUSTER_LIMIT - len(CLUSTER) - 1) + "\n")
    assert path.stat().st_size == CLUSTER_LIMIT
    assert len(Cluster.from_yaml(path).devices) == 2


def test_a_stream_without_a_size_is_cut_at_the_limit(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)

    def writer():   # more than the limit; the reader stops early, so the pipe may break
        with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as f:
            f.write(b"#" * (CLUSTER_LIMIT + 10))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with pytest.raises(SpecError, match=r"the file is more than 1,048,576 bytes, over the 1.0 MiB limit"):
            Cluster.from_yaml(fifo)
    finally:
        thread.join()


# -- YAML numbers and duplicate keys ---------------------------------------------------------------
def test_exponent_numbers_are_numbers(tmp_path):
    path = write(tmp_path / "cluster.yaml", CLUSTER.replace("memory_gib: 32", "memory_gib: 3.2e1")
                 .replace("peak_tflops: 15.7", "peak_tflops: 1.57E+1").replace("latency_us: 10", "latency_us: 1e1"))
    cluster = Cluster.from_yaml(path)
    assert [d.memory_gib for d in cluster.devices] == [32.0, 32.0]
    assert cluster.devices[0].peak_tflops == 15.7 and cluster.network.latency_us == 10.0
    assert yaml.load("[1e3, -2E-2, .5e1, 12, '1e3', 1_000]", Loader=StrictLoader) == [1000.0, -0.02, 5.0, 12, "1e3", 1000]


def test_an_exponent_where_an_integer_belongs_says_so(tmp_path):
    path = write(tmp_path / "cluster.yaml", CLUSTER.replace("count: 2", "count: 1e3"))
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value) == (f"{path}: hosts[0].devices[0].count must be an integer (number of identical devices), "
                            "got 1000.0")


def test_exponent_times_in_a_hand_edited_plan_load(setting, plan_file):
    graphs, cluster, plan = setting
    text = plan_file.read_text()
    first = plan.workers[0].compute_ms
    plan_file.write_text(text.replace(f"compute_ms: {first!r}", "compute_ms: 2e1", 1))
    loaded = Plan.from_yaml(plan_file, graphs=graphs, cluster=cluster)
    assert loaded.workers[0].compute_ms == 20.0


def test_a_duplicate_key_names_both_lines(capsys, tmp_path):
    path = write(tmp_path / "cluster.yaml", CLUSTER + "name: other\n")
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value) == (f"{path}: line 7: duplicate key 'name' (first at line 1); each key may appear once "
                            "in a mapping, remove one of them")
    nested = write(tmp_path / "nested.yaml", CLUSTER.replace("memory_gib: 32}", "memory_gib: 32, memory_gib: 16}"))
    with pytest.raises(SpecError, match=r"line 6: duplicate key 'memory_gib' \(first at line 6\)"):
        Cluster.from_yaml(nested)
    code, _, err = run(capsys, "cluster", str(path))
    assert_one_line_error(code, err, "duplicate key 'name'")


def test_a_duplicate_key_in_a_plan(plan_file):
    text = plan_file.read_text()
    plan_file.write_text(text + "solver: greedy\n")
    line = text.splitlines().index(next(l for l in text.splitlines() if l.startswith("solver:"))) + 1
    with pytest.raises(PlanError, match=rf"^{plan_file}: line {len(text.splitlines()) + 1}: duplicate key 'solver' "
                                        rf"\(first at line {line}\)"):
        Plan.from_yaml(plan_file)


def test_merge_keys_may_be_overridden():
    text = "base: &b {x: 1, y: 2}\nmine:\n  <<: *b\n  y: 3\n"
    assert yaml.load(text, Loader=StrictLoader)["mine"] == {"x": 1, "y": 3}


# -- absurd sizes and counts -----------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("memory_gib", "1e300", r"memory_gib must be <= 1048576 \(device memory in GiB, "
                            r"e\.g\. 32\), got 1e\+300; 1 PiB, far above any accelerator"),
    ("memory_gib", "1e400", r"memory_gib must be a number \(device memory in GiB, e\.g\. 32\), got inf"),
    ("peak_tflops", "1e300", r"peak_tflops must be <= 1000000 .*got 1e\+300; an exaflop per device"),
    ("count", "1000000000000", r"count must be <= 16384 \(number of identical devices\), got 1000000000000; "
                               r"16x the largest cluster"),
])
def test_absurd_device_figures_name_the_limit(tmp_path, field, value, message):
    old = {"memory_gib": "memory_gib: 32", "peak_tflops": "peak_tflops: 15.7", "count": "count: 2"}[field]
    path = write(tmp_path / "cluster.yaml", CLUSTER.replace(old, f"{field}: {value}"))
    with pytest.raises(SpecError, match=rf"^{path}: hosts\[0\]\.devices\[0\]\." + message):
        Cluster.from_yaml(path)


def test_too_many_devices_over_several_entries(tmp_path):
    hosts = "".join(f"  - name: h{i}\n    devices: [{{kind: T4, count: {MAX_DEVICES // 2}, peak_tflops: 8, "
                    f"memory_gib: 16}}]\n" for i in range(3))
    path = write(tmp_path / "cluster.yaml", CLUSTER.split("hosts:")[0] + "hosts:\n" + hosts)
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value).startswith(f"{path}: hosts[2].devices[0]: the cluster has more than 16,384 devices up to "
                                   "here, the most a spec may list (")


# -- hand-edited plans -----------------------------------------------------------------------------
def _set(*path):
    *keys, last, value = path

    def change(data):
        for key in keys:
            data = data[key]
        data[last] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_set("workers", 1, "forward_ms", 0, -2.5), r"plan\.workers\[1\]\.forward_ms\[0\] must be >= 0, got -2\.5"),
    (_set("workers", 0, "compute_ms", float("nan")),
     r"plan\.workers\[0\]\.compute_ms must be a number \(forward\+backward compute time per step, ms, predicted\), "
     r"got nan"),
    (_set("boundaries", 0, "bytes_per_sample", float("inf")),
     r"plan\.boundaries\[0\]\.bytes_per_sample must be a number \(bytes crossing the boundary per sample\), got inf"),
    (_set("boundaries", 0, "transfer_ms", 1, -1.0), r"plan\.boundaries\[0\]\.transfer_ms\[1\] must be >= 0, got -1\.0"),
    (_set("prediction", "step_time_ms", float("-inf")), r"plan\.prediction\.step_time_ms must be a number"),
    (_set("workers", 2, "memory_gib", -1), r"plan\.workers\[2\]\.memory_gib must be >= 0, got -1"),
    (_set("workers", 3, "micro_batch_sizes", 0, 0), r"plan\.workers\[3\]\.micro_batch_sizes\[0\] must be >= 1, got 0"),
    (_set("workers", 1, "memory_gib", 100.0),
     r"plan\.workers\[1\]\.memory_gib is 100 GiB, above its capacity_gib 28.8; the worker would run out of memory"),
])
def test_hand_edited_times_sizes_and_memory_are_refused(capsys, setting, tmp_path, change, message):
    _, _, plan = setting
    path = edited_plan(tmp_path, plan, change)
    with pytest.raises(PlanError, match=rf"^{path}: " + message):
        Plan.from_yaml(path)
    code, _, err = run(capsys, "simulate", path, "--trace", str(tmp_path / "step.json"))
    assert_one_line_error(code, err, f"{path}: plan.")
    assert os.listdir(tmp_path) == ["edited.yaml"]   # no trace, no temporary file


def test_memory_above_the_clusters_device(setting, tmp_path):
    graphs, cluster, plan = setting
    small = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(d, memory_gib=0.001) for d in cluster.devices))
    path = edited_plan(tmp_path, plan, lambda d: None)
    with pytest.raises(PlanError, match=rf"^{path}: plan\.workers\[0\]\.memory_gib is [0-9.]+ GiB, more than device "
                                        rf"'{plan.workers[0].device}' has \(0\.001 GiB in cluster "
                                        rf"'{cluster.name}'\); re-plan for this cluster with `whalelike plan`"):
        Plan.from_yaml(path, graphs=graphs, cluster=small)


def test_validate_rejects_devices_missing_from_the_cluster(setting):
    graphs, cluster, plan = setting
    other = synthetic_cluster([(2, 20.0, 32)], per_host=2)
    with pytest.raises(PlanError, match=rf"plan\.workers\[2\]\.device: unknown device '{plan.workers[2].device}' for "
                                        rf"cluster '{other.name}' \(it has .*\); re-plan for this cluster"):
        validate(plan, cluster=other)
    validate(plan, graphs=graphs, cluster=cluster)


def test_an_empty_or_missing_plan_file(tmp_path):
    empty = write(tmp_path / "empty.yaml", "")
    with pytest.raises(PlanError, match=rf"^{empty}: plan must be a mapping with keys model_fingerprint, .*got an "
                                        r"empty file$"):
        Plan.from_yaml(empty)
    with pytest.raises(PlanError, match=r"nope\.yaml: no such plan file; make one with `whalelike plan \.\.\. -o "):
        Plan.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(PlanError, match=rf"^{tmp_path}: is a directory, not a plan file"):
        Plan.from_yaml(tmp_path)


# -- one validate, run once per content ------------------------------------------------------------
def test_validate_runs_each_check_once_per_content(setting, monkeypatch):
    graphs, cluster, built = setting
    plan = copy.deepcopy(built)
    calls = []
    for name in ("check_alone", "check_model", "check_cluster"):
        original = getattr(planner.plan_checks, name)
        monkeypatch.setattr(planner.plan_checks, name,
                            lambda *args, _name=name, _original=original: (calls.append(_name), _original(*args)))
    validate(plan, cluster=cluster)                       # Engine.__init__
    validate(plan, graphs=graphs, cluster=cluster)        # Engine._build: only the model is new
    plan.validate(graphs=graphs, cluster=cluster)         # anyone again: nothing runs
    assert calls == ["check_alone", "check_cluster", "check_model"]
    validate(plan, cluster=copy.deepcopy(cluster))        # another cluster object is checked
    assert calls[-1] == "check_cluster" and len(calls) == 4

    plan.workers[0].forward_ms[0] = -1.0                  # edited in place: checked again
    with pytest.raises(PlanError, match=r"plan\.workers\[0\]\.forward_ms\[0\] must be >= 0, got -1\.0"):
        validate(plan, cluster=cluster)


def test_validation_leaves_no_trace_on_the_plan(setting):
    _, cluster, plan = setting
    validate(plan, cluster=cluster)
    assert pickle.loads(pickle.dumps(plan)) == plan == copy.deepcopy(plan)
    assert Plan.from_dict(plan.to_dict()) == plan and "_spec" not in repr(vars(plan))


def test_validate_takes_clusters_and_configs(setting):
    _, cluster, _ = setting
    validate(cluster)
    validate(Config(global_batch_size=8, num_micro_batch=2))
    with pytest.raises(TypeError, match=r"a Config is not checked against cluster; leave cluster= out"):
        validate(Config(global_batch_size=8), cluster=cluster)
    with pytest.raises(TypeError, match=r"validate\(\) takes a Cluster, Config or Plan, got dict"):
        validate({})


def test_check_plan_still_checks_everything(setting):
    graphs, cluster, plan = setting
    broken = dataclasses.replace(plan, global_batch_size=0)
    with pytest.raises(PlanError, match=r"plan\.global_batch_size must be >= 1, got 0"):
        planner.plan_checks.check_plan(broken, graphs, cluster)


def test_rules_speak_the_language_of_where_the_value_came_from():
    flag = Rule(bool, "a flag")
    assert flag.problem(1) == "must be True or False (a flag), got 1"
    assert flag.problem("yes", spelling="yaml") == "must be true or false (a flag), got 'yes'"
    with pytest.raises(SpecError, match=r"^Config\.num_micro_batch must be a positive integer, got 0$"):
        Config(global_batch_size=4, num_micro_batch=0)
    with pytest.raises(SpecError, match=r"^Config\.schedule must be one of gpipe, 1f1b, eager-1f1b, zb-h1, auto, got 'zb'$"):
        Config(global_batch_size=4, schedule="zb")


# -- YAML that expands ------------------------------------------------------------------------------
def test_aliases_cannot_make_a_small_file_huge(plan_file, monkeypatch):
    monkeypatch.setattr(whalelike.spec, "MAX_VALUES", 5_000)
    data = yaml.safe_load(plan_file.read_text())
    worker = yaml.safe_dump({"w": data["workers"][0]}, default_flow_style=True).strip()[4:-1]
    head = yaml.safe_dump({k: v for k, v in data.items() if k != "workers"}, sort_keys=False)
    plan_file.write_text(head + f"workers: [&w {worker}, " + ", ".join(["*w"] * 1000) + "]\n")
    with pytest.raises(PlanError, match=r"plan\.workers\[\d+\]: the data holds more than 5,000 values, more than any "
                                        r"spec needs; YAML aliases \(\*name\) repeat what an anchor"):
        Plan.from_yaml(plan_file)


def test_a_nested_alias_is_shown_cut_short(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = write(tmp_path / "cluster.yaml", CLUSTER.replace("name: lab", "name: *a8", 1))
    path.write_text("\n".join(lines) + "\n" + path.read_text())
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value).startswith(f"{path}: a0: unknown key")   # refused before any value is shown
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError) as e:
        Cluster.from_dict({**yaml.safe_load(CLUSTER), "name": yaml.load(path.read_text(), Loader=StrictLoader)["a8"]})
    assert str(e.value).startswith("<cluster spec>: name must be a non-empty string (cluster name), got [[[...], ")
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("value, problem", [("1" * 5000, "Exceeds the limit (4300 digits)"),
                                            ("2024-13-45", "month must be in 1..12")])
def test_unreadable_scalars_name_the_line(tmp_path, value, problem):
    path = write(tmp_path / "cluster.yaml", CLUSTER.replace("latency_us: 10", f"latency_us: {value}"))
    with pytest.raises(SpecError) as e:
        Cluster.from_yaml(path)
    assert str(e.value).startswith(f"{path}: line 2, column ")
    assert f"malformed YAML (cannot read '{value[:20]}" in str(e.value) and problem in str(e.value)
