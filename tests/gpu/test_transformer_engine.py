"""On a GPU with Transformer Engine: the TE layer spec computes what the local one does, one
checkpoint serves both, packed documents are really masked (THD and varlen), FP8 trains and
resumes exactly, and ``--deterministic-mode`` makes runs bitwise reproducible.
Skipped (reported, never passed) without CUDA or without Transformer Engine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron.apertus.model.engine import transformer_engine_error
from tests.conftest import PRETRAIN, REPO, read_json, series

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_te = pytest.mark.skipif(
    torch.cuda.is_available() and transformer_engine_error() is not None,
    reason=f"needs Transformer Engine ({transformer_engine_error()})",
)
SHAPE = {"hidden_size": 256, "ffn_hidden_size": 768, "seq_length": 256}


@pytest.fixture(scope="module")
def gpu():
    from megatron.apertus import parallel
    from megatron.apertus.model import ParallelConfig, preset

    model = preset("tiny", **SHAPE)
    parallel.initialize(ParallelConfig(), device="cuda", seed=3, model=model)
    yield model
    parallel.shutdown()


def build(model, impl: str):
    from megatron.apertus.model import ParallelConfig
    from megatron.apertus.model.builder import build_model

    chunk = build_model(
        model, ParallelConfig(), params_dtype=torch.bfloat16, transformer_impl=impl
    )[0]
    return chunk.eval()


def real_documents(lengths: list[int]) -> tuple[list[list[int]], int]:
    """Real documents of the embedded corpus cut to ``lengths`` tokens; and the eod id."""
    from megatron.apertus.prep.corpus import embedded_documents
    from megatron.apertus.tokenizer.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("TekkenTokenizer")
    encoded = [tokenizer.encode_document(t) for t in embedded_documents()[10:60]]
    long_enough = [ids for ids in encoded if len(ids) >= max(lengths)]
    return [ids[: n - 1] + [tokenizer.eod] for ids, n in zip(long_enough, lengths)], tokenizer.eod


def batch_of(rows: list[list[int]], eod: int, pack: bool):
    from megatron.apertus.data.batches import BatchConfig, collate

    samples = [
        {
            "tokens": torch.tensor(r),
            "labels": torch.tensor(r[1:] + [eod]),
            "loss_mask": torch.ones(len(r)),
        }
        for r in rows
    ]
    return collate(samples, BatchConfig(eod=eod, pack_documents=pack))


def logits(chunk, batch) -> torch.Tensor:
    from megatron.apertus.model.builder import chunk_groups
    from megatron.apertus.training.step import packed_seq_params_to

    with torch.no_grad():
        return chunk(
            batch.tokens.cuda(),
            batch.position_ids.cuda(),
            None,
            packed_seq_params=packed_seq_params_to(
                batch.packed_seq_params, "cuda", chunk_groups(chunk).cp
            ),
        ).float()


@needs_te
@pytest.mark.parametrize("direction", ["local->te", "te->local"])
def test_one_checkpoint_serves_both_implementations(gpu, tmp_path, direction):
    from megatron.apertus import checkpoint

    source, target = ("local", "transformer_engine")[:: 1 if direction == "local->te" else -1]
    saved = build(gpu, source)
    checkpoint.save_model(tmp_path, 0, [saved], gpu)
    loaded = build(gpu, target)
    checkpoint.load_model(tmp_path, [loaded])
    (a, b, c, d), eod = real_documents([90, 100, 66, 256])
    for pack in (False, True):
        batch = batch_of([a + b + c, d], eod, pack)
        want, got = logits(saved, batch), logits(loaded, batch)
        err = (got - want).abs().max().item() / want.abs().max().item()
        print(f"{direction} packed={pack}: max |diff| / max |logit| = {err:.2e}")
        assert err < 3e-2


@pytest.mark.parametrize("impl", [pytest.param("transformer_engine", marks=needs_te), "local"])
def test_packed_documents_are_really_masked(gpu, impl):
    """Changing one document changes none of the others' logits (THD under TE, varlen on local)."""
    chunk = build(gpu, impl)
    (a, b, c, d), eod = real_documents([90, 100, 66, 256])
    reference = logits(chunk, batch_of([a + b + c, d], eod, pack=True))
    perturbed = [a[0], *torch.randint(1000, 100000, (len(a) - 2,)).tolist(), a[-1]]
    changed = logits(chunk, batch_of([perturbed + b + c, d], eod, pack=True))
    assert not torch.allclose(changed[:, :90], reference[:, :90])
    torch.testing.assert_close(changed[:, 90:], reference[:, 90:], rtol=0, atol=1e-6)
    # Unpacked (one causal sequence) the perturbation leaks: the check above can fail.
    leaky = logits(chunk, batch_of([perturbed + b + c], eod, pack=False))
    assert not torch.allclose(
        leaky[:, 90:], logits(chunk, batch_of([a + b + c], eod, False))[:, 90:]
    )


