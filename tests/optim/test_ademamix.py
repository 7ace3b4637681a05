"""AdEMAMix: the multi-tensor update against the per-tensor reference, the reference against the
formula, and the optimizer inside megatron-core's stack (1 process, and DP=2 with the distributed
optimizer) against the reference, with checkpoint round trips.

Tolerances: foreach and reference differ only in rounding (lerp vs mul+add for the EMAs), one
or two fp32 ulps per step; parameters and moments here are at most O(1), where an ulp is 1.2e-7,
so 20 steps stay within 1e-6 absolute. Resumed runs must be bitwise equal.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from megatron.apertus.model import preset
from megatron.apertus.optim import AdEMAMix, AdEMAMixSettings
from megatron.apertus.optim.ademamix import STATE_KEYS, alpha_at, beta3_at
from tests.conftest import REPO, run_entry

WORKER = REPO / "tests" / "optim" / "megatron_worker.py"
ATOL = 1e-6
STEPS = 20
HYPER = dict(lr=3e-3, betas=(0.9, 0.95, 0.999), alpha=5.0, eps=1e-8)
CASES = {
    "plain": dict(weight_decay=0.0),
    "weight-decay": dict(weight_decay=0.1),
    "warmups": dict(weight_decay=0.0, alpha_warmup=8, beta3_warmup=8),
    "warmups-weight-decay": dict(weight_decay=0.1, alpha_warmup=8, beta3_warmup=8),
}


def _half_life(beta: float) -> float:
    return math.log(0.5) / math.log(beta)


def test_alpha_warmup_is_linear_then_constant():
    assert alpha_at(1, 8.0, 0) == 8.0
    assert alpha_at(25, 8.0, 100) == pytest.approx(2.0)
    assert alpha_at(100, 8.0, 100) == alpha_at(10**6, 8.0, 100) == 8.0


def test_beta3_warmup_interpolates_the_half_life():
    b1, b3, warmup = 0.9, 0.9999, 1000
    assert beta3_at(0, b1, b3, warmup) == pytest.approx(b1, abs=1e-15)
    assert beta3_at(warmup, b1, b3, warmup) == beta3_at(5 * warmup, b1, b3, warmup) == b3
    assert beta3_at(7, b1, b3, 0) == b3
    for step in (100, 500, 900):
        fraction = step / warmup
        expected = (1 - fraction) * _half_life(b1) + fraction * _half_life(b3)
        assert _half_life(beta3_at(step, b1, b3, warmup)) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("foreach", [False, True])
def test_first_step_matches_the_closed_form(foreach):
    """Step 1 from zero state: m1_hat = g, v_hat = g^2, m2 = (1 - b3(1)) g."""
    param = torch.randn(4, 5, dtype=torch.float64)
    grad = torch.randn(4, 5, dtype=torch.float64)
    hyper = dict(HYPER, weight_decay=0.1, alpha_warmup=10, beta3_warmup=10)
    optimizer = AdEMAMix([param.clone()], foreach=foreach, **hyper)
    optimizer.param_groups[0]["params"][0].grad = grad
    optimizer.step()
    alpha, beta3 = alpha_at(1, 5.0, 10), beta3_at(1, 0.9, 0.999, 10)
    update = (grad + alpha * (1 - beta3) * grad) / (grad.abs() + hyper["eps"]) + 0.1 * param
    torch.testing.assert_close(
        optimizer.param_groups[0]["params"][0], param - hyper["lr"] * update, rtol=1e-12, atol=0
    )


def test_invalid_hyperparameters_are_refused():
    param = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="betas are"):
        AdEMAMix(param, betas=(0.9, 0.999))
    with pytest.raises(ValueError, match="b3 must be in"):
        AdEMAMix(param, betas=(0.9, 0.999, 1.0))
    with pytest.raises(ValueError, match="b1 must be > 0"):
        AdEMAMix(param, betas=(0.0, 0.999, 0.9999), beta3_warmup=10)
    with pytest.raises(ValueError, match="ademamix-alpha"):
        AdEMAMixSettings(alpha=-1.0)
    with pytest.raises(ValueError, match="ademamix-beta3-warmup"):
        AdEMAMixSettings(beta3_warmup=-1)


@pytest.fixture
def tiny_model(tiny_cpu):
    return tiny_cpu.build(preset("tiny", vocab_size=512))


def _model_gradients(model, step: int) -> None:
    """Gradients of the tiny model's mean token loss on a random batch (in ``param.grad``)."""
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))
    positions = torch.arange(32).expand(2, 32)
    model.zero_grad(set_to_none=True)
    model(tokens, positions, None, labels=tokens).mean().backward()


