"""Where Megatron-LM's trainer behaves in a way that scripts, log parsers and dashboards rely on,
ours behaves the same: the iteration line's fields, names and order, its TensorBoard tags,
--exit-duration-in-mins, --use-checkpoint-args, and a resubmitted job of a finished run.

The expected formats are Megatron-LM's ``training_log`` and ``evaluate_and_print_results``
(``megatron/training/training.py``): each field is ``name: value`` closed by `` |``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.training.loop import train
from tests.conftest import PRETRAIN, after_backward, run_entry
from tests.training.test_first_hour import TINY, refused

BASE = [
    "--model-preset",
    "tiny",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
    "--lr",
    "3e-3",
]

MEGATRON_FIELDS = [
    r"iteration +(?P<iteration>\d+)/ +\d+",
    r"consumed samples: +\d+",
    r"elapsed time per iteration \(ms\): \d+\.\d",
    r"throughput per GPU \(TFLOP/s/GPU\): \d+\.\d",
    r"learning rate: \d\.\d{6}E[+-]\d\d",
    r"global batch size: +\d+",
    r"lm loss: (?P<loss>\d\.\d{6}E[+-]\d\d)",
    r"loss scale: \d+\.\d",
    r"grad norm: \d+\.\d{3}",
    r"params norm: \d+\.\d{3}",
    r"number of skipped iterations: +(?P<skipped>\d+)",
    r"number of nan iterations: +(?P<nan>\d+)",
]
"""Megatron-LM's iteration line with --log-throughput and --log-params-norm, in its order."""
MEGATRON_LINE = re.compile(" [|] ".join(MEGATRON_FIELDS) + r" [|]")
MEGATRON_VALIDATION = re.compile(
    r"validation loss at iteration \d+ [|] lm loss value: \d\.\d{6}E[+-]\d\d [|] "
    r"lm loss PPL: \d\.\d{6}E[+-]\d\d [|]"
)
MEGATRON_TAGS = {
    "lm loss",
    "learning-rate",
    "batch-size",
    "loss-scale",
    "grad-norm",
    "params-norm",
    "lm loss validation",
}
"""Megatron-LM's TensorBoard scalars, each also written as "<tag> vs samples"."""
MEGATRON_TIMER_TAGS = {"iteration-time", "throughput"}


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "apertus"]


def test_iteration_line_validation_line_and_tensorboard_tags_are_megatrons(tmp_path):
    proc = run_entry(
        PRETRAIN,
        BASE
        + [
            "--train-iters",
            "2",
            "--log-interval",
            "1",
            "--log-params-norm",
            "--tensorboard-dir",
            str(tmp_path),
        ],
    )
    lines = [line for line in proc.stdout.splitlines() if re.search(r"\d iteration ", line)]
    assert len(lines) == 2 and all(MEGATRON_LINE.search(line) for line in lines), lines
    ours = lines[0].split("number of nan iterations:   0 | ", 1)[1]
    assert ours.startswith("tokens per second per device: "), "our fields follow Megatron-LM's"
    assert MEGATRON_VALIDATION.search(proc.stdout), proc.stdout
    events = EventAccumulator(str(next(tmp_path.glob("events.out.tfevents.*"))))
    tags = set(events.Reload().Tags()["scalars"])
    expected = MEGATRON_TAGS | {f"{tag} vs samples" for tag in MEGATRON_TAGS} | MEGATRON_TIMER_TAGS
    assert expected <= tags, sorted(expected - tags)
    by_samples = [event.step for event in events.Scalars("lm loss vs samples")]
    assert by_samples == [4, 8], "the x axis of a 'vs samples' tag is the consumed samples"


def test_skipped_and_nan_iterations_are_counted_over_the_interval(tmp_path, caplog):
    """Iteration 2 gets a NaN gradient and weight: skipped; iteration 3's loss is then NaN:
    skipped and a NaN iteration. The line of iteration 3 averages the loss of the steps that
    updated the weights since the previous regular line (iteration 1, whose line is the
    job's first, not a regular one)."""

    def poison(iteration: int, model) -> None:
        if iteration == 2:
            weight = next(model[0].parameters())
            weight.main_grad.view(-1)[0] = math.nan
            weight.data.fill_(math.nan)

    cfg = pretrain_gpt.parse_args(
        BASE + ["--train-iters", "3", "--log-interval", "3", "--eval-iters", "0"]
    )
    with caplog.at_level(logging.INFO, logger="apertus"):
        with after_backward(poison):
            history = train(cfg)
    matches = [
        m
        for line in _lines(caplog)
        if (
            m := re.search(
                r"iteration +(\d+)/.*lm loss: (\S+) \|.*skipped iterations: +(\d+) \| "
                r"number of nan iterations: +(\d+) \|",
                line,
            )
        )
    ]
    assert [m.group(1) for m in matches] == ["1", "3"]
    assert (matches[1].group(3), matches[1].group(4)) == ("2", "1")
    assert float(matches[1].group(2)) == pytest.approx(history["train/loss"][0][1], rel=1e-6)


