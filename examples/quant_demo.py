"""Quantization of a tiny model on the embedded corpus: bf16 against RTN, GPTQ and QAD, each with
and without norm fusion, on the held-out documents (docs/quantization.md has a measured table).

    python examples/quant_demo.py [--out runs/quant-demo] [--formats int4 int3 int2 fp8 nvfp4]

1. ``pretrain_gpt.py`` trains the base model (tiny preset, ``BASE_ITERS`` steps); it is also
   the teacher, as in seed 003's QAD of a model from its own unquantized logits.
2. ``tools/generate_teacher_logits.py`` stores the base model's top-k over the QAD samples.
3. ``tools/fuse_norms.py`` writes the norm-fused base model.
4. For each format and each of the two base models: RTN is the base model evaluated with
   ``--quant-format`` (fake quantization is round-to-nearest); GPTQ (int formats) is
   ``tools/quantize.py --method gptq`` calibrated on the store's samples; QAD is
   ``pretrain_gpt.py --load BASE --finetune --distill-logits-path LOGITS --quant-format F``
   for ``QAD_ITERS`` steps (Adam without weight decay, cosine), evaluated with
   ``--quant-format F``. A control run does the same distillation without quantization, so
   the table separates what the extra steps on the teacher's logits give from what
   quantization-aware training gives.
5. ``OUT/summary.json`` and a Markdown table on stdout: validation loss of each, and the gap
   closed by QAD, ``(RTN - QAD) / (RTN - bf16)``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--model-preset", "tiny"]
BASE_ITERS = 200
QAD_ITERS = 30
EVAL = ["--eval-iters", "8"]
BASE_RUN = ["--seed", "3", "--global-batch-size", "8", "--micro-batch-size", "4"]
QAD_DATA = ["--seed", "11", "--global-batch-size", "8", "--micro-batch-size", "4"]
QAD_OPT = ["--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "4", "--weight-decay", "0.0"]  # fmt: skip


def run(script: str, *args: str) -> None:
    cmd = [sys.executable, str(REPO / script), *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)


GROUP = ["--quant-group-size", "-1"]
"""Per-output-channel integer scales: on a model this small, groups of 32 lose almost nothing."""


def quant_flags(fmt: str | None) -> list[str]:
    if fmt is None:
        return []
    return ["--quant-format", fmt, *(GROUP if fmt.startswith("int") else [])]


def evaluate(out: Path, ckpt: Path, fmt: str | None, name: str) -> float:
    log = out / "eval" / f"{name}.json"
    log.parent.mkdir(parents=True, exist_ok=True)
    run("pretrain_gpt.py", *MODEL, *BASE_RUN, *EVAL, "--load", str(ckpt), "--finetune",
        "--train-iters", "0", "--log-json", str(log), *quant_flags(fmt))  # fmt: skip
    return float(json.loads(log.read_text())["valid/loss"][-1][1])


def qad(out: Path, base: Path, logits: Path, fmt: str | None, name: str) -> Path:
    save = out / "qad" / name
    if not (save / "latest_checkpointed_iteration.txt").exists():
        run("pretrain_gpt.py", *MODEL, *QAD_DATA, *QAD_OPT, "--train-iters", str(QAD_ITERS),
            "--load", str(base), "--finetune", "--distill-logits-path", str(logits),
            "--save", str(save), *EVAL, *quant_flags(fmt))  # fmt: skip
    return save


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "quant-demo")
    parser.add_argument("--formats", nargs="+", default=["int4", "int3", "int2", "fp8", "nvfp4"])
    parser.add_argument("--base", type=Path, help="reuse this base checkpoint instead of step 1")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    base = args.base or out / "base"
    if args.base is None and not (base / "latest_checkpointed_iteration.txt").exists():
        run("pretrain_gpt.py", *MODEL, *BASE_RUN, "--lr", "3e-3", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "10", "--train-iters", str(BASE_ITERS),
            "--save", str(base))  # fmt: skip
    logits = out / "logits"
    if not logits.exists():
        run("tools/generate_teacher_logits.py", "--load", str(base), "--logits-dir", str(logits),
            "--topk", "64", *QAD_DATA, "--train-iters", str(QAD_ITERS), *EVAL)  # fmt: skip
    fused = out / "fused"
    if not fused.exists():
        run("tools/fuse_norms.py", "--load", str(base), "--save", str(fused))
    results: dict[str, float] = {"bf16": evaluate(out, base, None, "bf16")}
    control = qad(out, base, logits, None, "control")
    results["bf16 + distillation steps (control)"] = evaluate(out, control, None, "control")
    for fmt in args.formats:
        for tag, model in (("", base), (" + norm fusion", fused)):
            key = f"{fmt}{tag}"
            results[f"{key} RTN"] = evaluate(out, model, fmt, f"{key} RTN")
            if fmt.startswith("int"):
                gptq = out / "gptq" / key.replace(" ", "_")
                if not gptq.exists():
                    run("tools/quantize.py", "--load", str(model), "--save", str(gptq),
                        "--method", "gptq", "--quant-format", fmt, *GROUP,
                        "--distill-logits-path", str(logits), "--calibration-samples", "64",
                        *QAD_DATA, "--train-iters", str(QAD_ITERS), *EVAL)  # fmt: skip
                results[f"{key} GPTQ"] = evaluate(out, gptq, None, f"{key} GPTQ")
            trained = qad(out, model, logits, fmt, key.replace(" ", "_"))
            results[f"{key} QAD"] = evaluate(out, trained, fmt, f"{key} QAD")
            rtn, done, bf16 = results[f"{key} RTN"], results[f"{key} QAD"], results["bf16"]
            results[f"{key} gap closed"] = (rtn - done) / (rtn - bf16) if rtn != bf16 else 0.0
            (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| model | validation loss |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.4f} |")


if __name__ == "__main__":
    main()
