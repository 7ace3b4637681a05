# The two commands of the README. Each creates (or reuses) .venv inside the repo and installs
# what it needs: torch first, pinned, so that pip takes the CPU wheel and never a CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
KERNEL_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' 2>/dev/null)

.PHONY: demo test install

$(STAMP): setup.py $(KERNEL_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# A tiny Apertus model trained on real text (the Python reference topics that ship with Python)
# with the real 131072-token tekken tokenizer, on CPU, then validated on held-out documents.
demo: $(STAMP)
	$(PY) pretrain_gpt.py --model-preset tiny --train-iters 150 --global-batch-size 8 \
		--micro-batch-size 4 --lr 3e-3 --log-interval 10 --eval-interval 50 --eval-iters 4 \
		--save runs/demo --log-json runs/demo/history.json

test: $(STAMP)
	$(PY) -m pytest -q
