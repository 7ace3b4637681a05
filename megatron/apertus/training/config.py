"""The registry of config groups: one command line from the configs every unit declares.

Each unit declares its config next to its code (the model and its layout in
``model/config.py``, the optimizer in ``optim/builder.py``, the data in ``data/config.py``, the
loop's own groups in ``training/*_config.py``, ...); :mod:`megatron.apertus.flags` turns a
config's fields into Megatron-named flags (``micro_batch_size`` -> ``--micro-batch-size``), or
lets a group that needs more parse itself. Nothing below ``training/`` reads the command line:
entry points parse once and pass the built configs down.

:class:`RunConfig` is the registry: one field per config group, in ``--help`` order, with the
group's title. ``pretrain_gpt.py`` adds and reads every group (:func:`add_run_arguments`,
:func:`run_from_arguments`), the tools and the launch planner name the groups they need. A new
field of a registered config becomes a flag with no other edit; a new group is one field here.
``tests/training/test_cli_snapshot.py`` freezes the resulting command line.

This module and the config modules it reads import neither torch nor megatron-core: the flags
serve ``--help`` and argument errors, which must start at once. What needs them (a ramp-up's
steps, the device, GEMM statistics' names) imports them where it is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable

from megatron.apertus.align.config import AlignConfig
from megatron.apertus.data.config import DataConfig
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import add_group, build_group
from megatron.apertus.model.config import ApertusConfig, ParallelConfig
from megatron.apertus.model.cuda_graphs import CudaGraphConfig
from megatron.apertus.model.engine import EngineConfig, validate_engine
from megatron.apertus.optim.builder import AdEMAMixSettings, OptimizerSettings
from megatron.apertus.optim.schedule import ScheduleConfig
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.training.checkpoint_config import CheckpointConfig
from megatron.apertus.training.communication_config import CommunicationConfig
from megatron.apertus.training.cuda_graphs import check_cuda_graphs
from megatron.apertus.training.fp8_guard import Fp8GuardConfig
from megatron.apertus.training.logging_config import LoggingConfig
from megatron.apertus.training.loop_config import TrainingConfig
from megatron.apertus.training.profiling_config import ProfilingConfig
from megatron.apertus.training.rerun_config import RerunConfig
from megatron.apertus.training.timing_config import TimingConfig


def group(title: str, *, prefix: str = "") -> Any:
    """A :class:`RunConfig` field holding one config group: flags ``--<prefix><field>`` under
    ``title`` in ``--help``."""
    return field(metadata={"title": title, "prefix": prefix})


@dataclass(kw_only=True)
class RunConfig:
    """A training run: every config group, in ``--help`` order. The one table of groups."""

    model: ApertusConfig = group("model (overrides the preset)")
    parallel: ParallelConfig = group("parallelism")
    training: TrainingConfig = group("training")
    engine: EngineConfig = group("transformer implementation and FP8")
    cuda_graphs: CudaGraphConfig = group("CUDA graphs")
    optimizer: OptimizerSettings = group("optimizer")
    ademamix: AdEMAMixSettings = group("AdEMAMix", prefix="ademamix_")
    schedule: ScheduleConfig = group("learning-rate schedule")
    communication: CommunicationConfig = group("communication overlap")
    checkpoint: CheckpointConfig = group("checkpointing")
    data: DataConfig = group("data")
    dataset: DatasetConfig = group("datasets")
    goldfish: GoldfishConfig = group("goldfish loss", prefix="goldfish_")
    logging: LoggingConfig = group("logging")
    timing: TimingConfig = group("timers")
    profiling: ProfilingConfig = group("profiling")
    fp8_guard: Fp8GuardConfig = group("FP8 guard")
    rerun: RerunConfig = group("result validation (megatron-core's rerun state machine)")
    distill: DistillConfig = group("distillation (sparse top-k teacher logits)")
    align: AlignConfig = group("alignment (DPO, QRPO)")
    quant: QuantConfig = group("quantization-aware training")


GROUPS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(RunConfig)}
"""The config groups by name, in ``--help`` order."""


def group_class(name: str) -> type:
    """The dataclass of config group ``name``."""
    return typing.get_type_hints(RunConfig)[name]


def add_run_arguments(
    parser: argparse.ArgumentParser,
    names: Iterable[str] = GROUPS,
    *,
    titles: dict[str, str] | None = None,
) -> None:
    """The flags of the groups ``names`` (default: all), in registry order; ``titles`` renames
    groups in a tool's ``--help``."""
    wanted = set(names)
    for name, f in GROUPS.items():
        if name in wanted:
            title = (titles or {}).get(name, f.metadata["title"])
            add_group(parser, group_class(name), title=title, prefix=f.metadata["prefix"])


