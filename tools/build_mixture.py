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
from megatron.apertus.flags import add_arguments, from_arguments
from megatron.apertus.prep.mixture import (
    MixtureError,
    MixtureOptions,
    build_mixture,
    format_report,
)


def parse_args(argv: list[str] | None = None) -> MixtureOptions:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, MixtureOptions, title="mixture")
    return from_arguments(MixtureOptions, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        record = build_mixture(
            options.folders,
            options.weights,
            options.max_tokens,
            options.output,
            exclude=options.exclude,
            seed=options.seed,
            seq_length=options.seq_length,
        )
    except MixtureError as err:
        print(f"build_mixture.py: error: {err}", file=sys.stderr)
        return 2
    print(format_report(record))
    return 0


if __name__ == "__main__":
    run(main)
