"""Import a Hugging Face ``ApertusForCausalLM`` directory as an Apertus checkpoint (TP=1, PP=1).

    python tools/checkpoint/import_hf.py --hf-dir HF_DIR --save SAVE_DIR [--iteration 0]

The checkpoint is in megatron-core's torch_dist format, so training may load it with any
TP/PP layout.
"""

from __future__ import annotations

import argparse

from megatron.apertus.cli import ArgumentParser, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--hf-dir", required=True, help="directory with config.json and safetensors"
    )
    parser.add_argument("--save", required=True, help="save directory of the new checkpoint")
    parser.add_argument("--iteration", type=int, default=0, help="iteration number to save as")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Imported here so that --help answers without the multi-second megatron-core import.
    from megatron.apertus.convert.hf_io import import_hf

    out = import_hf(args.hf_dir, args.save, iteration=args.iteration)
    print(f"imported {args.hf_dir} -> {out}")


if __name__ == "__main__":
    run(main)
