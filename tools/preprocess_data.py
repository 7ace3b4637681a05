"""Tokenize JSON lines into megatron-core indexed datasets, Megatron-style.

    python tools/preprocess_data.py --input corpus.jsonl.zst --json-keys text \
        --output-prefix data/corpus --tokenizer-type TekkenTokenizer --workers 8

writes ``data/corpus_text_document.bin/.idx``; train with ``--data-path data/corpus_text_document``.
Every document is ``<s> ... </s>``; bad lines are reported with file:line and skipped.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.prep.preprocess import (
    DocumentOptions,
    PreprocessConfig,
    RunOptions,
    SentenceOptions,
    add_corpus_arguments,
    corpus_config,
    format_summary,
    preprocess,
)


def parse_args(argv: list[str] | None = None) -> tuple[PreprocessConfig, bool]:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_corpus_arguments(parser)
    add_arguments(parser, DocumentOptions, title="documents")
    add_arguments(parser, SentenceOptions, title="sentences")
    add_arguments(parser, RunOptions, title="run")
    args = parser.parse_args(argv)
    return corpus_config(args), from_arguments(RunOptions, args).strict


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config, strict = parse_args(argv)
    start = time.perf_counter()
    summary = preprocess(config)
    print(format_summary(summary, time.perf_counter() - start))
    return 1 if strict and summary.rejected_lines else 0


if __name__ == "__main__":
    run(main)
