"""Where training numbers go: the log line, TensorBoard, wandb, a JSON-lines log and a loss plot.

Throughput: tokens per second per device on every backend; on GPU also model TFLOP/s and MFU
against the device's dense bf16 peak, from the model FLOPs per token of
:func:`megatron.apertus.model.flops.flops_per_token`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.apertus.cli import atomic_outputs, naming_file

log = logging.getLogger("apertus")

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0}


def device_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


@dataclass(frozen=True)
class IntervalSummary:
    """What one iteration line reports of the steps since the previous one."""

    steps: int
    """Steps since the previous line (reset or not)."""
    ms_per_iteration: float
    tokens_per_second: float
    """Per device."""
    loss: float | None
    """Mean loss of the steps that updated the weights, 0.0 when every step of the interval was
    skipped (Megatron-LM divides by ``max(1, advanced)``); None until a step of this job has
    updated them (Megatron-LM has no loss entry to print before)."""
    skipped: int
    """Steps skipped for a non-finite loss or gradient norm."""
    nan: int
    """Skipped steps whose loss itself was not finite (Megatron-LM's "nan iterations")."""


class LogInterval:
    """The steps since the last log line: the line reports their average time, tokens/s and
    loss, and counts their skipped and NaN steps, as Megatron-LM's ``training_log`` does."""

    def __init__(self) -> None:
        self._reset()
        self.any_advanced = False
        """Whether a step of this job has updated the weights (kept across intervals)."""

    def _reset(self) -> None:
        self.seconds, self.tokens, self.steps = 0.0, 0, 0
        self.loss_sum, self.advanced, self.skipped, self.nan = 0.0, 0, 0, 0

    def add(self, seconds: float, tokens: int, *, loss: float | None, skipped: bool) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self.steps += 1
        if not skipped:
            self.advanced += 1
            self.any_advanced = True
            self.loss_sum += loss or 0.0
            return
        self.skipped += 1
        self.nan += loss is not None and not math.isfinite(loss)

    def take(self, world_size: int, *, reset: bool = True) -> IntervalSummary:
        """The interval's summary; ``reset`` starts the next one (Megatron-LM keeps counting
        through the extra line of a job's first iteration)."""
        seconds = max(self.seconds, 1e-9)
        summary = IntervalSummary(
            steps=self.steps,
            ms_per_iteration=1000 * seconds / max(self.steps, 1),
            tokens_per_second=self.tokens / seconds / world_size,
            loss=self.loss_sum / max(1, self.advanced) if self.any_advanced else None,
            skipped=self.skipped,
            nan=self.nan,
        )
        if reset:
            self._reset()
        return summary


def wandb_dir(save_dir: str | None, save: str | None) -> str | None:
    """wandb's local folder, as in Megatron-LM: --wandb-save-dir, else SAVE/wandb (else
    wandb's own default, ./wandb, where a run saves nothing)."""
    if save_dir:
        return save_dir
    return os.path.join(save, "wandb") if save else None


class Metrics:
    """Fan-out of scalar metrics to TensorBoard/wandb (when configured), the in-memory history
    and the ``--log-json`` file.

    ``--log-json`` is JSON Lines, one object per iteration and flush (``{"iteration": 12,
    "train/loss": 2.31, ...}``; :func:`read_history` reads it back), appended and flushed at
    every log line, so a run killed at any moment leaves every logged interval on disk. A run
    that resumes starts the file over from its restored history: entries a killed job logged
    after its last checkpoint are replaced by the ones the resumed run makes.
    """

    def __init__(
        self,
        *,
        tensorboard_dir: str | None,
        wandb_project: str | None,
        wandb_exp_name: str | None,
        config: dict,
        tensorboard_queue_size: int = 1000,
        wandb_entity: str | None = None,
        wandb_dir: str | None = None,
    ) -> None:
        self.history: dict[str, list] = {}
        self.tensorboard = None
        self.wandb = None
        self.json_log = None
        self.pending: dict[int, dict[str, float]] = {}
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(tensorboard_dir, max_queue=tensorboard_queue_size)
        if wandb_project:
            import wandb  # present: LoggingConfig refuses --wandb-project without it

            if wandb_dir is not None:
                os.makedirs(wandb_dir, exist_ok=True)
            self.wandb = wandb.init(
                project=wandb_project,
                name=wandb_exp_name,
                entity=wandb_entity,
                dir=wandb_dir,
                config=config,
            )

    def restore(self, path: Path, up_to_iteration: int) -> None:
        """Continue the history of a resumed run (entries after the checkpoint are dropped)."""
        if path.is_file():
            saved = json.loads(path.read_text())
            self.history = {k: [e for e in v if e[0] <= up_to_iteration] for k, v in saved.items()}

    def rewind(self, iteration: int, *, keep: str) -> None:
        """Continue from ``iteration`` (a run that went back to that checkpoint): what was
        recorded after it is dropped, except the names that start with ``keep``, and
        ``--log-json`` starts over from the history."""
        self.flush()
        self.history = {
            name: [e for e in entries if e[0] <= iteration or name.startswith(keep)]
            for name, entries in self.history.items()
        }
        if self.json_log is not None:
            path = Path(self.json_log.name)
            self.json_log.close()
            self.open_json_log(path)

    def open_json_log(self, path: str | Path) -> None:
        """Start ``path`` with the history so far (atomically), then append to it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        by_iteration: dict[int, dict[str, float]] = {}
        for name, entries in self.history.items():
            for iteration, value in entries:
                by_iteration.setdefault(iteration, {})[name] = value
        with atomic_outputs(path) as (temporary,):
            lines = (_json_line(it, by_iteration[it]) for it in sorted(by_iteration))
            Path(temporary).write_text("".join(lines))
        self.json_log = path.open("a")

    def snapshot(self, path: Path) -> None:
        """Write the history next to a checkpoint, atomically."""
        with atomic_outputs(path) as (temporary,):
            Path(temporary).write_text(json.dumps(self.history))

    def record(
        self,
        name: str,
        iteration: int,
        value: float,
        *,
        tag: str | None = None,
        samples: int | None = None,
        written: bool = True,
    ) -> None:
        """Record ``name`` (the history's and ``--log-json``'s key); unless not ``written`` (an
        iteration --tensorboard-log-interval skips), TensorBoard and wandb get it as ``tag``
        (default: ``name``), and with ``samples`` TensorBoard also as ``"<tag> vs samples"``
        against the consumed samples, as Megatron-LM writes its scalars."""
        self.history.setdefault(name, []).append([iteration, value])
        if self.json_log is not None:
            self.pending.setdefault(iteration, {})[name] = value
        if not written:
            return
        tag = tag or name
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, iteration)
            if samples is not None:
                self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step=iteration)

    def flush(self) -> None:
        """Append what was recorded since the last flush to the JSON log, and flush every sink."""
        if self.json_log is not None and self.pending:
            with naming_file(self.json_log.name):
                self.json_log.write(
                    "".join(_json_line(it, self.pending[it]) for it in sorted(self.pending))
                )
                self.json_log.flush()
            self.pending = {}
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def plot(self, path: str | Path | None) -> None:
        if path and "train/loss" in self.history:
            plot_losses(self.history, Path(path))

    def close(self, plot_path: str | None) -> None:
        self.flush()
        if self.json_log is not None:
            self.json_log.close()
            self.json_log = None
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.plot(plot_path)


def _json_line(iteration: int, values: dict[str, float]) -> str:
    return json.dumps({"iteration": iteration, **values}) + "\n"


def read_history(path: str | Path) -> dict[str, list]:
    """A ``--log-json`` file as ``{name: [[iteration, value], ...]}``; a last line cut short by
    a kill is ignored."""
    history: dict[str, list] = {}
    for line in Path(path).read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        iteration = entry.pop("iteration")
        for name, value in entry.items():
            history.setdefault(name, []).append([iteration, value])
    return history


def plot_losses(history: dict[str, list], path: Path) -> None:
    """PNG of the training loss and the validation loss (of each validation set) against
    iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    validation = sorted(name for name in history if name.startswith("valid/loss"))
    for name, style in [("train/loss", "-")] + [(name, "o-") for name in validation]:
        if name in history:
            steps, values = zip(*history[name])
            ax.plot(steps, values, style, label=name.replace("/", " "), markersize=4)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_outputs(path) as (temporary,):
        fig.savefig(temporary, dpi=120, format="png")
    plt.close(fig)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
