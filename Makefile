# The two commands of the README. Each creates (or reuses) .venv inside the repo and installs
# what it needs: torch first, pinned, so that pip takes the CPU wheel and never a CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
KERNEL_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' 2>/dev/null)

.PHONY: demo quant-demo test test-fast install

$(STAMP): setup.py $(KERNEL_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
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
	$(PY) -m pytest -q --durations=25

# The unit tests that start no process (no subprocess, torchrun or Slurm): tests/conftest.py
# marks the others "process". For daily work; CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu and not process" --durations=10
