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
from megatron.apertus.prep.preprocess import (
    PreprocessConfig,
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
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument(
        "--append-eod",
        action="store_true",
        default=True,
        help="end every document with </s> (the default; kept for Megatron compatibility)",
    )
    parser.add_argument(
        "--no-eod", dest="append_eod", action="store_false", help="do not append </s>"
    )
    parser.add_argument(
        "--no-bos", dest="add_bos", action="store_false", default=True, help="do not prepend <s>"
    )
    parser.add_argument(
        "--split-sentences",
        action="store_true",
        help="one index entry per sentence (nltk Punkt, punkt_tab data); writes "
        "PREFIX_KEY_sentence.bin/.idx",
    )
    parser.add_argument("--lang", default="english", help="Punkt model of --split-sentences")
    parser.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: keep the whitespace (newlines included) " "between sentences",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="accepted for Megatron-LM compatibility: --workers already "
        "tokenizes in parallel, and the output is in input order whatever its "
        "value",
    )
    parser.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="accepted for Megatron-LM compatibility: documents always keep " "their input order",
    )
    parser.add_argument(
        "--log-interval", type=int, default=1000, help="log progress every this many documents"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when any line was rejected [megatron-apertus addition]",
    )
    args = parser.parse_args(argv)
    return (
        corpus_config(
            args,
            json_keys=args.json_keys,
            add_bos=args.add_bos,
            add_eod=args.append_eod,
            split_sentences=args.split_sentences,
            lang=args.lang,
            keep_newlines=args.keep_newlines,
            log_interval=args.log_interval,
        ),
        args.strict,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config, strict = parse_args(argv)
    start = time.perf_counter()
    summary = preprocess(config)
    print(format_summary(summary, time.perf_counter() - start))
    return 1 if strict and summary.rejected_lines else 0


if __name__ == "__main__":
    run(main)
