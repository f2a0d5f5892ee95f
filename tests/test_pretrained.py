"""Hugging Face checkpoints in and out (:mod:`runtime.state.pretrained`), on uneven plans.

Nothing is downloaded: each model is built in code from a small config (seed 0) and written with
``transformers``' own ``save_pretrained`` in the test process. One 4-rank gloo spawn runs three
plans of one captured GPT-2 (tied embeddings, fused q|k|v; two blocks: the first under ``split``,
the second under ``replicate``), planned by ``planner.plan`` onto ``emulated-4`` (speeds 1, 1, 0.5,
0.25; emulation off): two pipeline stages, the first tensor-parallel on the 0.5 and 0.25 devices
(heads 3:1, MLP features 88:40, each rank's q, k and v columns three ranges of the fused weight),
the second data-parallel on the two full-speed devices (the tie spans the stages). The second
stage is kept by DDP (``pipeline-split``), by ZeRO 3 on FSDP2 (``zero3``), and by ragged ZeRO 3
holding 75% and 25% of every parameter's rows (``ragged``). One capture serves the three plans (a
capture of a ``transformers`` model costs about ten seconds of CPU per rank; the planner's and the
Engine's captures hit whalelike's capture cache), and a warm-up captures the model once for all ranks
before they fork (``run_ranks(warm=)``), built in memory and on the meta device, with the fake node
values its pipelines' first steps read (two fake runs of the whole graph).

For each, an Engine is built from *other* initial weights (seed 1) and ``load_pretrained`` reads the
directory: the full state dict equals the saved model's exactly, and each rank read exactly the
bytes of what it holds (``LoadReport.bytes_read`` against its ``named_state()``), which follow the
plan's uneven shares. Then 2 AdamW steps, ``save_pretrained`` (small shards, so several files and an
index), and ``from_pretrained`` in the test process gives back ``engine.state_dict()``.

The same spawn saves two models no executor holds yet (every rank holds them whole), reverting
``transformers``' conversions as its ``save_pretrained`` does (OLMoE's stacked experts to one file
tensor per expert, DINOv2's two SwiGLU projections to one file tensor) into a directory whose
tokenizer is kept and whose stale shard is dropped; ``from_pretrained`` gives each back. In one
process (no capture): every region a ``Slab`` describes (rows, columns, fused ranges, a tied copy
``"<name>@<key>"``, experts of OLMoE's per-expert files, a range across its fused gate|up) read
from ``transformers``' files, a conversion read whole (DINOv2's fused SwiGLU input), and the
one-line errors of loading.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import planner
import whalelike as wl
from dist_utils import run_ranks
from planner.balance.state_moves import Slab
from reference import warm_capture
from runtime import Engine
from runtime.replicas.held_state import local
from runtime.state.pretrained import PretrainedError, load_pretrained, load_state, save_pretrained
from whalelike.cluster import Cluster

pytest.importorskip("transformers")  # a pinned test dependency (pyproject [dev]); never skipped in CI

VOCAB, SEQ, BATCH, STEPS = 64, 8, 8, 2
SHARD_BYTES = 24_000
# plan -> (Config keywords, the data-parallel stage's ragged fractions or None)
PLANS = {"pipeline-split": (dict(num_micro_batch=2), None),
         "zero3": (dict(num_micro_batch=2, zero_stage=3, ragged_shards=False), None),
         "ragged": (dict(num_micro_batch=2, zero_stage=3, ragged_shards=False), [0.75, 0.25])}
ON_META = ("pipeline-split", "zero3")     # these Engines get a model built on the meta device


def _cluster() -> Cluster:
    return Cluster.preset("emulated-4").without_emulation()


def gpt2(seed: int, layers: int = 2, annotate: bool = True, **overrides):
    """GPT-2 (tied embeddings, fused q|k|v ``c_attn``, ``Conv1D`` weights stored [in, out]); the
    first block under ``split``, the second under ``replicate``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = dict(n_embd=32, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=False,
                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(GPT2Config(**{**config, **overrides}))
    if annotate:
        wl.annotate(model, {"transformer.h.0": wl.split(), "transformer.h.1": wl.replicate()})
    return model


def olmoe(seed: int):
    from transformers import OlmoeConfig, OlmoeForCausalLM
    torch.manual_seed(seed)
    return OlmoeForCausalLM(OlmoeConfig(hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                                        num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=32,
                                        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                        experts_implementation="batched_mm"))


def dino(seed: int):
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(seed)
    return Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                    image_size=16, patch_size=8, use_swiglu_ffn=True))


