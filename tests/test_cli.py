"""The ``whalelike`` command: output, one-line errors with exit status 2, and all-or-nothing files
(each bad output path has its own test in test_outputs.py).

Commands run in-process through ``main([...])`` (importing torch in a subprocess costs seconds);
two subprocess tests check the real entry point.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import planner
from whalelike import Config, SpecError, WhaleError, replicate
from whalelike.cli import _outputs, load_workload, main
from whalelike.cluster import Cluster
from whalelike.workload import Workload

from synthetic import synthetic_cluster, synthetic_model


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    lines = [l for l in err.splitlines() if not l.endswith(" ...")]  # drop progress lines
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("whalelike: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# -- whalelike cluster -----------------------------------------------------------------------------
def test_cluster_lists_presets(capsys):
    code, out, _ = run(capsys, "cluster")
    assert code == 0
    for name in Cluster.preset_names():
        assert name in out
    assert "V100-32GB x8 + P100-16GB x8 on 2 hosts" in out


def test_cluster_prints_a_presets_devices(capsys):
    code, out, _ = run(capsys, "cluster", "emulated-4")
    assert code == 0 and out.strip() == Cluster.preset("emulated-4").summary()


def test_cluster_file_with_a_schema_violation_is_one_line(capsys, tmp_path):
    d = Cluster.preset("emulated-2").to_dict()
    d["hosts"][0]["devices"][1]["memory_gib"] = -16
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(d))
    code, _, err = run(capsys, "cluster", str(path))
    assert_one_line_error(code, err, f"{path}: hosts[0].devices[1].memory_gib must be > 0, got -16")


def test_unknown_preset_lists_presets(capsys):
    code, _, err = run(capsys, "cluster", "emulated-5")
    assert_one_line_error(code, err, "unknown cluster preset 'emulated-5'", "emulated-4-equal", "whale-v100-p100")


def test_debug_shows_the_exception(capsys):
    with pytest.raises(SpecError):
        main(["--debug", "cluster", "emulated-5"])
    with pytest.raises(SpecError):
        main(["cluster", "emulated-5", "--debug"])


def test_the_installed_entry_point_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: x\nhosts: [\n")
    proc = subprocess.run([sys.executable, "-m", "whalelike.cli", "cluster", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"whalelike: error: {bad}: line ")
    assert "malformed YAML" in proc.stderr and "Traceback" not in proc.stderr


def test_the_entry_point_refuses_a_bad_output_before_reading_any_input(tmp_path):
    """Output paths are checked first: a wrong extension is reported, not the missing model."""
    svg = tmp_path / "plan.svg"
    proc = subprocess.run([sys.executable, "-m", "whalelike.cli", "plan", f"{tmp_path}/missing.py:build",
                           "--cluster", "emulated-4", "--global-batch", "8", "-o", str(tmp_path / "plan.yaml"),
                           "--timeline", str(svg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"whalelike: error: --timeline {svg}: expected a PNG picture ending in .png, got '.svg'; "
                           f"use e.g. {tmp_path / 'plan.png'}\n")
    assert os.listdir(tmp_path) == []


# -- the MODEL factory -----------------------------------------------------------------------------
FACTORIES = """\
    import torch
    import torch.nn as nn
    from whalelike.workload import Workload

    def good():
        return nn.Linear(4, 2), torch.randn(3, 4)

    def full():
        return Workload(model=nn.Linear(4, 2), example_args=(torch.randn(3, 4),))

    def wrong_type():
        return 42

    def crashes():
        raise RuntimeError("out of coffee")

    def exits():
        import sys
        sys.exit(3)

    not_a_function = 3
