"""``--log-max-attention-logit``: the step's largest pre-softmax attention logit, logged as
Megatron-LM names it, against q.k/sqrt(d) computed directly from each layer's queries and keys in
a real tiny CPU run (QK-normed, grouped-query attention); refused where the attention cannot
compute it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

import pretrain_gpt
from megatron.apertus.training import step as step_module
from megatron.apertus.training.loop import train
from tests.conftest import SMALL_VOCABULARY, series
from tests.test_apertus_launch_args import error_lines

BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--eval-interval 2 --log-interval 1 --lr 3e-3 --seed 5 --train-iters 3 --device cpu"
).split() + SMALL_VOCABULARY


def direct_max(module, args) -> None:
    """The largest causal q.k/sqrt(d) of one core-attention call, from its inputs [s, b, h, d]."""
    query, key = args[0].float(), args[1].float()
    key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
    logits = torch.einsum("sbhd,tbhd->bhst", query, key) / query.shape[-1] ** 0.5
    causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    module.direct = max(getattr(module, "direct", -1e30), logits[..., causal].max().item())


@contextlib.contextmanager
def measured(direct: dict) -> Iterator[None]:
    """Within the block, ``direct[n]``: the largest logit of training pass ``n`` over every
    layer, computed from the queries and keys each core attention is given."""
    original, passes = step_module.run_microbatches, 0

    def with_direct(model, data_iterators, shape, *, forward_only: bool, **objective):
        nonlocal passes
        cores = [layer.self_attention.core_attention for layer in model[0].module.decoder.layers]
        handles = [core.register_forward_pre_hook(direct_max) for core in cores]
        try:
            losses = original(model, data_iterators, shape, forward_only=forward_only, **objective)
        finally:
            for handle in handles:
                handle.remove()
        if not forward_only:
            passes += 1
            direct[passes] = max(core.__dict__.pop("direct") for core in cores)
        for core in cores:
            core.__dict__.pop("direct", None)
        return losses

    step_module.run_microbatches = with_direct
    try:
        yield
    finally:
        step_module.run_microbatches = original


def test_the_logged_maximum_is_q_dot_k_over_sqrt_d(tmp_path):
    direct = {}
    with measured(direct):
        history = train(pretrain_gpt.parse_args(BASE + ["--log-max-attention-logit"]))
    iterations, logged = series(history, "train/max_attention_logit")
    assert iterations == [1, 2, 3], "every step, validation passes left out"
    assert logged == pytest.approx([direct[i] for i in iterations], rel=1e-5)
    assert len(set(logged)) == 3 and min(logged) > 0

    history = train(pretrain_gpt.parse_args(BASE))
    assert "train/max_attention_logit" not in history, "nothing without the flag"


def test_refused_on_the_context_parallel_sdpa_attention(capsys):
    argv = BASE + ["--log-max-attention-logit", "--context-parallel-size", "2"]
    (refusal,) = error_lines(capsys, argv)
    assert refusal.startswith("--log-max-attention-logit: the context-parallel SDPA attention")
