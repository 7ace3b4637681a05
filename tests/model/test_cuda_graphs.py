"""The CUDA-graph flags keep Megatron-LM's names and meanings, reach megatron-core's
TransformerConfig on this line, and are refused in one line (exit 2) where a graph cannot run:
on this CPU, and on a GPU (described through the probes) for each combination megatron-core or
a replay cannot honour, while the combinations that can run pass (the controls)."""

from __future__ import annotations

import dataclasses

import pytest

import pretrain_gpt
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import ADDITION_MARK
from megatron.apertus.model.cuda_graphs import CudaGraphConfig, GraphedRun, cuda_graph_problems
from pretrain_gpt import parse_args

TE_OK = lambda: None  # noqa: E731
TE_MISSING = lambda: "Transformer Engine is not installed"  # noqa: E731
GPU_RUN = GraphedRun(
    device="cuda",
    precision="bf16",
    transformer_impl="transformer_engine",
    attention_backend="auto",
    packed_documents=False,
    pipeline_parallel=1,
    context_parallel=1,
    rampup=False,
    recompute_granularity=None,
    fp8=False,
    bf16_layers=False,
    fp8_guard_switches=False,
    intermediate_metrics=False,
    gradient_accumulation_fusion=True,
)
"""A bf16 run on a GPU with TE, unpacked: graphs of either implementation can run here unless a
case changes something."""
TE_GRAPHS = CudaGraphConfig(cuda_graph_impl="transformer_engine")
TE_MLP = CudaGraphConfig(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"])
LOCAL = CudaGraphConfig(cuda_graph_impl="local")


def problems(graphs: CudaGraphConfig, te=TE_OK, **changes) -> list[str]:
    return cuda_graph_problems(graphs, dataclasses.replace(GPU_RUN, **changes), te)


def test_flags_have_megatron_lm_names_defaults_and_no_addition_mark():
    parser = pretrain_gpt.build_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    impl = actions["--cuda-graph-impl"]
    assert impl.default == "none" and impl.choices == ("none", "local", "transformer_engine")
    assert actions["--cuda-graph-scope"].default == []
    assert actions["--cuda-graph-warmup-steps"].default == 3
    for flag in ("--cuda-graph-impl", "--cuda-graph-scope", "--cuda-graph-warmup-steps"):
        assert actions[flag].help and not actions[flag].help.endswith(ADDITION_MARK)
    assert "--cuda-graph-impl {none,local,transformer_engine}" in parser.format_help()


def test_flags_parse_into_the_config_group():
    from megatron.apertus.training.config import groups_from_arguments

    args = pretrain_gpt.build_parser().parse_args(
        [
            "--train-iters",
            "1",
            "--cuda-graph-impl",
            "transformer_engine",
            "--cuda-graph-scope",
            "mlp",
            "--cuda-graph-warmup-steps",
            "1",
        ]
    )
    graphs = groups_from_arguments(args, ["cuda_graphs"])["cuda_graphs"]
    assert graphs == CudaGraphConfig(
        cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"], cuda_graph_warmup_steps=1
    )
    assert not graphs.covers_attention and TE_GRAPHS.covers_attention
    default = groups_from_arguments(
        pretrain_gpt.build_parser().parse_args(["--train-iters", "1"]), ["cuda_graphs"]
    )["cuda_graphs"]
    assert default == CudaGraphConfig() and not default.enabled


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl local needs a CUDA device"),
        (
            ["--cuda-graph-impl", "transformer_engine"],
            "--cuda-graph-impl transformer_engine needs a CUDA device (this run is on cpu)",
        ),
        (["--cuda-graph-impl", "cpu"], "argument --cuda-graph-impl: invalid choice: 'cpu'"),
        (["--cuda-graph-scope", "mlp"], "--cuda-graph-scope mlp needs --cuda-graph-impl"),
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"],
            "megatron-core's local graphs cover whole layers",
        ),
        (
            ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"],
            "--cuda-graph-scope full_iteration: megatron-core's whole-iteration graph",
        ),
        (
            ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe"],
            "--cuda-graph-scope moe: the Apertus model has no MoE or Mamba layers",
        ),
        (["--cuda-graph-warmup-steps", "-1"], "--cuda-graph-warmup-steps must be >= 0, got -1"),
    ],
)
def test_entry_point_refuses_in_one_line_with_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--device", "cpu", "--train-iters", "1", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_without_te_both_implementations_are_refused():
    for graphs in (LOCAL, TE_GRAPHS):
        (line,) = problems(graphs, te=TE_MISSING)
        assert line.startswith(f"--cuda-graph-impl {graphs.cuda_graph_impl}: Transformer Engine")


