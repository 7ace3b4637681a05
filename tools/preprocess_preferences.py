"""Tokenize alignment data: DPO preference pairs or QRPO rewarded completions.

    python tools/preprocess_preferences.py --objective dpo --input pairs.jsonl \
        --output-prefix data/pairs --max-tokens 4097

DPO lines: ``{"prompt": [messages], "chosen": "...", "rejected": "..."}``; QRPO lines:
``{"prompt": [messages], "completion": "...", "reward": r, "ref_rewards": [r1, ...]}``.
Writes ``data/pairs_pref_document.bin/.idx`` and its ``_loss_mask`` (QRPO also ``_quantile``);
train with ``pretrain_gpt.py --align-objective dpo --train-data-path data/pairs_pref_document``.
Bad lines are reported as FILE:LINE and skipped. The format: docs/post_training.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.data.preprocess import (
    add_corpus_arguments,
    corpus_config,
    format_summary,
    preprocess,
)

OBJECTIVES = ("dpo", "qrpo")
"""``megatron.apertus.align.losses.OBJECTIVES``, spelled out so that ``--help`` and argument
errors need not import torch (a test keeps the two equal)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objective", required=True, choices=OBJECTIVES)
    add_corpus_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="skip examples with a conversation longer than this (--seq-length + 1)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    from megatron.apertus.align.data import PreferenceEncoder

    config = corpus_config(args)
    encoder = functools.partial(PreferenceEncoder, objective=args.objective,
                                max_tokens=args.max_tokens)  # fmt: skip
    start = time.perf_counter()
    summary = preprocess(config, encoder)
    print(format_summary(summary, time.perf_counter() - start).replace("documents", "examples"))
    return 0


if __name__ == "__main__":
    run(main)