def batches(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(STEPS)]


def lm_loss(out, targets):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_plan(name: str, graphs):
    options, fractions = PLANS[name]
    plan = planner.plan(graphs, _cluster(), wl.Config(global_batch_size=BATCH, **options))
    if fractions is not None:
        plan.stages[1] = dataclasses.replace(plan.stages[1], replica_sync="ragged", state_fractions=fractions)
    return plan


def _ranks(rank: int, world_size: int, source: str, out: str) -> dict:
    data = batches(2)
    graphs = wl.capture(gpt2(seed=1), data[0][0])     # the one capture: the Engines find it cached
    saved = gpt2(seed=0, annotate=False).state_dict()
    results = {}
    for name in PLANS:
        plan = make_plan(name, graphs)
        if name in ON_META:
            # built on the meta device: each rank gives storage only to what it holds and fills it from the
            # directory (Engine(weights=...)); set-up is measured
            with wl.empty_weights():
                model = gpt2(seed=1)
            engine = Engine(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01), loss_fn=lm_loss,
                            cluster=_cluster(), timeout_s=120, example_args=data[0][0], weights=source,
                            measure_memory=True)
            assert not any(p.is_meta for p in model.parameters()) or engine.empty is False
            report = engine.load_report
        else:
            engine = Engine(gpt2(seed=1), plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01), loss_fn=lm_loss,
                            cluster=_cluster(), timeout_s=120, example_args=data[0][0])   # other weights than saved
            report = load_pretrained(engine, source)
        state = engine.state_dict()
        assert state.keys() == saved.keys(), name
        for key, value in saved.items():
            assert torch.equal(state[key], value), f"{name}: {key} after load_pretrained"
        held = engine.executor.named_state()
        got = {"report": report, "plan": plan, "slabs": {n: s for n, (_, s) in held.items()},
               "held": sum(local(t).numel() * 4 for t, _ in held.values()),    # the files hold float32
               "setup_peak": engine.setup_peak_bytes,
               "buckets": _ddp_bucket_bytes(engine),
               "layer": max(layer.param_bytes for layer in graphs.layers)}
        got["losses"] = [float(engine.train_step(batch)) for batch in data]
        save_pretrained(engine, os.path.join(out, name), max_shard_bytes=SHARD_BYTES)
        final = engine.state_dict()
        if rank == 0:
            got["final"] = final
        results[name] = got
    results["alone"] = _save_alone(os.path.join(out, "alone"))
    return results


def _warm() -> None:
    """The ranks' captures, once before they fork (dist_utils' ``warm``): GPT-2 at their example batch,
    built in memory and on the meta device (a key of its own); every rank's is then a cache hit, and so
    are its pipelines' fake node values (``reference.warm_capture``)."""
    example = batches(2)[0][0]
    warm_capture(gpt2(seed=1), example)
    with wl.empty_weights():
        model = gpt2(seed=1)
    warm_capture(model, example)


def _ddp_bucket_bytes(engine) -> int:
    """The bytes of the gradient buckets DDP allocated on this rank (0 where no DDP runs)."""
    from runtime.replicas.ddp_sync import DDPSync
    return sum(p.numel() * p.element_size() for sync in engine.executor.syncs() if isinstance(sync, DDPSync)
               for p in sync.ddp.parameters() if p.requires_grad)


def _file_bytes(directory) -> int:
    """The bytes of every tensor in a directory's safetensors files (float32)."""
    from safetensors import safe_open
    total = 0
    for file in os.listdir(directory):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), "pt") as f:
                total += sum(torch.Size(f.get_slice(k).get_shape()).numel() * 4 for k in f.keys())
    return total


