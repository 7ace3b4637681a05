"""On a GPU with Transformer Engine: CUDA graphs (``--cuda-graph-impl``) are really captured and
replayed, and train as the same run without them does: the same losses step by step within
bf16's rounding, the same validation loss, and graphs held by every layer afterwards (none
without the flags: the negative control).

Each run is a process of its own: megatron-core keeps its graph record, memory pool and CUDA
stream per process. Skipped (reported, never passed) without CUDA or without TE.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron.apertus.model.engine import transformer_engine_error
from tests.conftest import PRETRAIN, REPO, run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and transformer_engine_error() is not None,
        reason=f"needs Transformer Engine ({transformer_engine_error()})",
    ),
]

STEPS = 6
LAYERS = 4
"""The tiny preset's layers: each holds its own graph (one micro-batch is captured without
pipeline parallelism)."""
BF16_RTOL = 1e-2
"""Graphs replay the same kernels on the same inputs, but megatron-core's capture warms each
graph up and TE picks its kernels afresh: the tolerance is bf16's (a few units of its 2^-8
precision), not bitwise."""
TRAIN = """
import json, os, sys
import torch
from megatron.apertus.model.cuda_graphs import captured_graphs
from megatron.apertus.training.loop import Trainer
from pretrain_gpt import parse_args

trainer = Trainer(parse_args(sys.argv[2:]))
losses = [trainer.step().loss for _ in range(int(sys.argv[1]))]
valid = trainer.validator.evaluate(trainer.state.iteration)[0]
torch.cuda.synchronize()
result = {"losses": losses, "valid": valid, "graphs": captured_graphs(trainer.model),
          "counted": trainer.graphs.count}
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
"""
BASE = [
    "--model-preset",
    "tiny",
    "--device",
    "cuda",
    "--precision",
    "bf16",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(STEPS),
    "--lr",
    "1e-3",
    "--eval-iters",
    "1",
    "--log-interval",
    "1000",
    "--use-distributed-optimizer",
]
TE = ["--transformer-impl", "transformer_engine"]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
CASES = {
    "local-our-layers": (
        ["--transformer-impl", "local"],
        ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"],
    ),
    "local-te-layers": (
        [*TE, "--no-gradient-accumulation-fusion"],
        ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "1"],
    ),
    "te-whole-layers": (
        TE,
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-warmup-steps", "1"],
    ),
    "te-mlp-packed": (
        [*TE, *PACKED],
        [
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-scope",
            "mlp",
            "--cuda-graph-warmup-steps",
            "2",
        ],
    ),
}


def train(argv: list[str]) -> dict:
    """Losses of ``STEPS`` steps, the validation loss after them, and the graphs the layers
    hold, from a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN, str(STEPS), *BASE, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("case", list(CASES))
def test_graphs_are_captured_and_train_as_eager_runs_do(case):
    layers, graphs = CASES[case]
    eager, graphed = train(layers), train([*layers, *graphs])

    assert eager["graphs"] == 0 and eager["counted"] == 0
    assert graphed["graphs"] >= LAYERS and graphed["counted"] == graphed["graphs"]
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=BF16_RTOL)
    assert graphed["valid"] == pytest.approx(eager["valid"], rel=BF16_RTOL)
    assert graphed["losses"][-1] < graphed["losses"][0]  # it trained


def test_graphs_are_captured_when_the_capture_iteration_is_skipped():
    """--iterations-to-skip at the iteration the capture comes before (warm-up 1: iteration 2):
    the graphs are still captured, as in Megatron-LM, and the later steps replay them."""
    graphs = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-warmup-steps", "1"]
    argv = [*BASE, *TE, *graphs, "--iterations-to-skip", "2"]
    proc = run_script(PRETRAIN, argv, python=sys.executable)  # a fresh process, not forked
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "iteration 2: skipped (--iterations-to-skip)" in proc.stdout
    assert "CUDA graphs (transformer_engine): " in proc.stdout
