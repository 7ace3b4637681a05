"""Pretrain an Apertus model on megatron-core: parse, build, train.

python pretrain_gpt.py --model-preset tiny --train-iters 50 --global-batch-size 8
torchrun --nproc-per-node 2 pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import torch

from megatron.apertus.align.config import AlignConfig
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.distill.logit_store import LogitStoreError
from megatron.apertus.launch.planner import Cluster, format_plan, plan, run_from_args
from megatron.apertus.model.config import ConfigError
from megatron.apertus.model.engine import EngineConfig, validate_engine
from megatron.apertus.optim import AdEMAMixSettings, ScheduleConfig
from megatron.apertus.parallel import resolve_device
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.training import config as C
from megatron.apertus.training.loop import RunConfig, TrainingStopped, train
from megatron.apertus.training.megatron_flags import add_megatron_flags, refusals
from megatron.apertus.training.run_log import configure_logging


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
    C.add_arguments(parser, C.CommunicationConfig, title="communication overlap")
    C.add_arguments(parser, C.CheckpointConfig, title="checkpointing")
    C.add_arguments(parser, C.DataConfig, title="data")
    C.add_arguments(parser, DatasetConfig, title="datasets")
    C.add_arguments(parser, GoldfishConfig, title="goldfish loss", prefix="goldfish_")
    C.add_arguments(parser, C.LoggingConfig, title="logging")
    C.add_arguments(parser, DistillConfig, title="distillation (sparse top-k teacher logits)")
    C.add_arguments(parser, AlignConfig, title="alignment (DPO, QRPO)")
    C.add_arguments(parser, QuantConfig, title="quantization-aware training")
    add_megatron_flags(parser)
    parser.add_argument(
        "--dry-run", action="store_true",
        help="check the flags, print the layout plan (memory and FLOPs per step) for the "
             "processes this command runs as (torchrun's WORLD_SIZE, else Slurm's SLURM_NTASKS, "
             "else 1) and exit without reading data or building the model; exit 1 when the "
             "layout cannot run" + C.ADDITION_MARK,
    )  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
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
            align=C.from_arguments(AlignConfig, args),
            engine=C.from_arguments(EngineConfig, args),
            communication=C.from_arguments(C.CommunicationConfig, args),
            quant=C.from_arguments(QuantConfig, args),
        )
        config.communication.check(
            distributed_optimizer=config.optimizer.use_distributed_optimizer,
            virtual_pipeline=config.parallel.virtual_pipeline_model_parallel_size is not None,
        )
        validate_engine(
            config.engine,
            device=resolve_device(config.training.device),
            num_layers=config.model.num_layers,
        )
    except (ConfigError, ValueError) as err:
        parser.error(str(err))
    except RuntimeError as err:  # --device cuda without a GPU
        parser.error(str(err))
    if args.dry_run:
        _dry_run(argv, config)
    return config


def _processes() -> tuple[int, int]:
    """(processes, processes per node) this command runs as: torchrun's, else Slurm's, else 1."""
    env = os.environ
    if "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return world, int(env.get("LOCAL_WORLD_SIZE", world))
    if "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        per_node = env.get("SLURM_NTASKS_PER_NODE", str(world)).split("(")[0]
        return world, int(per_node)
    return 1, 1


def _dry_run(argv: list[str], config: RunConfig) -> NoReturn:
    """Print the planner's view of this run and exit (rank 0 prints under torchrun)."""
    gpus, per_node = _processes()
    on_gpu = resolve_device(config.training.device) == "cuda"
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else None
    result = plan(run_from_args(argv), Cluster(gpus=gpus, gpus_per_node=per_node,
                                               gpu_memory_gib=memory))  # fmt: skip
    if os.environ.get("RANK", "0") == "0":
        print(format_plan(result, name="dry run"))
    sys.exit(0 if result.ok else 1)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(config.checkpoint.save)
    try:
        train(config)
    except (ConfigError, LogitStoreError) as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as err:
        sys.exit(f"pretrain_gpt.py: stopped: {err}")


if __name__ == "__main__":
    main()
