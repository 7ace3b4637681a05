r"""Export an Apertus checkpoint (any TP/PP) as a Hugging Face ``ApertusForCausalLM`` directory.

    python tools/checkpoint/export_hf.py --load SAVE_DIR --output HF_DIR \
        [--tokenizer tekken.json|tokenizer.json|HF_TOKENIZER_DIR|spm.model] [--dtype fp32|bf16]

HF_DIR gets config.json, generation_config.json, model.safetensors, the tokenizer of the
training run (recorded in the checkpoint; --tokenizer overrides it, and is required for a
checkpoint that records no run) and a README.md model card. The tokenizer puts <s> first, as
training did, so a scorer that tokenizes with its defaults (lm-evaluation-harness, vLLM) gives
the model the inputs it was trained on.
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--load", required=True, help="save dir (follows its tracker) or iter_* dir"
    )
    parser.add_argument("--output", required=True, help="HF directory to create (must not exist)")
    parser.add_argument(
        "--tokenizer",
        help="the tokenizer to write instead of the one the training run recorded: a tekken "
        "JSON, a tokenizer.json or a directory holding one, or a SentencePiece .model",
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--license",
        default="apache-2.0",
        help="the model card's Hugging Face Hub licence id (default: apache-2.0, the published "
        "Apertus models')",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported here so that --help answers without the multi-second megatron-core import.
    from megatron.apertus.convert.hf_io import export_checkpoint
    from megatron.apertus.model.config import dtype_from_name

    command = list(sys.argv) if argv is None else [__file__, *argv]  # as training records its own
    try:
        out = export_checkpoint(
            args.load,
            args.output,
            tokenizer=args.tokenizer,
            dtype=dtype_from_name(args.dtype),
            command=command,
            license=args.license,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"export_hf.py: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.load} -> {out}")
    return 0


if __name__ == "__main__":
    run(main)
