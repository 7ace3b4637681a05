"""Requests to save or stop, from signals and trigger files, agreed on by every rank.

* ``--exit-signal-handler``: SIGUSR2 (what Slurm's ``--signal=SIGUSR2@N`` sends before the time
  limit) and SIGTERM set a flag; at the end of the current step the run saves and exits 0.
* ``--trigger-path DIR``: a file ``DIR/save`` asks for a checkpoint (the file is removed once
  honoured), ``DIR/exit`` for a checkpoint and a clean exit.

Every rank must take the same decision in the same step, so the local requests are combined
with an all-reduce (MAX) each step: one rank's signal is enough.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("apertus")


@dataclass(frozen=True)
class Requests:
    save: bool = False
    exit: bool = False


class StopRequests:
    """Collects signal and trigger-file requests; ``poll()`` is a collective."""

    def __init__(self, *, handle_signals: bool, trigger_path: str | None) -> None:
        self.trigger = Path(trigger_path) if trigger_path else None
        self.signalled: int | None = None
        if handle_signals:
            for sig in (signal.SIGUSR2, signal.SIGTERM):
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signalled = signum

    def _local(self) -> tuple[bool, bool]:
        save = exit_ = self.signalled is not None
        if self.trigger is not None and dist.get_rank() == 0:
            save |= (self.trigger / "save").exists()
            exit_ |= (self.trigger / "exit").exists()
        return save or exit_, exit_

    def poll(self, device: torch.device) -> Requests:
        flags = torch.tensor(self._local(), dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        requests = Requests(save=bool(flags[0]), exit=bool(flags[1]))
        if requests.save and self.trigger is not None and dist.get_rank() == 0:
            (self.trigger / "save").unlink(missing_ok=True)
        if requests.exit and dist.get_rank() == 0:
            why = (
                f"signal {signal.Signals(self.signalled).name}"
                if self.signalled
                else "trigger file"
            )
            log.info(f"exit requested by {why}: saving a checkpoint and stopping")
        return requests
