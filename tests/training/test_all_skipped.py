"""A run whose every step was skipped stops with one line and saves nothing, whether it reaches
its end, a save or --max-skipped-steps first."""

from __future__ import annotations

from pathlib import Path

import pytest

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.training.loop import TrainingStopped, train
from tests.conftest import after_backward
from tests.training.test_loop import BASE, poison

EVERY = set(range(1, 20))


@pytest.mark.parametrize("extra", [[], ["--max-skipped-steps", "2", "--train-iters", "4"]])
def test_a_run_that_skipped_every_step_stops_without_saving(tmp_path: Path, extra: list) -> None:
    args = BASE + ["--train-iters", "2", "--save", str(tmp_path)] + extra
    with pytest.raises(TrainingStopped, match="every step of this run") as err:
        with after_backward(poison(EVERY)):
            train(pretrain_gpt.parse_args(args))
    assert "nothing saved" in str(err.value)
    assert checkpoint.latest_iteration(tmp_path) is None
