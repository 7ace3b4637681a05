"""Quantization of the distillation demo's teacher: unquantized against RTN, GPTQ, QAD and GPTQ
followed by QAD, each with and without norm fusion, and RTN after weight averaging, on the
held-out documents (docs/quantization.md has a measured table).

    python examples/quant_demo.py [--demo runs/demo] [--out runs/quant-demo]
                                  [--formats int4 int3 fp8 nvfp4]

0. The model is ``examples/demo.py``'s teacher (hidden 128, 4 layers, one pass over the
   embedded corpus); the demo runs first if ``DEMO/teacher`` does not exist.
1. ``tools/generate_teacher_logits.py`` stores the teacher's top-k over the QAD samples (the
   teacher's documents in another order): the recipe's QAD of a model from its own unquantized
   logits.
2. ``tools/fuse_norms.py`` writes the norm-fused teacher.
3. A control run distils the unquantized teacher from the store for the QAD steps, saving
   every ``AVERAGE_EVERY`` steps; ``tools/average_checkpoints.py`` averages its last
   ``AVERAGE_LAST`` checkpoints. The control separates what the extra steps on the teacher's
   logits give from what quantization-aware training gives, and its final checkpoint is the
   reference of the averaged one.
4. For each format and each of the two models (plain, norm-fused): RTN is the model evaluated
   with ``--quant-format`` (fake quantization is round-to-nearest); GPTQ is
   ``tools/quantize.py --method gptq`` calibrated on the store's samples; QAD is
   ``pretrain_gpt.py --load MODEL --finetune --distill-logits-path LOGITS --quant-format F``
   for ``QAD_ITERS`` steps (Adam without weight decay, cosine), evaluated under the format;
   "GPTQ, then QAD" is the same QAD started from GPTQ's weights instead of the model's.
   RTN also quantizes the control's final and averaged checkpoints. FP8 and NVFP4 are also
   evaluated with the layer inputs quantized and the weights not, which separates what their
   activations cost from what their weights cost.
5. ``OUT/summary.json`` and a Markdown table on stdout: validation loss of each, and the gap
   closed by QAD, ``(RTN - QAD) / (RTN - unquantized)``. Every step's result is kept in
   ``OUT``, so a rerun (say with more formats) only does what is missing.

Everything runs in the demo's precision (bf16 where it is fast, else fp32) with fp32 losses and
optimizer states.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from megatron.apertus import cli
from megatron.apertus.cli import run_step
from megatron.apertus.ops.cpu_capability import fast_precision
from megatron.apertus.quant.formats import ACTIVATION_FORMATS, FORMATS
from megatron.apertus.training.metrics import read_history

REPO = Path(__file__).resolve().parents[1]
PRECISION = ["--precision", fast_precision("cuda" if torch.cuda.is_available() else "cpu")]
MODEL = ["--model-preset", "tiny", "--hidden-size", "128", "--ffn-hidden-size", "384", *PRECISION]
"""The demo's teacher (``examples/demo.py``: TEACHER, PRECISION); the tools read the shape from
the checkpoint."""
QAD_ITERS = 80
AVERAGE_EVERY, AVERAGE_LAST = 20, 3
TOPK = 64
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
QAD_BATCH = ["--global-batch-size", "8", "--micro-batch-size", "8", "--eval-iters", "16"]
"""Batches of 8: at the same 640 samples, 80 steps of 8 closed 59% of the INT4 gap where 40
steps of 16 closed 32% (measured at learning rates 3e-5 to 2e-3: larger ones do worse)."""
EVAL_BATCH = ["--global-batch-size", "16", "--micro-batch-size", "8", "--eval-iters", "8"]
QAD_OPT = [
    "--lr",
    "1e-4",
    "--min-lr",
    "1e-5",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "4",
    "--weight-decay",
    "0.0",
]


def run(script: str, *args: str) -> None:
    cmd = [sys.executable, str(REPO / script), *args]
    print("$", " ".join(cmd), flush=True)
    run_step(cmd, cwd=REPO, stdout=subprocess.DEVNULL)


def complete(save: Path) -> bool:
    return (save / "latest_checkpointed_iteration.txt").exists()


class QuantDemo:
    """The demo's steps over one teacher and one data set; each skips what ``out`` holds."""

    def __init__(self, demo: Path, out: Path):
        self.out = out
        self.base = demo / "teacher"
        self.logits = out / "logits"
        self.data = [
            "--train-data-path",
            str(demo / "data" / "teacher_text_document"),
            "--valid-data-path",
            str(demo / "data" / "valid_text_document"),
            "--data-cache-path",
            str(demo / "cache"),
            "--seed",
            "11",
            *DOCUMENTS,
        ]
        """The teacher's documents in another order than its training's, and the held-out ones."""
        self.qad = [*self.data, "--train-iters", str(QAD_ITERS), *QAD_BATCH]
        """The QAD samples (and the store's, and GPTQ's calibration samples)."""

    def evaluate(self, ckpt: Path, quant: list[str], name: str) -> float:
        log = self.out / "eval" / f"{name.replace(' ', '_')}.jsonl"
        if not log.exists():
            log.parent.mkdir(parents=True, exist_ok=True)
            partial = log.with_suffix(".partial")
            partial.unlink(missing_ok=True)
            run(
                "pretrain_gpt.py",
                *MODEL,
                *self.data,
                *EVAL_BATCH,
                "--train-iters",
                "0",
                "--load",
                str(ckpt),
                "--finetune",
                "--log-json",
                str(partial),
                *quant,
            )
            partial.rename(log)
        return float(read_history(log)["valid/loss"][-1][1])

    def store_logits(self) -> None:
        if not self.logits.exists():
            run(
                "tools/generate_teacher_logits.py",
                *PRECISION,
                "--load",
                str(self.base),
                "--logits-dir",
                str(self.logits),
                "--topk",
                str(TOPK),
                *self.qad,
            )

    def fuse(self) -> Path:
        fused = self.out / "fused"
        if not complete(fused):
            run("tools/fuse_norms.py", "--load", str(self.base), "--save", str(fused))
        return fused

    def distil(self, model: Path, quant: list[str], name: str, *extra: str) -> Path:
        save = self.out / "qad" / name.replace(" ", "_")
        if not complete(save):
            run(
                "pretrain_gpt.py",
                *MODEL,
                *self.qad,
                *QAD_OPT,
                "--load",
                str(model),
                "--finetune",
                "--distill-logits-path",
                str(self.logits),
                "--save",
                str(save),
                *quant,
                *extra,
            )
        return save

    def average(self, control: Path) -> Path:
        averaged = self.out / "averaged"
        if not complete(averaged):
            run(
                "tools/average_checkpoints.py",
                "--load",
                str(control),
                "--last",
                str(AVERAGE_LAST),
                "--save",
                str(averaged),
            )
        return averaged

    def gptq(self, model: Path, quant: list[str], name: str) -> Path:
        save = self.out / "gptq" / name.replace(" ", "_")
        if not complete(save):
            run(
                "tools/quantize.py",
                "--load",
                str(model),
                "--save",
                str(save),
                "--method",
                "gptq",
                *quant,
                "--distill-logits-path",
                str(self.logits),
                "--calibration-samples",
                "64",
                *self.qad,
            )
        return save


