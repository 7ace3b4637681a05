"""Typed, per-concern configuration of a training run, and the command line generated from it.

Each dataclass owns one concern; its fields become Megatron-named flags (``micro_batch_size``
-> ``--micro-batch-size``) with the help text in the field's metadata. Nothing below
``training/`` reads the command line: entry points parse once and pass these objects down.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron.apertus.model.config import ApertusConfig, ConfigError, ParallelConfig
from megatron.apertus.model.presets import PRESETS, preset


def _help(text: str, default: Any = dataclasses.MISSING, **kwargs) -> Any:
    return field(default=default, metadata={"help": text}, **kwargs)


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    micro_batch_size: int = _help("samples per micro-batch per data-parallel rank", 1)
    global_batch_size: int = _help("samples per optimizer step over all data-parallel ranks", 8)
    train_iters: int = _help("optimizer steps to run", 100)
    seed: int = _help("seed of initialisation and data order", 1234)
    log_interval: int = _help("iterations between log lines", 10)
    eval_interval: int = _help("iterations between validation passes (0: only at the end)", 0)
    eval_iters: int = _help("validation batches per validation pass", 4)
    device: str = _help("auto, cpu or cuda", "auto")
    precision: str = _help("parameter dtype: fp32, bf16 or fp16", "fp32")

    def num_microbatches(self, dp_size: int) -> int:
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"--global-batch-size ({self.global_batch_size}) is not divisible by "
                f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size ({dp_size})"
            )
        return self.global_batch_size // per_step


@dataclass(kw_only=True, frozen=True)
class OptimizerSettings:
    optimizer: str = _help("adam", "adam")
    lr: float = _help("peak learning rate", 1e-3)
    weight_decay: float = _help(
        "decoupled weight decay (never on norms, biases, xIELU alphas)", 0.1
    )
    adam_beta1: float = _help("first-moment decay", 0.9)
    adam_beta2: float = _help("second-moment decay", 0.95)
    adam_eps: float = _help("denominator epsilon", 1e-8)
    clip_grad: float = _help("global gradient-norm clip (0: off)", 1.0)
    use_distributed_optimizer: bool = _help("shard optimizer state over data-parallel ranks", False)


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    save: Optional[str] = _help("directory to save checkpoints to", None)
    load: Optional[str] = _help(
        "checkpoint (save directory or iter_* directory) to start from", None
    )
    save_interval: int = _help("iterations between checkpoints (0: only at the end)", 0)


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    tokenizer_type: str = _help("TekkenTokenizer, HuggingFaceTokenizer or SentencePieceTokenizer",
                                "TekkenTokenizer")  # fmt: skip
    tokenizer_model: Optional[str] = _help(
        "tokenizer file or directory (TekkenTokenizer: default the one bundled with mistral-common)",
        None,
    )
    goldfish_loss: bool = _help("drop a deterministic 1/k of label positions from the loss", False)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    log_json: Optional[str] = _help(
        "write every logged iteration's loss and grad norm to this JSON file", None
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    title: str,
    defaults: bool = True,
    prefix: str = "",
) -> None:
    """Add one argument group with a flag ``--<prefix><field>`` per field of dataclass ``cls``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _base_type(hints[f.name])
        flag = _flag(prefix + f.name)
        kwargs = dict(default=_default(f) if defaults else None, help=f.metadata.get("help", ""))
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(kind) is list:
            group.add_argument(flag, nargs="+", type=typing.get_args(kind)[0], **kwargs)
        else:
            group.add_argument(flag, type=kind, **kwargs)


def from_arguments(cls: type, args: argparse.Namespace, base: Any = None, prefix: str = "") -> Any:
    """Build ``cls`` from parsed flags; unset flags (None) fall back to ``base`` or the default."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, prefix + f.name, None)
        if value is not None:
            values[f.name] = value
    if base is not None:
        return dataclasses.replace(base, **values)
    return cls(**values)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="architecture to start from; any model flag below overrides it",
    )
    add_arguments(parser, ApertusConfig, title="model (overrides the preset)", defaults=False)
    add_arguments(parser, ParallelConfig, title="parallelism")


def model_from_arguments(args: argparse.Namespace) -> ApertusConfig:
    return from_arguments(ApertusConfig, args, base=preset(args.model_preset))
