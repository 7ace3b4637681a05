"""Generate text from a checkpoint (docs/inference.md).

    python tools/generate_text.py --load SAVE_DIR [--ckpt-step N] \\
        --prompt "The capital of Switzerland is" [--prompt ...] | --prompts A B ... \\
        | --prompts-file PROMPTS.jsonl \\
        [--output OUT.jsonl] [--num-tokens-to-generate 30] \\
        [--top_k 1 | --top_k K --temperature T | --top_k 0 --top_p P --seed S] \\
        [--return-log-probs [--skip-prompt-log-probs]] [--top-n-logprobs N]

Greedy by default (``--top_k 1``, as Megatron-LM's static inference example). One JSON line per
prompt, in order: the prompt's fields (a ``--prompts-file`` line's, or ``{"prompt": TEXT}``),
``generated_text``, ``prompt_tokens``, ``generated_tokens`` and ``finish_reason`` (``eos``:
the end-of-document token came; ``length``), and with ``--return-log-probs``/
``--top-n-logprobs`` the log-probabilities under megatron-core's field names
(``--num-tokens-to-generate 0`` scores the prompts only). ``--output`` is written under a
temporary name and renamed when every prompt is done; without it the lines go to standard
output as they come.
The checkpoint may have been saved with any TP/PP layout; generation runs in one process.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from megatron.apertus.cli import ArgumentParser, check_output, run
from megatron.apertus.flags import ADDITION_MARK, add_arguments, from_arguments
from megatron.apertus.inference.config import (
    SamplingConfig,
    add_checkpoint_arguments,
    check_checkpoint_arguments,
    from_flags,
    read_prompts_file,
)

if TYPE_CHECKING:
    from megatron.apertus.inference.generate import GenerateConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_checkpoint_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a prompt (repeatable)" + ADDITION_MARK)
    prompts.add_argument("--prompts", nargs="+", help="prompts, each one argument")
    prompts.add_argument(
        "--prompts-file",
        help='JSONL, one {"prompt": TEXT, ...} per line; other fields are kept' + ADDITION_MARK,
    )
    parser.add_argument(
        "--output", help="JSONL file to write (default: standard output)" + ADDITION_MARK
    )
    add_arguments(parser, SamplingConfig, title="sampling")
    return parser.parse_args(argv)


def config(args: argparse.Namespace) -> GenerateConfig:
    """The generation config of the flags; every refusal comes before the model is built."""
    check_checkpoint_arguments(args)
    sampling = from_arguments(SamplingConfig, args)
    given = args.prompt or args.prompts
    prompts = from_flags(given) if given else read_prompts_file(args.prompts_file)
    if args.output is not None:
        check_output("--output", args.output, directory=False)
    from megatron.apertus.inference.generate import GenerateConfig, model_source  # torch: late

    source = model_source(
        args.load,
        args.ckpt_step,
        tokenizer=(args.tokenizer_type, args.tokenizer_model),
        device=args.device,
    )
    return GenerateConfig(source=source, sampling=sampling, prompts=prompts, output=args.output)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = config(parse_args(argv))
    from megatron.apertus.inference.generate import generate

    generate(cfg)


if __name__ == "__main__":
    run(main)
