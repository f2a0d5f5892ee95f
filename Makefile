# All set-up lives here so a fresh clone needs nothing but Python 3.10+.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test setup clean

# The main job: plan the flagship example onto the built-in emulated 4-device cluster and train it.
demo: $(STAMP)
	$(BIN)/python examples/main_job.py

test: $(STAMP)
	$(BIN)/python -m pytest

setup: $(STAMP)

# torch is pinned to the CPU build that ships on this machine's disk: a bare `torch` would pull CUDA.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
