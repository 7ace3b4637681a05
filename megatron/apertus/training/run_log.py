"""What a run prints, and where the rest goes.

The console gets this package's lines (the ``apertus`` loggers, INFO and up) and anyone's
warnings, so the first iteration line comes within a few lines of the start. Everything else
megatron-core and the tokenizers log at INFO (the DDP bucket's parameter list, the optimizer's
config, dataset index building) goes to ``SAVE/debug.log``, written by global rank 0, when the
run has a --save directory.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from megatron.apertus.ops.cpu_capability import slow_bf16_warning

DEBUG_LOG = "debug.log"
OURS = "apertus"
log = logging.getLogger(f"{OURS}.run")


class _OursOrWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == OURS or record.name.startswith(OURS + ".")
        return ours or record.levelno >= logging.WARNING


def configure_logging(save_dir: str | None, level: int | None = None) -> None:
    """Console and debug-log handlers on the root logger (in an entry point), which keeps
    records at ``level`` and up (--logging-level; default INFO). A run started again in the
    same interpreter replaces the handlers of the one before, whose console and --save may be
    gone."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if level is None else level)
    for earlier in [h for h in root.handlers if getattr(h, OURS, False)]:
        root.removeHandler(earlier)
        earlier.close()
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    console.addFilter(_OursOrWarnings())
    _add_ours(root, console)
    if not save_dir or os.environ.get("RANK", "0") != "0":
        return
    try:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        debug = logging.FileHandler(Path(save_dir) / DEBUG_LOG)
    except OSError:
        return  # an unwritable --save is refused, in one line, when the run starts
    debug.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    _add_ours(root, debug)


def _add_ours(root: logging.Logger, handler: logging.Handler) -> None:
    setattr(handler, OURS, True)
    root.addHandler(handler)


def warn_if_slow_precision(precision: str, device: str) -> None:
    """Say once, on global rank 0, when the run asked for a precision this CPU computes slowly."""
    if os.environ.get("RANK", "0") == "0" and (warning := slow_bf16_warning(precision, device)):
        log.warning(warning)
