"""A checkpoint written under one supported megatron-core line (0.16.x or 0.19.x) resumes under
the other on the same trajectory, in both directions.

Needs both lines' environments: this interpreter's and the other's, named by
``APERTUS_OTHER_PYTHON`` (``make smoke`` sets it to ``.venv/bin/python``); skipped without it.
"""

from __future__ import annotations

import os
import sys
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatron.apertus import checkpoint
from tests.conftest import PRETRAIN, read_json, run_entry, series
from tests.training.test_resume import COMMON, ITERS

OTHER = os.environ.get("APERTUS_OTHER_PYTHON", "")
pytestmark = [
    pytest.mark.smoke,
    pytest.mark.skipif(
        not Path(OTHER).is_file(), reason="APERTUS_OTHER_PYTHON names no interpreter"
    ),
]
STOP = 3


def mcore_version(python: str) -> str:
    return subprocess.run(
        [python, "-c", "from megatron.core import package_info; print(package_info.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, tuple[str, list[float]]]:
    """Each line's interpreter and the losses of its uninterrupted run."""
    root = tmp_path_factory.mktemp("lines")
    found = {}
    for name, python in (("this", ""), ("other", OTHER)):
        log = root / f"{name}.json"
        run_entry(PRETRAIN, COMMON + ["--log-json", str(log)], python=python)
        found[name] = (python, series(read_json(log), "train/loss")[1])
    assert mcore_version(OTHER) != mcore_version(sys.executable), "the same line twice"
    return found


@pytest.mark.parametrize("first, second", [("other", "this"), ("this", "other")])
def test_checkpoint_of_one_line_continues_under_the_other(lines, first, second, tmp_path):
    save = tmp_path / "ckpt"
    run_entry(PRETRAIN, COMMON + ["--save", str(save), "--exit-interval", str(STOP)],
              python=lines[first][0])  # fmt: skip
    assert checkpoint.latest_iteration(save) == STOP
    log = tmp_path / "resumed.json"
    run_entry(PRETRAIN, COMMON + ["--save", str(save), "--load", str(save), "--log-json", str(log)],
              python=lines[second][0])  # fmt: skip
    steps, losses = series(read_json(log), "train/loss")
    assert steps == list(range(1, ITERS + 1))
    # The first STOP losses were computed by the first line, the rest by the second.
    expected = lines[first][1][:STOP] + lines[second][1][STOP:]
    np.testing.assert_allclose(losses, expected, rtol=2e-6)
    np.testing.assert_allclose(lines[first][1], lines[second][1], rtol=2e-6)
