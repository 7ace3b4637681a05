"""Megatron-LM's result validation on megatron-core's rerun state machine, in real tiny CPU runs
whose final hidden states are scaled by 1000 from a chosen forward pass on: a loss spike (and
the large gradients that come with it) made on purpose. A transient one (gone in the rerun)
leaves the run exactly as a clean one; a persistent one is found reproducible and kept; without
the flags the same spike goes unsaid. Bad values: one line, exit 2."""

from __future__ import annotations

import contextlib
import logging
from importlib.metadata import version

import pytest

import pretrain_gpt
from megatron.apertus.training.loop import train
from tests.conftest import SMALL_VOCABULARY, after_backward, series
from tests.test_apertus_launch_args import error_lines

BASE = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 1 --eval-iters 0 "
    "--log-interval 1 --lr 3e-3 --seed 5 --device cpu"
).split() + SMALL_VOCABULARY
SPIKE = 27
"""The iteration the spike starts at: megatron-core validates from the second iteration on and
takes the first 100 values (4 micro-batches a step: iterations 2-26) as the scale."""
RERUN_LOG = "megatron.core.rerun_state_machine"


def spiky_pass(module, inputs, output):
    return output * 1000


@contextlib.contextmanager
def spike_from(first_pass: int, *, transient: bool):
    """From training forward-backward pass ``first_pass`` on (a rerun is a pass), the final
    norm's output is 1000 times too large; ``transient``: for that one pass only."""
    handles = []

    def hook(n: int, model) -> None:
        if n == first_pass - 1:
            norm = model[0].module.decoder.final_layernorm
            handles.append(norm.register_forward_hook(spiky_pass))
        if transient and n == first_pass and handles:
            handles.pop().remove()

    with after_backward(hook):
        yield


def _run(flags: list[str], caplog, spike: str | None, iters: int = 30, at: int = SPIKE):
    """Losses by iteration and megatron-core's rerun lines of one run."""
    argv = BASE + ["--train-iters", str(iters), *flags]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=RERUN_LOG):
        if spike is None:
            history = train(pretrain_gpt.parse_args(argv))
        else:
            with spike_from(at, transient=spike == "transient"):
                history = train(pretrain_gpt.parse_args(argv))
    lines = [r.getMessage() for r in caplog.records if r.name == RERUN_LOG]
    return dict(zip(*series(history, "train/loss"))), lines


def test_a_transient_spike_is_rerun_away(caplog):
    clean, _ = _run([], caplog, None)
    checked, lines = _run(["--check-for-spiky-loss"], caplog, "transient")
    rejected = [line for line in lines if "(message='Spiky loss')" in line]
    assert len(rejected) == 1 and rejected[0].startswith("Unexpected result "), lines
    assert f"at iteration #{SPIKE} " in rejected[0]
    assert any("First rerun: unexpected result is not reproducible" in line for line in lines)
    assert any("Possible transient error!" in line for line in lines)
    assert "Continuing normal execution because failed validation was not fatal" in lines
    assert checked == clean, "the step keeps the rerun's result: no trace of the spike"

    unchecked, lines = _run([], caplog, "transient")
    assert unchecked[SPIKE] > 10 * clean[SPIKE], "the same spike, unchecked, is trained on"
    assert not [line for line in lines if "Unexpected result" in line or "rerun" in line]


def test_a_persistent_spike_is_reproduced_and_the_run_goes_on(caplog):
    losses, lines = _run(["--check-for-spiky-loss"], caplog, "persistent")
    reproduced = [line for line in lines if "unexpected result is reproducible" in line]
    assert [f"iteration #{it}:" in line for it, line in zip(range(SPIKE, 31), reproduced)] == [
        True
    ] * (31 - SPIKE), lines
    assert "Need to rerun on a different GPU to verify correctness" in reproduced[0]
    assert min(losses[it] for it in range(SPIKE, 31)) > 50, "the reproduced spike is kept"
    assert list(losses)[-1] == 30, "non-fatal in Megatron-LM: the run goes on to its end"


def test_large_gradients_are_found_in_their_bucket(caplog):
    """One bucket per parameter (megatron-core splits the gradients only when it overlaps their
    reduction): 43 gradient norms a step, so 100 are sampled by iteration 4."""
    flags = ["--check-for-large-grads", "--overlap-grad-reduce", "--ddp-bucket-size", "1"]
    _, lines = _run(flags, caplog, "persistent", iters=7, at=6)
    rejected = [line for line in lines if line.startswith("Unexpected result ")]
    assert rejected and "at iteration #6 " in rejected[0], lines
    assert "(message='found unexpected large grads in bucket #" in rejected[0]
    assert any("unexpected result is reproducible" in line for line in lines)


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--error-injection-rate", "-1"], "--error-injection-rate must be >= 0, got -1"),
        (
            ["--result-rejected-tracker-filename", "/"],
            "--result-rejected-tracker-filename / is a directory, not a file",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line(flags, line, capsys):
    (refusal,) = error_lines(capsys, BASE + ["--train-iters", "1", *flags])
    assert refusal.startswith(line)


@pytest.mark.skipif(version("megatron-core") >= "0.19", reason="megatron-core 0.19 reports")
def test_report_stats_is_refused_where_megatron_core_cannot_report(capsys):
    argv = BASE + ["--train-iters", "1", "--rerun-mode", "report_stats"]
    (refusal,) = error_lines(capsys, argv)
    assert refusal.startswith(
        "--rerun-mode report_stats: the determinism statistics of megatron-core's rerun state "
        "machine fail when they report before megatron-core 0.19 (found 0.16"
    )


@pytest.mark.skipif(version("megatron-core") < "0.19", reason="megatron-core < 0.19 cannot report")
def test_report_stats_reruns_every_step_and_reports_identical_results(caplog):
    argv = BASE + ["--train-iters", "4", "--check-for-spiky-loss", "--rerun-mode", "report_stats"]
    with caplog.at_level(logging.INFO, logger=RERUN_LOG):
        history = train(pretrain_gpt.parse_args(argv))
    lines = [r.getMessage() for r in caplog.records if r.name == RERUN_LOG]
    assert "  From validation call 'Spiky loss':" in lines
    assert "    16 samples, all identical" in lines, "4 micro-batches x 4 steps, each rerun"
    assert len(series(history, "train/loss")[0]) == 4
