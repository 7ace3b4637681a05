"""Which checkpoints a run keeps: Megatron-LM's ``--save-retain-interval`` in ``--save``, and
only the latest of the non-persistent checkpoints.

``--save-retain-interval N`` works as in Megatron-LM: once a checkpoint is published, the one the
tracker named before it is removed unless its iteration is a multiple of N (or 0, or the same
iteration saved again), so the multiples of N and the latest remain. Non-persistent checkpoints
keep only the latest: once one is published, the older ones in its directory are removed
(Megatron-LM removes them before its next save, so two are on disk between saves).

Invariants: only published checkpoints are removed (a save in flight, even a background one, is
a ``.tmp`` directory nobody lists); the checkpoint the tracker names is never removed (the
tracker is read again just before); a symbolic link is left alone, as Megatron-LM does; each
removal renames the directory first (:func:`checkpoint_files.remove_checkpoint`), so a removal
cut short never looks like a checkpoint. Rank 0, which publishes, removes, in a background
thread (deleting a large checkpoint takes a while), which the next removal and the end of the
run wait for; the other ranks never read what is removed, so they do not wait. A removal that
fails (permissions) is a warning: the run goes on with one checkpoint too many.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from megatron.apertus.checkpoint_files import (
    checkpoint_iteration,
    iteration_dir,
    latest_iteration,
    remove_checkpoint,
    saved_iterations,
)

log = logging.getLogger("apertus")


class Retention:
    """The removals after each save into one directory (rank 0 only)."""

    def __init__(
        self, save_dir: str | Path, *, retain_interval: int | None, latest_only: bool
    ) -> None:
        self.save_dir = Path(save_dir)
        self.retain_interval = retain_interval
        self.latest_only = latest_only
        self.previous = _tracked(self.save_dir)
        """What the tracker named before the last publication (Megatron-LM reads it there)."""
        self._worker: threading.Thread | None = None

    def published(self, path: Path) -> None:
        """``path`` is published and the tracker names it: remove what it replaces."""
        iteration = checkpoint_iteration(path)
        doomed = self._replaced(iteration)
        self.previous = iteration
        if doomed:
            self.finish()
            self._worker = threading.Thread(target=self._remove, args=(doomed,), daemon=True)
            self._worker.start()

    def _replaced(self, iteration: int) -> list[int]:
        """The iterations that publishing ``iteration`` makes removable."""
        if self.latest_only:
            return [it for it in saved_iterations(self.save_dir) if it < iteration]
        previous, interval = self.previous, self.retain_interval
        if interval is None or previous in (None, 0, iteration) or previous % interval == 0:
            return []
        return [previous]

    def _remove(self, iterations: list[int]) -> None:
        tracked = _tracked(self.save_dir)
        for iteration in iterations:
            path = iteration_dir(self.save_dir, iteration)
            if iteration == tracked or path.is_symlink() or not path.is_dir():
                continue
            try:
                remove_checkpoint(path)
            except OSError as err:
                log.warning(f"could not remove checkpoint {path}: {err}")
                continue
            log.info(f"removed checkpoint {path}")

    def finish(self) -> None:
        """Wait for the removal in progress, if any."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None


def _tracked(save_dir: Path) -> int | None:
    """The iteration the tracker names; None without one, or with one that is not a number
    (the first save replaces it)."""
    try:
        return latest_iteration(save_dir)
    except ValueError:
        return None
