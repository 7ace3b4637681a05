"""The files of a checkpoint save directory, readable without torch.

Launchers (``launch/slurm.py``, whose batch step may run on a host Python without torch) and
``checkpoint.py`` share these names::

    SAVE/latest_checkpointed_iteration.txt   iteration of the newest *complete* checkpoint
    SAVE/iter_0000100/                        a checkpoint (complete once the tracker names it)
    SAVE/iter_0000100.tmp/                    a checkpoint being written
    SAVE/iter_0000100/apertus_run.json        how the run that saved it was made (tokenizer,
                                              data, tokens seen, command); training saves only
    SAVE/iter_0000100/apertus_manifest.json   every file of the checkpoint with its size (and a
                                              checksum of the small ones), written last
    SAVE/iter_0000100/metrics.json            the run's history up to the checkpoint, published
                                              with it; training saves only
    SAVE/metrics.json                         the run's history, rewritten after each save
    SAVE/iter_0000050.removing/               a checkpoint being removed (renamed first, so that
                                              nothing takes what is left of it for a checkpoint)
    SAVE/non_persistent/                      the non-persistent checkpoints, laid out alike
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_CONFIG = "apertus_model.json"
RUN_INFO = "apertus_run.json"
MANIFEST = "apertus_manifest.json"
"""What a complete save wrote: a file cut short or lost since (a copy stopped half-way, a full
disk on another tool's write) is named on load instead of failing deep inside megatron-core."""
HASHED_UP_TO = 1 << 20
"""Files up to this size (our JSON files, megatron-core's metadata and common state) are hashed;
the shards are only measured: hashing gigabytes at every save would cost minutes."""
METRICS_FILE = "metrics.json"
"""The recorded history, kept inside each checkpoint (what a resumed run continues and an export
reports: written before the checkpoint is published, so the two never disagree, whenever a job
is killed) and in the save directory (the whole run's, for people and plots)."""
NON_PERSISTENT_DIR = "non_persistent"
"""Megatron-LM's folder of the non-persistent checkpoints inside --save (and --load), where
--non-persistent-global-ckpt-dir does not name another."""
REMOVING = ".removing"
"""Suffix of a checkpoint directory being removed; no reader takes it for a checkpoint."""
_ITERATION_DIR = re.compile(r"iter_(\d{7})(\.tmp)?")


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def non_persistent_dir(parent: str | os.PathLike, explicit: str | None) -> Path:
    """The non-persistent checkpoints of a run saving to (or loading from) ``parent``."""
    return Path(explicit) if explicit else Path(parent) / NON_PERSISTENT_DIR


def remove_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """Remove a checkpoint directory: renamed at once, then deleted, so that a removal cut short
    (a job killed) leaves a ``.removing`` directory that no load, tracker or launcher takes for
    a checkpoint; such leftovers in the same save directory go with it."""
    checkpoint_dir = Path(checkpoint_dir)
    doomed = checkpoint_dir.with_name(checkpoint_dir.name + REMOVING)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(checkpoint_dir, doomed)
    for leftover in [doomed, *checkpoint_dir.parent.glob(f"iter_*{REMOVING}")]:
        shutil.rmtree(leftover, ignore_errors=True)


def checkpoint_iteration(checkpoint_dir: str | os.PathLike) -> int:
    """The iteration of a checkpoint directory (``iter_0000100`` -> 100)."""
    match = _ITERATION_DIR.fullmatch(Path(checkpoint_dir).name)
    if match is None or match.group(2):
        raise ValueError(f"{checkpoint_dir} is not a checkpoint directory iter_NNNNNNN")
    return int(match.group(1))


def latest_iteration(load_dir: str | os.PathLike) -> int | None:
    tracker = Path(load_dir) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def saved_iterations(save_dir: str | os.PathLike) -> list[int]:
    """The iterations of the checkpoints in ``save_dir`` (``iter_*`` directories renamed after
    their save, holding the model's config; older and newer than the tracker alike), in order."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    return sorted(
        int(match.group(1))
        for path in save_dir.iterdir()
        if (match := _ITERATION_DIR.fullmatch(path.name))
        and not match.group(2)
        and (path / MODEL_CONFIG).is_file()
    )


def unfinished_checkpoints(save_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint directories the tracker does not vouch for: ``.tmp`` ones (a save cut short)
    and ``iter_*`` ones newer than the tracker (renamed, but the tracker never advanced)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    latest = latest_iteration(save_dir)
    found = []
    for path in sorted(save_dir.iterdir()):
        match = _ITERATION_DIR.fullmatch(path.name)
        if match and path.is_dir():
            if match.group(2) or latest is None or int(match.group(1)) > latest:
                found.append(path)
    return found


def read_run_info(checkpoint_dir: str | os.PathLike) -> dict | None:
    """The run record of a checkpoint directory (``iter_*``), or None when it has none
    (checkpoints written by conversion tools, or by versions that did not record runs)."""
    path = Path(checkpoint_dir) / RUN_INFO
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def history_file(
    checkpoint_dir: str | os.PathLike, save_dir: str | os.PathLike | None = None
) -> Path | None:
    """The history that goes with the checkpoint ``checkpoint_dir`` (an ``iter_*`` directory):
    the one saved inside it; for checkpoints saved before they held one, the save directory's:
    beside it, ``save_dir``'s when given (the --load a non-persistent checkpoint was found
    through), or the one of the --save holding the default non-persistent directory. None when
    there is none (conversion tools record no history)."""
    checkpoint_dir = Path(checkpoint_dir)
    parent = checkpoint_dir.parent
    candidates = [checkpoint_dir, parent]
    if save_dir is not None:
        candidates.append(Path(save_dir))
    if parent.name == NON_PERSISTENT_DIR:
        candidates.append(parent.parent)
    return next((c / METRICS_FILE for c in candidates if (c / METRICS_FILE).is_file()), None)


def final_losses(checkpoint_dir: str | os.PathLike) -> dict[str, tuple[int, float]]:
    """The last training and validation loss (of each validation set: ``valid/loss-NAME``)
    recorded up to the checkpoint ``iter_*`` as ``{"train/loss": (iteration, value), ...}``,
    from its history (:func:`history_file`; empty when there is none)."""
    checkpoint_dir = Path(checkpoint_dir)
    match = _ITERATION_DIR.fullmatch(checkpoint_dir.name)
    history_path = history_file(checkpoint_dir)
    if match is None or history_path is None:
        return {}
    history = json.loads(history_path.read_text())
    upto = int(match.group(1))
    found = {}
    names = ["train/loss"] + sorted(name for name in history if name.startswith("valid/loss"))
    for name in names:
        entries = [(int(it), float(v)) for it, v in history.get(name, []) if it <= upto]
        if entries:
            found[name] = entries[-1]
    return found


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _describe(path: Path) -> dict:
    size = path.stat().st_size
    entry: dict = {"bytes": size}
    if size <= HASHED_UP_TO:
        entry["sha256"] = _sha256(path)
    return entry


def write_manifest(checkpoint_dir: str | os.PathLike) -> None:
    """Record every file of a checkpoint just written completely (before it is published), so
    that a load can tell a damaged checkpoint from one of another run. Written under a temporary
    name and renamed: a manifest is either whole or absent."""
    checkpoint_dir = Path(checkpoint_dir)
    files = {
        path.relative_to(checkpoint_dir).as_posix(): _describe(path)
        for path in sorted(checkpoint_dir.rglob("*"))
        if path.is_file() and path.name not in (MANIFEST, MANIFEST + ".tmp")
    }
    tmp = checkpoint_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1) + "\n")
    os.replace(tmp, checkpoint_dir / MANIFEST)


def manifest_problem(checkpoint_dir: str | os.PathLike, source: str) -> str | None:
    """The line refusing a checkpoint whose files differ from what its save wrote, naming the
    first such file (``source`` begins it: ``--load DIR``), or None. Checkpoints saved before
    manifests existed have none and are not checked. Callers raise it as their user error."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{source}: {path} is damaged (not the JSON its save wrote)"
    for name, entry in files.items():
        problem = _file_problem(checkpoint_dir / name, entry)
        if problem:
            return (
                f"{source}: {checkpoint_dir / name} {problem}; the checkpoint cannot be loaded: "
                "restore the file from a copy, or --load an earlier iteration directory"
            )
    return None


def _file_problem(path: Path, entry: dict) -> str | None:
    """What differs between ``path`` and its manifest ``entry``, or None."""
    if not path.is_file():
        return "is missing (the save wrote it)"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"is damaged ({size} bytes, the save wrote {entry['bytes']})"
    if "sha256" in entry and _sha256(path) != entry["sha256"]:
        return "is damaged (its contents differ from what the save wrote)"
    return None