def test_exit_duration_stops_validation_then_saves_and_exits(tmp_path, caplog):
    """A limit already passed: the validation at the start stops after its first batch (no
    loss recorded), the first step runs, then every rank agrees to save and stop."""
    cfg = pretrain_gpt.parse_args(
        BASE
        + [
            "--train-iters",
            "5",
            "--eval-interval",
            "1",
            "--eval-iters",
            "3",
            "--exit-duration-in-mins",
            "1e-4",
            "--save",
            str(tmp_path),
        ]
    )
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = train(cfg)
    assert not history["completed"]
    assert "valid/loss" not in history
    assert checkpoint.latest_iteration(tmp_path) == 1
    lines = _lines(caplog)
    assert "--exit-duration-in-mins reached during validation: stopping it" in lines
    assert (
        "exit requested by --exit-duration-in-mins 0.0001: saving a checkpoint and stopping"
        in lines
    )


@pytest.fixture(scope="module")
def narrow(tmp_path_factory) -> Path:
    """A one-step run of a model narrower than the preset (--hidden-size 32)."""
    save = tmp_path_factory.mktemp("narrow")
    train(
        pretrain_gpt.parse_args(
            BASE
            + [
                "--train-iters",
                "1",
                "--hidden-size",
                "32",
                "--lr-decay-iters",
                "4",
                "--save",
                str(save),
            ]
        )
    )
    return save


def test_rerunning_a_finished_run_says_so_and_writes_nothing(narrow, caplog):
    before = {p: p.stat().st_mtime_ns for p in narrow.rglob("*")}
    cfg = pretrain_gpt.parse_args(
        BASE
        + [
            "--train-iters",
            "1",
            "--hidden-size",
            "32",
            "--lr-decay-iters",
            "4",
            "--save",
            str(narrow),
            "--load",
            str(narrow),
        ]
    )
    with caplog.at_level(logging.INFO, logger="apertus"):
        assert train(cfg) == {"completed": True}
    assert _lines(caplog) == [
        f"the run is already finished: {narrow}/iter_0000001 is at "
        "iteration 1 (--train-iters 1); nothing to do"
    ]
    assert {p: p.stat().st_mtime_ns for p in narrow.rglob("*")} == before


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(narrow, capsys, caplog):
    cfg = pretrain_gpt.parse_args(
        BASE
        + [
            "--train-iters",
            "2",
            "--lr-decay-iters",
            "4",
            "--use-checkpoint-args",
            "--load",
            str(narrow),
        ]
    )
    assert cfg.model == checkpoint.load_model_config(narrow)
    assert cfg.model.hidden_size == 32
    assert "hidden_size" in capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = train(cfg)
    assert any(
        line.startswith(f"resumed from {narrow}/iter_0000001 at iteration 1")
        for line in _lines(caplog)
    ), _lines(caplog)
    assert history["train/loss"][-1][0] == 2


def test_use_checkpoint_args_keeps_the_flags_given(narrow):
    cfg = pretrain_gpt.parse_args(
        BASE
        + [
            "--train-iters",
            "2",
            "--seq-length",
            "64",
            "--use-checkpoint-args",
            "--load",
            str(narrow),
        ]
    )
    assert cfg.model == dataclasses.replace(checkpoint.load_model_config(narrow), seq_length=64)


def test_use_checkpoint_args_without_a_checkpoint_keeps_the_command_line(tmp_path, capsys):
    cfg = pretrain_gpt.parse_args(
        BASE + ["--train-iters", "2", "--use-checkpoint-args", "--load", str(tmp_path)]
    )
    assert cfg.model.hidden_size == 64
    assert "no checkpoint at" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_project_without_wandb_is_refused_in_one_line():
    assert refused(["--wandb-project", "apertus"]) == (
        "--wandb-project needs wandb, which is not installed: pip install 'megatron-apertus[wandb]'"
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            "--lr-warmup-iters 4",
            "--lr-warmup-iters 4 (8 samples) must be shorter than the schedule, "
            "the run's --train-iters 1 (2 samples)",
        ),
        (
            "--lr-warmup-iters 2 --lr-decay-iters 2",
            "--lr-warmup-iters 2 (4 samples) must be shorter "
            "than the schedule, --lr-decay-iters 2 (4 samples)",
        ),
        (
            "--lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 2 --lr-decay-iters 3",
            "--lr-warmup-iters 2 (4 samples) plus --lr-wsd-decay-iters 2 (4 samples) exceed the "
            "schedule, --lr-decay-iters 3 (6 samples)",
        ),
    ],
)
def test_a_schedule_that_does_not_fit_the_run_is_refused_naming_the_flags(flags, expected, capsys):
    with pytest.raises(SystemExit) as stopped:
        pretrain_gpt.parse_args(TINY + flags.split())
    assert stopped.value.code == 2
    assert f": error: {expected} (see " in capsys.readouterr().err.splitlines()[-1]
