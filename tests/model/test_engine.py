"""The implementation and FP8 flags are checked before anything is allocated, each refusal in one
line naming the flag and what is missing; GPUs this machine lacks are described to the same
rules through the probe parameters."""

from __future__ import annotations

import os

import pytest

from megatron.apertus.errors import ConfigError
from megatron.apertus.model.config import ParallelConfig
from megatron.apertus.model.engine import (
    EngineConfig,
    deterministic_core_attention,
    resolve_transformer_impl,
    select_te_attention_backend,
    transformer_config_fields,
    validate_engine,
)
from pretrain_gpt import parse_args

HOPPER, ADA, AMPERE, BLACKWELL = (9, 0), (8, 9), (8, 0), (10, 0)
TE_OK = lambda: None  # noqa: E731
TE_MISSING = lambda: "Transformer Engine is not installed"  # noqa: E731


def check(engine: EngineConfig, *, device="cuda", te=TE_OK, gpu=HOPPER, layers=4) -> str:
    return validate_engine(
        engine, device=device, num_layers=layers, te_error=te, capability=lambda: gpu
    )


def test_default_is_te_on_cuda_when_it_imports_else_local():
    assert resolve_transformer_impl(EngineConfig(), "cuda", TE_OK) == "transformer_engine"
    assert resolve_transformer_impl(EngineConfig(), "cuda", TE_MISSING) == "local"
    assert resolve_transformer_impl(EngineConfig(), "cpu", TE_OK) == "local"
    assert check(EngineConfig(), device="cpu", te=TE_MISSING, gpu=None) == "local"


