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
import glob
import logging
import sys
import time
from pathlib import Path

from megatron.apertus.align.data import PreferenceEncoder
from megatron.apertus.align.losses import OBJECTIVES
from megatron.apertus.data.preprocess import PreprocessConfig, format_summary, preprocess
from megatron.apertus.data.tokenizer import TOKENIZER_TYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objective", required=True, choices=OBJECTIVES)
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSON-lines files (.jsonl, .gz, .zst); shell-style globs allowed")  # fmt: skip
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", default="TekkenTokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None,
                        help="tokenizer file/directory (TekkenTokenizer defaults to mistral-common's)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="skip examples with a conversation longer than this (--seq-length + 1)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-reported", type=int, default=10, help="bad lines reported in full")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    inputs = [p for pattern in args.input for p in (sorted(glob.glob(pattern)) or [pattern])]
    config = PreprocessConfig(
        inputs=[Path(p) for p in inputs], output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        workers=args.workers, max_reported=args.max_reported,
    )  # fmt: skip
    encoder = functools.partial(PreferenceEncoder, objective=args.objective,
                                max_tokens=args.max_tokens)  # fmt: skip
    start = time.perf_counter()
    try:
        summary = preprocess(config, encoder)
    except (FileNotFoundError, ValueError) as err:
        print(f"preprocess_preferences.py: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary, time.perf_counter() - start).replace("documents", "examples"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
