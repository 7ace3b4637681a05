"""TP=2, PP=2 (also interleaved), DP=2 (also with the distributed optimizer), with and without
overlapped communication, on 2 CPU processes reproduce the single-process losses of 3 optimizer
steps from the same initial checkpoint, on the 4096-piece test vocabulary.

Tolerances (fp32): relative 2e-6 on every training and validation loss; relative 1e-4 on the
gradient norm. Splitting a matmul over TP ranks or a batch over DP ranks changes the order of
floating-point sums, so bitwise equality is not promised (the losses happen to be bitwise
equal on this machine). megatron-core accumulates the squared gradient norm in fp32 over
all the model's elements, and the TP partition of that sum alone moves it by ~1e-5 relative. Adam
then amplifies such differences step by step: with eps=1e-8 it is a sign update on gradients
near 1e-9, so the third step's norm drifts by ~5e-4; the test uses eps=1e-4 (drift ~1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import PRETRAIN, SMALL_VOCABULARY, read_json, run_entry, series

COMMON = [
    "--model-preset",
    "tiny",
    "--seed",
    "7",
    "--lr",
    "3e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "1",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--adam-eps",
    "1e-4",
    *SMALL_VOCABULARY,
]
RTOL = 2e-6
OVERLAP_BUCKET = 40_000
"""Gradient elements per bucket with overlap: the tiny model's chunks split into several."""
GRAD_NORM_RTOL = 5e-4

LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2-interleaved": [
        "--pipeline-model-parallel-size",
        "2",
        "--virtual-pipeline-model-parallel-size",
        "2",
    ],
    "dp2": [],
    "dp2-distributed-optimizer": ["--use-distributed-optimizer"],
    # Overlapped communication (several buckets) must not change a result.
    "dp2-overlap": ["--overlap-grad-reduce", "--ddp-bucket-size", str(OVERLAP_BUCKET)],
    "dp2-distributed-optimizer-overlap": [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        str(OVERLAP_BUCKET),
    ],
    "pp2-interleaved-overlap": [
        "--pipeline-model-parallel-size",
        "2",
        "--virtual-pipeline-model-parallel-size",
        "2",
        "--overlap-grad-reduce",
        "--overlap-p2p-communication-warmup-flush",
    ],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    run_entry(PRETRAIN, COMMON + ["--train-iters", "0", "--save", str(root / "init")])
    run_entry(
        PRETRAIN,
        COMMON
        + [
            "--train-iters",
            "3",
            "--load",
            str(root / "init"),
            "--log-json",
            str(root / "reference.json"),
        ],
    )
    return root, read_json(root / "reference.json")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_process_layout_matches_one_process(reference, layout):
    root, expected = reference
    out = root / f"{layout}.json"
    args = (
        COMMON
        + LAYOUTS[layout]
        + ["--train-iters", "3", "--load", str(root / "init"), "--log-json", str(out)]
    )
    run_entry(PRETRAIN, args, nproc=2)
    got = read_json(out)
    steps, losses = series(got, "train/loss")
    ref_steps, ref_losses = series(expected, "train/loss")
    assert steps == ref_steps == [1, 2, 3]
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    np.testing.assert_allclose(
        series(got, "train/grad_norm")[1],
        series(expected, "train/grad_norm")[1],
        rtol=GRAD_NORM_RTOL,
        atol=0,
    )
    np.testing.assert_allclose(
        series(got, "valid/loss")[1], series(expected, "valid/loss")[1], rtol=RTOL
    )
    # The steps must actually train, or equality would prove little.
    assert ref_losses[2] < ref_losses[0] - 0.05
