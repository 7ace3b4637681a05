"""The training loop's guards and outputs: NaN skipping and stopping, batch ramp-up, logs."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import final_losses
from megatron.apertus.training.loop import TrainingStopped, train
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, after_backward, read_json, run_entry, series

BASE = [
    "--model-preset",
    "tiny",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--lr",
    "3e-3",
    *SMALL_VOCABULARY,
]


def poison(at: set[int]):
    """An ``after_backward`` hook that writes NaN into one gradient at the given iterations."""

    def hook(iteration: int, model) -> None:
        if iteration in at:
            next(model[0].parameters()).main_grad.view(-1)[0] = math.nan

    return hook


def test_nan_gradient_skips_the_step_and_training_goes_on(tmp_path):
    snapshots = {}

    def hook(iteration, model):
        snapshots[iteration] = [p.detach().clone() for p in model[0].parameters()]
        poison({2})(iteration, model)

    cfg = pretrain_gpt.parse_args(BASE + ["--train-iters", "4", "--save", str(tmp_path)])
    with after_backward(hook):
        history = train(cfg)
    norms = dict(history["train/grad_norm"])
    assert set(norms) == {1, 3, 4}, "the poisoned step has no finite norm to record"
    # Weights seen at iteration 3 equal those at iteration 2: the update of step 2 was skipped.
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
    assert history["completed"]


def test_repeated_nan_stops_with_the_last_good_state_saved(tmp_path):
    cfg = pretrain_gpt.parse_args(
        BASE + ["--train-iters", "8", "--save", str(tmp_path), "--max-skipped-steps", "3"]
    )
    with pytest.raises(TrainingStopped, match="3 consecutive steps") as err:
        with after_backward(poison({3, 4, 5, 6, 7, 8})):
            train(cfg)
    assert str(tmp_path) in str(err.value)
    assert checkpoint.latest_iteration(tmp_path) == 5  # iterations 3-5 skipped: weights of step 2


def test_batch_size_ramp_up_and_sample_based_length(tmp_path):
    log = tmp_path / "history.json"
    proc = run_entry(
        PRETRAIN,
        BASE
        + [
            "--rampup-batch-size",
            "2",
            "2",
            "8",
            "--train-samples",
            "20",
            "--micro-batch-size",
            "1",
            "--log-json",
            str(log),
        ],
    )
    batches = [int(size) for size in re.findall(r"\| global batch size: +(\d+) \|", proc.stdout)]
    assert batches == [2, 2, 2, 2, 4, 4, 4], batches
    assert re.search(r"iteration +7/ +7 \| consumed samples: +20 \|", proc.stdout)


def test_tensorboard_plot_and_json(tmp_path):
    run_entry(
        PRETRAIN,
        BASE
        + [
            "--train-iters",
            "3",
            "--eval-interval",
            "3",
            "--save",
            str(tmp_path / "ckpt"),
            "--tensorboard-dir",
            str(tmp_path / "tb"),
            "--log-json",
            str(tmp_path / "h.json"),
        ],
    )
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    png = (tmp_path / "ckpt" / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    history = read_json(tmp_path / "h.json")
    assert series(history, "train/loss")[0] == [1, 2, 3]
    assert series(history, "valid/loss")[0] == [0, 3]


def test_trigger_files_save_and_exit(tmp_path):
    triggers = tmp_path / "triggers"
    triggers.mkdir()
    (triggers / "save").touch()
    (triggers / "exit").touch()
    proc = run_entry(
        PRETRAIN,
        BASE
        + [
            "--train-iters",
            "50",
            "--save",
            str(tmp_path / "ckpt"),
            "--trigger-path",
            str(triggers),
        ],
    )
    assert "exit requested by trigger file" in proc.stdout
    assert checkpoint.latest_iteration(tmp_path / "ckpt") == 1
    assert not (triggers / "save").exists(), "an honoured save request is removed"


def test_the_last_checkpoint_holds_the_final_validation(tmp_path):
    """The run's last step falls on --save-interval: its validation pass comes before that save,
    so the checkpoint's own history, the save directory's and an export's model card
    (``final_losses``) all hold the final validation loss, the one the run returns."""
    save = tmp_path / "save"
    history = train(
        pretrain_gpt.parse_args(
            BASE + ["--train-iters", "2", "--save-interval", "2", "--save", str(save)]
        )
    )
    final = series(history, "valid/loss")
    assert final[0] == [2]
    for recorded in (save / "iter_0000002" / "metrics.json", save / "metrics.json"):
        assert series(json.loads(recorded.read_text()), "valid/loss") == final
    assert final_losses(save / "iter_0000002")["valid/loss"] == (2, final[1][0])
