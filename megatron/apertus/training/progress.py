"""Megatron-LM's progress file (``--log-progress``): ``SAVE/progress.txt``, one line per job start
and per checkpoint, so a multi-job run's throughput can be followed across restarts.

Each line is tab-separated, as Megatron-LM writes it::

    2026-11-25 01:02:03  Job ID: 4242  # GPUs: 1024  Starting job
    2026-11-25 03:04:05  Job ID: 4242  # GPUs: 1024  Saved checkpoint  Iteration: 2000
        Job throughput: 181.3 TFLOP/s/GPU  Cumulative throughput: 180.9 TFLOP/s/GPU
        Floating-point operations: 1.23e+21  Tokens (in billions): 16.78

(one line, wrapped here). "Job throughput" counts from this job's start; "cumulative" from the
first start logged with the same number of GPUs. Floating-point operations are the model's
training FLOPs of every token consumed so far (``model.flops.flops_per_token``), so a resumed run
derives them from its consumed samples. A background save logs "Saving async checkpoint".
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

PROGRESS_FILE = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _field(token: str, kind: type):
    return kind(token.split(": ", 1)[1])


class ProgressLog:
    """Appends Megatron-LM's progress lines (call on the one reporting rank)."""

    def __init__(
        self,
        save_dir: str | os.PathLike,
        *,
        world_size: int,
        flops_per_sample: float,
        tokens_per_sample: int,
        consumed_samples: int,
    ) -> None:
        self.path = Path(save_dir) / PROGRESS_FILE
        self.world_size = world_size
        self.flops_per_sample = flops_per_sample
        self.tokens_per_sample = tokens_per_sample
        self.job_start = datetime.now()
        self.job_start_flops = consumed_samples * flops_per_sample

    def _append(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        job = os.environ.get("SLURM_JOB_ID", "")
        stamp = datetime.now().strftime(_TIME_FORMAT)
        with self.path.open("a") as log:
            log.write(f"{stamp}\tJob ID: {job}\t# GPUs: {self.world_size}\t{text}\n")

    def start(self) -> None:
        self.job_start = datetime.now().replace(microsecond=0)
        self._append("Starting job")

    def _first_start(self) -> tuple[datetime, float]:
        """When the run first started with this many GPUs, and its FLOPs then."""
        first, first_flops, latest_flops = self.job_start, self.job_start_flops, 0.0
        found = False
        for line in self.path.read_text().splitlines():
            tokens = line.split("\t")
            if len(tokens) < 4:
                continue
            if tokens[3] in ("Saved checkpoint", "Saving async checkpoint"):
                latest_flops = _field(tokens[7], float)
            if _field(tokens[2], int) != self.world_size:
                found = False  # another size breaks the series: count from the next start
                continue
            if tokens[3] == "Starting job" and not found:
                first, first_flops, found = (
                    datetime.strptime(tokens[0], _TIME_FORMAT),
                    latest_flops,
                    True,
                )
        return first, first_flops

    def saved(self, iteration: int, consumed_samples: int, *, background: bool) -> None:
        """The line of a checkpoint at ``iteration`` after ``consumed_samples`` samples."""
        flops = consumed_samples * self.flops_per_sample
        now = datetime.now()
        first, first_flops = self._first_start()
        job = self._tflops_per_gpu(flops - self.job_start_flops, now - self.job_start)
        cumulative = self._tflops_per_gpu(flops - first_flops, now - first)
        tokens = consumed_samples * self.tokens_per_sample
        kind = "Saving async checkpoint" if background else "Saved checkpoint"
        self._append(
            f"{kind}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}"
        )

    def _tflops_per_gpu(self, flops: float, elapsed) -> float:
        seconds = max(elapsed.total_seconds(), 1e-9)
        return flops / (seconds * 1e12 * self.world_size)
