"""Megatron-LM's schedule flags on tiny runs: the weight decay the optimizer applies
(--weight-decay-incr-style, --start/--end-weight-decay), --lr-warmup-fraction, the embedding and
output layer's own learning rate (--decoupled-lr, --decoupled-min-lr) and --iterations-to-skip,
each checked by its effect on the weights, with Adam and AdEMAMix where the optimizer matters.

The run: global batch 4, --train-iters 4 (16 samples), no warmup unless said: step n runs with
the schedule at sample 4(n-1).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pytest
import torch

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import read_run_info
from megatron.apertus.training.loop import Trainer, train
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, after_backward, read_json, run_entry, series
from tests.training.test_first_hour import refused
from tests.training.test_resume import final_weights

BASE = (
    "--model-preset tiny --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--log-interval 1 --lr 3e-3 --min-lr 3e-4 --lr-decay-style linear --seed 5"
).split() + SMALL_VOCABULARY
LR, MIN_LR, DECOUPLED_LR, DECOUPLED_MIN_LR = 3e-3, 3e-4, 1e-2, 1e-3
DECOUPLED = f"--decoupled-lr {DECOUPLED_LR} --decoupled-min-lr {DECOUPLED_MIN_LR}".split()
RISING_WD = "--weight-decay-incr-style linear --start-weight-decay 0 --end-weight-decay 0.4".split()
EMBEDDING_OR_OUTPUT = ("module.embedding.word_embeddings.weight", "module.output_layer.weight")
FC1, FINAL_NORM = (
    "module.decoder.layers.0.mlp.linear_fc1.weight",
    "module.decoder.final_layernorm.weight",
)


@contextlib.contextmanager
def trainer(extra: list[str], iters: int = 4) -> Iterator[Trainer]:
    """A built run (``BASE`` + ``extra``) to step by hand."""
    run = Trainer(pretrain_gpt.parse_args(BASE + ["--train-iters", str(iters), *extra]))
    try:
        yield run
    finally:
        run.shutdown()


def weights(run: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in run.model[0].named_parameters()}


def group_of(run: Trainer, name: str) -> dict:
    """The optimizer's param group that holds parameter ``name``."""
    param = dict(run.model[0].named_parameters())[name]
    return next(g for g in run.optimizer.param_groups if any(p is param for p in g["params"]))


def linear(start: float, end: float, samples: int, length: int = 16) -> float:
    return start + (end - start) * samples / length


def _steps(extra: list[str], count: int) -> tuple[list[dict], list[dict]]:
    """The weights after each of ``count`` steps (index 0: before the first) and each group's
    weight decay and lr as the optimizer held them for each step."""
    with trainer(extra) as run:
        seen, groups = [weights(run)], []
        for _ in range(count):
            groups.append({n: dict(group_of(run, n)) for n in seen[0]})
            run.step()
            seen.append(weights(run))
    return seen, groups


@pytest.mark.parametrize("optimizer", ["adam", "ademamix"])
def test_the_optimizer_applies_the_rising_weight_decay(optimizer):
    """--weight-decay-incr-style linear 0 -> 0.4 over the run: step n decays by 0.1 (n - 1)
    (norms by 0). Against a twin with no weight decay, the first step (decay 0) is bitwise the
    same and the second differs by exactly lr * 0.1 * w in the decayed weights only."""
    flags = ["--optimizer", optimizer, *DECOUPLED]
    rising, groups = _steps(flags + RISING_WD, 3)
    none, _ = _steps(flags + ["--weight-decay", "0"], 2)
    for n, held in enumerate(groups, start=1):
        for name, group in held.items():
            assert group["weight_decay"] == pytest.approx(0.1 * (n - 1) * group["wd_mult"])
    assert all(torch.equal(rising[1][name], none[1][name]) for name in rising[1])
    decayed = {name for name, group in groups[1].items() if group["wd_mult"] == 1.0}
    assert FC1 in decayed and FINAL_NORM not in decayed
    for name in rising[2]:
        if name not in decayed:
            assert torch.equal(rising[2][name], none[2][name]), name
            continue
        step = groups[1][name]["lr"] * groups[1][name]["weight_decay"]
        torch.testing.assert_close(
            none[2][name] - rising[2][name], step * rising[1][name], rtol=1e-3, atol=1e-8
        )


