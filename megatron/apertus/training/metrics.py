"""Where training numbers go: the log line, TensorBoard, wandb, a JSON history and a loss plot.

Throughput: tokens per second per device on every backend; on GPU also model TFLOP/s and MFU
against the device's dense bf16 peak. Model FLOPs per token follow the usual count:
6 x (non-embedding parameters + output layer) for the matmuls, plus 6 x layers x seq x hidden
for attention scores and values (causal halves the 12 of full attention).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from megatron.apertus.model.config import ApertusConfig

log = logging.getLogger("apertus")

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0}


def flops_per_token(model: ApertusConfig) -> float:
    """Training FLOPs (forward + backward) per token."""
    dense = model.num_parameters() - model.vocab_size * model.hidden_size  # output layer stays
    if not model.untie_embeddings_and_output_weights:
        dense += model.vocab_size * model.hidden_size
    attention = 6 * model.num_layers * model.seq_length * model.hidden_size
    return 6 * dense + attention


def device_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


class Metrics:
    """Fan-out of scalar metrics to TensorBoard/wandb (when configured) and a JSON history."""

    def __init__(self, *, tensorboard_dir: str | None, wandb_project: str | None,
                 wandb_exp_name: str | None, config: dict) -> None:  # fmt: skip
        self.history: dict[str, list] = {}
        self.tensorboard = None
        self.wandb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(tensorboard_dir)
        if wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError(
                    "--wandb-project needs wandb: pip install 'megatron-apertus[wandb]'"
                ) from err
            self.wandb = wandb.init(project=wandb_project, name=wandb_exp_name, config=config)

    def restore(self, path: Path, up_to_iteration: int) -> None:
        """Continue the history of a resumed run (entries after the checkpoint are dropped)."""
        if path.is_file():
            saved = json.loads(path.read_text())
            self.history = {k: [e for e in v if e[0] <= up_to_iteration] for k, v in saved.items()}

    def snapshot(self, path: Path) -> None:
        """Write the history next to a checkpoint, atomically."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.history))
        tmp.replace(path)

    def record(self, name: str, iteration: int, value: float) -> None:
        self.history.setdefault(name, []).append([iteration, value])
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log({name: value}, step=iteration)

    def close(self, json_path: str | None, plot_path: str | None) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if json_path:
            Path(json_path).write_text(json.dumps(self.history, indent=1))
        if plot_path and "train/loss" in self.history:
            plot_losses(self.history, Path(plot_path))


def plot_losses(history: dict[str, list], path: Path) -> None:
    """PNG of the training loss and the validation loss against iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("train/loss", "-"), ("valid/loss", "o-")):
        if name in history:
            steps, values = zip(*history[name])
            ax.plot(steps, values, style, label=name.replace("/", " "), markersize=4)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
