"""The planner: refusals name the broken constraint; the published 8B and 70B layouts."""

from __future__ import annotations

import re

import pytest

from megatron.apertus.errors import ConfigError
from megatron.apertus.launch.planner import (
    GIB,
    Cluster,
    format_plan,
    plan,
    run_from_args,
)
from tools.plan_layout import main as plan_layout

RECIPE = [
    "--precision",
    "bf16",
    "--seq-length",
    "4096",
    "--optimizer",
    "ademamix",
    "--use-distributed-optimizer",
]
EIGHT_B = RECIPE + [
    "--train-iters",
    "1000",
    "--model-preset",
    "apertus-8b",
    "--tensor-model-parallel-size",
    "2",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "2048",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "block",
    "--recompute-num-layers",
    "8",
]
SEVENTY_B = RECIPE + [
    "--train-iters",
    "1000",
    "--model-preset",
    "apertus-70b",
    "--tensor-model-parallel-size",
    "4",
    "--pipeline-model-parallel-size",
    "8",
    "--virtual-pipeline-model-parallel-size",
    "5",
    "--sequence-parallel",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4096",
]
GH200 = dict(gpus_per_node=4, gpu_memory_gib=96)


def test_published_8b_layout_on_1024_gpus():
    result = plan(run_from_args(EIGHT_B), Cluster(gpus=1024, **GH200))
    assert result.ok, result.problems
    assert (result.data_parallel, result.microbatches) == (512, 1)
    stage = result.peak
    model = result.run.model
    replicated = model.num_layers * (2 * model.hidden_size + 2 * model.kv_channels + 2) + 4096
    assert stage.parameters == (model.num_parameters() - replicated) // 2 + replicated  # TP=2
    assert stage.weights == 2 * stage.parameters and stage.gradients == 4 * stage.parameters
    assert stage.optimizer == pytest.approx(16 * stage.parameters / 512)  # master + 3 moments
    assert stage.total / GIB < 0.9 * 96
    assert result.recompute_alternatives["none"] / GIB > 0.9 * 96, "fits only with recomputation"


def test_alignment_is_planned_with_the_output_loss_it_runs():
    """An alignment run's output loss is unfused, as the run itself decides: its whole logits
    and their fp32 softmax are planned (also for an explicit --no-fused-output-loss)."""
    cluster = Cluster(gpus=1024, **GH200)
    fused = plan(run_from_args(EIGHT_B), cluster)
    aligned = plan(run_from_args(EIGHT_B + ["--align-objective", "dpo"]), cluster)
    flagged = plan(run_from_args(EIGHT_B + ["--no-fused-output-loss"]), cluster)
    assert fused.run.training.fused_output_loss and not aligned.run.training.fused_output_loss
    vocab_per_rank, tokens = 131072 // 2, 4 * 4096  # TP 2; micro-batch 4 x 4096
    assert aligned.peak.loss_buffers == (2 + 4) * tokens * vocab_per_rank
    assert flagged.peak.loss_buffers == aligned.peak.loss_buffers > fused.peak.loss_buffers
    assert "unfused output layer + loss (logits, fp32 softmax)" in format_plan(aligned)
    assert "fused output layer + loss (dX" in format_plan(fused)
    with pytest.raises(ConfigError, match="cannot run with --align-objective"):
        run_from_args(EIGHT_B + ["--align-objective", "dpo", "--fused-output-loss"])


def test_published_70b_layout_on_4096_gpus():
    result = plan(run_from_args(SEVENTY_B), Cluster(gpus=4096, **GH200))
    assert result.ok, result.problems
    assert (result.data_parallel, result.microbatches) == (128, 32)
    first, middle, last = result.stages[0], result.stages[1], result.stages[-1]
    hidden = result.run.model.hidden_size
    assert last.parameters == first.parameters + hidden > middle.parameters  # + final norm
    assert result.peak.pipeline_rank == 0, "the first stage holds the most micro-batches"
    assert result.flops_per_step == pytest.approx(6 * 70.6e9 * 4096 * 4096, rel=0.05)


