"""Norm fusion of a checkpoint (docs/quantization.md): equalize the input-column norms of QKV
and of the MLP's up projection and fold the reciprocal scales into the preceding RMSNorms.
The model's function is unchanged; its weights quantize better.

    python tools/fuse_norms.py --load SAVE_DIR --save FUSED_DIR

Any TP/PP layout in; the output loads into any layout.
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="save dir (follows its tracker) or iter_* dir"
    )
    parser.add_argument("--save", required=True, help="save dir of the fused checkpoint")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Imported here so that --help answers without the multi-second megatron-core import.
    from megatron.apertus.convert.quant_io import fuse_norms_checkpoint
    from megatron.apertus.errors import ConfigError

    try:
        out = fuse_norms_checkpoint(args.load, args.save)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"fuse_norms.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"norm-fused {args.load} -> {out}")


if __name__ == "__main__":
    run(main)
