"""Tokenize JSON-lines conversations in the Apertus chat format, with an assistant-only loss mask.

    python tools/preprocess_chat.py --input chats.jsonl --output-prefix data/sft \
        --max-tokens 4096 --workers 8

Every line holds ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``
(a system message only first). Writes ``data/sft_chat_document.bin/.idx`` (the token ids) and
``data/sft_chat_document_loss_mask.bin/.idx`` (1 on the assistant's tokens and their
``<|assistant_end|>``); train with ``pretrain_gpt.py --sft --data-path data/sft_chat_document``.
A conversation with an unknown role, an empty message, no assistant turn, or more than
``--max-tokens`` tokens is reported as FILE:LINE and skipped. The format: docs/post_training.md.
"""

from __future__ import annotations

import argparse
import functools
import glob
import logging
import sys
import time
from pathlib import Path

from megatron.apertus.data.chat import ChatEncoder
from megatron.apertus.data.preprocess import PreprocessConfig, format_summary, preprocess
from megatron.apertus.data.tokenizer import TOKENIZER_TYPES


def parse_args(argv: list[str] | None = None) -> tuple[PreprocessConfig, int | None]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSON-lines files (.jsonl, .gz, .zst); shell-style globs allowed")  # fmt: skip
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", default="TekkenTokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None,
                        help="tokenizer file/directory (TekkenTokenizer defaults to mistral-common's)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="skip conversations longer than this many tokens (e.g. --seq-length)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-reported", type=int, default=10, help="bad lines reported in full")
    args = parser.parse_args(argv)
    if args.max_tokens is not None and args.max_tokens < 2:
        parser.error(f"--max-tokens must be >= 2, got {args.max_tokens}")
    inputs = []
    for pattern in args.input:
        inputs.extend(sorted(glob.glob(pattern)) or [pattern])  # a missing name is reported
    config = PreprocessConfig(
        inputs=[Path(p) for p in inputs], output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        workers=args.workers, max_reported=args.max_reported,
    )  # fmt: skip
    return config, args.max_tokens


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config, max_tokens = parse_args(argv)
    start = time.perf_counter()
    try:
        summary = preprocess(config, functools.partial(ChatEncoder, max_tokens=max_tokens))
    except (FileNotFoundError, ValueError) as err:
        print(f"preprocess_chat.py: error: {err}", file=sys.stderr)
        return 2
    print(
        format_summary(summary, time.perf_counter() - start).replace("documents", "conversations")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