@pytest.mark.parametrize(
    "flags, gpus, message",
    [
        (
            [
                "--model-preset",
                "apertus-70b",
                "--tensor-model-parallel-size",
                "4",
                "--pipeline-model-parallel-size",
                "8",
                "--virtual-pipeline-model-parallel-size",
                "3",
            ],
            4096,
            "--num-layers (80) is not divisible by --pipeline-model-parallel-size (8) x virtual stages (3)",
        ),
        (
            ["--model-preset", "apertus-8b", "--tensor-model-parallel-size", "3"],
            1020,
            "--num-attention-heads (32) is not divisible by --tensor-model-parallel-size (3)",
        ),
        (
            [
                "--model-preset",
                "apertus-8b",
                "--tensor-model-parallel-size",
                "2",
                "--micro-batch-size",
                "4",
                "--global-batch-size",
                "1024",
            ],
            1024,
            "--global-batch-size (1024) is not divisible by --micro-batch-size (4) x data-parallel size "
            "(512) = 2048",
        ),
        (
            [
                "--model-preset",
                "apertus-70b",
                "--tensor-model-parallel-size",
                "4",
                "--pipeline-model-parallel-size",
                "8",
                "--virtual-pipeline-model-parallel-size",
                "5",
                "--global-batch-size",
                "1152",
            ],
            4096,
            "gives 9 micro-batches per step, not a multiple of --pipeline-model-parallel-size (8)",
        ),
        (
            ["--model-preset", "apertus-8b", "--tensor-model-parallel-size", "8"],
            1024,
            "--tensor-model-parallel-size (8) does not divide GPUs per node (4)",
        ),
        (
            [
                "--model-preset",
                "apertus-8b",
                "--tensor-model-parallel-size",
                "2",
                "--micro-batch-size",
                "4",
                "--global-batch-size",
                "2048",
            ],
            1024,
            "pipeline stage 0 needs 93.8 GiB per GPU, more than the 86.4 GiB usable (90% of 96 GiB); "
            "--recompute-granularity full",
        ),
        (
            [
                "--model-preset",
                "apertus-8b",
                "--global-batch-size",
                "2048",
                "--micro-batch-size",
                "1",
                "--tensor-model-parallel-size",
                "2",
                "--rampup-batch-size",
                "256",
                "100",
                "1000",
            ],
            1024,
            "--rampup-batch-size 256 100: the ramp from 256 must reach --global-batch-size 2048",
        ),
    ],
    ids=[
        "layers-pp-vp",
        "heads-tp",
        "global-batch",
        "interleaved-microbatches",
        "tp-across-nodes",
        "memory",
        "ramp-up",
    ],
)
def test_refusals_name_the_constraint(flags, gpus, message):
    length = ["--train-samples" if "--rampup-batch-size" in flags else "--train-iters", "100000"]
    result = plan(run_from_args(RECIPE + length + flags), Cluster(gpus=gpus, **GH200))
    assert not result.ok
    assert any(message in problem for problem in result.problems), result.problems
    assert "REFUSED:" in format_plan(result)


def test_sample_based_length_follows_megatron_cores_ramp_up():
    """tests/training/test_loop.py observes 7 steps (batches 2, 2, 2, 2, 4, 4, 4) for this run."""
    run = run_from_args(
        [
            "--rampup-batch-size",
            "2",
            "2",
            "8",
            "--train-samples",
            "20",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "1",
        ]
    )
    assert run.training.total_iterations(dp=1) == 7


def test_cli_prints_the_plan_and_exits_1_on_refusal(capsys):
    assert plan_layout(["--gpus", "1024", "--gpu-memory-gib", "96", "--", *EIGHT_B]) == 0
    assert "OK: the layout is valid and fits" in capsys.readouterr().out
    bad = EIGHT_B + ["--global-batch-size", "1024"]
    assert plan_layout(["--gpus", "1024", "--gpu-memory-gib", "96", "--", *bad]) == 1
    assert "REFUSED:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cluster, message",
    [
        (dict(gpu_memory_gib=0.0), "--gpu-memory-gib (0) must be positive"),
        (dict(gpu_memory_gib=-80.0), "--gpu-memory-gib (-80) must be positive"),
        (dict(gpu_memory_gib=float("nan")), "--gpu-memory-gib (nan) must be positive"),
        (dict(gpu_memory_gib=96.0, usable_fraction=0.0), "--usable-fraction (0) must be in"),
        (dict(gpu_memory_gib=96.0, usable_fraction=1.5), "--usable-fraction (1.5) must be in"),
    ],
    ids=["zero memory", "negative memory", "nan memory", "no usable share", "more than all"],
)
def test_a_gpu_without_memory_is_refused_not_planned(cluster, message):
    """A memory of 0 was both "not checked" in the plan's header and the reason for refusing
    every layout (exit 1, as for a layout that does not fit): it is a mistake in the flags."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        Cluster(gpus=8, gpus_per_node=4, **cluster)