"""


@pytest.fixture
def factories(tmp_path) -> Path:
    path = tmp_path / "models.py"
    path.write_text(textwrap.dedent(FACTORIES))
    return path


def test_factory_returning_a_tuple_or_a_workload(factories):
    tuple_wl = load_workload(f"{factories}:good")
    assert isinstance(tuple_wl, Workload) and tuple_wl.example_args[0].shape == (3, 4)
    assert isinstance(load_workload(f"{factories}:full"), Workload)


@pytest.mark.parametrize("suffix,fragments", [
    (":wrong_type", ["wrong_type() must return a whalelike.Workload or a (model, example_args) tuple, got int"]),
    (":missing", ["has no attribute 'missing'", "functions defined there: crashes, exits, full, good, wrong_type"]),
    (":not_a_function", ["'not_a_function' is a int, not a function"]),
    (":crashes", ["crashes(): raised RuntimeError: out of coffee"]),
    (":exits", ["models.py:exits(): called sys.exit(3)", "must return a model"]),
    ("", ["MODEL must be path/to/file.py:factory"]),
])
def test_factory_problems_are_one_line_errors(capsys, factories, suffix, fragments):
    code, _, err = run(capsys, "inspect", f"{factories}{suffix}")
    assert_one_line_error(code, err, *fragments)


def test_missing_model_file(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", f"{tmp_path}/nope.py:model")
    assert_one_line_error(code, err, "nope.py: no such file")


def test_model_file_that_fails_to_import(capsys, tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import torch\n1 / 0\n")
    code, _, err = run(capsys, "inspect", f"{path}:model")
    assert_one_line_error(code, err, "broken.py: importing it failed: ZeroDivisionError")


def test_model_file_that_exits_when_imported(capsys, tmp_path):
    path = tmp_path / "script.py"
    path.write_text("import sys\nsys.exit(4)\n")
    code, _, err = run(capsys, "inspect", f"{path}:model")
    assert_one_line_error(code, err, "script.py: importing it called sys.exit(4)", '__name__ == "__main__"')


# -- whalelike inspect and plan with real capture ---------------------------------------------------
SCOPED_MODEL = """\
    import torch
    import torch.nn as nn
    import whalelike as wl

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with wl.replicate():
                self.lower = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
            with wl.replicate():
                self.upper = nn.Linear(32, 4)

        def forward(self, x):
            return self.upper(self.lower(x))

    def build():
        return Net(), (torch.randn(4, 16),)
