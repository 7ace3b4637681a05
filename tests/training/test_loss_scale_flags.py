"""Megatron-LM's loss-scaling flags reach megatron-core's gradient scaler: --loss-scale holds
the scale constant, --initial-loss-scale and --loss-scale-window start and grow fp16's dynamic
one; values it cannot divide by are refused in one line."""

from __future__ import annotations

import pytest

import pretrain_gpt
from megatron.apertus.training.loop import train
from tests.conftest import SMALL_VOCABULARY
from tests.training.test_first_hour import refused

FP16 = (
    "--model-preset tiny --mock-data --global-batch-size 2 --micro-batch-size 2 --eval-iters 0 "
    "--log-interval 1 --train-iters 3 --fp16"
).split() + SMALL_VOCABULARY


def scales(*flags: str) -> list[float]:
    history = train(pretrain_gpt.parse_args(FP16 + list(flags)))
    return [scale for _, scale in history["train/loss_scale"]]


def test_a_static_loss_scale_stays():
    assert scales("--loss-scale", "1024") == [1024.0] * 3


def test_the_dynamic_scale_starts_where_asked_and_grows_after_its_window():
    assert scales("--initial-loss-scale", "4096") == [4096.0] * 3
    assert scales("--initial-loss-scale", "4096", "--loss-scale-window", "1") == [
        8192.0,
        16384.0,
        32768.0,
    ]


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--loss-scale", "0"], "--loss-scale must be a finite number > 0, got 0.0"),
        (["--hysteresis", "0"], "--hysteresis must be >= 1, got 0"),
        (
            ["--min-loss-scale", "8", "--initial-loss-scale", "4"],
            "--min-loss-scale must be <= --initial-loss-scale 4.0, got 8.0",
        ),
    ],
    ids=["zero-scale", "zero-hysteresis", "min-above-initial"],
)
def test_scales_it_cannot_divide_by_are_refused(flags, line):
    assert refused(flags) == line