def _decay_groups(params: list) -> list[dict]:
    """The split megatron-core makes: no weight decay on 1-D tensors."""
    return [
        {"params": [p for p in params if p.ndim > 1]},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_foreach_matches_reference_on_model_gradients(tiny_model, case):
    params = [p for p in tiny_model.parameters()]
    initial = [p.detach().clone() for p in params]
    references = [p.detach().clone() for p in params]
    fast = AdEMAMix(_decay_groups(params), **HYPER, **CASES[case])
    slow = AdEMAMix(_decay_groups(references), **HYPER, **CASES[case], foreach=False)
    try:
        for step in range(STEPS):
            _model_gradients(tiny_model, step)
            for ref, p in zip(references, params):
                ref.grad = p.grad.clone()
            fast.step()
            slow.step()
        for p, ref in zip(params, references):
            torch.testing.assert_close(p.detach(), ref, rtol=0, atol=ATOL)
            for key in STATE_KEYS:
                torch.testing.assert_close(
                    fast.state[p][key], slow.state[ref][key], rtol=0, atol=ATOL
                )
            assert fast.state[p]["step"].item() == slow.state[ref]["step"].item() == STEPS
        moved = max((p.detach() - p0).abs().max().item() for p, p0 in zip(params, initial))
        assert moved > 100 * ATOL, "the updates must be large against the tolerance"
    finally:
        with torch.no_grad():
            for p, p0 in zip(params, initial):
                p.copy_(p0)


@pytest.mark.parametrize("chunk_numel", [1, 7, 300])
def test_chunks_change_nothing(chunk_numel):
    """Cutting tensors into flat views is exact (elementwise ops), also with a non-contiguous
    tensor, which is kept whole."""
    torch.manual_seed(0)
    shapes = [(50, 30), (13,), (1,)]
    params = [torch.randn(s) for s in shapes] + [torch.randn(3, 100).t()]
    copies = [p.clone() for p in params]
    hyper = dict(HYPER, weight_decay=0.1, alpha_warmup=6, beta3_warmup=6)
    chunked = AdEMAMix(params, **hyper, chunk_numel=chunk_numel)
    whole = AdEMAMix(copies, **hyper, chunk_numel=10**9)
    for _ in range(5):
        for p, q in zip(params, copies):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        chunked.step()
        whole.step()
    assert all(torch.equal(p, q) for p, q in zip(params, copies))


def test_state_dict_round_trip_is_bitwise():
    """Save after 5 steps, load into a fresh optimizer over copies, run both 5 more steps."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (1,), (7, 3, 5)]
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    hyper = dict(HYPER, weight_decay=0.1, alpha_warmup=6, beta3_warmup=6)
    optimizer = AdEMAMix(params, **hyper)
    grads = [[torch.randn(s) for s in shapes] for _ in range(10)]

    def run(optimizer, params, steps):
        for step in steps:
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            optimizer.step()

    run(optimizer, params, range(5))
    saved = copy.deepcopy(optimizer.state_dict())
    copies = [p.detach().clone().requires_grad_() for p in params]
    resumed = AdEMAMix(copies, **dict(hyper, alpha=0.0))  # hyperparameters come from the state
    resumed.load_state_dict(saved)
    run(optimizer, params, range(5, 10))
    run(resumed, copies, range(5, 10))
    for p, q in zip(params, copies):
        assert torch.equal(p, q)
        assert all(torch.equal(optimizer.state[p][k], resumed.state[q][k]) for k in STATE_KEYS)
        assert optimizer.state[p]["step"].item() == resumed.state[q]["step"].item() == 10


# -- through megatron-core ---------------------------------------------------------------------

FORMATS = ["fully_reshardable", "dp_reshardable"]


@pytest.fixture(scope="module")
def megatron_reports(tmp_path_factory):
    """One single-process run (FP32Optimizer) and one DP=2 run (distributed optimizer)."""
    root = tmp_path_factory.mktemp("ademamix")
    single, sharded = root / "single.json", root / "distributed.json"
    # FP32Optimizer ignores the sharding type: one dist_checkpointing round trip is enough.
    run_entry(WORKER, ["--formats", FORMATS[0], "--state-dict-round-trip", "--out", str(single)])
    run_entry(
        WORKER, ["--distributed-optimizer", "--formats", *FORMATS, "--out", str(sharded)], nproc=2
    )
    return {
        key: json.loads(path.read_text())
        for key, path in (("single", single), ("distributed", sharded))
    }


@pytest.mark.smoke  # megatron-core 0.19 moved where the defaults are applied
@pytest.mark.parametrize("run", ["single", "distributed"])
def test_no_weight_decay_on_norms_and_xielu_alphas(megatron_reports, run):
    decay = megatron_reports[run]["weight_decay"]
    assert len(decay) == 43  # 4 layers x 10 + embedding, final norm, output layer
    for name, value in decay.items():
        exempt = "layernorm" in name or "activation_func.alpha_" in name
        assert value == (0.0 if exempt else 0.1), name
    assert sum(1 for name in decay if "activation_func.alpha_" in name) == 8


@pytest.mark.parametrize("run", ["single", "distributed"])
def test_wrapped_optimizer_matches_reference(megatron_reports, run):
    diffs = megatron_reports[run]["max_abs_diff"]
    assert len(diffs) == 6
    assert max(diffs) < ATOL


@pytest.mark.parametrize(
    "run, how",
    [("single", FORMATS[0]), ("single", "state_dict")] + [("distributed", f) for f in FORMATS],
)
def test_resume_restores_all_three_moments_bitwise(megatron_reports, run, how):
    resume = megatron_reports[run]["resume"][how]
    assert resume["state_keys"] == ["exp_avg", "exp_avg_slow", "exp_avg_sq", "step"]
    assert resume["states_bitwise_equal"]
    assert resume["resumed_bitwise_equal"]
