"""Tokenize JSON-lines SFT data into the Apertus chat format, with a loss mask on what is learned.

    python tools/preprocess_chat.py --input chats.jsonl --output-prefix data/sft \
        --max-tokens 4096 --workers 8

Every line holds one of TRL's SFT layouts: ``{"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}, ...]}`` (a system message only first; every assistant turn learned),
``{"prompt": [...], "completion": [{"role": "assistant", ...}]}`` or
``{"prompt": "...", "completion": "..."}`` (the completion alone learned; text is plain text,
no chat template) or ``{"text": "..."}`` (all learned). Writes
``data/sft_chat_document.bin/.idx`` (the token ids) and
``data/sft_chat_document_loss_mask.bin/.idx`` (1 on the learned tokens: an assistant message's
and its ``<|assistant_end|>``, or text and ``</s>``); train with ``pretrain_gpt.py --sft
--data-path data/sft_chat_document``. A line with an unknown role, an empty message, no
assistant turn, none of these layouts, or more than ``--max-tokens`` tokens is reported as
FILE:LINE and skipped. The layouts: docs/post_training.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.prep.chat import ChatEncoder, ChatOptions
from megatron.apertus.prep.preprocess import (
    PreprocessConfig,
    add_corpus_arguments,
    corpus_config,
    format_summary,
    preprocess,
)


def parse_args(argv: list[str] | None = None) -> tuple[PreprocessConfig, int | None]:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_corpus_arguments(parser)
    add_arguments(parser, ChatOptions, title="conversations")
    args = parser.parse_args(argv)
    return corpus_config(args), from_arguments(ChatOptions, args).max_tokens


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config, max_tokens = parse_args(argv)
    start = time.perf_counter()
    summary = preprocess(config, functools.partial(ChatEncoder, max_tokens=max_tokens))
    print(
        format_summary(summary, time.perf_counter() - start).replace("documents", "conversations")
    )
    return 0


if __name__ == "__main__":
    run(main)
