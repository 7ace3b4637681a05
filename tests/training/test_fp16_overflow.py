"""fp16's dynamic loss scaling as in Megatron-LM: a step whose scaled gradients overflow (the loss
finite) is skipped and counted on the iteration line while the scale backs off, but is no fault
for --max-skipped-steps; a non-finite loss, and an overflow under a constant --loss-scale, are."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
import torch

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.training.loop import TrainingStopped, train
from tests.conftest import SMALL_VOCABULARY, after_backward, read_json, run_entry, series

FP16 = (
    "--model-preset tiny --global-batch-size 2 --micro-batch-size 2 --eval-iters 0 "
    "--log-interval 1 --lr 3e-3 --fp16 --max-skipped-steps 5"
).split() + SMALL_VOCABULARY

LINE = re.compile(
    r"iteration +(?P<iteration>\d+)/.* loss scale: (?P<scale>\d+\.\d) \|.*"
    r"number of skipped iterations: +(?P<skipped>\d+) \| "
    r"number of nan iterations: +(?P<nan>\d+) \|"
)


def iteration_lines(caplog) -> list[re.Match]:
    lines = (r.getMessage() for r in caplog.records if r.name == "apertus")
    return [m for line in lines if (m := LINE.search(line))]


def scaler_rule(overflowed: list[bool], *, initial: float = 2.0**32, hysteresis: int = 2):
    """The scale after each step by megatron-core's dynamic rule, within one growth window: each
    overflow spends one of the hysteresis, and every overflow once they are spent halves it."""
    scale, left, scales = initial, hysteresis, []
    for overflow in overflowed:
        if overflow:
            left -= 1
            scale = max(scale / 2, 1.0) if left <= 0 else scale
        scales.append(scale)
    return scales


def test_a_run_from_the_default_scale_trains_past_its_overflows(tmp_path, caplog):
    snapshots = {}

    def snapshot(iteration: int, model) -> None:
        snapshots[iteration] = [p.detach().clone() for p in model[0].parameters()]

    args = FP16 + ["--train-iters", "24", "--save", str(tmp_path), "--save-interval", "4"]
    with caplog.at_level(logging.INFO, logger="apertus"), after_backward(snapshot):
        history = train(pretrain_gpt.parse_args(args))
    assert history["completed"]
    lines = iteration_lines(caplog)
    assert [int(m["iteration"]) for m in lines] == list(range(1, 25))
    overflowed = [m["skipped"] == "1" for m in lines]
    first_update = overflowed.index(False) + 1
    assert first_update > 5 + 1, "more overflows in a row than --max-skipped-steps allows faults"
    assert all(m["nan"] == "0" for m in lines), "the losses stay finite"
    scales = [scale for _, scale in history["train/loss_scale"]]
    assert scales == scaler_rule(overflowed)
    assert [float(m["scale"]) for m in lines] == scales, "the line shows the scale after the step"
    for it in range(1, 24):
        same = all(torch.equal(a, b) for a, b in zip(snapshots[it], snapshots[it + 1]))
        assert same == overflowed[it - 1], f"iteration {it}: weights untouched iff skipped"
    updated = [it for it, overflow in enumerate(overflowed, 1) if not overflow]
    assert [it for it, _ in history["train/grad_norm"]] == updated, "no norm on an overflow"
    assert len(updated) >= 4
    losses = dict(history["train/loss"])
    assert min(losses[it] for it in updated[-3:]) < losses[1] - 0.1, losses
    saved = sorted(int(p.name[len("iter_") :]) for p in tmp_path.glob("iter_*"))
    assert saved and saved[0] >= first_update, "no checkpoint before the first update"
    assert checkpoint.latest_iteration(tmp_path) == 24


def test_a_nan_loss_under_fp16_still_stops_the_run(tmp_path, caplog):
    """Iteration 2 gets a NaN gradient (an overflow to the scaler: the loss is finite) and a NaN
    weight, so every later loss is NaN: faults, 3 in a row stop the run with step 1's weights."""

    def poison(iteration: int, model) -> None:
        if iteration == 2:
            weight = next(model[0].parameters())
            weight.main_grad.view(-1)[0] = math.nan
            weight.data.fill_(math.nan)

    args = FP16 + ["--train-iters", "10", "--save", str(tmp_path), "--max-skipped-steps", "3"]
    args += ["--initial-loss-scale", "1024"]
    with caplog.at_level(logging.INFO, logger="apertus"), after_backward(poison):
        with pytest.raises(TrainingStopped, match="3 consecutive steps"):
            train(pretrain_gpt.parse_args(args))
    lines = iteration_lines(caplog)
    assert [(m["skipped"], m["nan"]) for m in lines] == [("0", "0"), ("1", "0")] + [("1", "1")] * 3
    assert [float(m["scale"]) for m in lines] == [1024.0, 1024.0, 512.0, 256.0, 128.0]
    assert checkpoint.latest_iteration(tmp_path) == 5


def test_an_overflow_under_a_constant_loss_scale_is_a_fault(tmp_path):
    """Megatron-LM checks the gradients of a static scale for Inf and NaN (a fatal error); here
    the overflows count toward --max-skipped-steps and a run none of whose steps trained stops
    saving nothing."""
    args = FP16 + ["--train-iters", "10", "--save", str(tmp_path), "--loss-scale", "4294967296"]
    with pytest.raises(TrainingStopped, match="every step of this run \\(5, up to iteration 5\\)"):
        train(pretrain_gpt.parse_args(args))
    assert checkpoint.latest_iteration(tmp_path) is None


