# The two commands of the README. Each creates (or reuses) .venv inside the repo and installs
# what it needs, torch first and pinned. From PyPI, torch==2.13.0 is the CUDA build with its
# NVIDIA libraries (about 2.6 GB to download; it runs on CPU too); TORCH_INDEX_URL takes it from
# another index instead, e.g. PyTorch's CPU wheels on a machine without a GPU (about 200 MB):
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# (A machine that keeps a local torch wheel for pip, as a wheelhouse or pip's own configuration
# provides, gets that one either way.)
# The default line: Python 3.11 (python3), megatron-core 0.16.x; `make smoke` checks the other.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX_URL ?=
# pytest-xdist workers of make test and make test-fast: a test that starts one process
# (OMP_NUM_THREADS=1) keeps one core busy, so two workers keep two cores busy. A worker that
# crashes is not replaced: its test fails and the run ends with the other worker's tests
# (a replacement reruns the crashed file from its start, crash included, up to 8 times).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0
STAMP := $(VENV)/.installed
KERNEL_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' 2>/dev/null)

.PHONY: demo quant-demo test test-fast install smoke smoke-install format format-check

$(STAMP): setup.py $(KERNEL_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	$(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The whole pretraining path on the embedded default (examples/demo.py): preprocess real text
# with the 131072-token tekken tokenizer, train a tiny Apertus model with Goldfish, AdEMAMix and
# WSD on CPU, stop half way, resume, validate on held-out documents, plot the losses.
demo: $(STAMP)
	$(PY) examples/demo.py --out runs/demo

# Quantization of the demo's teacher (examples/quant_demo.py): RTN, GPTQ, QAD and GPTQ then QAD
# for INT4, INT3, FP8 and NVFP4, with and without norm fusion, and RTN after weight averaging.
# Runs `demo` first if runs/demo has no teacher.
quant-demo: $(STAMP)
	$(PY) examples/quant_demo.py --demo runs/demo --out runs/quant-demo

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25

# black and isort format the code (settings in pyproject.toml); CI runs format-check before
# the tests.
format: $(STAMP)
	$(PY) -m isort -q .
	$(PY) -m black -q .

format-check: $(STAMP)
	$(PY) -m black --check -q .
	$(PY) -m isort --check-only -q .

# The unit tests that start no process (no subprocess, torchrun or Slurm): tests/conftest.py
# marks the others "process". For daily work; CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not gpu and not process" --durations=10

# The second supported line (docs/install.md): Python 3.12 with megatron-core 0.19.x in .venv312
# (torch from PyPI, its default CUDA build, which runs on CPU), then its smoke tier (tests marked
# `smoke`: the compatibility layer, train and exact resume on 1 process, TP=2 and PP=2, CP=2 p2p
# and hierarchical CP=4 against one process, the launch arrays and the planner, the Hugging Face
# export).
SMOKE_VENV ?= .venv312
SMOKE_PYTHON ?= $(shell PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || command -v python3.12)

smoke-install:
	$(MAKE) install VENV=$(SMOKE_VENV) PYTHON="$(SMOKE_PYTHON)"

smoke: smoke-install
	$(SMOKE_VENV)/bin/python -m pytest -q -m smoke --durations=10