def weights_as_loaded(fmt: str) -> list[str]:
    """Flags that evaluate a checkpoint's weights as they are (a GPTQ checkpoint's are already
    quantized, the unquantized model's show what the inputs alone cost); the
    weight-and-activation formats still quantize the layer inputs."""
    if fmt in ACTIVATION_FORMATS:
        return [*quant_flags(fmt), "--quant-activations-only"]
    return []


def gap_closed(rtn: float, qad: float, unquantized: float, control: float) -> float | None:
    """``(RTN - QAD) / (RTN - unquantized)``; None where RTN's gap is no larger than what the
    same distillation steps move the unquantized model (``control``): there is nothing to close
    that the steps themselves do not blur."""
    noise = abs(control - unquantized)
    return (rtn - qad) / (rtn - unquantized) if rtn - unquantized > noise else None


def table(results: dict[str, float], formats: list[str]) -> str:
    """The Markdown table of docs/quantization.md."""
    bf16, control = results["unquantized"], results["control"]
    lines = [
        f"Unquantized: {bf16:.4f}; after the same {QAD_ITERS} distillation steps unquantized "
        f"(control): {control:.4f}.",
        "",
        "| format | norm fusion | RTN (gap) | GPTQ | QAD | gap closed by QAD | GPTQ, then QAD |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt in formats:
        for fused in ("no", "yes"):
            key = f"{fmt}{' + norm fusion' if fused == 'yes' else ''}"
            rtn, qad = results[f"{key} RTN"], results[f"{key} QAD"]
            closed = gap_closed(rtn, qad, bf16, control)
            share = (
                f"n/a (RTN gap < {abs(control - bf16):.4f})" if closed is None else f"{closed:.0%}"
            )
            lines.append(
                f"| {fmt} | {fused} | {rtn:.4f} ({rtn - bf16:+.4f}) | "
                f"{results[f'{key} GPTQ']:.4f} | {qad:.4f} | {share} | "
                f"{results[f'{key} GPTQ + QAD']:.4f} |"
            )
    lines += [
        "",
        f"| format | RTN of the control | RTN of the mean of its last {AVERAGE_LAST} "
        "checkpoints |",
        "|---|---|---|",
    ]
    for fmt in formats:
        lines.append(
            f"| {fmt} | {results[f'{fmt} control RTN']:.4f} | "
            f"{results[f'{fmt} averaged RTN']:.4f} |"
        )
    activations = [fmt for fmt in formats if fmt in ACTIVATION_FORMATS]
    if activations:
        lines += ["", "| format | inputs quantized, weights not |", "|---|---|"]
        lines += [f"| {fmt} | {results[f'{fmt} inputs only']:.4f} |" for fmt in activations]
    return "\n".join(lines)


def quant_flags(fmt: str) -> list[str]:
    return ["--quant-format", fmt]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--demo",
        type=Path,
        default=REPO / "runs" / "demo",
        help="examples/demo.py's output (made if it has no teacher)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "quant-demo")
    parser.add_argument(
        "--formats", nargs="+", default=["int4", "int3", "fp8", "nvfp4"], choices=FORMATS
    )
    args = parser.parse_args()
    demo, out = args.demo.resolve(), args.out.resolve()
    if not complete(demo / "teacher"):
        run("examples/demo.py", "--out", str(demo))
    out.mkdir(parents=True, exist_ok=True)
    steps = QuantDemo(demo, out)
    steps.store_logits()
    fused = steps.fuse()
    control = steps.distil(steps.base, [], "control", "--save-interval", str(AVERAGE_EVERY))
    averaged = steps.average(control)
    results = {
        "unquantized": steps.evaluate(steps.base, [], "unquantized"),
        "control": steps.evaluate(control, [], "control"),
    }
    for fmt in args.formats:
        quant = quant_flags(fmt)
        for tag, model in (("", steps.base), (" + norm fusion", fused)):
            key = f"{fmt}{tag}"
            results[f"{key} RTN"] = steps.evaluate(model, quant, f"{key} RTN")
            gptq = steps.gptq(model, quant, key)
            results[f"{key} GPTQ"] = steps.evaluate(gptq, weights_as_loaded(fmt), f"{key} GPTQ")
            qad = steps.distil(model, quant, key)
            results[f"{key} QAD"] = steps.evaluate(qad, quant, f"{key} QAD")
            both = steps.distil(gptq, quant, f"{key} GPTQ + QAD")
            results[f"{key} GPTQ + QAD"] = steps.evaluate(both, quant, f"{key} GPTQ + QAD")
        results[f"{fmt} control RTN"] = steps.evaluate(control, quant, f"{fmt} control RTN")
        results[f"{fmt} averaged RTN"] = steps.evaluate(averaged, quant, f"{fmt} averaged RTN")
        if fmt in ACTIVATION_FORMATS:
            results[f"{fmt} inputs only"] = steps.evaluate(
                steps.base, weights_as_loaded(fmt), f"{fmt} inputs only"
            )
        (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results, args.formats))


if __name__ == "__main__":
    cli.run(main)