@pytest.mark.parametrize("optimizer", ["adam", "ademamix"])
def test_decoupled_lr_moves_the_embedding_and_output_layer_at_their_own_rate(optimizer):
    """The embedding and output layer form their own group on the decoupled schedule, every
    other parameter follows --lr; the first update moves each weight by about its lr (Adam's and
    AdEMAMix's first step is the sign of the gradient)."""
    seen, groups = _steps(["--optimizer", optimizer, "--weight-decay", "0", *DECOUPLED], 3)
    for n, held in enumerate(groups):
        for name, group in held.items():
            decoupled = name in EMBEDDING_OR_OUTPUT
            high, low = (DECOUPLED_LR, DECOUPLED_MIN_LR) if decoupled else (LR, MIN_LR)
            assert group["lr"] == pytest.approx(linear(high, low, 4 * n)), (n, name)
            assert group["is_decoupled_lr"] == decoupled
    moved = {name: (seen[1][name] - seen[0][name]).abs().max().item() for name in seen[0]}
    for name in EMBEDDING_OR_OUTPUT:
        assert moved[name] == pytest.approx(DECOUPLED_LR, rel=1e-3), name
    assert moved[FC1] == pytest.approx(LR, rel=1e-3)


def test_without_decoupled_lr_the_embedding_follows_lr():
    """Negative control: one lr for all, no group marked decoupled."""
    seen, groups = _steps(["--weight-decay", "0"], 1)
    assert {g["lr"] for g in groups[0].values()} == {LR}
    assert not any(g["is_decoupled_lr"] for g in groups[0].values())
    embedding = EMBEDDING_OR_OUTPUT[0]
    step = seen[1][embedding] - seen[0][embedding]
    assert step.abs().max().item() == pytest.approx(LR, rel=1e-3)


def test_decoupled_lr_resumes_bitwise(tmp_path):
    """A run stopped after 2 steps and resumed ends with the uninterrupted run's weights: the
    decoupled group keeps its own rates across the checkpoint."""
    flags = BASE + DECOUPLED + RISING_WD + ["--train-iters", "4"]
    train(pretrain_gpt.parse_args(flags + ["--save", str(tmp_path / "whole")]))
    stopped = flags + ["--save", str(tmp_path / "cut"), "--load", str(tmp_path / "cut")]
    train(pretrain_gpt.parse_args(stopped + ["--exit-interval", "2"]))
    train(pretrain_gpt.parse_args(stopped))
    whole, cut = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    assert all(torch.equal(whole[name], cut[name]) for name in whole)


def _history(extra: list[str], path, iters: int = 6) -> dict:
    train(
        pretrain_gpt.parse_args(
            BASE + ["--train-iters", str(iters), "--log-json", str(path)] + extra
        )
    )
    return read_json(path)


def test_warmup_fraction_trains_as_the_equivalent_warmup_iters(tmp_path):
    """--lr-warmup-fraction 0.5 of 6 iterations is --lr-warmup-iters 3: the same lr at every
    step and so the same losses, bitwise; another fraction is another run."""
    fraction = _history(["--lr-warmup-fraction", "0.5"], tmp_path / "fraction.json")
    iters = _history(["--lr-warmup-iters", "3"], tmp_path / "iters.json")
    other = _history(["--lr-warmup-fraction", "0.25"], tmp_path / "other.json")
    assert series(fraction, "train/lr")[1][:3] == pytest.approx([LR / 3, 2 * LR / 3, LR])
    for name in ("train/lr", "train/loss"):
        assert series(fraction, name) == series(iters, name)
    assert series(other, "train/lr") != series(fraction, "train/lr")


def _skipping(extra: list[str], iters: int = 5) -> tuple[dict, dict[int, list[torch.Tensor]]]:
    """The history of a run and the weights each backward pass saw (by pass)."""
    seen = {}

    def snapshot(passes: int, model) -> None:
        seen[passes] = [p.detach().clone() for p in model[0].parameters()]

    with after_backward(snapshot):
        history = train(pretrain_gpt.parse_args(BASE + ["--train-iters", str(iters), *extra]))
    return history, seen


