"""Merge the indexed datasets of a directory into one, in name order.

    python tools/merge_datasets.py --input data/tokens --output-prefix data/dump-1-merged

As Megatron-LM's tool, plus checks: every part has the same index dtype and (from its
``.meta.json``) the same tokenizer and ``<s>``/``</s>`` rules; output written under a temporary
name and renamed when complete.
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.prep.merge import MergeError, MergeOptions, dataset_prefixes, merge


def parse_args(argv: list[str] | None = None) -> MergeOptions:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, MergeOptions, title="merge")
    return from_arguments(MergeOptions, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        prefixes = dataset_prefixes(options.input)
        documents = merge(
            prefixes, options.output_prefix, require_records=not options.no_tokenizer_check
        )
    except MergeError as err:
        print(f"merge_datasets.py: error: {err}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets, {documents} documents into {options.output_prefix}")
    return 0


if __name__ == "__main__":
    run(main)
