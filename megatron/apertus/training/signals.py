"""Requests to save or stop, from signals and trigger files, agreed on by every rank.

* ``--exit-signal-handler``: SIGUSR2 (what Slurm's ``--signal=SIGUSR2@N`` sends before the time
  limit), SIGTERM, Ctrl-C (SIGINT) and the signal ``--exit-signal`` names set a flag; at the end of the current step the run saves
  and exits 0. A second Ctrl-C stops at once, without saving. Without the flag, Ctrl-C and
  SIGTERM stop the run at once with one line (``cli.run``), exit code 130 or 143.
* ``--trigger-path DIR``: a file ``DIR/save`` asks for a checkpoint (the file is removed once
  honoured), ``DIR/exit`` for a checkpoint and a clean exit.
* ``--exit-duration-in-mins M``: once the process has run M minutes (counted from its start, as
  Megatron-LM counts from its start-up), a checkpoint and a clean exit; validation stops at its
  next batch.

Every rank must take the same decision in the same step, so the local requests are combined
with an all-reduce (MAX) each step: one rank's signal is enough.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

log = logging.getLogger("apertus")


@dataclass(frozen=True)
class Requests:
    save: bool = False
    exit: bool = False


def _minutes_running() -> float:
    return (time.time() - psutil.Process().create_time()) / 60


def past_duration(minutes: float | None, device: torch.device) -> bool:
    """Whether any rank has run longer than ``minutes`` (a collective unless ``minutes`` is
    None: every rank calls it at the same point)."""
    if minutes is None:
        return False
    flag = torch.tensor([_minutes_running() > minutes], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag[0])


class StopRequests:
    """Collects signal, trigger-file and time-limit requests; ``poll()`` is a collective."""

    def __init__(
        self,
        *,
        handle_signals: bool,
        trigger_path: str | None,
        exit_duration_in_mins: float | None = None,
        exit_signal: str = "SIGTERM",
    ) -> None:
        self.trigger = Path(trigger_path) if trigger_path else None
        self.exit_duration_in_mins = exit_duration_in_mins
        self.signalled: int | None = None
        if handle_signals:
            handled = {signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.Signals[exit_signal]}
            for sig in sorted(handled):
                # A job started with Ctrl-C ignored (nohup, `cmd &`) keeps ignoring it.
                if signal.getsignal(sig) != signal.SIG_IGN:
                    signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signalled = signum
        if signum == signal.SIGINT:  # the next Ctrl-C does not wait for the save
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _local(self) -> tuple[bool, bool, bool]:
        save = exit_ = self.signalled is not None
        if self.trigger is not None and dist.get_rank() == 0:
            save |= (self.trigger / "save").exists()
            exit_ |= (self.trigger / "exit").exists()
        limit = self.exit_duration_in_mins
        timed_out = limit is not None and _minutes_running() > limit
        return save or exit_ or timed_out, exit_ or timed_out, timed_out

    def poll(self, device: torch.device) -> Requests:
        flags = torch.tensor(self._local(), dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        requests = Requests(save=bool(flags[0]), exit=bool(flags[1]))
        if requests.save and self.trigger is not None and dist.get_rank() == 0:
            (self.trigger / "save").unlink(missing_ok=True)
        if requests.exit and dist.get_rank() == 0:
            if flags[2]:
                why = f"--exit-duration-in-mins {self.exit_duration_in_mins:g}"
            elif self.signalled:
                why = f"signal {signal.Signals(self.signalled).name}"
            else:
                why = "trigger file"
            log.info(f"exit requested by {why}: saving a checkpoint and stopping")
        return requests
