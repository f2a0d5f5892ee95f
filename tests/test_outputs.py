"""Output files (whalelike/files.py and the CLI's use of it): each bad output path of issue 10 item 5
is refused with one line naming the option, the path and the fix, exit status 2, before any work,
and leaves no file behind (neither the target nor a temporary file); good ones are written all or
none, through symlinks, with the permissions ``open(path, "w")`` would give.
"""
from __future__ import annotations

import os
import stat
import tempfile
from unittest import mock

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from whalelike import Config, replicate
from whalelike.files import TEMP_MARK, Outputs, OutputError, check_output_paths, write_atomic

from synthetic import synthetic_cluster, synthetic_model
from test_cli import assert_one_line_error, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def graphs():
    return synthetic_model(num_layers=4, strategies=(replicate(), replicate()), hidden=64, seq=8, heads=4)


@pytest.fixture
def no_work(monkeypatch):
    """``whalelike plan`` whose capture fails the test: a bad output must be refused before it."""
    def capture_workload(args):
        raise AssertionError("capture ran although an output path is bad")

    monkeypatch.setattr("whalelike.cli.capture_workload", capture_workload)


@pytest.fixture
def captured(monkeypatch, graphs):
    monkeypatch.setattr("whalelike.cli.capture_workload", lambda args: graphs)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory, graphs):
    cluster = synthetic_cluster([(2, 20.0, 16), (2, 10.0, 16)], per_host=2)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=16, num_micro_batch=4, schedule="1f1b"))
    path = tmp_path_factory.mktemp("plans") / "plan.yaml"
    plan.to_yaml(path)
    return path


def plan_cmd(*outputs: str) -> list[str]:
    return ["plan", "model.py:build", "--cluster", "emulated-4", "--global-batch", "16", *outputs]


def assert_files(folder, *names: str) -> None:
    """``folder`` holds exactly ``names``: nothing written, no temporary file left."""
    assert sorted(os.listdir(folder)) == sorted(names)


# -- the final move would fail ----------------------------------------------------------------------
def test_output_path_that_is_a_directory(capsys, no_work, tmp_path):
    (tmp_path / "plans").mkdir()
    code, _, err = run(capsys, *plan_cmd("-o", str(tmp_path / "plans")))
    assert_one_line_error(code, err, f"-o {tmp_path / 'plans'}: is a directory; name a file inside it",
                          f"e.g. -o {tmp_path / 'plans' / 'plan.yaml'}")
    assert_files(tmp_path, "plans")
    assert_files(tmp_path / "plans")


def test_output_path_ending_in_a_slash(tmp_path):
    with pytest.raises(OutputError, match=r"-o .*/plans/: ends with '/', so it names a directory; name a file, "
                                          r"e.g. -o .*/plans/plan.yaml"):
        check_output_paths({"-o": f"{tmp_path}/plans/"}, kinds={"-o": "yaml"})
    assert_files(tmp_path)


def test_output_that_becomes_a_directory_during_the_work_writes_nothing(tmp_path):
    with pytest.raises(OutputError, match=r"--timeline .*step.png: is a directory"):
        with Outputs() as out:
            for name, label in (("plan.yaml", "-o"), ("step.png", "--timeline")):
                with open(out.stage(tmp_path / name, label=label), "w") as f:
                    f.write(name)
            (tmp_path / "step.png").mkdir()   # someone made it a directory while we planned
    assert_files(tmp_path, "step.png")     # plan.yaml was not written either
    assert_files(tmp_path / "step.png")


