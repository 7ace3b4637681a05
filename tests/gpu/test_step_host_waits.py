"""On a GPU: a training step makes the host wait for the device a fixed number of times (the
step's loss, finiteness and gradient norm), not once or more per micro-batch; each wait lets the
GPU's queue run dry while Python queues the next kernels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROFILED_STEP = """
import json, sys
import torch
from megatron.apertus.training.loop import Trainer
from pretrain_gpt import parse_args

trainer = Trainer(parse_args(sys.argv[1:]))
for _ in range(2):
    trainer.step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    trainer.step()
    torch.cuda.synchronize()
waits = {e.key: e.count for e in prof.key_averages() if e.key == "cudaStreamSynchronize"}
print("WAITS " + json.dumps(waits))
"""


def host_waits_of_a_step(micro_batches: int) -> int:
    """``cudaStreamSynchronize`` calls in one step of the tiny model, packed documents."""
    argv = [
        "--model-preset",
        "tiny",
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--transformer-impl",
        "local",
        "--seq-length",
        "256",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(micro_batches),
        "--train-iters",
        "3",
        "--reset-attention-mask",
        "--reset-position-ids",
        "--eval-iters",
        "0",
        "--log-interval",
        "1000",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", PROFILED_STEP, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("WAITS "))
    return json.loads(line[len("WAITS ") :]).get("cudaStreamSynchronize", 0)


def test_host_waits_do_not_grow_with_micro_batches():
    two, eight = host_waits_of_a_step(2), host_waits_of_a_step(8)
    assert eight == two, (two, eight)
