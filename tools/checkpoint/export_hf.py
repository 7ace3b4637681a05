"""Export an Apertus checkpoint (any TP/PP) as a Hugging Face ``ApertusForCausalLM`` directory.

    python tools/checkpoint/export_hf.py --load SAVE_DIR --output HF_DIR \
        [--tokenizer tekken.json|HF_TOKENIZER_DIR] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="save dir (follows its tracker) or iter_* dir"
    )
    parser.add_argument("--output", required=True, help="HF directory to create (must not exist)")
    parser.add_argument(
        "--tokenizer", help="tekken JSON (converted) or HF tokenizer dir (tokenizer files copied)"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Imported here so that --help answers without the multi-second megatron-core import.
    from megatron.apertus.convert.hf_io import export_checkpoint
    from megatron.apertus.model.config import dtype_from_name

    out = export_checkpoint(
        args.load, args.output, tokenizer=args.tokenizer, dtype=dtype_from_name(args.dtype)
    )
    print(f"exported {args.load} -> {out}")


if __name__ == "__main__":
    main()
