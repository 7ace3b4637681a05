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
from megatron.apertus.prep.merge import MergeError, dataset_prefixes, merge


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--input", required=True, help="directory holding the .bin/.idx pairs to merge"
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx (and .meta.json)"
    )
    parser.add_argument(
        "--no-tokenizer-check",
        dest="require_records",
        action="store_false",
        help="merge parts that have no .meta.json (their tokenizer is unknown; "
        "dtypes are still checked) [megatron-apertus addition]",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prefixes = dataset_prefixes(args.input)
        documents = merge(prefixes, args.output_prefix, require_records=args.require_records)
    except MergeError as err:
        print(f"merge_datasets.py: error: {err}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets, {documents} documents into {args.output_prefix}")
    return 0


if __name__ == "__main__":
    run(main)
