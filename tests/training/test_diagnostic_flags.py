"""Megatron-LM's profiler and diagnostic spellings: what the PyTorch profiler's trace holds with
--pytorch-profiler-collect-shapes/-callstack/-chakra (and without them), the FP8 weight-gradient
switch as megatron-core receives it, megatron-core's JIT fuser switched off, and the one-line
refusals of what a CPU run or this code cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron.core import jit

import pretrain_gpt
from megatron.apertus.model.engine import EngineConfig, transformer_config_fields
from megatron.apertus.training.loop import train
from tests.conftest import SMALL_VOCABULARY
from tests.test_apertus_launch_args import error_lines

BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 0 "
    "--log-interval 1 --lr 3e-3 --seed 5 --device cpu"
).split() + SMALL_VOCABULARY
COLLECT = [
    "--pytorch-profiler-collect-shapes",
    "--pytorch-profiler-collect-callstack",
    "--pytorch-profiler-collect-chakra",
]


def _profiled(tmp_path: Path, flags: list[str]) -> list[dict]:
    """The trace events of a profiled iteration 2 (Megatron-LM's window: START to END-1)."""
    board = tmp_path / "tb"
    profile = "--train-iters 2 --profile --use-pytorch-profiler --profile-step-start 2 "
    profile += f"--profile-step-end 3 --tensorboard-dir {board}"
    train(pretrain_gpt.parse_args(BASE + profile.split() + flags))
    (trace,) = board.glob("*.pt.trace.json")
    return json.loads(trace.read_text())["traceEvents"]


def test_the_trace_holds_shapes_and_stacks_only_when_asked(tmp_path):
    events = _profiled(tmp_path / "with", COLLECT)
    mm = [e for e in events if e.get("name") == "aten::mm"]
    assert mm and all(e["args"].get("Input Dims") for e in mm), "shapes of every matmul"
    assert any(e.get("cat") == "python_function" for e in events), "the Python call stack"
    chakra = tmp_path / "with" / "chakra" / "rank-0.json.gz"
    assert chakra.stat().st_size > 0, "Megatron-LM's place for the execution trace"

    events = _profiled(tmp_path / "without", [])
    assert not [e for e in events if "Input Dims" in e.get("args", {})]
    assert not [e for e in events if e.get("cat") == "python_function"]
    assert not (tmp_path / "without" / "chakra").exists()


def test_no_fp8_wgrad_reaches_megatron_cores_recipe_field():
    """megatron-core builds DelayedScaling's override_linear_precision from ``fp8_wgrad``."""
    for flag in ("--no-fp8-wgrad", "--disable-fp8-wgrad"):
        engine = pretrain_gpt.parse_args(BASE + ["--train-iters", "1", flag]).engine
        assert engine.no_fp8_wgrad
    fp8 = EngineConfig(fp8_format="e4m3", no_fp8_wgrad=True)
    assert transformer_config_fields(fp8, "transformer_engine")["fp8_wgrad"] is False
    default = EngineConfig(fp8_format="e4m3")
    assert transformer_config_fields(default, "transformer_engine")["fp8_wgrad"] is True


def test_disable_jit_fuser_leaves_megatron_cores_decorator_a_no_op():
    assert jit.jit_fuser is not jit.noop_decorator
    try:
        train(pretrain_gpt.parse_args(BASE + ["--train-iters", "1", "--disable-jit-fuser"]))
        assert jit.jit_fuser is jit.noop_decorator
    finally:
        jit.enable_jit_fuser()


def test_restatements_are_accepted():
    pretrain_gpt.parse_args(BASE + ["--train-iters", "1", "--fp8-interval", "1"])
    pretrain_gpt.parse_args(BASE + ["--train-iters", "1", "--record-shapes"])


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--nvtx-ranges"], "--nvtx-ranges emits NVTX ranges for Nsight Systems"),
        (["--te-rng-tracker"], "--te-rng-tracker is Transformer Engine's RNG tracker"),
        (["--log-energy"], "--log-energy: the GPUs' energy is read through NVML"),
        (
            ["--disable-gloo-process-groups"],
            "--disable-gloo-process-groups: megatron-core's gloo process groups",
        ),
        (
            ["--dataloader-inter-document-masking"],
            "--dataloader-inter-document-masking: give --reset-attention-mask "
            "--reset-position-ids",
        ),
        (["--fp8-interval", "2"], "--fp8-interval 2: deprecated in Megatron-LM"),
        (
            ["--no-fp8-wgrad", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
            "--no-fp8-wgrad: megatron-core keeps the weight gradients in FP8",
        ),
    ],
)
def test_refusals_are_one_line(flags, line, capsys):
    (refusal,) = error_lines(capsys, BASE + ["--train-iters", "1", *flags])
    assert refusal.startswith(line)
