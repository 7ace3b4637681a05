"""Post-training quantization baselines (docs/quantization.md): round-to-nearest (RTN) or GPTQ
of the decoder's linear weights. The output checkpoint holds the quantized values in the
checkpoint's dtype; evaluate it like any checkpoint (fp8 and nvfp4 also quantize activations:
evaluate those with ``pretrain_gpt.py --quant-format F --quant-activations-only``).

    python tools/quantize.py --load SAVE_DIR --save RTN_DIR --method rtn --quant-format int4
    python tools/quantize.py --load SAVE_DIR --save GPTQ_DIR --method gptq --quant-format int4 \\
        --distill-logits-path LOGITS --calibration-samples 128 \\
        --data-path PREFIX --seed 1234 --global-batch-size 1024 --train-iters 1000

GPTQ calibrates on the first samples of the teacher-logit store's run: give the data and run
flags the store was made for (as for tools/generate_teacher_logits.py); their keys are checked.
"""

from __future__ import annotations

import argparse
import sys

from megatron.apertus.cli import ArgumentParser, run

GROUPS = ("training", "data", "dataset", "quant")
"""The config groups of ``pretrain_gpt.py`` this tool reads (GPTQ: the store's run, to find its
samples)."""
TITLES = {
    "quant": "format",
    "training": "gptq: the store's run (order of its samples)",
    "data": "gptq: data",
    "dataset": "gptq: datasets",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron.apertus.training import config as C

    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="save dir (follows its tracker) or iter_* dir"
    )
    parser.add_argument("--save", required=True, help="save dir of the quantized checkpoint")
    parser.add_argument("--method", choices=("rtn", "gptq"), required=True)
    parser.add_argument(
        "--damp", type=float, default=0.01, help="gptq: damping, a fraction of H's mean diagonal"
    )
    parser.add_argument(
        "--calibration-samples",
        type=int,
        default=128,
        help="gptq: samples of the store's run to calibrate on",
    )
    parser.add_argument(
        "--distill-logits-path", help="gptq: teacher-logit store whose samples calibrate"
    )
    C.add_run_arguments(parser, GROUPS, titles=TITLES)
    args = parser.parse_args(argv)
    if args.quant_format is None:
        parser.error("--quant-format is required")
    if args.mock_data:
        parser.error(
            "--mock-data: GPTQ calibrates on the samples of the --distill-logits-path store's "
            "run, which trained on real data"
        )
    if args.method == "gptq" and args.distill_logits_path is None:
        parser.error("--method gptq needs --distill-logits-path (its samples calibrate)")
    if args.calibration_samples < 1:
        parser.error(f"--calibration-samples must be at least 1, got {args.calibration_samples}")
    return args


def _samples(args: argparse.Namespace, seq_length: int) -> list:
    from megatron.apertus.convert.quant_io import calibration_samples
    from megatron.apertus.data.datasets import build_datasets
    from megatron.apertus.prep.corpus import embedded_corpus_prefix
    from megatron.apertus.tokenizer.tokenizers import build_tokenizer
    from megatron.apertus.training import config as C

    groups = C.groups_from_arguments(args, ("training", "data", "dataset"))
    training, data = groups["training"], groups["data"]
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model)
    train, _, _ = build_datasets(
        groups["dataset"],
        tokenizer,
        seq_length=seq_length,
        seed=training.seed,
        num_samples=training.dataset_sizes(),
        default_corpus=embedded_corpus_prefix,
    )
    return calibration_samples(
        args.distill_logits_path, args.calibration_samples, dataset=train, seq_length=seq_length
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from megatron.apertus.checkpoint import load_model_config
    from megatron.apertus.convert.quant_io import PTQSettings, quantize_checkpoint
    from megatron.apertus.distill.logit_store import LogitStoreError
    from megatron.apertus.errors import ConfigError
    from megatron.apertus.training import config as C

    try:
        quant = C.groups_from_arguments(args, ("quant",))["quant"]
        settings = PTQSettings(args.method, quant, args.damp)
        samples = None
        if args.method == "gptq":
            seq_length = load_model_config(args.load).seq_length
            samples = lambda: _samples(args, seq_length)  # noqa: E731
        out = quantize_checkpoint(args.load, args.save, settings, samples)
    except (ConfigError, LogitStoreError, FileNotFoundError, ValueError) as err:
        print(f"quantize.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.method} {args.quant_format}: {args.load} -> {out}")


if __name__ == "__main__":
    run(main)
