"""On a GPU: ``--profile --use-pytorch-profiler`` traces the device's kernels of the profiled
iteration, and ``--record-memory-history`` writes an allocator snapshot holding the run's
allocations. Skipped (reported, never passed) without CUDA."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from tests.conftest import PRETRAIN, SMALL_VOCABULARY, run_entry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_profiled_run_traces_kernels_and_snapshots_memory(tmp_path):
    board, snapshot = tmp_path / "tb", tmp_path / "snapshot.pickle"
    flags = (
        "--device cuda --precision bf16 --model-preset tiny --train-iters 3 "
        "--global-batch-size 4 --micro-batch-size 2 --eval-iters 1 --log-interval 1 "
        "--profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 3 "
        f"--tensorboard-dir {board} --record-memory-history --memory-snapshot-path {snapshot}"
    )
    run_entry(PRETRAIN, flags.split() + SMALL_VOCABULARY)
    (trace,) = board.glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {str(event.get("name")) for event in events}
    assert {name for name in names if name.startswith("ProfilerStep#")} == {"ProfilerStep#2"}
    assert any(event.get("cat") == "kernel" for event in events)
    with open(snapshot, "rb") as handle:
        state = pickle.load(handle)
    assert state["segments"]
    actions = {event["action"] for trace in state["device_traces"] for event in trace}
    assert "alloc" in actions
    assert not list(tmp_path.glob("*.tmp.pickle"))
