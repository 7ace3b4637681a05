"""A run killed with SIGKILL at one exact moment: right after a given checkpoint is published
(its directory renamed, its tracker advanced), before the run does anything else, such as
writing the history beside the checkpoints. A kill that a test times from outside lands a little
later each time; this one lands there every time.

    python -m tests.training.die_after_publishing SAVE/iter_0000003 pretrain_gpt.py ARGS...

runs the script as ``__main__`` with ``ARGS`` in a process that kills itself there; the run
itself is not changed in any other way.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from megatron.apertus import checkpoint


def command(checkpoint_dir: Path, script: Path, args: list[str]) -> list[str]:
    """The command line that runs ``script`` with ``args`` and dies once ``checkpoint_dir`` is
    published (run it from the repository's root)."""
    return [sys.executable, "-m", __spec__.name, str(checkpoint_dir), str(script), *args]


def _die_after_publishing(target: Path) -> None:
    publish = checkpoint._publish

    def publish_then_die(save_dir, tmp, final, iteration, on_published) -> None:
        publish(save_dir, tmp, final, iteration, on_published)
        if Path(final).resolve() == target:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._publish = publish_then_die


if __name__ == "__main__":
    _die_after_publishing(Path(sys.argv[1]).resolve())
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
