"""Export a QAD checkpoint (full-precision weights, any TP/PP) as a compressed-tensors Hugging
Face directory with its decoder projections quantized as ``--quant-format`` fake-quantizes them
(docs/quantization.md, "Export"): int2/3/4/6 as ``pack-quantized`` (symmetric), fp8 as
``float-quantized`` with dynamic input scales, nvfp4 as ``nvfp4-pack-quantized`` with static
input global scales calibrated on the first documents of ``--calibration-data``.

    python tools/checkpoint/export_quantized_hf.py --load QAD_DIR --output HF_DIR \\
        --quant-format int4 --quant-group-size 128 [--tokenizer TOKENIZER]
    python tools/checkpoint/export_quantized_hf.py --load QAD_DIR --output HF_DIR \\
        --quant-format fp8 --quant-fp8-scaling channel
    python tools/checkpoint/export_quantized_hf.py --load QAD_DIR --output HF_DIR \\
        --quant-format nvfp4 --calibration-data PREFIX --calibration-samples 128
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron.apertus.training import config as C

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--load", required=True, help="save dir (follows its tracker) or iter_* dir"
    )
    parser.add_argument("--output", required=True, help="HF directory to create (must not exist)")
    parser.add_argument(
        "--tokenizer",
        help="default: the tokenizer the training run recorded; else "
        "a tekken JSON, a tokenizer.json or its directory, or a SentencePiece model",
    )
    parser.add_argument(
        "--calibration-data",
        metavar="PREFIX",
        help="nvfp4: tokenized documents (the .bin/.idx prefix tools/preprocess_data.py writes) "
        "whose largest decoder-linear inputs set the static input global scales",
    )
    parser.add_argument(
        "--calibration-samples",
        type=int,
        default=128,
        help="nvfp4: how many of its first documents (each cut to the model's " "sequence length)",
    )
    C.add_run_arguments(parser, ("quant",), titles={"quant": "format"})
    args = parser.parse_args(argv)
    if args.quant_format is None:
        parser.error("--quant-format is required")
    if args.quant_format == "nvfp4" and args.calibration_data is None:
        parser.error(
            "--quant-format nvfp4 needs --calibration-data (its input global scales "
            "are static in compressed-tensors)"
        )
    if args.quant_format != "nvfp4" and args.calibration_data is not None:
        parser.error("--calibration-data applies to --quant-format nvfp4 only")
    if args.calibration_samples < 1:
        parser.error(f"--calibration-samples must be at least 1, got {args.calibration_samples}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megatron.apertus.convert.hf import ConversionError
    from megatron.apertus.convert.quant_export import calibration_documents, export_quantized
    from megatron.apertus.errors import ConfigError
    from megatron.apertus.training import config as C

    calibration = None
    if args.calibration_data is not None:
        calibration = lambda seq_length: calibration_documents(  # noqa: E731
            args.calibration_data, args.calibration_samples, seq_length
        )
    try:
        quant = C.groups_from_arguments(args, ("quant",))["quant"]
        out = export_quantized(
            args.load, args.output, quant, tokenizer=args.tokenizer, calibration=calibration
        )
    except (ConfigError, ConversionError, FileExistsError, FileNotFoundError) as err:
        print(f"export_quantized_hf.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {args.load} -> {out}")


if __name__ == "__main__":
    run(main)
