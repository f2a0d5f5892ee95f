# All set-up lives here so a fresh clone needs nothing but Python 3.10+.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo demo-balance test setup clean gpu-check

# The main job: measure the built-in emulated unequal 4-device cluster on Whale's flagship hybrid
# (replicate conv + split 20k-class classifier), plan the model from the measurements, then train it
# with torchrun next to the naive plan. The profile's cache is out/profiles (remove out/ to measure afresh).
DEMO_MODEL   ?= examples/hybrid_classifier.py:build
DEMO_CLUSTER ?= emulated-4
DEMO_ARGS    ?= --global-batch 64 --micro-batches 4

demo: $(STAMP)
	mkdir -p out
	$(BIN)/torchrun --nproc_per_node 4 -m whalelike.cli profile $(DEMO_MODEL) --cluster $(DEMO_CLUSTER) \
	    --max-batch 16 --cache-dir out/profiles -o out/profile.yaml
	$(BIN)/whalelike plan $(DEMO_MODEL) --cluster $(DEMO_CLUSTER) $(DEMO_ARGS) --profile out/profile.yaml \
	    -o out/plan.yaml --timeline out/plan.png
	$(BIN)/torchrun --nproc_per_node 4 examples/train.py $(DEMO_MODEL) --plan out/plan.yaml --profile out/profile.yaml \
	    --steps 30 --compare-naive

# Dynamic balancing: the same model on a cluster whose rank 1 slows threefold for steps 5-14; the
# runtime re-plans around it and back, prints each event and draws out/run.png (+ out/run.json).
demo-balance: $(STAMP)
	mkdir -p out
	$(BIN)/whalelike plan $(DEMO_MODEL) --cluster examples/clusters/emulated-straggler.yaml --global-batch 64 --micro-batches 4 -o out/plan-straggler.yaml
	$(BIN)/torchrun --nproc_per_node 4 examples/train.py $(DEMO_MODEL) --plan out/plan-straggler.yaml --cluster examples/clusters/emulated-straggler.yaml --steps 24 --run-timeline out/run.png

# On a machine with one CUDA GPU and a CUDA build of torch (not this venv's CPU build), under 5 minutes,
# nothing downloaded (bench/gpu_check.py): matrix rates per dtype; the training recipe on the device
# (precisions, clipping, schedule, recompute) against plain PyTorch, measured against predicted memory;
# the suite's tests one GPU can run (pytest, CUDA visible); `whalelike profile` of the examples on the
# GPU (largest batch by a real out-of-memory error, speed curves in GPU_CHECK_OUT); predicted against
# measured step time from the profile, compute segments timed by CUDA events; then each optimizer's update
# against the passes the planner counts at the data sheet's memory bandwidth (bench/update_rate.py). GPU_PY: that torch's
# python, with the project's dependencies and its dev extra (pytest, hypothesis, transformers).
GPU_PY ?= python3
GPU_CHECK_OUT ?= out/gpu-check
gpu-check:
	PYTHONPATH=. $(GPU_PY) -m torch.distributed.run --nproc_per_node 1 bench/gpu_check.py --out $(GPU_CHECK_OUT)
	PYTHONPATH=. $(GPU_PY) bench/update_rate.py --device cuda

# Bytecode is cached even where the environment says PYTHONDONTWRITEBYTECODE: the suite starts about a
# hundred cold Python processes (torchrun workers, CLIs), each of which would compile the library again.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest

setup: $(STAMP)

# torch is pinned to the CPU build that ships on this machine's disk: a bare `torch` would pull CUDA
# (one resolution for torch and the project's dependencies).
# Installer: where that wheel lies in one of pip's find-links folders (pip's configuration or
# PIP_FIND_LINKS), uv installs it and the dependencies: it unpacks in parallel, about 20 s where
# pip takes about 55 (uv does not read pip's configuration, so it is given the wheel's path).
# Elsewhere, or if uv cannot be installed or fails, pip does it all.
# Bytecode: pip would compile all ~10,000 modules of torch and transformers, two thirds of the set-up's
# time, for the few hundred any process here imports; so the packages install uncompiled and
# tests/precompile.py imports what the suite's and the demo's processes start with, which writes
# their bytecode. The project's own is compiled in full (an editable install is not compiled):
# otherwise the first processes to import it (make test's three pytest workers, starting together)
# each compile all of it.
TORCH_VERSION  = 2.13.0
FIND_LINKS     = $(subst file://,,$(PIP_FIND_LINKS) $(shell $(PY) -m pip config get global.find-links 2>/dev/null))
TORCH_WHEEL    = $(firstword $(wildcard $(addsuffix /torch-$(TORCH_VERSION)+cpu-*.whl,$(FIND_LINKS))))
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	if [ -n "$(TORCH_WHEEL)" ] && $(BIN)/pip install -q --disable-pip-version-check uv && \
	   $(BIN)/uv pip install -q --no-cache --python $(BIN)/python '$(TORCH_WHEEL)' -e '.[dev]'; then :; else \
	   $(BIN)/pip install -q --no-compile --disable-pip-version-check torch==$(TORCH_VERSION) -e '.[dev]'; fi
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python tests/precompile.py
	$(BIN)/python -m compileall -q -j 0 whalelike planner runtime examples bench tests
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
