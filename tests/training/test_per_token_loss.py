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

In one process, megatron-core's schedule, DDP and gradient finalisation over micro-batches with
2, 9 and 16 loss tokens give, in both modes, the gradient of the loss each mode documents,
computed by plain autograd on a copy of the model: the micro-batches' means averaged (default),
their sums over the total count (per token).

Tolerances as tests/parallel/test_context_parallel.py: splitting the batch changes the order of
fp32 sums only; the control misses by the imbalance of the token counts (percents).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megatron.apertus.data.batches import Batch
from megatron.apertus.training.step import StepShape, run_microbatches, wrap_ddp
from tests.conftest import REPO, SMALL_VOCABULARY, read_json, run_entry, series

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
    # One step of lr 3e-3 apart: 2e-5 (Python 3.12's corpus) to 4e-4 relative, measured.
    assert abs(second - expected[1]) > 5 * RTOL * expected[1]
    missed = _gradient_errors(default, expected_run)
    matrices = [param for param in missed if reference[param].numel() > 1]
    assert min(missed[param] for param in matrices) > 100 * GRAD_TOL, missed


MASKED = (2, 9, 16)
"""Loss tokens of each micro-batch of the in-process step (of 16 positions)."""


def _micro_batches(vocab: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for kept in MASKED:
        tokens = torch.randint(0, vocab, (1, 17), generator=generator)
        mask = torch.zeros(1, 16)
        mask[0, torch.randperm(16, generator=generator)[:kept]] = 1
        positions = torch.arange(16)[None]
        batches.append(Batch(tokens[:, :-1], tokens[:, 1:], mask, positions))
    return batches


def _documented_gradients(plain: torch.nn.Module, batches: list[Batch], per_token: bool) -> list:
    """Plain autograd's gradients of the loss the mode documents (the fused loss's gradients
    are computed in its forward pass: one forward pass per backward)."""
    sums = torch.stack(
        [
            plain(b.tokens, b.position_ids, None, labels=b.labels, loss_mask=b.loss_mask)
            for b in batches
        ]
    )
    counts = torch.tensor(MASKED, dtype=sums.dtype)
    loss = sums.sum() / counts.sum() if per_token else (sums / counts).mean()
    return torch.autograd.grad(loss, list(plain.parameters()))


@pytest.mark.parametrize("per_token", [False, True], ids=["default", "per-token"])
def test_schedule_gradient_is_the_documented_loss(tiny_cpu, per_token):
    chunk = tiny_cpu.build(fused_loss=True, calculate_per_token_loss=per_token)
    plain = tiny_cpu.build(fused_loss=True)
    plain.load_state_dict(chunk.state_dict())
    (model,) = wrap_ddp([chunk], chunk.config, use_distributed_optimizer=False)
    model.config.finalize_model_grads_func = finalize_model_grads
    batches = _micro_batches(tiny_cpu.model.vocab_size)
    shape = StepShape(num_microbatches=len(batches), seq_length=16, micro_batch_size=1)
    reported = run_microbatches([model], [iter(batches)], shape, forward_only=False)
    assert [int(entry["lm loss"][1]) for entry in reported] == list(MASKED)
    misses = []
    for (name, param), want, other in zip(
        model.module.named_parameters(),
        _documented_gradients(plain, batches, per_token),
        _documented_gradients(plain, batches, not per_token),
    ):
        scale = want.abs().max().item()
        error = (param.main_grad - want).abs().max().item() / scale
        assert error < (GRAD_TOL if want.numel() > 1 else SCALAR_GRAD_TOL), (name, error)
        misses.append((param.main_grad - other).abs().max().item() / scale)
    assert max(misses) > 100 * GRAD_TOL  # the other mode's loss: the comparison tells them apart
