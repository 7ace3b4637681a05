"""Pretrain an Apertus model on megatron-core: parse, build, train.

python pretrain_gpt.py --model-preset tiny --train-iters 50 --global-batch-size 8
torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.distill.logit_store import LogitStoreError
from megatron.apertus.model.config import ConfigError
from megatron.apertus.model.engine import EngineConfig, validate_engine
from megatron.apertus.optim import AdEMAMixSettings, ScheduleConfig
from megatron.apertus.parallel import resolve_device
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.training import config as C
from megatron.apertus.training.loop import RunConfig, TrainingStopped, train
from megatron.apertus.training.megatron_flags import add_megatron_flags, refusals


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The run a command line describes; exits 2 with one line per flag it cannot honour.

    As in Megatron-LM, flags are never abbreviated: ``--xielu`` is a flag of its own, not a
    prefix of ``--xielu-beta``.
    """
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    C.add_model_arguments(parser)
    C.add_arguments(parser, C.TrainingConfig, title="training")
    C.add_arguments(parser, EngineConfig, title="transformer implementation and FP8")
    C.add_arguments(parser, C.OptimizerSettings, title="optimizer")
    C.add_arguments(parser, AdEMAMixSettings, title="AdEMAMix", prefix="ademamix_")
    C.add_arguments(parser, ScheduleConfig, title="learning-rate schedule")
    C.add_arguments(parser, C.CheckpointConfig, title="checkpointing")
    C.add_arguments(parser, C.DataConfig, title="data")
    C.add_arguments(parser, DatasetConfig, title="datasets")
    C.add_arguments(parser, GoldfishConfig, title="goldfish loss", prefix="goldfish_")
    C.add_arguments(parser, C.LoggingConfig, title="logging")
    C.add_arguments(parser, DistillConfig, title="distillation (sparse top-k teacher logits)")
    C.add_arguments(parser, QuantConfig, title="quantization-aware training")
    add_megatron_flags(parser)
    args = parser.parse_args(argv)
    refused = refusals(args)
    if len(refused) > 1:
        parser.error(f"{len(refused)} flags cannot be honoured:\n  " + "\n  ".join(refused))
    if refused:
        parser.error(refused[0])
    try:
        model = C.model_from_arguments(args)
        config = RunConfig(
            model=model,
            parallel=C.parallel_from_arguments(args, model),
            training=C.from_arguments(C.TrainingConfig, args),
            optimizer=C.from_arguments(C.OptimizerSettings, args),
            ademamix=C.from_arguments(AdEMAMixSettings, args, prefix="ademamix_"),
            schedule=C.from_arguments(ScheduleConfig, args),
            checkpoint=C.from_arguments(C.CheckpointConfig, args),
            data=C.from_arguments(C.DataConfig, args),
            dataset=C.from_arguments(DatasetConfig, args),
            goldfish=C.from_arguments(GoldfishConfig, args, prefix="goldfish_"),
            logging=C.from_arguments(C.LoggingConfig, args),
            distill=C.from_arguments(DistillConfig, args),
            engine=C.from_arguments(EngineConfig, args),
            quant=C.from_arguments(QuantConfig, args),
        )
        validate_engine(
            config.engine,
            device=resolve_device(config.training.device),
            num_layers=config.model.num_layers,
            context_parallel_size=config.parallel.context_parallel_size,
        )
    except (ConfigError, ValueError) as err:
        parser.error(str(err))
    except RuntimeError as err:  # --device cuda without a GPU
        parser.error(str(err))
    return config


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    config = parse_args(argv)
    try:
        train(config)
    except (ConfigError, LogitStoreError) as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as err:
        sys.exit(f"pretrain_gpt.py: stopped: {err}")


if __name__ == "__main__":
    main()
