"""--check-weight-hash-across-dp-replicas-interval and --log-num-zeros-in-grad, Megatron-LM's
flags, on real data-parallel runs: the check passes on a DP=2 run without changing its losses,
and stops, naming the rank, two replicas one ulp apart (a real 2-process gloo world); the count
of zero gradients reaches the iteration line and TensorBoard."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, read_json, run_entry, run_script, series

WORKER = Path(__file__).with_name("replica_worker.py")
BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 1 --eval-iters 1 "
    "--log-interval 1 --lr 3e-3 --seed 5 --train-iters 2"
).split() + SMALL_VOCABULARY
FLAGS = ["--check-weight-hash-across-dp-replicas-interval", "1", "--log-num-zeros-in-grad"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DP=2 runs with both flags (and TensorBoard) and without them: (output, history) each,
    the flagged run's TensorBoard folder."""
    root = tmp_path_factory.mktemp("replicas")
    done = {}
    for name, flags in (
        ("checked", FLAGS + ["--tensorboard-dir", str(root / "tb")]),
        ("plain", []),
    ):
        log = root / f"{name}.json"
        proc = run_entry(PRETRAIN, BASE + flags + ["--log-json", str(log)], nproc=2)
        done[name] = (proc.stdout + proc.stderr, read_json(log))
    return done, root / "tb"


def test_identical_replicas_pass_and_the_losses_are_unchanged(runs):
    """Checked before the first step and after each (interval 1), as Megatron-LM says it."""
    done, _ = runs
    output, history = done["checked"]
    for iteration in (0, 1, 2):
        assert f">>> Weight hashes match after {iteration} iterations..." in output
    assert ">>> Weight hashes match" not in done["plain"][0]
    assert series(history, "train/loss") == series(done["plain"][1], "train/loss")


def test_zero_gradients_are_counted_in_the_line_and_tensorboard(runs):
    done, folder = runs
    output, history = done["checked"]
    lines = [line for line in output.splitlines() if "| consumed samples:" in line]
    assert len(lines) == 2 and all("| grad norm: " in line for line in lines)
    assert all("| num zeros: " in line for line in lines)
    assert "num zeros" not in done["plain"][0], "only with the flag"
    events = EventAccumulator(str(folder)).Reload()
    zeros = [(e.step, e.value) for e in events.Scalars("num-zeros")]
    assert [step for step, _ in zeros] == [1, 2]
    assert [e.step for e in events.Scalars("num-zeros vs samples")] == [4, 8]
    parameters = pretrain_gpt.parse_args(BASE).model.num_parameters()
    for (_, value), line in zip(zeros, lines):
        assert 0 <= value <= parameters
        assert f"| num zeros: {value:.1f} |" in line
    assert series(history, "train/num_zeros_in_grad") == ([1, 2], [value for _, value in zeros])


def test_a_replica_one_ulp_off_stops_naming_its_rank():
    """Two ranks with the same weights pass; once rank 1 moves one entry by one ulp, both stop
    with the one line naming rank 1 and the parameter (:func:`megatron.apertus.cli.run`'s exit 2),
    no traceback."""
    proc = run_script(
        WORKER, ["--perturb-rank", "1"], nproc=2, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ">>> Weight hashes match after 1 iterations..." in output
    line = (
        "replica_worker.py: error: the weights of the data-parallel replicas (ranks 0, 1) "
        "differ at iteration 2 (they matched at iteration 1): rank 1 in chunk0.1.weight; "
        "silent data corruption on those ranks' devices or links "
        "(--check-weight-hash-across-dp-replicas-interval)"
    )
    assert line in output, output[-4000:]
    assert "Traceback" not in output and "ReplicasDiverged" not in output
