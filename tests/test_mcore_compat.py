"""The megatron-core compatibility layer: one meaning of each call on 0.16.x and 0.19.x.

Runs on whichever line is installed, against that line's own megatron-core objects.
"""

from __future__ import annotations

import ast
import logging

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron.apertus import mcore_compat
from tests.conftest import REPO

pytestmark = pytest.mark.smoke


def megatron_lm_ramp(consumed: int, start: int, increment: int, ramp: int, gbs: int) -> int:
    """Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES`` rule, as documented."""
    if consumed > ramp:
        return gbs
    per_increment = ramp / ((gbs - start) // increment)
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize(
    "start, increment, ramp, gbs, micro, dp",
    [
        (1024, 1024, 1718272000, 2048, 4, 256),  # the Apertus 8B array
        (16, 16, 1000, 64, 1, 4),
        (8, 8, 999, 80, 2, 2),  # thresholds that are not integers
        (2, 2, 5, 12, 1, 2),  # fewer samples than increments: shared thresholds
    ],
)
def test_rampup_follows_megatron_lm_at_every_consumed_count(start, increment, ramp, gbs, micro, dp):
    calculator = mcore_compat.rampup_calculator([start, increment, ramp], gbs, micro, dp)
    per_increment = ramp / ((gbs - start) // increment)
    counts = {0, 1, ramp - 1, ramp, ramp + 1, ramp + 2}
    for k in range(1, (gbs - start) // increment + 1):
        edge = int(k * per_increment)
        counts |= {edge - 1, edge, edge + 1}
    for consumed in sorted(c for c in counts if c >= 0):
        calculator.update(consumed, consistency_check=False)
        expected = megatron_lm_ramp(consumed, start, increment, ramp, gbs)
        assert calculator.get_current_global_batch_size() == expected, consumed


def test_a_ramped_run_counts_the_same_steps_on_every_line():
    """A ramp 16 to 64 over 1000 samples, then 4000 more: 102 optimizer steps as counted by
    megatron-core 0.16's own ramp calculator, and so on this line."""
    from megatron.apertus.training.loop_config import TrainingConfig

    t = TrainingConfig(
        global_batch_size=64,
        micro_batch_size=1,
        train_samples=5000,
        rampup_batch_size=[16, 16, 1000],
    )
    assert t.total_iterations(dp=4) == 102


def _setup_requirement() -> Requirement:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "MCORE_REQUIREMENT":
            return Requirement(node.value.value)
    raise AssertionError("setup.py has no MCORE_REQUIREMENT")


@pytest.mark.parametrize(
    "version",
    ["0.15.2", "0.16.0", "0.16.1", "0.16.9", "0.17.0", "0.18.3", "0.19.0", "0.19.2", "0.20.0"],
)
def test_setup_and_the_import_check_agree_on_the_supported_releases(version):
    assert _setup_requirement().specifier.contains(version) == mcore_compat.is_supported(
        Version(version)
    )


def test_the_installed_release_is_supported():
    assert mcore_compat.is_supported(mcore_compat.MCORE_VERSION)
    assert mcore_compat.STEP_SCHEDULE == (mcore_compat.MCORE_VERSION >= Version("0.19"))


@pytest.mark.parametrize("logger_name, notice", sorted(mcore_compat.RELEASE_NOTICES.items()))
def test_release_notices_are_hidden_and_nothing_else_from_their_loggers(
    logger_name: str, notice: str, caplog: pytest.LogCaptureFixture
):
    logger = logging.getLogger(logger_name)
    with caplog.at_level(logging.WARNING, logger=logger_name):
        logger.warning(f"{notice} and will be removed in the future releases.")
        logger.warning("a checkpoint shard could not be written")
    assert [r.getMessage() for r in caplog.records] == ["a checkpoint shard could not be written"]
