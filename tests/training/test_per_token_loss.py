"""``--calculate-per-token-loss``: the loss and its gradients are divided by the loss tokens of
the whole global batch, so a step over micro-batches and data-parallel ranks whose loss-token
counts differ (Goldfish drops, ``--eod-mask-loss``) is the step one process takes over the
whole global batch as one micro-batch, whose loss is its sum over its total token count.

Real tiny runs of ``pretrain_gpt.py`` (gloo, CPU) from the same seed, each step's gradients
taken by tests/parallel/grad_worker.py:

* the reference: one process, the global batch of 4 samples as one micro-batch (the default and
  the per-token normalisation are the same there: one micro-batch, one rank);
* DP=2 with 2 micro-batches per rank (and CP=2 with packed documents, marked slow) with the flag
  match it: the first step's loss and every gradient element, and the second step's loss;
* the negative control, the same layout without the flag (Megatron-LM's default, the mean of
  the micro-batches' means): the same first loss (the logged loss is the global batch's sum over
  its count either way) but other gradients and so another second loss.

Tolerances as tests/parallel/test_context_parallel.py: splitting the batch changes the order of
fp32 sums only; the control misses by the imbalance of the token counts (percents).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import PRETRAIN, REPO, SMALL_VOCABULARY, read_json, run_entry, series

GRAD_WORKER = REPO / "tests" / "parallel" / "grad_worker.py"
PER_TOKEN = ["--calculate-per-token-loss"]
COMMON = [
    *("--model-preset", "tiny", "--seed", "7", "--lr", "3e-3", "--adam-eps", "1e-4"),
    *("--seq-length", "64", "--global-batch-size", "4", "--train-iters", "2"),
    *("--eval-iters", "0", "--log-interval", "1", "--device", "cpu"),
    # Goldfish drops a third of the positions, each sample its own share: uneven counts.
    *("--goldfish-loss", "--goldfish-k", "3", "--goldfish-h", "4", "--eod-mask-loss"),
    *SMALL_VOCABULARY,
]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
LAYOUTS = {
    "dp2": ([], ["--micro-batch-size", "1"]),
    "cp2": (PACKED, ["--micro-batch-size", "2", "--context-parallel-size", "2"]),
}
"""Each layout's data flags (the reference's too) and its two processes: 2 data-parallel ranks
x 2 micro-batches of one sample; one data-parallel rank with 2 micro-batches of 2 packed samples,
each shared out over 2 context-parallel ranks whose shares hold different numbers of loss
tokens."""
RTOL = 2e-6
GRAD_TOL = 2e-6
"""Largest first-step gradient difference relative to the largest magnitude of the
parameter's gradient (one-number parameters: SCALAR_GRAD_TOL, as in test_context_parallel)."""
SCALAR_GRAD_TOL = 1e-4


def _run(tmp_path, name: str, args: list[str], nproc: int) -> dict:
    """The run's log and its first step's gradients, ``["grads"]``: one dict per rank."""
    out, prefix = tmp_path / f"{name}.json", tmp_path / f"{name}-grads"
    flags = COMMON + args + ["--log-json", str(out)]
    run_entry(GRAD_WORKER, [str(prefix), "--", *flags], nproc=nproc)
    history = read_json(out)
    history["grads"] = [torch.load(f"{prefix}.rank{r}.pt")["grads"] for r in range(nproc)]
    return history


def _gradient_errors(got: dict, expected: dict) -> dict[str, float]:
    """Each parameter's largest first-step gradient difference over the ranks, relative to the
    largest magnitude of the reference's gradient."""
    (reference,) = expected["grads"]
    errors = dict.fromkeys(reference, 0.0)
    for grads in got["grads"]:
        assert grads.keys() == reference.keys()
        for name, want in reference.items():
            scale = want.abs().max().item()
            assert scale > 0, f"{name}: a zero gradient compares nothing"
            errors[name] = max(errors[name], (grads[name] - want).abs().max().item() / scale)
    return errors


def _losses(history: dict) -> list[float]:
    steps, losses = series(history, "train/loss")
    assert steps == [1, 2]
    return losses


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """``whole(data)``: one process's run of the data flags ``data``, the global batch as one
    micro-batch, run once per module."""
    root, runs = tmp_path_factory.mktemp("per_token"), {}

    def run(data: list[str]) -> dict:
        key = " ".join(data)
        if key not in runs:
            runs[key] = _run(root, f"whole{len(runs)}", data + ["--micro-batch-size", "4"], 1)
        return runs[key]

    return run


@pytest.mark.parametrize("name", [pytest.param("dp2"), pytest.param("cp2", marks=pytest.mark.slow)])
def test_per_token_loss_is_the_whole_batch_sum_over_its_tokens(whole, tmp_path, name):
    data, layout = LAYOUTS[name]
    expected_run = whole(data)
    per_token = _run(tmp_path, "per-token", data + layout + PER_TOKEN, 2)
    default = _run(tmp_path, "default", data + layout, 2)
    (reference,) = expected_run["grads"]
    errors = _gradient_errors(per_token, expected_run)
    for param, error in errors.items():
        tolerance = GRAD_TOL if reference[param].numel() > 1 else SCALAR_GRAD_TOL
        assert error < tolerance, (param, error)
    expected = _losses(expected_run)
    np.testing.assert_allclose(_losses(per_token), expected, rtol=RTOL, atol=0)
    # The control: the logged first loss is the same sum over the same count, the step is not.
    first, second = _losses(default)
    np.testing.assert_allclose(first, expected[0], rtol=RTOL, atol=0)
    assert abs(second - expected[1]) > 100 * RTOL * expected[1]
    missed = _gradient_errors(default, expected_run)
    matrices = [param for param in missed if reference[param].numel() > 1]
    assert min(missed[param] for param in matrices) > 100 * GRAD_TOL, missed
