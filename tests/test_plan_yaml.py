"""Plan YAML round trip and the validation of hand-edited plan files."""
import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner
from planner import Plan, PlanError, Prediction
from whalelike import Config, replicate
from whalelike.spec import StrictLoader
from whalelike.strategy import Strategy

from synthetic import synthetic_cluster, synthetic_model

TP_STAGE = Strategy("replicate", 2, Strategy("split", 2))


@pytest.fixture(scope="module")
def setting():
    graphs = synthetic_model(8, [replicate(2), TP_STAGE], hidden=256, seq=32)
    cluster = synthetic_cluster([(4, 20.0, 32), (2, 10.0, 16)], per_host=4)
    config = Config(global_batch_size=48, num_micro_batch=4)
    return graphs, cluster, planner.plan(graphs, cluster, config)


def _edit(tmp_path, plan, change):
    data = plan.to_dict()
    change(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_round_trip_is_exact(setting, tmp_path):
    graphs, cluster, plan = setting
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path, graphs=graphs, cluster=cluster)
    assert loaded == plan
    assert Plan.from_dict(plan.to_dict()) == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]   # no temporary left behind


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_round_trip_keeps_the_precision(setting, tmp_path, precision):
    graphs, cluster, plan = setting
    plan = dataclasses.replace(plan, precision=precision)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path, graphs=graphs, cluster=cluster)
    assert loaded == plan and loaded.precision == precision
    assert yaml.safe_load(path.read_text())["precision"] == precision


def test_a_plan_file_without_precision_is_fp32(setting, tmp_path):
    graphs, cluster, plan = setting
    path = _edit(tmp_path, plan, lambda data: data.pop("precision"))
    assert Plan.from_yaml(path, graphs=graphs, cluster=cluster).precision == "fp32"


finite = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False, width=64)   # times and sizes are >= 0


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step=finite, bubble=finite, gap=st.one_of(st.none(), st.floats(0, 10)), times=st.lists(finite, min_size=4, max_size=4))
def test_round_trip_keeps_every_float(setting, tmp_path, step, bubble, gap, times):
    _, _, plan = setting
    workers = list(plan.workers)
    workers[0] = dataclasses.replace(workers[0], forward_ms=times, memory_gib=step)
    edited = dataclasses.replace(plan, prediction=Prediction(step, bubble, step), optimality_gap=gap, workers=workers)
    path = tmp_path / "p.yaml"
    edited.to_yaml(path)
    assert Plan.from_dict(yaml.load(path.read_text(), Loader=StrictLoader)) == edited   # the loader from_yaml uses


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["workers"][0]["micro_batch_sizes"].__setitem__(0, 99), "batch shares sum to"),
        (lambda d: d["workers"][1].__setitem__("device", "tpu-7"), "unknown device 'tpu-7'"),
        (lambda d: d["workers"][2].__setitem__("rank", 5), "plan.workers[2].rank is 5"),
        (lambda d: d["stages"][1].__setitem__("layers", [5, 6, 7]), "plan.stages[1].layers must be contiguous"),
        (lambda d: d.__setitem__("schema_version", 99), "schema_version is 99"),
        (lambda d: d["workers"][0].pop("host"), "plan.workers[0]: missing required key 'host' (host of the device)"),
        (lambda d: d["workers"][0].__setitem__("stage", "zero"),
         "plan.workers[0].stage must be an integer (pipeline stage index), got 'zero'"),
        (lambda d: d.__setitem__("solver", "magic"), "plan.solver must be one of"),
        (lambda d: d["stages"][1]["shard_sizes"].__setitem__("layers.4.mlp.fc1", [1000, 100]),
         "sums to 1100, the dimension is 1024"),
        (lambda d: d["workers"][0]["micro_batch_sizes"].append(1), "a pipeline needs one per micro-batch"),
    ],
)
def test_hand_edited_plan_names_the_bad_field(setting, tmp_path, change, message):
    graphs, cluster, plan = setting
    path = _edit(tmp_path, plan, change)
    with pytest.raises(PlanError) as e:
        Plan.from_yaml(path, graphs=graphs, cluster=cluster)
    assert message in str(e.value)


def test_plan_for_a_different_model(setting, tmp_path):
    graphs, cluster, plan = setting
    other = synthetic_model(8, [replicate(2), TP_STAGE], hidden=512, seq=32)
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    with pytest.raises(PlanError, match=r"plan was made for model [0-9a-f]{12}, this model is [0-9a-f]{12}"):
        Plan.from_yaml(path, graphs=other, cluster=cluster)


def test_summary_is_an_aligned_table(setting):
    _, _, plan = setting
    text = plan.summary()
    table = text.split("\n\n")[1].splitlines()
    assert table[0].split()[:4] == ["rank", "device", "host", "stage"]
    assert len(table) == 2 + plan.world_size
    assert len({len(line) for line in table[2:]}) == 1 or all(len(l) <= len(table[1]) for l in table[2:])
    assert "predicted speed-up over naive" in text and "naive plan" in text


def test_round_trip_of_a_zb_h1_plan_chosen_by_auto(tmp_path):
    graphs = synthetic_model(12, [replicate() for _ in range(4)], hidden=256, seq=32)
    cluster = synthetic_cluster([(2, 20.0, 32), (2, 10.0, 32)], per_host=4)
    plan = planner.plan(graphs, cluster, Config(global_batch_size=32, num_micro_batch=8, schedule="auto"))
    assert plan.schedule == "zb-h1" and set(plan.schedule_steps_ms) == {"1f1b", "zb-h1"}
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    loaded = Plan.from_yaml(path, graphs=graphs, cluster=cluster)
    assert loaded == plan and Plan.from_dict(plan.to_dict()) == plan
    written = yaml.safe_load(path.read_text())
    assert written["schedule"] == "zb-h1" and written["schedule_steps_ms"] == plan.schedule_steps_ms
    # a file from before the field loads with the schedule as asked; an unknown schedule is named
    assert Plan.from_yaml(_edit(tmp_path, plan, lambda d: d.pop("schedule_steps_ms")), graphs=graphs,
                          cluster=cluster).schedule_steps_ms == {}
    with pytest.raises(PlanError, match=r"plan.schedule_steps_ms names \['zb-h2'\], not schedules"):
        Plan.from_yaml(_edit(tmp_path, plan, lambda d: d["schedule_steps_ms"].__setitem__("zb-h2", 1.0)),
                       graphs=graphs, cluster=cluster)