def test_each_rank_reads_its_uneven_pieces_and_any_plan_saves_what_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    source = tmp_path / "in"
    gpt2(seed=0, annotate=False).save_pretrained(source)
    total = _file_bytes(source)
    results = run_ranks(_ranks, 4, args=(str(source), str(tmp_path / "out")), init_process_group=False,
                        timeout_s=600, warm=_warm)
    initial = gpt2(seed=0, annotate=False).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(source)      # the single-process run from the same files
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    expected = []
    for inputs, targets in batches(2):
        optimizer.zero_grad()
        loss = lm_loss(reference(*inputs), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    for name in PLANS:
        got = [r[name] for r in results]
        for g in got:
            torch.testing.assert_close(g["losses"], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if name in ON_META:
            # built on meta: no rank's set-up ever held more than its share and one layer; a DDP rank's share
            # includes the gradient buckets DDP allocates at construction (its gradients, held from then on)
            for rank, g in enumerate(got):
                share = g["held"] + g["buckets"]
                assert g["setup_peak"] is not None and 0 < g["setup_peak"] <= share + g["layer"], \
                    (name, rank, g["setup_peak"], g["held"], g["buckets"], g["layer"])
        # each rank read exactly what it holds, in slices, never the whole model
        assert [g["report"].bytes_read for g in got] == [g["held"] for g in got], name
        assert all(g["report"].read_whole == () and g["report"].bytes_read < total for g in got), name
        # from_pretrained gives back engine.state_dict() after training
        out = tmp_path / "out" / name
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and (out / "config.json").is_file(), name
        assert "lm_head.weight" not in index["weight_map"], "a tie is saved once, under the name transformers keeps"
        back = AutoModelForCausalLM.from_pretrained(out).state_dict()
        final = got[0]["final"]
        assert back.keys() == final.keys(), name
        for key, value in final.items():
            assert torch.equal(back[key], value), f"{name}: {key} from_pretrained after save_pretrained"
        assert not torch.equal(final["transformer.h.0.attn.c_attn.weight"],
                               initial["transformer.h.0.attn.c_attn.weight"]), f"{name}: training changed nothing"

    # the plan: stage 0 tensor-parallel on ranks 2 and 3 (heads 3:1, MLP features 88:40), stage 1
    # data-parallel on ranks 0 and 1
    plan = results[0]["pipeline-split"]["plan"]
    assert [sorted(w.rank for w in plan.stage_workers(s.index)) for s in plan.stages] == [[2, 3], [0, 1]]
    assert plan.stages[0].shard_sizes["transformer.h.0.attn.c_attn"] == [72, 24]
    assert plan.stages[0].shard_sizes["transformer.h.0.mlp.c_fc"] == [88, 40]
    qkv = "transformer.h.0.attn.c_attn.weight"          # fused q|k|v, [in, out]: three ranges each
    assert [(results[r]["pipeline-split"]["slabs"][qkv].dim, results[r]["pipeline-split"]["slabs"][qkv].ranges)
            for r in (2, 3)] == [(1, ((0, 24), (32, 56), (64, 88))), (1, ((24, 32), (56, 64), (88, 96)))]
    mine = lambda r, name: sum(v.numel() * 4 for k, v in initial.items()     # noqa: E731
                               if k in results[r][name]["slabs"] and results[r][name]["slabs"][k].whole)
    for name in PLANS:
        read = [r[name]["report"].bytes_read for r in results]
        # stage 0: what both hold whole read by both, every sliced tensor read once between them, unevenly
        sliced = sum(initial[k].numel() * 4 for k, s in results[2][name]["slabs"].items() if not s.whole)
        slices = [read[r] - mine(r, name) for r in (2, 3)]
        assert slices[0] + slices[1] == sliced and slices[0] > 2 * slices[1] > 0, (name, read)
        assert all(n.split(".")[1] in ("wte", "wpe") or n.startswith("transformer.h.0.")
                   for r in (2, 3) for n in results[r][name]["slabs"]), name
        assert not any(n.startswith("transformer.h.0.") for r in (0, 1) for n in results[r][name]["slabs"]), name
    # stage 1: DDP's ranks each read the whole stage; ZeRO's ranks read its rows once between them,
    # FSDP2 evenly, ragged 3:1 (the tie, kept whole under ZeRO, by both)
    ddp = [r["pipeline-split"]["report"].bytes_read for r in results[:2]]
    assert ddp[0] == ddp[1] == mine(0, "pipeline-split")
    for name, ratio in (("zero3", 1), ("ragged", 3)):
        read = [r[name]["report"].bytes_read for r in results[:2]]
        rows = [read[r] - mine(r, name) for r in (0, 1)]
        assert rows[0] == ratio * rows[1] > 0 and mine(0, name) == mine(1, name), (name, read)
        assert sum(rows) + mine(0, name) == ddp[0], (name, read, ddp)

    _check_saved_alone(tmp_path / "out" / "alone", results[0]["alone"])


# -- in one process ------------------------------------------------------------------------------
def _sliced(full: torch.Tensor, slab: Slab) -> torch.Tensor:
    if slab.whole:
        return full
    return torch.cat([full.narrow(slab.dim, a, b - a) for a, b in slab.ranges], slab.dim)


def _load_regions(model, saved: dict, directory, slabs: dict):
    """Load the regions ``slabs`` into fresh ``torch.empty`` tensors; each equals the saved tensor's region."""
    held = {name: (torch.empty(slab.local_shape), slab) for name, slab in slabs.items()}
    report = load_state(model, held, directory)
    for name, (tensor, slab) in held.items():
        assert torch.equal(tensor, _sliced(saved[name.split("@")[0]], slab)), name
    return report


def test_every_held_region_is_read_from_transformers_files(tmp_path):
    src = gpt2(seed=0, annotate=False)
    src.save_pretrained(tmp_path / "gpt2")
    report = _load_regions(gpt2(seed=1, annotate=False), src.state_dict(), tmp_path / "gpt2", {
        "transformer.wte.weight": Slab((VOCAB, 32)),
        "transformer.wte.weight@lm_head.weight": Slab((VOCAB, 32), 0, ((10, 20), (40, 45))),    # a tie saved once
        "lm_head.weight": Slab((VOCAB, 32), 1, ((3, 9),)),
        "transformer.h.0.attn.c_attn.weight": Slab((32, 96), 1, ((0, 8), (32, 40), (64, 72))),  # fused q|k|v
        "transformer.h.1.attn.c_proj.weight": Slab((32, 32), 0, ((5, 17),)),     # row-parallel ([in, out])
        "transformer.ln_f.weight": Slab((32,))})
    assert report.bytes_read == 4 * (VOCAB * 32 + 15 * 32 + VOCAB * 6 + 32 * 24 + 12 * 32 + 32)
    assert (report.tensors, report.slices, report.read_whole) == (6, 9, ())

    src = olmoe(seed=0)
    src.save_pretrained(tmp_path / "olmoe")          # one file tensor per expert and projection
    keys = json.loads((tmp_path / "olmoe" / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tmp_path / "olmoe" / "model.safetensors.index.json").exists() else None
    assert keys is None or "model.layers.1.mlp.experts.3.up_proj.weight" in keys
    report = _load_regions(olmoe(seed=1), src.state_dict(), tmp_path / "olmoe", {
        "model.layers.1.mlp.experts.gate_up_proj": Slab((8, 48, 32), 0, ((3, 6),)),           # experts 3-5
        "model.layers.0.mlp.experts.gate_up_proj": Slab((8, 48, 32), 1, ((20, 30), (0, 2))),   # across gate|up
        "model.layers.0.mlp.experts.down_proj": Slab((8, 32, 24), 2, ((5, 9),))})
    assert report.bytes_read == 4 * (3 * 48 * 32 + 8 * 12 * 32 + 8 * 32 * 4)
    assert report.slices == 3 * 2 + 8 * 2 + 8 + 8     # experts 3-5 only; both parts of 20-30, one of 0-2; down

    src = dino(seed=0)
    src.save_pretrained(tmp_path / "dino")           # gate and up fused in one file tensor: read whole
    saved = src.state_dict()
    slabs = {k: Slab(tuple(v.shape)) for k, v in saved.items()}
    gate = "encoder.layer.0.mlp.gate_proj.weight"
    slabs[gate] = Slab(tuple(saved[gate].shape), 0, ((2, 5), (9, 11)))
    report = _load_regions(dino(seed=1), saved, tmp_path / "dino", slabs)
    assert set(report.read_whole) == {f"encoder.layer.0.mlp.{p}_proj.{w}" for p in ("gate", "up")
                                      for w in ("weight", "bias")}


def _save_alone(root: str) -> dict:
    """save_pretrained of models no executor holds yet (every rank holds them whole): OLMoE (its
    stacked experts written one tensor per expert) and DINOv2 (two projections written as one
    tensor) into a directory that holds a tokenizer and a stale shard of an earlier save; then
    two targets it cannot write."""
    out = {}
    directory = os.path.join(root, "dino")
    if dist.get_rank() == 0:
        os.makedirs(directory)
        with open(os.path.join(directory, "tokenizer.json"), "w") as f:
            f.write("{}")
        with open(os.path.join(directory, "model-00001-of-00009.safetensors"), "w") as f:
            f.write("a stale shard of an earlier save")
    dist.barrier()
    for name, model in (("olmoe", olmoe(seed=0)), ("dino", dino(seed=0))):
        engine = types.SimpleNamespace(model=model, slot=types.SimpleNamespace(built=False),
                                       device=torch.device("cpu"),
                                       runtime=types.SimpleNamespace(collective=lambda fn: fn()))
        save_pretrained(engine, os.path.join(root, name), max_shard_bytes=SHARD_BYTES)
        out[name] = model.state_dict()
    errors = []
    for bad in (os.path.join(directory, "config.json"), os.path.join(directory, "config.json", "x")):
        with pytest.raises(PretrainedError) as e:
            save_pretrained(engine, bad)
        errors.append(str(e.value))
    return {"states": out, "errors": errors}


def _check_saved_alone(root, result: dict) -> None:
    from safetensors import safe_open
    from transformers import Dinov2Model, OlmoeForCausalLM

    assert (root / "dino" / "tokenizer.json").read_text() == "{}"        # carried over
    for name, cls, converted, model_only in (
            ("olmoe", OlmoeForCausalLM, "model.layers.0.mlp.experts.7.gate_proj.weight", "experts.gate_up_proj"),
            ("dino", Dinov2Model, "encoder.layer.0.mlp.weights_in.weight", "gate_proj")):
        out = root / name
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert converted in weight_map and not any(model_only in k for k in weight_map), name   # original format
        assert {f for f in os.listdir(out) if f.endswith(".safetensors")} == set(weight_map.values()), name
        with safe_open(str(out / weight_map[converted]), "pt") as f:
            assert f.metadata() == {"format": "pt"}
        back = cls.from_pretrained(out).state_dict()
        for key, value in result["states"][name].items():
            assert torch.equal(back[key], value), f"{name}: {key}"
    assert not [p for p in os.listdir(root) if p.startswith(".")], "no temporary directory left"
    a_file, under_a_file = result["errors"]
    assert "is a file; name a directory" in a_file and "\n" not in a_file
    assert "cannot create its parent" in under_a_file and "\n" not in under_a_file


def test_load_errors_are_one_line(tmp_path):
    model = gpt2(seed=0, annotate=False)
    (tmp_path / "config.json").write_text("{}")
    for bad, match in ((tmp_path / "nowhere", r"no such directory"),
                       (tmp_path / "config.json", r"is a file, not a directory"),
                       (tmp_path, r"no model.safetensors or model.safetensors.index.json in it")):
        with pytest.raises(PretrainedError, match=match) as e:
            load_state(model, {}, bad)
        assert "\n" not in str(e.value)
    gpt2(seed=0, annotate=False, layers=1).save_pretrained(tmp_path / "shallower")
    with pytest.raises(PretrainedError, match=r"lacks 12 of this model's 29 tensors: transformer\.h\.1\.") as e:
        load_state(model, {}, tmp_path / "shallower")
    assert str(tmp_path / "shallower") in str(e.value)
    gpt2(seed=0, annotate=False, n_inner=64).save_pretrained(tmp_path / "narrower")
    with pytest.raises(PretrainedError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight \(32, 64\) there, "
                                              r"\(32, 128\) in the model"):
        load_state(model, {}, tmp_path / "narrower")