@pytest.mark.parametrize(
    "graphs, changes, message",
    [
        (TE_GRAPHS, dict(packed_documents=True), "graph the MLP only (--cuda-graph-scope mlp)"),
        (LOCAL, dict(packed_documents=True), "packed documents (--reset-attention-mask)"),
        (TE_GRAPHS, dict(transformer_impl="local"), "--transformer-impl local reads the all-zero"),
        (TE_GRAPHS, dict(attention_backend="local"), "--attention-backend local reads"),
        (LOCAL, dict(recompute_granularity="full"), "--recompute-granularity full"),
        (TE_MLP, dict(pipeline_parallel=2, rampup=True), "--rampup-batch-size changes"),
        (LOCAL, dict(transformer_impl="local", context_parallel=2), "context-parallel attention"),
        (TE_GRAPHS, dict(fp8=True, bf16_layers=True), "--bf16-layers is read at every forward"),
        (TE_MLP, dict(fp8=True, fp8_guard_switches=True), "the FP8 guard's switching actions"),
        (TE_GRAPHS, dict(intermediate_metrics=True), "--log-intermediate-metrics reads"),
        (TE_MLP, dict(precision="fp32"), "needs --precision bf16: megatron-core captures"),
        (LOCAL, {}, "give --no-gradient-accumulation-fusion"),
        (TE_GRAPHS, dict(device="cpu"), "needs a CUDA device (this run is on cpu)"),
    ],
)
def test_each_combination_a_graph_cannot_run_is_refused(graphs, changes, message):
    found = problems(graphs, **changes)
    assert found and message in found[0], found
    assert all("\n" not in line for line in found)


@pytest.mark.parametrize(
    "graphs, changes",
    [
        (TE_GRAPHS, {}),
        (TE_MLP, dict(packed_documents=True)),
        (TE_MLP, dict(transformer_impl="local")),
        (TE_MLP, dict(fp8=True, pipeline_parallel=2, context_parallel=2)),
        (TE_GRAPHS, dict(fp8=False, bf16_layers=True)),
        (LOCAL, dict(gradient_accumulation_fusion=False)),
        (LOCAL, dict(transformer_impl="local")),
        (LOCAL, dict(transformer_impl="local", precision="fp32")),
        (LOCAL, dict(transformer_impl="local", rampup=True, recompute_granularity="selective")),
        (CudaGraphConfig(), dict(device="cpu", packed_documents=True, transformer_impl="local")),
    ],
)
def test_combinations_that_can_run_pass(graphs, changes):
    assert problems(graphs, **changes) == []


def test_expandable_segments_need_nccl_graph_register_off(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    assert "NCCL_GRAPH_REGISTER=0" in problems(TE_GRAPHS)[0]
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert problems(TE_GRAPHS) == []


def test_a_direct_config_is_checked_like_the_flags():
    with pytest.raises(ConfigError, match="--cuda-graph-impl must be one of"):
        CudaGraphConfig(cuda_graph_impl="full_iteration")


@pytest.mark.parametrize(
    "graphs, scope",
    [(CudaGraphConfig(), []), (TE_MLP, ["mlp"]), (TE_GRAPHS, []), (LOCAL, [])],
)
def test_megatron_core_takes_the_fields_on_this_line(graphs, scope, recwarn):
    """megatron-core's own TransformerConfig (its validation included) accepts what the builder
    passes, without its deprecation warnings; 0.19 spells the scope ``cuda_graph_modules``."""
    from megatron.apertus.mcore_compat import CUDA_GRAPH_MODULES
    from megatron.apertus.model.builder import transformer_config
    from megatron.apertus.model.config import ParallelConfig, preset

    config = transformer_config(preset("tiny"), ParallelConfig(), graphs=graphs)
    field = config.cuda_graph_modules if CUDA_GRAPH_MODULES else config.cuda_graph_scope
    assert config.cuda_graph_impl == graphs.cuda_graph_impl
    assert [s.name for s in field] == scope
    assert config.cuda_graph_warmup_steps == graphs.cuda_graph_warmup_steps
    assert config.use_te_rng_tracker == graphs.enabled
    deprecated = [w for w in recwarn if "cuda_graph" in str(w.message)]
    assert not deprecated, [str(w.message) for w in deprecated]