def test_a_move_failing_midway_names_the_files_already_written(tmp_path, monkeypatch):
    """Every check runs before the first rename; a rename that fails anyway (the disk went away)
    says which targets were already replaced, and leaves no temporary file."""
    real_replace = os.replace

    def replace(source, target):
        if str(target).endswith("b.json"):
            raise OSError(5, "Input/output error")
        real_replace(source, target)

    monkeypatch.setattr("whalelike.files.os.replace", replace)
    with pytest.raises(OutputError) as caught:
        with Outputs() as out:
            for name in ("a.json", "b.json", "c.json"):
                with open(out.stage(tmp_path / name, kind="json"), "w") as f:
                    f.write("{}")
    message = str(caught.value)
    assert "b.json: moving the finished file into place failed (Input/output error)" in message
    assert f"already written: {tmp_path / 'a.json'}" in message
    assert_files(tmp_path, "a.json")


def test_empty_output_path(capsys, no_work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *plan_cmd("-o", ""))
    assert_one_line_error(code, err, "-o: the output path is empty ('')", "e.g. -o plan.yaml")
    assert_files(tmp_path)


# -- paths that cannot be written -------------------------------------------------------------------
def test_trace_path_under_a_file(capsys, plan_file, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    trace = tmp_path / "notes.txt" / "step.json"
    code, _, err = run(capsys, "simulate", str(plan_file), "--timeline", str(tmp_path / "step.png"),
                       "--trace", str(trace))
    assert_one_line_error(code, err, f"--trace {trace}: {tmp_path / 'notes.txt'} is not a directory")
    assert_files(tmp_path, "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_trace_in_a_missing_directory_is_written_there(capsys, plan_file, tmp_path):
    """``--trace out/deep/step.json`` before ``out/`` exists: the directories are made (mkdir -p)."""
    trace = tmp_path / "out" / "deep" / "step.json"
    code, out, _ = run(capsys, "simulate", str(plan_file), "--trace", str(trace))
    assert code == 0 and f"wrote {trace}" in out
    assert_files(tmp_path, "out")
    assert os.listdir(tmp_path / "out" / "deep") == ["step.json"]


def test_directories_made_for_a_command_that_fails_are_removed(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError, match="the work failed"):
        with Outputs() as out:
            out.stage(tmp_path / "kept" / "new" / "deeper" / "a.json", kind="json")
            out.stage(tmp_path / "made" / "b.json", kind="json")
            assert (tmp_path / "made").is_dir() and (tmp_path / "kept" / "new" / "deeper").is_dir()
            raise RuntimeError("the work failed")
    assert_files(tmp_path, "kept")   # only what was there before
    assert os.listdir(tmp_path / "kept") == []


def test_a_missing_directory_under_a_file_or_a_read_only_one_is_refused(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt is not a directory"):
        check_output_paths({"-o": tmp_path / "notes.txt" / "sub" / "plan.yaml"})
    locked = tmp_path / "locked"
    locked.mkdir()
    # the kernel's answer for a read-only directory (the suite may run as root, who writes anywhere)
    real_access = os.access
    monkeypatch.setattr("whalelike.files.os.access",
                        lambda path, mode: False if os.fspath(path) == str(locked) else real_access(path, mode))
    with pytest.raises(OutputError, match=f"directory {locked / 'sub'} does not exist and cannot be made in {locked}"):
        check_output_paths({"-o": locked / "sub" / "plan.yaml"})
    assert_files(tmp_path, "locked", "notes.txt")


def test_trace_in_an_unwritable_directory(capsys, plan_file, tmp_path, monkeypatch):
    """As a normal user the directory's mode refuses the file; as root (who may write anyway) the
    creation of the temporary file is made to fail the way the kernel would."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    real_open = os.open

    def open_(path, flags, mode=0o777, **kw):
        if os.path.dirname(str(path)) == str(locked) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr("whalelike.files.os.open", open_)
    trace = locked / "step.json"
    try:
        code, _, err = run(capsys, "simulate", str(plan_file), "--timeline", str(tmp_path / "step.png"),
                           "--trace", str(trace))
        assert_one_line_error(code, err, f"--trace {trace}: cannot create", f"in {locked} (permission denied)",
                              "choose a writable directory")
        assert_files(locked)
    finally:
        locked.chmod(0o700)
    assert_files(tmp_path, "locked")


def test_fifo_is_refused(capsys, no_work, tmp_path):
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    code, _, err = run(capsys, *plan_cmd("-o", str(tmp_path / "plan.yaml"), "--trace", str(fifo)))
    assert_one_line_error(code, err, f"--trace {fifo}: is a FIFO (named pipe), not a regular file",
                          "choose another path")
    assert_files(tmp_path, "trace.json")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_character_device_is_refused():
    with pytest.raises(OutputError, match="--trace /dev/null: is a character device, not a regular file"):
        check_output_paths({"--trace": "/dev/null"})


# -- two outputs, one file --------------------------------------------------------------------------
def test_two_outputs_naming_the_same_file(capsys, no_work, tmp_path):
    (tmp_path / "step.json").symlink_to("step.png")   # the same file under a .json name
    code, _, err = run(capsys, *plan_cmd("-o", str(tmp_path / "plan.yaml"), "--timeline", str(tmp_path / "step.png"),
                                         "--trace", str(tmp_path / "step.json")))
    assert_one_line_error(code, err, "--timeline and --trace name the same file", "give each output its own file")
    assert_files(tmp_path, "step.json")


def test_same_path_twice_through_the_api(tmp_path):
    with pytest.raises(OutputError, match="-o and --copy name the same file"):
        check_output_paths({"-o": tmp_path / "plan.yaml", "--copy": f"{tmp_path}/./plan.yaml"})
    with pytest.raises(OutputError, match="output file .*a.yaml: given twice as an output"):
        with Outputs() as out:
            out.stage(tmp_path / "a.yaml")
            out.stage(tmp_path / "a.yaml")
    assert_files(tmp_path)


def test_output_that_would_replace_an_input(capsys, no_work, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("mine")
    code, _, err = run(capsys, "plan", "model.py:build", "--cluster", str(cluster), "--global-batch", "16",
                       "-o", str(cluster))
    assert_one_line_error(code, err, f"-o {cluster}: is the --cluster input of this command", "choose another path")
    assert cluster.read_text() == "mine"
    assert_files(tmp_path, "cluster.yaml")


# -- extensions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("outputs,fragment", [
    (["--timeline", "step.svg"], "--timeline step.svg: expected a PNG picture ending in .png, got '.svg'; "
                                 "use e.g. step.png"),
    (["--timeline", "step.json", "--trace", "step.png"], "--timeline step.json: expected a PNG picture ending in "
                                                         ".png, got '.json'"),
    (["--trace", "step.png"], "--trace step.png: expected a JSON file ending in .json, got '.png'"),
    (["--trace", "trace"], "--trace trace: expected a JSON file ending in .json, it has no extension"),
])
def test_wrong_extension_for_plan(capsys, no_work, tmp_path, monkeypatch, outputs, fragment):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *plan_cmd("-o", "plan.yaml", *outputs))
    assert_one_line_error(code, err, fragment)
    assert_files(tmp_path)


def test_plan_output_must_be_yaml(capsys, no_work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *plan_cmd("-o", "plan.json"))
    assert_one_line_error(code, err, "-o plan.json: expected a YAML file ending in .yaml or .yml, got '.json'",
                          "use e.g. plan.yaml")
    assert_files(tmp_path)


def test_simulate_checks_extensions_before_simulating(capsys, plan_file, tmp_path, monkeypatch):
    def simulate(plan):
        raise AssertionError("simulated although an output path is bad")

    monkeypatch.setattr("planner.simulate", simulate)
    code, _, err = run(capsys, "simulate", str(plan_file), "--timeline", str(tmp_path / "step.svg"))
    assert_one_line_error(code, err, "expected a PNG picture ending in .png, got '.svg'")
    assert_files(tmp_path)


def test_writers_check_their_extension(tmp_path):
    from planner.schedule.timeline import write_chrome_trace, write_png
    from test_simulator import chain_plan

    plan = chain_plan([(1.0, 2.0)], 2)
    with pytest.raises(OutputError, match="expected a PNG picture ending in .png, got '.json'"):
        write_png(plan, tmp_path / "step.json")
    with pytest.raises(OutputError, match="expected a JSON file ending in .json, got '.png'"):
        write_chrome_trace(plan, tmp_path / "step.png")
    write_png(plan, tmp_path / "STEP.PNG")   # the case of the extension does not matter
    assert_files(tmp_path, "STEP.PNG")


# -- symlinks ---------------------------------------------------------------------------------------
def test_symlink_is_written_through(capsys, captured, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "plan.yaml").write_text("old")
    link = tmp_path / "latest.yaml"
    link.symlink_to(results / "plan.yaml")
    dangling = tmp_path / "step.png"
    dangling.symlink_to(results / "step.png")          # points to a file not made yet
    code, out, _ = run(capsys, *plan_cmd("-o", str(link), "--timeline", str(dangling)))
    assert code == 0 and f"wrote {link}" in out
    assert link.is_symlink() and os.readlink(link) == str(results / "plan.yaml")
    assert yaml.safe_load((results / "plan.yaml").read_text())["global_batch_size"] == 16
    assert dangling.is_symlink() and (results / "step.png").read_bytes().startswith(PNG_MAGIC)
    assert_files(tmp_path, "latest.yaml", "results", "step.png")
    assert_files(results, "plan.yaml", "step.png")


def test_symlink_loop_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    with pytest.raises(OutputError, match=r"-o .*loop.yaml: cannot be used as an output \(Too many levels"):
        check_output_paths({"-o": loop})


# -- permissions ------------------------------------------------------------------------------------
@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def test_plan_yaml_permissions_equal_from_the_api_and_the_cli(capsys, captured, tmp_path, umask_027):
    code, _, _ = run(capsys, *plan_cmd("-o", str(tmp_path / "cli.yaml"), "--trace", str(tmp_path / "cli.json")))
    assert code == 0
    plan = planner.Plan.from_yaml(tmp_path / "cli.yaml")
    write_atomic(tmp_path / "api.yaml", yaml.safe_dump(plan.to_dict(), sort_keys=False), kind="yaml")
    modes = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in os.listdir(tmp_path)}
    assert modes == {"cli.yaml": umask_027, "cli.json": umask_027, "api.yaml": umask_027}   # open(path, "w")'s


def test_an_existing_file_keeps_its_mode(tmp_path, umask_027):
    target = tmp_path / "plan.yaml"
    target.write_text("old")
    target.chmod(0o604)
    write_atomic(target, "new", kind="yaml")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o604
    assert_files(tmp_path, "plan.yaml")


# -- all or none ------------------------------------------------------------------------------------
def test_an_error_in_the_work_leaves_old_files_and_no_temporary_ones(tmp_path):
    (tmp_path / "plan.yaml").write_text("old plan")
    with pytest.raises(ZeroDivisionError):
        with Outputs() as out:
            for name in ("plan.yaml", "step.json"):
                with open(out.stage(tmp_path / name), "w") as f:
                    f.write("new")
            1 / 0
    assert (tmp_path / "plan.yaml").read_text() == "old plan"
    assert_files(tmp_path, "plan.yaml")


def test_temporary_files_are_hidden_beside_the_target_with_its_extension(tmp_path):
    with Outputs() as out:
        temp = out.stage(tmp_path / "plan.yaml", kind="yaml")
        assert os.path.dirname(temp) == str(tmp_path)
        name = os.path.basename(temp)
        assert name.startswith(".plan.") and name.endswith(".tmp.yaml")
        write_atomic(temp, "nested writers accept the temporary path", kind="yaml")
        assert out.commit() == [str(tmp_path / "plan.yaml")]
        assert out.commit() == [str(tmp_path / "plan.yaml")]   # once only
    assert (tmp_path / "plan.yaml").read_text() == "nested writers accept the temporary path"
    assert_files(tmp_path, "plan.yaml")


def test_discard_inside_the_block_writes_nothing(tmp_path):
    with Outputs() as out:
        with open(out.stage(tmp_path / "plan.yaml"), "w") as f:
            f.write("draft")
        out.discard()
        assert out.commit() == []
        with pytest.raises(RuntimeError, match="Outputs.stage after commit or discard"):
            out.stage(tmp_path / "other.yaml")
    assert_files(tmp_path)


# -- the invariant, over mixes of targets and failures ---------------------------------------------
TARGET_SETUPS = ("new", "existing", "link", "dangling link")


@settings(max_examples=60, deadline=None)
@given(setups=st.lists(st.sampled_from(TARGET_SETUPS), min_size=1, max_size=4),
       existing_mode=st.sampled_from([0o600, 0o640, 0o604, 0o664]),
       failure=st.sampled_from([None, "error in the work", "target became a directory", "rename failed"]),
       failing_index=st.integers(0, 3))
def test_every_target_is_old_or_new_and_no_temporary_file_survives(setups, existing_mode, failure, failing_index):
    """Targets of every sort (new, existing with its own mode, symlink, dangling symlink) and every
    failure (in the work, a check at commit, a rename midway): each target holds its old content or
    its complete new one, all change together unless a rename itself failed (then exactly those
    before it, as the error says), links stay links, modes follow ``open(path, "w")``."""
    umask = os.umask(0o022)
    os.umask(umask)
    with tempfile.TemporaryDirectory() as root:
        os.mkdir(os.path.join(root, "real"))
        targets, files = [], []   # what the caller names; the file that gets the content
        for index, setup in enumerate(setups):
            target = os.path.join(root, f"out{index}.json")
            file = os.path.join(root, "real", f"out{index}.json") if "link" in setup else target
            if setup in ("existing", "link"):
                with open(file, "w") as f:
                    f.write(f"old {index}")
                os.chmod(file, existing_mode)
            if "link" in setup:
                os.symlink(file, target)
            targets.append(target)
            files.append(file)
        before = [open(file).read() if os.path.exists(file) else None for file in files]
        failing = failing_index % len(setups)
        renames = []
        real_replace = os.replace

        def replace(source, destination):
            if failure == "rename failed" and len(renames) == failing:
                raise OSError(28, "No space left on device")
            renames.append(destination)
            real_replace(source, destination)

        with mock.patch("whalelike.files.os.replace", replace):
            try:
                with Outputs() as out:
                    for index, target in enumerate(targets):
                        with open(out.stage(target, kind="json", label=f"--out{index}"), "w") as f:
                            f.write(f"new {index}")
                    if failure == "error in the work":
                        raise KeyError("the work failed")
                    if failure == "target became a directory":
                        if os.path.exists(files[failing]):
                            os.unlink(files[failing])
                        os.mkdir(files[failing])
                error = None
            except (KeyError, OutputError) as caught:
                error = caught

        leftovers = [name for _, _, names in os.walk(root) for name in names if TEMP_MARK in name]
        assert leftovers == []
        assert all(os.path.islink(t) == ("link" in s) for t, s in zip(targets, setups))
        if failure is None:
            assert error is None
            written = range(len(setups))
        elif failure == "rename failed":
            assert isinstance(error, OutputError) and "No space left on device" in str(error)
            assert ("already written: " + ", ".join(targets[:failing]) if failing else "no file was written") \
                in str(error)
            written = range(failing)
        else:
            assert error is not None
            written = range(0)
        for index, file in enumerate(files):
            if failure == "target became a directory" and index == failing:
                assert os.path.isdir(file)
            elif index in written:
                assert open(file).read() == f"new {index}"
                mode = existing_mode if before[index] is not None else 0o666 & ~umask
                assert stat.S_IMODE(os.stat(file).st_mode) == mode
            else:
                assert (open(file).read() if os.path.exists(file) else None) == before[index]
