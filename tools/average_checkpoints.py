"""Average the weights of checkpoints (docs/quantization.md): every tensor becomes the mean of
its values in the given checkpoints, which helps round-to-nearest quantization.

    python tools/average_checkpoints.py --load SAVE_DIR --last 4 --save AVG_DIR
    python tools/average_checkpoints.py --load SAVE_DIR --iterations 800 900 1000 --save AVG_DIR

Any TP/PP layouts in (they may differ); one checkpoint out, at the newest iteration.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.apertus.cli import ArgumentParser, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", required=True, help="save dir holding the iter_* checkpoints")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int, help="average the N newest checkpoints")
    which.add_argument("--iterations", type=int, nargs="+", help="average these iterations")
    parser.add_argument("--save", required=True, help="save dir of the averaged checkpoint")
    args = parser.parse_args(argv)
    if args.last is not None and args.last < 1:
        parser.error(f"--last must be at least 1, got {args.last}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megatron.apertus.convert.quant_io import average_checkpoints, last_checkpoints
    from megatron.apertus.errors import ConfigError

    try:
        if args.last is not None:
            paths = last_checkpoints(args.load, args.last)
        else:
            paths = [Path(args.load) / f"iter_{i:07d}" for i in args.iterations]
            missing = [str(p) for p in paths if not p.is_dir()]
            if missing:
                raise ConfigError(f"--iterations: no checkpoint {missing[0]}")
        out = average_checkpoints(paths, args.save)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"average_checkpoints.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"averaged {', '.join(p.name for p in paths)} -> {out}")


if __name__ == "__main__":
    run(main)