def test_an_overflow_at_the_minimum_scale_is_a_fault(tmp_path):
    """The scale cannot back off below --min-loss-scale: from there an overflow is a gradient
    that is not finite at any scale the run allows, a fault (Megatron-LM would skip such steps
    for ever). Iterations 1 and 2 are overflows (the second halves the scale to its minimum),
    3 to 5 faults."""
    args = FP16 + ["--train-iters", "10", "--save", str(tmp_path), "--max-skipped-steps", "3"]
    args += ["--min-loss-scale", "2147483648"]
    with pytest.raises(TrainingStopped, match="every step of this run \\(5, up to iteration 5\\)"):
        train(pretrain_gpt.parse_args(args))
    assert checkpoint.latest_iteration(tmp_path) is None


def test_a_run_that_ends_before_its_first_update_saves_nothing(tmp_path):
    args = FP16 + ["--train-iters", "3", "--save", str(tmp_path)]
    with pytest.raises(TrainingStopped, match="overflowed fp16's dynamic loss scale") as err:
        train(pretrain_gpt.parse_args(args))
    assert "--initial-loss-scale" in str(err.value)
    assert checkpoint.latest_iteration(tmp_path) is None


def test_an_interval_of_overflows_only_logs_a_loss_of_zero_as_megatron_lm(tmp_path, caplog):
    """Iterations 3 and 4 overflow (a NaN gradient, the loss finite): the line at 4 closes an
    interval none of whose steps updated the weights, and Megatron-LM's training_log prints its
    loss as the sum over the updating steps divided by max(1, their number): 0. --log-json keeps
    each step's loss, skipped or not, as Megatron-LM's TensorBoard ``lm loss`` does."""

    def overflow(iteration: int, model) -> None:
        if iteration in (3, 4):
            next(model[0].parameters()).main_grad.view(-1)[0] = math.nan

    log = tmp_path / "h.json"
    args = FP16 + ["--train-iters", "4", "--log-interval", "2", "--initial-loss-scale", "1024"]
    with caplog.at_level(logging.INFO, logger="apertus"), after_backward(overflow):
        train(pretrain_gpt.parse_args(args + ["--log-json", str(log)]))
    lines = [r.getMessage() for r in caplog.records if re.match(r"iteration +\d+/", r.getMessage())]
    losses = [re.search(r"\| lm loss: (\S+) \|", line) for line in lines]
    assert [m["iteration"] for m in iteration_lines(caplog)] == ["1", "2", "4"]
    assert [m["skipped"] for m in iteration_lines(caplog)] == ["0", "0", "2"]
    assert all(m is not None for m in losses), lines
    assert float(losses[1][1]) > 1.0 and losses[2][1] == "0.000000E+00"
    steps, values = series(read_json(log), "train/loss")
    assert steps == [1, 2, 3, 4] and all(math.isfinite(v) and v > 1.0 for v in values)


def test_overflows_before_the_first_update_log_no_loss_as_megatron_lm(caplog):
    """Before any step of the job updated the weights, Megatron-LM's training_log has no loss
    to average and prints none; neither does ours."""
    args = FP16 + ["--train-iters", "2", "--max-skipped-steps", "5"]
    with caplog.at_level(logging.INFO, logger="apertus"), pytest.raises(TrainingStopped):
        train(pretrain_gpt.parse_args(args))
    lines = [r.getMessage() for r in caplog.records if re.match(r"iteration +\d+/", r.getMessage())]
    assert len(lines) == 2 and not [line for line in lines if "lm loss" in line], lines


OVERFLOW_WORKER = Path(__file__).with_name("overflow_worker.py")
DISTRIBUTED = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--ddp-bucket-size",
    "40000",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "8",
    "--initial-loss-scale",
    "1024",
    "--hysteresis",
    "1",
    "--log-params-norm",
    "--check-weight-hash-across-dp-replicas-interval",
    "1",
    "--eval-interval",
    "4",
    "--eval-iters",
    "1",
    "--save-interval",
    "4",
]
"""Two data-parallel ranks sharding the optimizer over several buckets, their weights compared
after every step; a loss scale at which nothing overflows by itself."""


def test_one_ranks_overflow_with_the_distributed_optimizer_and_overlapped_gathers(tmp_path):
    """Rank 1 alone overflows at iterations 3 and 5 (its shard of the gradients; rank 0's is
    finite): both ranks skip the step, whose weights stay as they were (the params norm of the
    step before, the replicas equal), and --overlap-param-gather, which gathers the updated
    weights only in the next forward pass, trains, validates and saves exactly as the gather
    right after the step does (2 ranks, gloo)."""
    runs = {}
    for name, overlap in (("gathered", []), ("overlapped", ["--overlap-param-gather"])):
        log, save = tmp_path / f"{name}.json", str(tmp_path / name)
        flags = overlap + ["--log-json", str(log), "--save", save]
        run_entry(OVERFLOW_WORKER, ["3,5", *FP16, *DISTRIBUTED, *flags], nproc=2)
        runs[name] = read_json(log)
    gathered, overlapped = runs["gathered"], runs["overlapped"]
    steps, norms = series(overlapped, "train/params_norm")
    assert steps == list(range(1, 9))
    assert [it for it, _ in overlapped["train/grad_norm"]] == [1, 2, 4, 6, 7, 8]
    assert norms[2] == norms[1] and norms[4] == norms[3], "no update at 3 and 5"
    assert len(set(norms)) == 6, "the other steps update"
    assert series(overlapped, "train/loss_scale")[1] == [1024.0] * 2 + [512.0] * 2 + [256.0] * 4
    for name in ("train/loss", "train/params_norm", "train/loss_scale", "valid/loss"):
        assert series(overlapped, name) == series(gathered, name), name