"""


@pytest.fixture(scope="module")
def scoped_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "scoped.py"
    path.write_text(textwrap.dedent(SCOPED_MODEL))
    return f"{path}:build"


def test_inspect_prints_the_table_or_json(capsys, scoped_model):
    from whalelike.graphs.capture import capture

    wl = load_workload(scoped_model)
    graphs = capture(wl.model, wl.example_args, optimizer="sgd")
    code, out, _ = run(capsys, "inspect", scoped_model, "--optimizer", "sgd")
    assert code == 0 and out.strip() == graphs.table()
    code, out, _ = run(capsys, "inspect", scoped_model, "--optimizer", "sgd", "--json")
    assert code == 0 and json.loads(out) == json.loads(json.dumps(graphs.to_dict()))


def test_plan_end_to_end(capsys, scoped_model, tmp_path):
    out_yaml = tmp_path / "plan.yaml"
    code, out, _ = run(capsys, "plan", scoped_model, "--cluster", "emulated-2", "--global-batch", "8",
                       "--micro-batches", "2", "--pipeline-schedule", "gpipe", "-o", str(out_yaml))
    assert code == 0 and "predicted speed-up over naive" in out
    plan = planner.Plan.from_yaml(out_yaml, cluster=Cluster.preset("emulated-2"))
    assert plan.schedule == "gpipe" and plan.global_batch_size == 8 and len(plan.stages) == 2


def test_plan_names_the_pipeline_schedule_as_train_py_does(capsys, scoped_model, tmp_path):
    """One name for one concept: ``--pipeline-schedule`` on ``whalelike plan`` and on train.py (whose
    ``--schedule`` is the learning-rate schedule); the old spelling says the new one."""
    code, _, err = run(capsys, "plan", scoped_model, "--cluster", "emulated-4", "--global-batch", "8",
                       "--schedule", "gpipe", "-o", str(tmp_path / "p.yaml"))
    assert_one_line_error(code, err, "--schedule is now --pipeline-schedule", "--pipeline-schedule gpipe")
    assert not (tmp_path / "p.yaml").exists()


def test_plan_takes_every_p_reduce_setting_as_a_flag(capsys, scoped_model, tmp_path):
    out_yaml = tmp_path / "partial.yaml"
    code, _, err = run(capsys, "plan", scoped_model, "--cluster", "emulated-4", "--global-batch", "8",
                       "--dp-sync", "partial", "--partial-generator", "static", "--partial-group-size", "2",
                       "--partial-delta-c", "3", "-o", str(out_yaml))
    assert code == 0, err
    stages = [s for s in planner.Plan.from_yaml(out_yaml, cluster=Cluster.preset("emulated-4")).stages if s.replica_sync == "partial"]
    assert stages and all((s.partial_generator, s.partial_group_size, s.partial_delta_c) == ("static", 2, 3)
                          for s in stages)


def test_plan_precision_flag(capsys, scoped_model, tmp_path):
    """--precision reaches the plan (and its summary); a precision a device cannot run is one line
    naming the device and the precisions to use instead."""
    out_yaml = tmp_path / "plan.yaml"
    code, out, _ = run(capsys, "plan", scoped_model, "--cluster", "emulated-2", "--global-batch", "8",
                       "--precision", "fp16", "-o", str(out_yaml))
    assert code == 0 and "precision fp16" in out.splitlines()[0]
    assert planner.Plan.from_yaml(out_yaml, cluster=Cluster.preset("emulated-2")).precision == "fp16"
    code, _, err = run(capsys, "plan", scoped_model, "--cluster", "emulated-2", "--global-batch", "8",
                       "--precision", "bf16", "-o", str(tmp_path / "bf16.yaml"))
    assert_one_line_error(code, err, "emu-half cannot run bf16", "emu-half-0", "plan with precision fp16 or fp32")
    assert not (tmp_path / "bf16.yaml").exists()


# -- whalelike simulate ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    graphs = synthetic_model(num_layers=4, strategies=(replicate(), replicate()), hidden=64, seq=8, heads=4)
    cluster = synthetic_cluster([(2, 20.0, 16), (2, 10.0, 16)], per_host=2)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16, num_micro_batch=4, schedule="1f1b"))
    path = tmp_path_factory.mktemp("plans") / "plan.yaml"
    plan.to_yaml(path)
    return path


def test_simulate_prints_the_step_and_writes_pictures(capsys, plan_file, tmp_path):
    png, trace = tmp_path / "step.png", tmp_path / "step.json"
    code, out, _ = run(capsys, "simulate", str(plan_file), "--timeline", str(png), "--trace", str(trace))
    assert code == 0
    assert out.startswith("simulated step (1f1b, 4 micro-batch(es))")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and trace.stat().st_size > 0
    assert f"wrote {png}" in out and f"wrote {trace}" in out
    assert sorted(os.listdir(tmp_path)) == ["step.json", "step.png"]  # no temporary files left


def test_simulate_writes_nothing_when_one_output_cannot_be_written(capsys, plan_file, tmp_path):
    trace = tmp_path / "step.json"
    (tmp_path / "a-file").write_text("mine")
    code, _, err = run(capsys, "simulate", str(plan_file), "--trace", str(trace),
                       "--timeline", str(tmp_path / "a-file" / "step.png"))
    assert_one_line_error(code, err, "a-file is not a directory")
    assert os.listdir(tmp_path) == ["a-file"]


def test_simulate_a_missing_or_hand_broken_plan(capsys, plan_file, tmp_path):
    code, _, err = run(capsys, "simulate", str(tmp_path / "missing.yaml"))
    assert_one_line_error(code, err, "missing.yaml: no such plan file")
    data = yaml.safe_load(plan_file.read_text())
    data["workers"][0]["micro_batch_sizes"][0] += 1   # shares no longer sum to the global batch
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(data, sort_keys=False))
    code, _, err = run(capsys, "simulate", str(broken))
    stage = data["workers"][0]["stage"]
    assert_one_line_error(code, err, f"{broken}: plan.workers of stage {stage}: batch shares sum to 17")


def test_outputs_are_all_or_nothing(tmp_path):
    with pytest.raises(WhaleError):
        with _outputs() as out:
            Path(out.stage(str(tmp_path / "a.txt"))).write_text("a")
            Path(out.stage(str(tmp_path / "b.txt"))).write_text("b")
            raise WhaleError("planning failed")
    assert os.listdir(tmp_path) == []
    with _outputs() as out:
        Path(out.stage(str(tmp_path / "a.txt"))).write_text("a")
    assert (tmp_path / "a.txt").read_text() == "a" and os.listdir(tmp_path) == ["a.txt"]


# -- whalelike plan (capture replaced by synthetic TaskGraphs; capture has its own tests) ----------
@pytest.fixture
def synthetic_capture(monkeypatch):
    graphs = synthetic_model(num_layers=4, strategies=(replicate(), replicate()), hidden=64, seq=8, heads=4)
    monkeypatch.setattr("whalelike.cli.capture_workload", lambda args: graphs)
    return graphs


def test_plan_prints_the_summary_and_writes_every_file(capsys, synthetic_capture, tmp_path):
    out_yaml, png, trace = tmp_path / "plan.yaml", tmp_path / "plan.png", tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", "model.py:workload", "--cluster", "emulated-4", "--global-batch", "16",
                       "--micro-batches", "4", "-o", str(out_yaml), "--timeline", str(png), "--trace", str(trace))
    assert code == 0
    plan = planner.Plan.from_yaml(out_yaml, graphs=synthetic_capture, cluster=Cluster.preset("emulated-4"))
    assert out.startswith(plan.summary())
    assert "predicted speed-up over naive" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and trace.stat().st_size > 0
    assert sorted(os.listdir(tmp_path)) == ["plan.json", "plan.png", "plan.yaml"]
    code, out, _ = run(capsys, "simulate", str(out_yaml))
    assert code == 0 and "simulated step (1f1b, 4 micro-batch(es))" in out


def test_a_plan_that_fails_says_one_line_without_the_warnings_of_what_it_tried(capsys, caplog, synthetic_capture,
                                                                             tmp_path):
    """A global batch no device holds: the planner warns on its way (partitions that overflow, a
    fallback to recompute) and then fails; the error alone is said, in one line. Warnings of a plan
    that succeeds are still printed, after it."""
    import logging

    with caplog.at_level(logging.WARNING):
        code, _, err = run(capsys, "plan", "model.py:workload", "--cluster", "emulated-4", "--global-batch",
                           "1000000000000", "-o", str(tmp_path / "plan.yaml"))
    assert_one_line_error(code, err, "does not fit")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert os.listdir(tmp_path) == []
    real = planner.plan

    def warns(*args, **kwargs):
        logging.getLogger("planner").warning("a note the planner makes on its way")
        return real(*args, **kwargs)

    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "plan", warns)
        code, _, _ = run(capsys, "plan", "model.py:workload", "--cluster", "emulated-4", "--global-batch", "16",
                         "-o", str(tmp_path / "plan.yaml"))
    assert code == 0
    assert [r.getMessage() for r in caplog.records] == ["a note the planner makes on its way"]


def test_plan_sync_batchnorm_flag_is_recorded(capsys, synthetic_capture, tmp_path):
    for flags, expected in (([], False), (["--sync-batchnorm"], True)):
        out_yaml = tmp_path / f"plan{expected}.yaml"
        code, _, _ = run(capsys, "plan", "model.py:workload", "--cluster", "emulated-4", "--global-batch", "16",
                         *flags, "-o", str(out_yaml))
        assert code == 0
        assert planner.Plan.from_yaml(out_yaml).sync_batchnorm is expected


@pytest.mark.parametrize("example", ["hybrid_classifier", "gpt", "third_party", "hf_gpt2"])
def test_plan_each_example_on_the_emulated_cluster(capsys, tmp_path, example):
    spec = str(Path(__file__).parent.parent / "examples" / f"{example}.py") + ":build"
    out_yaml, png = tmp_path / "plan.yaml", tmp_path / "plan.png"
    code, out, _ = run(capsys, "plan", spec, "--cluster", "emulated-4", "--global-batch", "16",
                       "--micro-batches", "2", "-o", str(out_yaml), "--timeline", str(png))
    assert code == 0
    plan = planner.Plan.from_yaml(out_yaml, cluster=Cluster.preset("emulated-4"))
    assert out.startswith(plan.summary()) and "predicted speed-up over naive" in out
    assert plan.prediction.step_time_ms < plan.naive_prediction.step_time_ms
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,fragments", [
    (["--global-batch", "1"], ["global_batch_size 1 is smaller than the 2 data-parallel groups"]),
    (["--global-batch", "16", "--micro-batches", "0"], ["num_micro_batch must be a positive integer, got 0"]),
    (["--global-batch", "16", "--cluster", "nope.yaml"], ["nope.yaml: no such cluster file"]),
])
def test_plan_failures_write_no_file(capsys, synthetic_capture, tmp_path, argv, fragments):
    args = ["plan", "model.py:workload", "--cluster", "emulated-4", *argv,
            "-o", str(tmp_path / "plan.yaml"), "--timeline", str(tmp_path / "plan.png")]
    code, _, err = run(capsys, *args)
    assert_one_line_error(code, err, *fragments)
    assert os.listdir(tmp_path) == []


def test_simulate_checks_the_plans_devices_against_its_cluster(capsys, tmp_path):
    cluster = Cluster.preset("emulated-4")
    plan = planner.plan(synthetic_model(4, [replicate(4)], hidden=64, seq=8), cluster, Config(global_batch_size=8))
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    code, _, err = run(capsys, "simulate", str(path), "--cluster", "emulated-2")
    assert_one_line_error(code, err, f"{path}: plan.workers[1].device: unknown device '{plan.workers[1].device}' "
                                     "for cluster 'emulated-2'")
    data = yaml.safe_load(path.read_text())
    data["workers"][1]["device"] = "gpu-9"   # the plan names the preset emulated-4: checked against it
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    code, _, err = run(capsys, "simulate", str(path))
    assert_one_line_error(code, err, "plan.workers[1].device: unknown device 'gpu-9' for cluster 'emulated-4'")
    assert os.listdir(tmp_path) == ["plan.yaml"]


def test_a_model_file_is_executed_once_while_it_is_unchanged(tmp_path):
    """load_workload calls the factory again on the file it executed before (same classes, so whalelike's
    capture cache knows the model), and executes the file again once it changed."""
    source = tmp_path / "twice.py"
    text = "import torch\nclass Net(torch.nn.Linear):\n    pass\ndef build():\n    return Net({n}, 2), torch.randn(2, {n})\n"
    source.write_text(text.format(n=3))
    first, second = (load_workload(f"{source}:build") for _ in range(2))
    assert type(first.model) is type(second.model) and first.model is not second.model
    source.write_text(text.format(n=40))
    changed = load_workload(f"{source}:build")
    assert type(changed.model) is not type(first.model) and changed.model.in_features == 40