@pytest.mark.parametrize(
    "engine, kwargs, message",
    [
        (
            EngineConfig(transformer_impl="transformer_engine"),
            dict(te=TE_MISSING),
            "--transformer-impl transformer_engine: Transformer Engine is not installed",
        ),
        (
            EngineConfig(transformer_impl="transformer_engine"),
            dict(device="cpu", gpu=None),
            "--transformer-impl transformer_engine needs a CUDA device",
        ),
        (
            EngineConfig(fp8_format="e4m3"),
            dict(device="cpu", gpu=None),
            "--fp8-format e4m3 needs --transformer-impl transformer_engine",
        ),
        (
            EngineConfig(transformer_impl="local", fp8_format="hybrid"),
            {},
            "--fp8-format hybrid needs --transformer-impl transformer_engine",
        ),
        (
            EngineConfig(transformer_impl="transformer_engine", fp8_format="e4m3"),
            dict(gpu=AMPERE),
            "--fp8-format e4m3 needs a GPU of compute capability >= 8.9",
        ),
        (
            EngineConfig(fp8_format="e4m3", fp8_recipe="mxfp8"),
            dict(gpu=HOPPER),
            "--fp8-recipe mxfp8 needs a Blackwell GPU",
        ),
        (
            EngineConfig(
                fp8_format="e4m3",
                fp8_recipe="tensorwise",
                first_last_layers_bf16=True,
                num_layers_at_start_in_bf16=3,
                num_layers_at_end_in_bf16=2,
            ),
            {},
            "--num-layers-at-start-in-bf16 (3) + --num-layers-at-end-in-bf16 (2)",
        ),
    ],
)
def test_each_refusal_names_the_flag_and_what_is_missing(engine, kwargs, message):
    with pytest.raises(ConfigError) as err:
        check(engine, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("gpu", [ADA, HOPPER, BLACKWELL])
def test_fp8_is_accepted_from_ada_on(gpu):
    engine = EngineConfig(fp8_format="hybrid", fp8_recipe="tensorwise")
    assert check(engine, gpu=gpu) == "transformer_engine"
    assert check(EngineConfig(fp8_format="e4m3", fp8_recipe="mxfp8"), gpu=BLACKWELL)


@pytest.mark.parametrize(
    "gpu, packed, backend",
    [
        (HOPPER, True, "local"),  # TE's deterministic THD backward is off on Hopper
        (HOPPER, False, "auto"),  # cuDNN's deterministic sbhd backward stays
        (AMPERE, False, "local"),  # no deterministic cuDNN attention before Hopper
        (AMPERE, True, "local"),
        (BLACKWELL, True, "auto"),
    ],
)
def test_deterministic_mode_avoids_te_unfused_attention(gpu, packed, backend):
    engine = EngineConfig(deterministic_mode=True)
    chosen = deterministic_core_attention(
        engine, "transformer_engine", packed_documents=packed, capability=lambda: gpu
    )
    assert chosen.attention_backend == backend
    assert chosen.deterministic_mode


@pytest.mark.parametrize(
    "engine, impl",
    [
        (EngineConfig(), "transformer_engine"),  # not deterministic
        (EngineConfig(deterministic_mode=True, attention_backend="fused"), "transformer_engine"),
        (EngineConfig(deterministic_mode=True), "local"),
    ],
)
def test_deterministic_core_attention_leaves_other_choices_alone(engine, impl):
    chosen = deterministic_core_attention(
        engine, impl, packed_documents=True, capability=lambda: HOPPER
    )
    assert chosen == engine


@pytest.mark.parametrize(
    "flags, impl, fused",
    [
        ([], "transformer_engine", True),
        (["--no-rope-fusion"], "transformer_engine", False),
        ([], "local", False),  # megatron-core's unfused RoPE is the local implementation's only one
    ],
)
def test_rope_fusion_is_transformer_engines_kernel_unless_switched_off(flags, impl, fused):
    engine = parse_args(["--train-iters", "1", "--device", "cpu", *flags]).engine
    assert transformer_config_fields(engine, impl)["apply_rope_fusion"] is fused


SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def exported(monkeypatch, **switches: str) -> None:
    """A cluster environment that exports TE's attention switches; all three are restored after
    the test, also where megatron-core sets them while building a model."""
    for name in SWITCHES:
        monkeypatch.setenv(name, switches.get(name, ""))
        if name not in switches:
            monkeypatch.delenv(name)


def test_a_named_te_backend_turns_the_others_off(monkeypatch):
    exported(monkeypatch, NVTE_FLASH_ATTN="1")
    select_te_attention_backend("fused", "transformer_engine")
    assert [os.environ[name] for name in SWITCHES] == ["0", "1", "0"]


@pytest.mark.parametrize(
    "backend, impl", [("auto", "local"), ("local", "local"), ("local", "transformer_engine")]
)
def test_switches_are_dropped_where_te_attention_is_unused(backend, impl, monkeypatch, tiny_cpu):
    """A deterministic TE run may switch to local core attention by itself; an exported switch
    must not stop it in megatron-core's backend assertion."""
    exported(monkeypatch, NVTE_FLASH_ATTN="1", NVTE_FUSED_ATTN="0")
    select_te_attention_backend(backend, impl)
    assert not any(name in os.environ for name in SWITCHES)
    tiny_cpu.build(engine=EngineConfig(attention_backend=backend))


def test_auto_under_te_refuses_a_backend_switched_off(monkeypatch):
    exported(monkeypatch, NVTE_FUSED_ATTN="0")
    with pytest.raises(ConfigError, match="NVTE_FUSED_ATTN=0 .* --attention-backend flash"):
        select_te_attention_backend("auto", "transformer_engine")
    exported(monkeypatch, NVTE_FLASH_ATTN="1")
    select_te_attention_backend("auto", "transformer_engine")
    assert os.environ["NVTE_FLASH_ATTN"] == "1"


@pytest.mark.parametrize(
    "fields, flag",
    [
        (dict(fp8_format="e5m2"), "--fp8-format"),
        (dict(fp8_recipe="current"), "--fp8-recipe"),
        (dict(fp8_amax_compute_algo="mean"), "--fp8-amax-compute-algo"),
        (dict(transformer_impl="te"), "--transformer-impl"),
        (dict(fp8_param_gather=True), "--fp8-param-gather needs --fp8-format"),
        (
            dict(fp8_format="hybrid", first_last_layers_bf16=True),
            "--first-last-layers-bf16 does not work with --fp8-recipe delayed",
        ),
        (dict(fp8_amax_history_len=0), "--fp8-amax-history-len"),
    ],
)
def test_bad_values_are_refused_at_construction(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineConfig(**fields)


def test_context_parallel_size_is_validated():
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        ParallelConfig(context_parallel_size=0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine"),
        (["--fp8-format", "e4m3"], "--fp8-format e4m3 needs --transformer-impl transformer_engine"),
        (["--cp-comm-type", "ring"], "--cp-comm-type must be one of p2p, a2a, a2a+p2p"),
        (
            ["--context-parallel-size", "3", "--seq-length", "64"],
            "--seq-length (64) is not divisible by 2 x --context-parallel-size (3)",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
                "--num-attention-heads",
                "2",
                "--num-query-groups",
                "2",
            ],
            "--cp-comm-type a2a: --num-attention-heads (2) / --tensor-model-parallel-size (1)",
        ),
        (
            ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"],
            "--hierarchical-context-parallel-sizes 2 3: the product 2 x 3 = 6 is not",
        ),
        (
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--seq-length", "64"],
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P",
        ),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "--seq-length", "64"],
            "--cp-comm-type lists 2 values for --num-layers (4)",
        ),
        (["--log-intermediate-metrics", "skew"], "--log-intermediate-metrics: unknown skew"),
    ],
)
def test_entry_point_exits_2_with_one_line_before_building_anything(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--device", "cpu", "--train-iters", "1", *flags])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in last and message in last


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_main_grad_alignment_follows_the_buffer_layout(tiny_cpu, distributed_optimizer):
    """Gradient-accumulation fusion lets TE's GEMMs write only 16-byte aligned ``main_grad``s:
    the distributed optimizer's buffer aligns every parameter; the plain one packs them, and
    xIELU's scalar parameters shift the weights after them."""
    from megatron.apertus.model.engine import is_gemm_aligned
    from megatron.apertus.training.step import wrap_ddp

    chunk = tiny_cpu.build()
    (ddp,) = wrap_ddp([chunk], chunk.config, use_distributed_optimizer=distributed_optimizer)
    aligned = [is_gemm_aligned(p.main_grad) for p in ddp.parameters() if p.dim() == 2]
    assert all(aligned) if distributed_optimizer else not all(aligned)