def test_varlen_attention_matches_per_document_sdpa(gpu):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.apertus.model import ParallelConfig, transformer_config
    from megatron.apertus.model.attention import SDPAttention, uses_varlen

    config = transformer_config(gpu, ParallelConfig(), params_dtype=torch.bfloat16)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
    lengths = [300, 17, 1000, 1, 731]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu.cuda(),
        cu_seqlens_kv=cu.cuda(),
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    t = sum(lengths)
    q = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert uses_varlen(q)
    out_grad = torch.randn(t, 8 * 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for path in (attention._varlen, attention._per_segment):
        out = path(q, k, v, params)
        results.append((out, *torch.autograd.grad(out, (q, k, v), out_grad)))
    for fast, exact in zip(*results):
        torch.testing.assert_close(fast.float(), exact.float(), rtol=2e-2, atol=2e-2)


# -- whole runs through the entry point --------------------------------------------------------


def pretrain(
    tmp_path, name: str, *extra: str, iters: int = 8, env: dict | None = None, code: int = 0
) -> list[float] | str:
    """Losses of a run (or, when it must fail with ``code``, its last line of stderr)."""
    log = tmp_path / f"{name}.json"
    cmd = [
        sys.executable,
        str(PRETRAIN),
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--model-preset",
        "tiny",
        "--hidden-size",
        "256",
        "--ffn-hidden-size",
        "768",
        "--seq-length",
        "256",
        "--train-iters",
        str(iters),
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--log-interval",
        "1",
        "--eval-iters",
        "1",
        "--reset-attention-mask",
        "--reset-position-ids",
        "--log-json",
        str(log),
        *extra,
    ]
    # errors="replace": a library may print bytes that are not UTF-8
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=900,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    if code:
        return proc.stderr.strip().splitlines()[-1]
    print(name, [line for line in proc.stdout.splitlines() if "transformer implementation" in line])
    return series(read_json(log), "train/loss")[1]


FP8 = [
    "--transformer-impl",
    "transformer_engine",
    "--fp8-format",
    "hybrid",
    "--fp8-recipe",
    "delayed",
    "--fp8-amax-history-len",
    "16",
    "--fp8-amax-compute-algo",
    "max",
]


def te_weight_gradients(ddp, batch) -> dict[str, torch.Tensor]:
    """``main_grad`` of every TE linear's weight after two micro-batches' backward."""
    from megatron.apertus.model.builder import chunk_groups
    from megatron.apertus.training.step import packed_seq_params_to

    ddp.zero_grad_buffer()
    for _ in range(2):
        out = ddp(
            batch.tokens.cuda(),
            batch.position_ids.cuda(),
            None,
            packed_seq_params=packed_seq_params_to(
                batch.packed_seq_params, "cuda", chunk_groups(ddp).cp
            ),
        )
        out.float().square().mean().backward()
    return {
        name: module.weight.main_grad.clone()
        for name, module in ddp.named_modules()
        if hasattr(module, "fuse_wgrad_accumulation")
    }


@needs_te
def test_te_weight_gradients_accumulate_into_main_grad(gpu):
    """With the fusion TE's GEMMs write the fp32 ``main_grad`` themselves (DDP adds nothing) and
    it holds what the bf16 gradient plus DDP's add gave."""
    from megatron.apertus.model.engine import fuse_te_wgrad_accumulation
    from megatron.apertus.training.step import wrap_ddp

    chunk = build(gpu, "transformer_engine").train()
    # the distributed optimizer's buffer layout starts every parameter 16-byte aligned
    (ddp,) = wrap_ddp([chunk], chunk.config, use_distributed_optimizer=True)
    rows, eod = real_documents([256, 256])
    batch = batch_of(rows, eod, pack=False)
    added = te_weight_gradients(ddp, batch)
    assert fuse_te_wgrad_accumulation(ddp) == (len(added), len(added))
    assert len(added) >= 4 * gpu.num_layers
    fused = te_weight_gradients(ddp, batch)
    for name, grad in fused.items():
        weight = ddp.get_submodule(name).weight
        assert weight.grad_added_to_main_grad and weight.grad is None, name
        assert grad.abs().sum() > 0, name
        # fp32 accumulation against a bf16 gradient added in fp32: equal to bf16's precision
        assert (grad - added[name]).norm() <= 1e-2 * added[name].norm(), name


@needs_te
def test_gradient_accumulation_fusion_trains_as_the_add_does(tmp_path):
    flags = [
        "--transformer-impl",
        "transformer_engine",
        "--deterministic-mode",
        "--use-distributed-optimizer",
    ]
    fused = pretrain(tmp_path, "fused", *flags)
    added = pretrain(tmp_path, "added", *flags, "--no-gradient-accumulation-fusion")
    assert fused[-1] < fused[0] - 1.0
    assert fused == pytest.approx(added, rel=1e-2), (fused, added)
    # FP8 weight-gradient GEMMs accumulate into fp32 only from 16-byte aligned buffers
    fp8 = pretrain(tmp_path, "fp8-fused", *FP8, "--use-distributed-optimizer")
    assert fp8[-1] < fp8[0] - 1.0


@needs_te
def test_unfused_rope_trains_as_the_fused_kernel_does(tmp_path):
    flags = ["--transformer-impl", "transformer_engine", "--deterministic-mode"]
    fused = pretrain(tmp_path, "rope-fused", *flags)
    unfused = pretrain(tmp_path, "rope-unfused", *flags, "--no-rope-fusion")
    assert fused[-1] < fused[0] - 1.0
    assert fused == pytest.approx(unfused, rel=1e-3), (fused, unfused)


@needs_te
def test_fp8_trains_is_deterministic_and_resumes_exactly(tmp_path):
    first = pretrain(tmp_path, "fp8-a", *FP8, "--deterministic-mode")
    again = pretrain(tmp_path, "fp8-b", *FP8, "--deterministic-mode")
    assert first[-1] < first[0] - 1.0
    assert first == again, (first, again)
    ckpt = str(tmp_path / "ckpt")
    pretrain(
        tmp_path, "fp8-stop", *FP8, "--deterministic-mode", "--save", ckpt, "--exit-interval", "4"
    )
    resume = [*FP8, "--deterministic-mode", "--save", ckpt, "--load", ckpt]
    # TE keeps delayed-scaling state as a pickle: loaded only when the user says the file is trusted.
    refusal = pretrain(tmp_path, "fp8-refused", *resume, code=2)
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in refusal and str(ckpt) in refusal
    resumed = pretrain(
        tmp_path, "fp8-resumed", *resume, env={"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}
    )
    # The amax history and scales come back with the weights: the continuation is bitwise equal.
    assert resumed[-4:] == first[-4:], (resumed, first)


def test_local_packed_runs_are_deterministic(tmp_path):
    flags = ["--transformer-impl", "local", "--deterministic-mode"]
    assert pretrain(tmp_path, "det-a", *flags) == pretrain(tmp_path, "det-b", *flags)


@needs_te
def test_te_packed_runs_are_deterministic(tmp_path):
    """Before Blackwell, TE's deterministic attention for packed documents of realistic sizes is
    its unfused one; the run takes torch's varlen kernel beside TE's linears instead, bitwise
    repeatable."""
    flags = ["--transformer-impl", "transformer_engine", "--deterministic-mode"]
    assert pretrain(tmp_path, "te-det-a", *flags) == pretrain(tmp_path, "te-det-b", *flags)


@needs_te
def test_intermediate_metrics_under_fp8(tmp_path):
    pretrain(
        tmp_path,
        "metrics",
        *FP8,
        "--log-intermediate-metrics",
        "rms",
        "kurtosis",
        "underflow",
        "overflow",
        "--log-intermediate-metrics-interval",
        "4",
        iters=4,
    )
    history = read_json(tmp_path / "metrics.json")
    kurtosis = history["intermediate/layer001/fc2/kurtosis"]
    assert [i for i, _ in kurtosis] == [1, 4] and all(v > 1.0 for _, v in kurtosis)
    for key, values in history.items():
        if key.endswith(("underflow", "overflow")):
            assert all(0.0 <= v <= 1.0 for _, v in values), key
    print({k: v for k, v in history.items() if k.startswith("intermediate/layer004/")})
