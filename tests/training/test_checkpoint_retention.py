"""Megatron-LM's --save-retain-interval and global non-persistent checkpoints, checked by their
effect on tiny runs (6 steps) through the command line: which iterations remain on disk, which
checkpoint --load resumes, and that a run killed just after a non-persistent save is published
continues from it bit for bit, its history included."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import (
    METRICS_FILE,
    MODEL_CONFIG,
    NON_PERSISTENT_DIR,
    TRACKER,
    remove_checkpoint,
    saved_iterations,
    unfinished_checkpoints,
)
from megatron.apertus.training.checkpoint_retention import Retention
from tests.conftest import PRETRAIN, SMALL_VOCABULARY, read_json, run_entry, series
from tests.training.test_resume import final_weights, killed_after_publishing, same_history

ITERS = 6
BASE = (
    "--model-preset tiny --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    f"--log-interval 1 --lr 3e-3 --seed 5 --train-iters {ITERS} --eval-interval 100"
).split() + SMALL_VOCABULARY
NON_PERSISTENT = ["--non-persistent-ckpt-type", "global"]


def _left_on_disk(save: Path) -> list[str]:
    """Everything of ``save`` that looks like a checkpoint, kept or half-removed."""
    return sorted(p.name for p in save.iterdir() if p.name.startswith("iter_"))


@pytest.fixture(scope="module")
def retained(tmp_path_factory):
    """6 steps saving after each, keeping multiples of 4: the uninterrupted reference run."""
    root = tmp_path_factory.mktemp("retention")
    save, log = root / "retained", root / "retained.json"
    flags = f"--save {save} --save-interval 1 --save-retain-interval 4 --log-json {log}"
    proc = run_entry(PRETRAIN, BASE + flags.split())
    return root, proc.stdout, series(read_json(log), "train/loss")


def test_retain_interval_keeps_its_multiples_and_the_latest(retained):
    """After each save the checkpoint the tracker named before is removed unless a multiple of
    the interval: of 1..6 only 4 and 6 remain, nothing half-removed, the tracker at 6."""
    root, stdout, _ = retained
    save = root / "retained"
    assert _left_on_disk(save) == ["iter_0000004", "iter_0000006"]
    assert checkpoint.latest_iteration(save) == ITERS
    for removed in (1, 2, 3, 5):
        assert f"removed checkpoint {save / f'iter_{removed:07d}'}" in stdout


@pytest.mark.slow
def test_retain_interval_with_background_saves(retained):
    """--async-save publishes each save later; the same checkpoints remain."""
    root, _, _ = retained
    save = root / "async"
    flags = f"--save {save} --async-save --save-interval 1 --save-retain-interval 4"
    run_entry(PRETRAIN, BASE + flags.split())
    assert _left_on_disk(save) == ["iter_0000004", "iter_0000006"]


@dataclass
class Killed:
    save: Path
    flags: list[str]
    """The run's flags (non-persistent saves every step, persistent every 2)."""
    history_at_kill: dict
    """``SAVE/metrics.json`` as the kill left it."""
    without_type: str
    """What a --skip-train --load of the killed run's directory without
    --non-persistent-ckpt-type printed, before anything resumed from it."""


@pytest.fixture(scope="module")
def killed(retained) -> Killed:
    """A run saving persistently every 2 steps and non-persistently every step, killed (-9)
    just after its non-persistent checkpoint of iteration 3 is published: before the history
    beside the checkpoints is written again."""
    root, _, _ = retained
    save = root / "killed"
    flags = NON_PERSISTENT + ["--non-persistent-save-interval", "1"]
    flags += ["--save", str(save), "--save-interval", "2"]
    killed_after_publishing(save / NON_PERSISTENT_DIR / "iter_0000003", BASE + flags)
    history = json.loads((save / METRICS_FILE).read_text())
    control = run_entry(PRETRAIN, BASE + ["--load", str(save), "--skip-train"])
    return Killed(save, flags, history, control.stdout)


@pytest.fixture(scope="module")
def resumed(retained, killed) -> tuple[int, str, Path]:
    """The killed run started again with --load: the iteration its non-persistent tracker
    named, the run's output and its --log-json."""
    root, _, _ = retained
    at = checkpoint.latest_iteration(killed.save / NON_PERSISTENT_DIR)
    log = root / "resumed.json"
    flags = killed.flags + ["--load", str(killed.save), "--log-json", str(log)]
    return at, run_entry(PRETRAIN, BASE + flags).stdout, log