def groups_from_arguments(
    args: argparse.Namespace, names: Iterable[str] = GROUPS, *, model: ApertusConfig | None = None
) -> dict[str, Any]:
    """The config groups ``names`` built from parsed flags, by name, in registry order (a group
    may read the ones before it: the layout reads the model's layer count). ``model``: the
    model when it is not among ``names`` (a checkpoint's)."""
    wanted = set(names)
    built: dict[str, Any] = {} if model is None else {"model": model}
    for name, f in GROUPS.items():
        if name in wanted:
            cls, prefix = group_class(name), f.metadata["prefix"]
            built[name] = build_group(cls, args, prefix=prefix, built=built)
    return {name: value for name, value in built.items() if name in wanted}


def run_from_arguments(args: argparse.Namespace, given: Iterable[str] = ()) -> RunConfig:
    """The whole run, checked across groups (overlap flags, engine against device and layout);
    ``given``: the destinations the command line set
    (:func:`~megatron.apertus.flags.given_destinations`), for the flags that must not appear
    without another even at their default values."""
    from megatron.apertus.parallel import check_launch, resolve_device

    config = RunConfig(**groups_from_arguments(args))
    check_mock_data(config)
    check_null_tokenizer(config)
    config.align.check_given(given)
    device = resolve_device(config.training.device)
    config.communication.check(
        distributed_optimizer=config.optimizer.use_distributed_optimizer,
        virtual_pipeline=config.parallel.virtual_pipeline_model_parallel_size is not None,
        pipeline=config.parallel.pipeline_model_parallel_size,
        device=device,
        per_token_loss=config.training.calculate_per_token_loss,
    )
    check_launch(config.parallel, device)
    impl = validate_engine(config.engine, device=device, num_layers=config.model.num_layers)
    if config.training.te_rng_tracker and impl != "transformer_engine":
        raise ConfigError(
            "--te-rng-tracker is Transformer Engine's RNG tracker: it needs --transformer-impl "
            "transformer_engine (a GPU with Transformer Engine)"
        )
    config.logging.check_max_attention_logit(
        te_attention=impl == "transformer_engine" and config.engine.attention_backend != "local",
        context_parallel=config.parallel.context_parallel_size > 1,
    )
    check_cuda_graphs(config, device=device, impl=impl, engine=config.engine)
    config.profiling.check(device=device, tensorboard_dir=config.logging.tensorboard_dir)
    config.logging.check_memory_interval(config.training.log_interval)
    config.logging.check_device_memory(device)
    config.fp8_guard.check_run(
        save=config.checkpoint.save,
        fp8_param_gather=config.engine.fp8_param_gather,
        saves_left_out=config.checkpoint.saves_left_out(),
    )
    return config


def check_mock_data(config: RunConfig) -> None:
    """Refuse --mock-data beside an objective that reads data of its own."""
    if not config.dataset.mock_data:
        return
    for flag, given, why in (
        (
            "--distill-logits-path",
            config.distill.enabled,
            "a teacher store holds the logits of the samples of the dataset it was made from",
        ),
        ("--align-objective", config.align.enabled, "alignment reads preference pairs"),
    ):
        if given:
            raise ConfigError(f"--mock-data and {flag} exclude each other: {why}")


def check_null_tokenizer(config: RunConfig) -> None:
    """Megatron-LM's NullTokenizer trains on --mock-data only (it has no vocabulary to read a
    corpus with), its end-of-document and padding ids inside the model's vocabulary."""
    data = config.data
    if data.tokenizer_type != "NullTokenizer":
        return
    if not config.dataset.mock_data:
        raise ConfigError(
            "--tokenizer-type NullTokenizer has ids but no vocabulary to read a corpus with: "
            "it trains on --mock-data only"
        )
    from megatron.apertus.tokenizer.tokenizers import null_tokenizer

    null_tokenizer(config.model.vocab_size, data.null_tokenizer_eod_id, data.null_tokenizer_pad_id)
