"""``whalelike train JOB.yaml`` (runtime.launch): the typed job file, its overrides and one-line
errors (in process, cheap), the optimizer's name mapped onto what the planner prices, and one real
2-rank run under torchrun whose losses equal ``examples/train.py``'s for the same options."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess

import pytest
import torch

import warm_python
from runtime.launch import job as jobs
from runtime.launch import trainer
from test_examples_train import BYTE_LM, _two_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "examples", "job.yaml")
TEXT = os.path.join(ROOT, "examples", "data", "tinyshakespeare.txt")


def test_the_example_job_loads_with_its_defaults_and_overrides():
    job = jobs.load(JOB, ["--train.steps", "4", "--cluster.spec=emulated-2", "--optimizer.args", "{weight_decay: 0.1}",
                          "--train.clip_grad_norm", "null", "--checkpoint.resume", "false"])
    assert job.train.steps == 4 and job.cluster.spec == "emulated-2" and job.train.clip_grad_norm is None
    assert job.optimizer.args == {"weight_decay": 0.1} and job.checkpoint.resume is False
    assert job.model.factory == "examples/hf_llama.py:build" and job.data.path.endswith("tinyshakespeare.txt")
    args = jobs.to_args(job)
    assert (args.steps, args.cluster, args.optimizer, args.no_resume, args.global_batch) == \
        (4, "emulated-2", "AdamW", True, 16)
    assert "train:\n  steps: 4" in job.to_yaml()       # the resolved job, printed at start


def test_job_fields_are_the_trainers_flags():
    """One definition: every field's default and help are its flag's; every flag but --compare-naive
    is a field (the module refuses to import otherwise)."""
    defaults = trainer.build_parser().parse_args(["m.py:f"])
    args = jobs.to_args(jobs.from_dict({"model": "examples/gpt.py:build", "plan": {"file": JOB}}))
    for name, value in vars(defaults).items():
        if name not in ("model", "plan"):
            assert getattr(args, name) == value, name
    flags = {a.option_strings[0] for a in trainer.build_parser()._actions if a.option_strings}
    assert flags - {f for keys in jobs.FIELDS.values() for f in keys.values()} == jobs.NOT_IN_JOBS


@pytest.mark.parametrize("data, overrides, says", [
    ({"trian": {}}, [], "unknown section 'trian'; did you mean 'train'? the sections are model, cluster"),
    ({"train": {"stepz": 3}}, [], "unknown key train.stepz; did you mean 'steps'? the keys of train are steps"),
    ({}, ["--train.steps", "ten"], "command line: train.steps must be an integer, got 'ten'"),
    ({"train": {"steps": 2.5}}, [], "j.yaml: train.steps must be an integer, got 2.5"),
    ({"train": {"schedule": "cosin"}}, [], "train.schedule must be one of cosine"),
    ({"train": {"steps": 2}}, [], "j.yaml: train.steps must exceed the 2 untimed warm-up steps of the throughput table, got 2"),
    ({"model": {"factory": "examples/gpt.py:build", "weights": "/no/such/ckpt"}}, [],
     "model.weights /no/such/ckpt: no such directory"),
    ({"data": {"path": "/no/such.txt"}}, [], "data.path /no/such.txt: no such file"),
    ({"plan": {"file": "/no/plan.yaml"}}, [], "plan.file /no/plan.yaml: no such file"),
    ({}, ["steps", "3"], "'steps' is not an override; write --section.key value"),
])
def test_each_error_is_one_line_naming_the_key(data, overrides, says):
    with pytest.raises(jobs.JobError) as caught:
        jobs.to_args(jobs.from_dict({"model": "examples/gpt.py:build", "plan": {"file": JOB}, **data}, "j.yaml",
                                    overrides))
    message = str(caught.value)
    assert says in message and "\n" not in message, message


def test_without_torchrun_the_trainer_says_so_before_building_the_model(tmp_path, monkeypatch, capsys):
    """A plain ``python train.py`` would build, capture and plan the model (minutes at real size)
    before the Engine refused to start: the trainer says it first, in one line."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    factory = tmp_path / "never.py"
    factory.write_text("def build():\n    raise AssertionError('the model was built')\n")
    args = trainer.parse_args([f"{factory}:build", "--cluster", "emulated-2", "--global-batch", "8", "--steps", "5"])
    assert trainer.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.py: error: the trainer runs under torchrun (environment lacks RANK" in err


def test_the_optimizer_is_a_torch_optim_name_priced_by_the_planner():
    assert trainer.priced_optimizer("AdamW", {}) == "adamw" and trainer.priced_optimizer("Adam", {}) == "adam"
    assert trainer.priced_optimizer("SGD", {}) == "sgd"
    assert trainer.priced_optimizer("SGD", {"momentum": 0.9}) == "sgd_momentum"
    for name, says in (("Adagrad", "the planner cannot price its state (it prices SGD, Adam, AdamW)"),
                       ("Nope", "is not a torch.optim optimizer")):
        with pytest.raises(jobs.JobError, match=r"optimizer\.name .*" + says.split(" (")[0]):
            jobs.to_args(jobs.from_dict({"model": "examples/gpt.py:build", "plan": {"file": JOB},
                                         "optimizer": {"name": name}}))
    with pytest.raises(jobs.JobError, match="optimizer.args: torch.optim.SGD takes no keyword 'betas'"):
        jobs.to_args(jobs.from_dict({"model": "examples/gpt.py:build", "plan": {"file": JOB},
                                     "optimizer": {"name": "SGD", "args": {"betas": [0.9, 0.9]}}}))
    # the optimizer built is the one named, with its arguments; the plan made prices its state
    args = argparse.Namespace(optimizer="SGD", optimizer_args={"momentum": 0.5}, lr=0.1)
    built = trainer.optimizer_factory(args)([torch.nn.Parameter(torch.zeros(2))])
    assert type(built) is torch.optim.SGD and built.defaults["momentum"] == 0.5 and built.defaults["lr"] == 0.1
    config = trainer.planning_config(argparse.Namespace(global_batch=8, micro_batches=1, pipeline_schedule="1f1b",
                                                        zero=None, precision=None, memory_reserve=0.1, **vars(args)))
    assert config.optimizer == "sgd_momentum"


def _launch(command: list, tmp_path) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = warm_python.environment({**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                   "OMP_NUM_THREADS": "1"})
    done = subprocess.run([warm_python.torchrun(), "--nproc_per_node", "2", "--master_port", str(port), *command], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _saved(folder) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(folder) + ".pt"
    dcp_to_torch_save(os.path.join(folder, "step-00000004"), out)
    return torch.load(out, weights_only=False)


def _losses(folder) -> list:
    return _saved(folder)["meta"]["extra"]["losses"]


def test_whalelike_train_runs_the_example_job_like_train_py(tmp_path):
    (tmp_path / "byte_lm.py").write_text(BYTE_LM)
    (tmp_path / "two.yaml").write_text(_two_devices("two", (1.0, 3.0)))
    model, cluster = f"{tmp_path}/byte_lm.py:build", str(tmp_path / "two.yaml")
    done = _launch(["-m", "whalelike.cli", "train", JOB, "--train.steps", "4", "--model.factory", model,
                    "--cluster.spec", cluster, "--plan.global_batch_size", "8", "--plan.num_micro_batch", "1",
                    "--data.seq_len", "16", "--eval.every", "2", "--eval.batches", "1",
                    "--checkpoint.dir", str(tmp_path / "job"), "--metrics.dir", str(tmp_path / "metrics"),
                    "--export.dir", str(tmp_path / "export"), "--balance.policy", "off", "--train.timeout", "60"],
                   tmp_path)
    assert "whalelike train: " in done.stdout and "resolved:" in done.stdout and "eval step 4: loss" in done.stdout
    assert os.path.getsize(tmp_path / "metrics" / "steps.jsonl") > 0
    _launch([os.path.join(ROOT, "examples", "train.py"), model, "--steps", "4", "--cluster", cluster,
             "--global-batch", "8", "--data", TEXT, "--seq-len", "16", "--lr", "3e-3", "--optimizer", "AdamW",
             "--optimizer-args", '{"weight_decay": 0.01}', "--schedule", "cosine", "--warmup-steps", "3",
             "--clip-grad-norm", "1.0", "--checkpoint-dir", str(tmp_path / "script"), "--balance", "off",
             "--timeout", "60"], tmp_path)
    job, script = _losses(tmp_path / "job"), _losses(tmp_path / "script")
    assert len(job) == 4 and job == script, (job, script)
    # export.dir: the trained model as safetensors, equal to the last checkpoint's model state
    from safetensors.torch import load_file
    exported = {}
    for file in os.listdir(tmp_path / "export"):
        if file.endswith(".safetensors"):
            exported.update(load_file(tmp_path / "export" / file))
    final = {k[len("model/"):]: v for k, v in _saved(tmp_path / "job").items() if k.startswith("model/")}
    assert exported.keys() == final.keys() and exported, (sorted(exported), sorted(final))
    for name, value in final.items():
        assert torch.equal(exported[name], value), name
