"""The sampled store's estimator is unbiased and top-k's is not, through the real path: draws
encoded and decoded by the store's codec, the student's gradient from the fused output-layer
loss (the compiled CPU kernel), compared with the full-vocabulary KD gradient.

With N ids drawn i.i.d. from the teacher p and weights counts / N, the loss is the
cross-entropy to the empirical distribution, whose expectation over the draws is CE(p, q):
the mean of many independent draws' gradients converges to the full KD gradient, within its
standard error. Top-k (renormalised, or with its tail ignored) gives one fixed gradient that
differs from the full one by many standard errors of that same mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.apertus.distill.logit_codec import SampledBlockDecoder, encode_sampled_block
from megatron.apertus.ops.sparse_kl import fused_linear_sparse_kd

VOCAB, HIDDEN, TOKENS, DRAWS, REPLICAS = 64, 16, 3, 12, 20000
TOLERANCE = 4.5
"""Allowed |mean - full| in standard errors of the mean, for every gradient component: with
48 components and a fixed seed, a correct estimator exceeds 4.5 with probability < 1e-3."""


def problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states x [T, H], output weight W [V, H] and a long-tailed teacher p [T, V]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    teacher_logits = 2.0 * torch.randn(TOKENS, VOCAB, generator=g)
    return x, weight, torch.softmax(teacher_logits.double(), -1)


def full_kd_gradient(x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """d/dx of sum_t KL(p_t || softmax(x_t W^T)) over the full vocabulary, in float64."""
    x = x.double().requires_grad_()
    logq = torch.log_softmax(x @ weight.double().T, -1)
    (p * (p.log() - logq)).sum().backward()
    return x.grad


def per_row_gradient(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, tail: str
) -> torch.Tensor:
    """The fused loss's d/dx of every row (alpha = 1: the KL term alone)."""
    x = x.clone().requires_grad_()
    rows = x.shape[0]
    labels, mask = torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    loss, _ = fused_linear_sparse_kd(
        x, weight, ids, probs, labels, mask, alpha=1.0, tail=tail, impl="cpu"
    )
    loss.backward()
    return x.grad.double()


def stored_draws(p: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """REPLICAS independent sets of DRAWS ids per token, as the store keeps and returns them:
    encoded by the codec, decoded to distinct ids with weights counts / N (rows [R * T, N])."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(p.numpy(), axis=-1)
    uniforms = rng.random((REPLICAS, TOKENS, DRAWS))
    draws = np.stack(
        [np.searchsorted(cdf[t], uniforms[:, t], side="right") for t in range(TOKENS)], axis=1
    ).clip(max=VOCAB - 1)
    rows = REPLICAS * TOKENS
    encoded = encode_sampled_block(
        draws.reshape(rows, DRAWS), samples=1, vocab_size=VOCAB, zstd_level=3
    )
    decoder = SampledBlockDecoder(
        encoded.tables, encoded.table_size, positions=rows, draws=DRAWS, vocab_size=VOCAB
    )
    ids, probs = np.empty((rows, DRAWS), np.int64), np.empty((rows, DRAWS), np.float32)
    frames = (int(encoded.frame_sizes[0, 0]), int(encoded.frame_sizes[0, 1]))
    decoder.decode(encoded.payloads[0], frames, int(encoded.escapes[0]), ids, probs)
    return torch.from_numpy(ids), torch.from_numpy(probs)


@pytest.fixture(scope="module")
def setting():
    x, weight, p = problem()
    return x, weight, p, full_kd_gradient(x, weight, p)


def test_mean_sampled_gradient_is_the_full_kd_gradient(setting):
    x, weight, p, full = setting
    ids, probs = stored_draws(p)
    grads = per_row_gradient(x.repeat(REPLICAS, 1), weight, ids, probs, "ignore")
    grads = grads.view(REPLICAS, TOKENS, HIDDEN)
    mean, standard_error = grads.mean(0), grads.std(0) / REPLICAS**0.5
    z = (mean - full).abs() / standard_error
    assert z.max() < TOLERANCE, f"{z.max():.2f} standard errors off the full KD gradient"
    # the estimate is not trivially loose: its error is small against the gradient itself
    assert (mean - full).norm() < 0.02 * full.norm()


@pytest.mark.parametrize("tail", ["renormalize", "ignore"])
def test_topk_gradient_is_biased(setting, tail):
    x, weight, p, full = setting
    top = p.float().topk(DRAWS, dim=-1)
    topk = per_row_gradient(x, weight, top.indices, top.values, tail)
    ids, probs = stored_draws(p)
    grads = per_row_gradient(x.repeat(REPLICAS, 1), weight, ids, probs, "ignore")
    standard_error = grads.view(REPLICAS, TOKENS, HIDDEN).std(0) / REPLICAS**0.5
    z = (topk - full).abs() / standard_error
    assert z.max() > 10 * TOLERANCE, f"top-{DRAWS} is only {z.max():.2f} standard errors off"
