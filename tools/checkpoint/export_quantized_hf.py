"""Export a QAD checkpoint (full-precision weights, any TP/PP) as a compressed-tensors Hugging
Face directory with its decoder projections quantized as ``--quant-format`` fake-quantizes them.

    python tools/checkpoint/export_quantized_hf.py --load QAD_DIR --output HF_DIR \
        --quant-format int4 --quant-group-size 128 [--tokenizer TOKENIZER]
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron.apertus.quant.config import QuantConfig
    from megatron.apertus.training import config as C

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="save dir (follows its tracker) or iter_* dir"
    )
    parser.add_argument("--output", required=True, help="HF directory to create (must not exist)")
    parser.add_argument(
        "--tokenizer",
        help="default: the tokenizer the training run recorded; else "
        "a tekken JSON, a tokenizer.json or its directory, or a SentencePiece model",
    )
    C.add_arguments(parser, QuantConfig, title="format")
    args = parser.parse_args(argv)
    if args.quant_format is None or not args.quant_format.startswith("int"):
        parser.error("--quant-format int2, int3, int4 or int6 is required")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megatron.apertus.convert.hf import ConversionError
    from megatron.apertus.convert.quant_export import export_quantized
    from megatron.apertus.model.config import ConfigError
    from megatron.apertus.quant.config import QuantConfig
    from megatron.apertus.training import config as C

    try:
        out = export_quantized(args.load, args.output, C.from_arguments(QuantConfig, args),
                               tokenizer=args.tokenizer)  # fmt: skip
    except (ConfigError, ConversionError, FileExistsError, FileNotFoundError) as err:
        print(f"export_quantized_hf.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {args.load} -> {out}")


if __name__ == "__main__":
    main()
