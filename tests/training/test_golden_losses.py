"""A tiny pretraining run's losses, end to end, against a curve checked in beside this file.

Catches silent numerical drift anywhere between the command line and the loss: tokenizer, data
order, initialisation, the model, the fused loss, the optimizer and the schedule. On a CPU with
the instruction set the curve was recorded on (``cpu_capability``), the losses must be equal bit
for bit: the run is deterministic and single-threaded. On another one, to a relative 1e-5: MKL
picks its GEMM kernels by instruction set, so fp32 sums round differently in the last bits, and
ten steps keep such differences near 1e-6; a change of the recipe's numerics moves them by more.
The default data is the running interpreter's documentation, so each Python version has its own
curve.

Regenerate (a deliberate change of the numerics only) with, under each Python version::

    python -m tests.training.test_golden_losses
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from tests.conftest import PRETRAIN, read_json, run_entry, series

GOLDEN = Path(__file__).with_name("golden_tiny_losses.json")
ARGS = [
    "--model-preset",
    "tiny",
    "--train-iters",
    "10",
    "--global-batch-size",
    "8",
    "--log-interval",
    "1",
    "--precision",
    "fp32",
    "--device",
    "cpu",
]
RELATIVE = 1e-5
PYTHON = ".".join(platform.python_version_tuple()[:2])
"""The curve's key: the embedded corpus is this Python's documentation."""


def run_curve(log: Path) -> dict[str, list[list[float]]]:
    """The run's training and validation losses as ``{name: [[iteration, value], ...]}``."""
    run_entry(PRETRAIN, [*ARGS, "--log-json", str(log)])
    history = read_json(log)
    return {
        name: [list(p) for p in zip(*series(history, name))]
        for name in ("train/loss", "valid/loss")
    }


@pytest.mark.smoke
def test_tiny_run_reproduces_the_golden_curve(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS, "the golden curve belongs to other flags: regenerate it"
    if PYTHON not in golden["curves"]:
        pytest.skip(
            f"no golden curve for Python {PYTHON}: record one with "
            "`python -m tests.training.test_golden_losses`"
        )
    curves = run_curve(tmp_path / "log.jsonl")
    same_cpu = golden["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for name, want in golden["curves"][PYTHON].items():
        got = curves[name]
        assert [i for i, _ in got] == [i for i, _ in want], name
        for (it, a), (_, b) in zip(got, want):
            if same_cpu:
                assert a == b, f"{name} at iteration {it}: {a!r}, golden {b!r}"
            else:
                assert abs(a - b) <= RELATIVE * abs(b), f"{name} at iteration {it}: {a}, {b}"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        curves = run_curve(Path(tmp) / "log.jsonl")
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"curves": {}}
    if recorded.get("args") != ARGS:
        recorded["curves"] = {}  # other flags: the other Pythons' curves are stale too
    GOLDEN.write_text(
        json.dumps(
            {
                "args": ARGS,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "curves": {**recorded["curves"], PYTHON: curves},
            },
            sort_keys=True,
        )
        + "\n"
    )
    print(f"wrote {GOLDEN}")