def test_a_skipped_iteration_consumes_its_batch_and_leaves_weights_and_schedule(caplog):
    """--iterations-to-skip 3, Megatron-LM's meaning: iteration 3 trains nothing (iteration 4
    starts from the weights iteration 3 would have), its global batch is consumed (iteration 4
    trains on batch 4, not batch 3) and the lr schedule does not advance (iteration 4 runs at the
    lr an unskipped run has at iteration 3); the iteration line counts the skipped samples."""
    with caplog.at_level(logging.INFO, logger="apertus"):
        skipped, seen = _skipping(["--iterations-to-skip", "3"])
    lines = [r.getMessage() for r in caplog.records if r.name == "apertus"]  # this run's only
    plain, plain_seen = _skipping([])
    assert series(skipped, "train/loss")[0] == [1, 2, 4, 5]
    assert all(torch.equal(a, b) for a, b in zip(seen[3], plain_seen[3]))  # before step 4 / 3
    assert not all(torch.equal(a, b) for a, b in zip(seen[3], plain_seen[4]))  # 2 vs 3 updates
    losses, plain_losses = (dict(zip(*series(h, "train/loss"))) for h in (skipped, plain))
    assert losses[2] == plain_losses[2] and losses[4] != plain_losses[3]
    lrs, plain_lrs = (dict(zip(*series(h, "train/lr"))) for h in (skipped, plain))
    assert lrs[4] == plain_lrs[3] and lrs[5] == plain_lrs[4]
    assert series(skipped, "train/skipped_samples") == ([4, 5], [4.0, 4.0])
    assert "train/skipped_samples" not in plain
    assert "iteration 3: skipped (--iterations-to-skip), its 4 samples consumed untrained" in lines
    (fourth,) = [line for line in lines if line.startswith("iteration        4/")]
    assert "| consumed samples:           16 | skipped samples:            4 |" in fourth


@pytest.mark.parametrize("exit_at", [2, 4])
def test_skipping_resumes_bitwise(tmp_path, exit_at):
    """Stopped before the skipped iteration (the recovery from a spike: resume the checkpoint
    before it with the flag) or after it, the resumed run ends as the uninterrupted one."""
    flags = BASE + ["--train-iters", "6", "--iterations-to-skip", "3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(
        pretrain_gpt.parse_args(
            flags + ["--save", str(whole), "--log-json", str(tmp_path / "w.json")]
        )
    )
    resumed = flags + [
        "--save",
        str(cut),
        "--load",
        str(cut),
        "--log-json",
        str(tmp_path / "c.json"),
    ]
    train(pretrain_gpt.parse_args(resumed + ["--exit-interval", str(exit_at)]))
    train(pretrain_gpt.parse_args(resumed))
    for name in ("train/loss", "train/lr", "train/skipped_samples"):
        assert series(read_json(tmp_path / "c.json"), name) == series(
            read_json(tmp_path / "w.json"), name
        )
    assert read_run_info(checkpoint.find_checkpoint(cut))["consumed_samples"] == 24
    first, second = final_weights(whole), final_weights(cut)
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--start-weight-decay", "0.1"], "--start-weight-decay needs --weight-decay-incr-style"),
        (
            ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.1"],
            "cosine needs --start-weight-decay and --end-weight-decay",
        ),
        (
            ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"],
            "give --lr-warmup-fraction or --lr-warmup-iters, not both",
        ),
        (["--decoupled-min-lr", "1e-4"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--iterations-to-skip", "0"], "--iterations-to-skip must be >= 1"),
    ],
)
def test_violations_are_refused_in_one_line(flags, line):
    assert line in refused(flags)


@pytest.mark.slow
def test_decoupled_lr_resumes_bitwise_with_the_distributed_optimizer(tmp_path):
    """The same on 2 data-parallel ranks with AdEMAMix's distributed optimizer, whose param
    groups are sharded and matched by the same key on load."""
    flags = BASE + DECOUPLED + RISING_WD + ["--train-iters", "4", "--micro-batch-size", "1"]
    flags += ["--optimizer", "ademamix", "--use-distributed-optimizer"]
    run_entry(PRETRAIN, flags + ["--save", str(tmp_path / "whole")], nproc=2)
    cut = flags + ["--save", str(tmp_path / "cut"), "--load", str(tmp_path / "cut")]
    run_entry(PRETRAIN, cut + ["--exit-interval", "2"], nproc=2)
    run_entry(PRETRAIN, cut, nproc=2)
    whole, resumed = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
