"""Generate a teacher's top-k logits, or ids drawn from it, over a student's training data
(docs/distillation.md).

Give the teacher checkpoint and the *student's* data and batch flags: the store then holds,
at position i, the teacher's top-k for the i-th sample the student will consume; with
``--sampling random --samples N``, N ids drawn from the teacher's distribution at each token
instead (distinct ids and counts: an unbiased sparse target).

    python tools/generate_teacher_logits.py --load TEACHER_SAVE_DIR --logits-dir LOGITS \\
        --data-path PREFIX --seq-length 4096 --global-batch-size 1024 --train-iters 1000 \\
        --seed 1234 [--topk 256 | --sampling random --samples 32] \\
        [--tensor-model-parallel-size 2 ...]
    torchrun --nproc-per-node 8 tools/generate_teacher_logits.py ...   # DP x TP x PP ranks

The teacher's architecture is read from its checkpoint; ``--seq-length`` may override it (the
student's). Re-running the same command resumes: finished blocks are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.model.config import PRESETS, ApertusConfig, preset
from megatron.apertus.training import config as C

ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "untie_embeddings_and_output_weights",
)


def check_architecture(model: ApertusConfig, expected: ApertusConfig, name: str) -> None:
    """Refuse a teacher checkpoint that is not the architecture the launcher planned for."""
    differ = [
        f"{f} {getattr(model, f)} (preset: {getattr(expected, f)})"
        for f in ARCHITECTURE
        if getattr(model, f) != getattr(expected, f)
    ]
    if differ:
        raise ConfigError(f"--load is not an {name} checkpoint: {', '.join(differ)}")


GROUPS = ("parallel", "training", "data", "dataset")
"""The config groups of ``pretrain_gpt.py`` this tool reads: the teacher's layout, and the
student's run whose samples it scores."""
TITLES = {"parallel": "teacher parallelism", "training": "the student's run (order of its samples)"}


def parse_args(argv: list[str] | None = None):
    from megatron.apertus.training.teacher_logits_config import GenerationConfig, LogitsConfig

    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", required=True, help="teacher checkpoint (save or iter_* dir)")
    parser.add_argument(
        "--model-preset",
        choices=sorted(PRESETS),
        help="optional: refuse a checkpoint whose architecture is not this preset's",
    )
    parser.add_argument("--seq-length", type=int, help="the student's sequence length")
    C.add_run_arguments(parser, GROUPS, titles=TITLES)
    add_arguments(parser, LogitsConfig, title="teacher logits")
    args = parser.parse_args(argv)
    if args.mock_data:
        parser.error(
            "--mock-data: a teacher store is made for a student that trains on real data "
            "(pretrain_gpt.py refuses --mock-data beside --distill-logits-path)"
        )
    if not args.load.strip():
        parser.error("--load is empty: give the teacher's save directory or iter_* directory")
    from megatron.apertus.checkpoint import load_model_config  # torch: after argument errors

    try:
        model: ApertusConfig = load_model_config(args.load)
        if args.model_preset is not None:
            check_architecture(model, preset(args.model_preset), args.model_preset)
        if args.seq_length is not None:
            model = dataclasses.replace(model, seq_length=args.seq_length)
        return GenerationConfig(
            load=args.load,
            model=model,
            **C.groups_from_arguments(args, GROUPS, model=model),
            logits=from_arguments(LogitsConfig, args),
        )
    except (ConfigError, ValueError, FileNotFoundError) as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    config = parse_args(argv)
    from megatron.apertus.distill.logit_store import LogitStoreError
    from megatron.apertus.training.teacher_logits import generate

    try:
        generate(config)
    except LogitStoreError as err:  # a store of another run or a damaged one: the user's to fix
        raise ConfigError(str(err)) from None


if __name__ == "__main__":
    run(main)
