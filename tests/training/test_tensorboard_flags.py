"""Megatron-LM's TensorBoard flags, read back from the event files of tiny runs:
--tensorboard-log-interval thins the training scalars (not validation's, not --log-json's),
--log-validation-ppl-to-tensorboard writes exp(validation loss), --tensorboard-queue-size
sizes the writer's queue (--log-timers-to-tensorboard: tests/training/test_step_timers.py)."""

from __future__ import annotations

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron.apertus.training.loop import train
from megatron.apertus.training.metrics import Metrics
from tests.conftest import SMALL_VOCABULARY
from tests.training.test_first_hour import refused

BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--eval-interval 3 --log-interval 1 --lr 3e-3 --seed 5 --train-iters 5"
).split() + SMALL_VOCABULARY
THINNED = ["lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm", "iteration-time"]


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder)).Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The scalars and history of a run with --tensorboard-log-interval 2 and the validation
    perplexity, and the scalars of the same run with neither."""
    root = tmp_path_factory.mktemp("tensorboard")
    flags = ["--tensorboard-log-interval", "2", "--log-validation-ppl-to-tensorboard"]
    history = train(
        pretrain_gpt.parse_args(BASE + flags + ["--tensorboard-dir", str(root / "thinned")])
    )
    train(pretrain_gpt.parse_args(BASE + ["--tensorboard-dir", str(root / "default")]))
    return _scalars(root / "thinned"), history, _scalars(root / "default")


def test_the_interval_thins_the_training_scalars(written):
    """As Megatron-LM: the iterations that are multiples of the interval; by default every one."""
    thinned, history, default = written
    for tag in THINNED:
        assert [step for step, _ in thinned[tag]] == [2, 4], tag
        assert [step for step, _ in default[tag]] == [1, 2, 3, 4, 5], tag
    assert [step for step, _ in thinned["lm loss vs samples"]] == [8, 16]
    assert [it for it, _ in history["train/loss"]] == [1, 2, 3, 4, 5], "the history keeps all"
    assert [value for _, value in thinned["lm loss"]] == pytest.approx(
        [history["train/loss"][1][1], history["train/loss"][3][1]], rel=1e-6
    )


def test_validation_is_written_at_every_pass_with_its_perplexity(written):
    thinned, history, default = written
    loss = thinned["lm loss validation"]
    assert [step for step, _ in loss] == [0, 3, 5], "not thinned by the interval"
    ppl = thinned["lm loss validation ppl"]
    assert [step for step, _ in ppl] == [0, 3, 5]
    for (_, value), (_, perplexity) in zip(loss, ppl):
        assert perplexity == pytest.approx(math.exp(value), rel=1e-5)
    assert [step for step, _ in thinned["lm loss validation ppl vs samples"]] == [0, 12, 20]
    assert [it for it, _ in history["valid/ppl"]] == [0, 3, 5]
    assert not any("ppl" in tag for tag in default), "only with the flag"


def test_queue_size_is_the_writers(tmp_path):
    metrics = Metrics(
        tensorboard_dir=str(tmp_path),
        wandb_project=None,
        wandb_exp_name=None,
        config={},
        tensorboard_queue_size=7,
    )
    assert metrics.tensorboard.max_queue == 7
    metrics.close(None)


@pytest.mark.parametrize("flag", ["--tensorboard-log-interval", "--tensorboard-queue-size"])
def test_a_count_below_one_is_refused(flag):
    assert refused([flag, "0"]) == f"{flag} must be >= 1, got 0"