def test_load_ignores_non_persistent_checkpoints_without_their_type(killed):
    """Negative control: as in Megatron-LM, --load looks at non-persistent checkpoints only
    under --non-persistent-ckpt-type; without it the persistent iteration 2 is resumed."""
    assert f"resumed from {killed.save / 'iter_0000002'} at iteration 2" in killed.without_type


def test_killed_run_resumes_its_newest_non_persistent_checkpoint_bitwise(retained, resumed):
    """The non-persistent checkpoint is newer than the persistent one, so the restart continues
    from it, on the uninterrupted run's trajectory to the last bit; only the latest
    non-persistent checkpoint is kept, every persistent one is (no retain interval)."""
    root, _, (ref_steps, ref_losses) = retained
    at, stdout, log = resumed
    save = root / "killed"
    frequent = save / NON_PERSISTENT_DIR
    assert at == 3
    assert f"resumed from {frequent / 'iter_0000003'} at iteration 3" in stdout
    assert series(read_json(log), "train/loss") == (ref_steps, ref_losses), "bitwise equal"
    weights, expected = final_weights(save), final_weights(root / "retained")
    assert weights.keys() == expected.keys()
    assert all(torch.equal(value, expected[key]) for key, value in weights.items())
    assert _left_on_disk(save) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert _left_on_disk(frequent) == ["iter_0000005"]


def test_a_kill_just_after_publishing_loses_no_history(retained, killed, resumed):
    """Killed between the publication of iteration 3 and the history's write beside the
    checkpoints, which then stopped at step 2: the history published inside the checkpoint
    holds step 3, and the resumed run's history equals the uninterrupted run's, step 3
    included (--log-json started over from it, and metrics.json)."""
    root, _, _ = retained
    assert [it for it, _ in killed.history_at_kill["train/loss"]] == [1, 2], "the kill's moment"
    _, _, log = resumed
    expected = json.loads((root / "retained" / METRICS_FILE).read_text())
    assert [it for it, _ in expected["train/loss"]] == list(range(1, ITERS + 1))
    assert same_history(json.loads((killed.save / METRICS_FILE).read_text()), expected)
    assert same_history(read_json(log), read_json(root / "retained.json"))


def test_a_newer_persistent_checkpoint_wins(killed, resumed):
    """After the resumed run the persistent checkpoint (6, the end) is newer than the
    non-persistent one (5, the last step the persistent interval left): --load takes it."""
    assert checkpoint.latest_iteration(killed.save / NON_PERSISTENT_DIR) == 5
    proc = run_entry(PRETRAIN, BASE + killed.flags + ["--load", str(killed.save), "--skip-train"])
    assert f"resumed from {killed.save / 'iter_0000006'} at iteration 6" in proc.stdout


def _fake_checkpoint(save: Path, iteration: int) -> Path:
    """An ``iter_*`` directory as a published save leaves it, as far as listings look."""
    path = save / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / MODEL_CONFIG).write_text("{}")
    return path


def test_a_removal_cut_short_is_no_checkpoint_and_goes_with_the_next(tmp_path):
    """A job killed while deleting leaves ``iter_*.removing``: no listing (loads, the Slurm
    launcher) takes it for a checkpoint, and the next removal deletes it."""
    save = tmp_path / "save"
    _fake_checkpoint(save, 1)
    _fake_checkpoint(save, 3)
    (save / TRACKER).write_text("3\n")
    leftover = _fake_checkpoint(save, 2).rename(save / "iter_0000002.removing")
    assert saved_iterations(save) == [1, 3] and unfinished_checkpoints(save) == []
    remove_checkpoint(save / "iter_0000001")
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000003", TRACKER]
    assert not leftover.exists()


def test_retention_leaves_the_tracked_checkpoint_and_symbolic_links(tmp_path):
    """Removals skip what the tracker names (here: a tracker moved back, as --ckpt-step and a
    later save can) and symbolic links, as Megatron-LM skips them."""
    save = tmp_path / "save"
    for iteration in (1, 2):
        _fake_checkpoint(save, iteration)
    (save / "iter_0000003").symlink_to(_fake_checkpoint(tmp_path / "elsewhere", 3))
    (save / TRACKER).write_text("2\n")
    retention = Retention(save, retain_interval=None, latest_only=True)
    retention.published(_fake_checkpoint(save, 4))
    retention.finish()
    assert saved_iterations(save) == [2, 3, 4]
