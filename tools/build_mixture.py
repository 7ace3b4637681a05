"""Build a weighted mixture of tokenized folders from whole datasets, reproducibly.

    python tools/build_mixture.py --folders data/web data/code data/math \\
        --weights 0.7 0.2 0.1 --max-tokens 80_000_000_000 --seq-length 8192 \\
        --exclude mixtures/phase1 --output mixtures/phase2 --seed 1234

Each folder gives whole ``.bin/.idx`` datasets, in an order shuffled with ``--seed``, until its
share ``weight / sum(weights) x --max-tokens`` is met (passed by less than one dataset); datasets
in the ``--exclude`` folders (earlier mixtures) are never taken. ``--output`` gets symbolic
links to the chosen datasets and ``mixture.json``; the report gives tokens and samples per
dataset at ``--seq-length``. Train on it with ``tools/data_config.py``'s ``--data-path`` list.
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, run
from megatron.apertus.prep.mixture import MixtureError, build_mixture, format_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--folders",
        nargs="+",
        required=True,
        help="folders of .bin/.idx datasets (or earlier mixtures)",
    )
    parser.add_argument(
        "--weights", nargs="+", type=float, required=True, help="one per folder; normalised"
    )
    parser.add_argument(
        "--max-tokens",
        type=lambda s: int(s.replace("_", "")),
        required=True,
        help="token budget of the mixture (underscores allowed)",
    )
    parser.add_argument(
        "--exclude", nargs="*", default=[], help="folders whose datasets must not be taken again"
    )
    parser.add_argument("--output", required=True, help="the mixture folder (must not exist)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--seq-length", type=int, default=4096, help="sequence length of the samples in the report"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        record = build_mixture(
            args.folders,
            args.weights,
            args.max_tokens,
            args.output,
            exclude=args.exclude,
            seed=args.seed,
            seq_length=args.seq_length,
        )
    except MixtureError as err:
        print(f"build_mixture.py: error: {err}", file=sys.stderr)
        return 2
    print(format_report(record))
    return 0


if __name__ == "__main__":
    run(main)
