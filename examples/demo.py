"""The embedded end-to-end demo: pretrain a teacher with the Apertus recipe, store its top-k
logits, distil a smaller student from them, and compare it with a cross-entropy-only student.

    python examples/demo.py [--out runs/demo] [--teacher-iters 120] [--student-iters 24]

1. ``tools/preprocess_data.py`` tokenizes real text shipped with Python (the language reference
   topics and the standard library's docstrings, ~0.5M tokens) with the 131072-token tekken
   tokenizer into ``OUT/data``: the teacher's training documents (the first 90%), the held-out
   documents (the last 10%, every run's validation data) and the students' training documents
   (every 8th of the teacher's, 1/9 of its tokens).
2. ``pretrain_gpt.py`` trains the teacher (hidden 128, 4 layers) with Goldfish (k=50, h=50),
   AdEMAMix, a WSD schedule with 1-sqrt cooldown, document masking and ``<s>``/``</s>``
   documents; it stops at half the steps with a checkpoint (``--exit-interval``) and a second
   run resumes from it to the end.
3. ``tools/generate_teacher_logits.py`` stores the teacher's top-k over the student's training
   samples, in the order the student consumes them (``OUT/logits``).
4. Two students of the same smaller shape (hidden 64) train for the same steps on the same
   samples: one distilled (0.9 KL to the teacher's top-256 + 0.1 CE, with the default ``label``
   tail), one with cross-entropy only. 24 steps of 16 samples are about one pass over their
   documents (a fifth of the teacher's tokens): the setting distillation is for, a student with
   less data than its teacher had.
5. ``OUT/summary.json`` holds the validation losses, the unigram baselines of the data, the
   time of a distillation step against a cross-entropy step, and ``OUT/loss.png`` the curves.

Weights and matrix products run in the precision that is fast on the machine at hand
(``PRECISION``): bf16 on a GPU or a CPU with native bf16 (AVX512-BF16, AMX, Arm BF16), fp32 on
other CPUs, where bf16 runs ~80x slower; losses and optimizer states are fp32 either way.
``OUT/summary.json`` records the precision, the CPU and the wall time.

Sizes: every token costs the 131072-wide output layer (three GEMMs and two passes over
[tokens, 131072] in training, one GEMM and one pass in validation and logit generation), so the
tokens processed set the time. They are chosen for a 2-core CPU without native bf16 (fp32) to
finish in well under 15 minutes: the teacher sees 246k tokens (120 steps, 54% of its
documents), the students 49k each, and each validation 8k held-out tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatron.apertus import cli
from megatron.apertus.cli import run_step
from megatron.apertus.ops.cpu_capability import cpu_name, fast_precision
from megatron.apertus.training.metrics import read_history

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
# 16 samples of 128 tokens a step. At a fixed number of tokens the batch barely matters here:
# 82k teacher tokens in steps of 16, 8 or 4 samples (lr 2e-3, with the cooldown) ended at
# held-out 7.39 / 7.39 / 7.39, and the steps of 4 were no cheaper per token.
GLOBAL_BATCH = 16
# 4 global batches, 64 held-out samples (8k tokens), the same ones at every validation and in
# every run, so the students' curves are compared on the same tokens.
EVAL_ITERS = 4
# Learning rates: for the teacher, 2e-3 was best of 1e-3 / 2e-3 / 4e-3 / 8e-3 over 40 steps with
# the cooldown (held-out 9.26 at step 20 for 1e-3; 7.39 / 7.43 / 7.49 at step 40 for the others).
TEACHER_LR = 2e-3
STUDENT_LR = 5e-3
# Top-256: the store's time is the teacher's forward and torch's top-k over 131072 logits per
# token, which costs about the same for k = 64 (0.19 against 0.24 ms a token here).
TOPK = 256
STUDENT_SHARE = 8  # the students train on every 8th of the teacher's documents
# bf16 weights and GEMMs where they are fast, fp32 loss and optimizer state (megatron-core's
# Float16Module and main weights): on CPUs with AVX512-BF16 a bf16 GEMM runs ~4x an fp32 one (285
# against 67 GFLOP/s), and the 131072-wide output layer dominates this model's time; on AVX2-only
# CPUs it runs ~80x slower, so those train in fp32 (chosen by the CPU's features, see
# ops/cpu_capability.py, so every run on one machine uses the same precision).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRECISION = ["--precision", fast_precision(DEVICE)]
# Untied embeddings: tied, Adam-type updates move every one of the 131072 rows along the same
# direction each step (each gets a small softmax gradient), and in a model this narrow that
# shared drift swamps the input embeddings; the model then ignores its input (measured: a
# tied hidden-128 teacher lost 0.04 nats when its input was replaced by a constant token).
TEACHER = ["--model-preset", "tiny", "--hidden-size", "128", "--ffn-hidden-size", "384"]
STUDENT = ["--model-preset", "tiny"]  # hidden 64


def run(*args: str) -> float:
    """Run one of our entry points; its wall time in seconds."""
    print("$", " ".join(args), flush=True)
    start = time.perf_counter()
    run_step([sys.executable, *args], cwd=REPO)
    return time.perf_counter() - start


def preprocess(out: Path) -> dict[str, str]:
    """Token files of the three document sets; their prefixes by name."""
    from megatron.apertus.prep.corpus import training_documents, write_jsonl

    documents = training_documents()
    first_valid = int(round(len(documents) * 0.9))
    parts = {
        "teacher": documents[:first_valid],
        "valid": documents[first_valid:],
        "student": documents[:first_valid:STUDENT_SHARE],
    }
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    prefixes = {}
    for name, part in parts.items():
        source = write_jsonl(data / f"{name}.jsonl", part)
        run(
            "tools/preprocess_data.py",
            "--input",
            str(source),
            "--output-prefix",
            str(data / name),
            "--workers",
            "2",
        )
        prefixes[name] = str(data / f"{name}_text_document")
    return prefixes


def tokens(prefix: str) -> np.ndarray:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return np.concatenate([np.array(dataset[i]) for i in range(len(dataset))])


def unigram_baselines(data: dict[str, str]) -> dict[str, float]:
    """Nats per token of context-free predictions on the held-out documents: their own unigram
    entropy, and the cross-entropy of the unigram model of the teacher's and of the students'
    training documents (add-0.1 smoothed): the best a model ignoring context can do."""
    valid = tokens(data["valid"])

    def entropy(tokens: np.ndarray) -> float:
        counts = np.bincount(tokens).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def unigram_loss(train: np.ndarray) -> float:
        counts = np.bincount(train, minlength=int(valid.max()) + 1) + 0.1
        return float(-np.log(counts[valid] / counts.sum()).mean())

    return {
        "unigram_entropy_validation": entropy(valid),
        "unigram_model_of_teacher_data_validation_loss": unigram_loss(tokens(data["teacher"])),
        "unigram_model_of_student_data_validation_loss": unigram_loss(tokens(data["student"])),
    }


def data_args(out: Path, train: str, valid: str, iters: int) -> list[str]:
    """Data, batch and validation flags (the students' are shared with the teacher's logits)."""
    return [
        "--train-data-path",
        train,
        "--valid-data-path",
        valid,
        "--data-cache-path",
        str(out / "cache"),
        "--seed",
        str(SEED),
        "--train-iters",
        str(iters),
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--micro-batch-size",
        str(GLOBAL_BATCH // 2),
        "--reset-position-ids",
        "--reset-attention-mask",
        "--eod-mask-loss",
        "--eval-interval",
        str(iters // 4),
        "--eval-iters",
        str(EVAL_ITERS),
        *PRECISION,
    ]


def recipe_args(iters: int, lr: float) -> list[str]:
    """The Apertus recipe: AdEMAMix, WSD with a 1-sqrt cooldown, Goldfish loss; the loss over
    the global batch's tokens, since packed documents and Goldfish leave its micro-batches with
    different token counts."""
    return [
        "--calculate-per-token-loss",
        "--optimizer",
        "ademamix",
        "--lr",
        str(lr),
        "--min-lr",
        str(lr / 10),
        "--weight-decay",
        "0.1",
        "--ademamix-alpha",
        "2",
        "--ademamix-beta3",
        "0.999",
        "--ademamix-alpha-warmup",
        str(iters),
        "--ademamix-beta3-warmup",
        str(iters),
        "--clip-grad",
        "1.0",
        "--lr-decay-style",
        "WSD",
        "--lr-wsd-decay-style",
        "1-sqrt",
        "--lr-warmup-iters",
        str(iters // 20),
        "--lr-wsd-decay-iters",
        str(iters // 5),
        "--goldfish-loss",
        "--goldfish-k",
        "50",
        "--goldfish-h",
        "50",
        "--log-interval",
        "10",
    ]


def pretrain_teacher(out: Path, data: dict[str, str], iters: int) -> dict:
    """Train, stop half way with a checkpoint, resume to the end; the whole history."""
    args = [
        *TEACHER,
        *data_args(out, data["teacher"], data["valid"], iters),
        *recipe_args(iters, lr=TEACHER_LR),
        "--save",
        str(out / "teacher"),
    ]
    run(
        "pretrain_gpt.py",
        *args,
        "--exit-interval",
        str(iters // 2),
        "--log-json",
        str(out / "teacher-part1.json"),
    )
    run(
        "pretrain_gpt.py",
        *args,
        "--load",
        str(out / "teacher"),
        "--log-json",
        str(out / "teacher.json"),
    )
    first = read_history(out / "teacher-part1.json")
    history = read_history(out / "teacher.json")  # the resumed run continues it
    history["resumed_at_iteration"] = first["train/loss"][-1][0]
    return history


def train_student(out: Path, data: dict[str, str], iters: int, name: str, extra: list[str]) -> dict:
    args = [
        *STUDENT,
        *data_args(out, data["student"], data["valid"], iters),
        *recipe_args(iters, lr=STUDENT_LR),
        "--save",
        str(out / name),
        "--log-json",
        str(out / f"{name}.json"),
        *extra,
    ]
    run("pretrain_gpt.py", *args)
    return read_history(out / f"{name}.json")


def median_step_seconds(history: dict) -> float:
    """Median step time, without the first steps (start-up, allocator warm-up)."""
    return statistics.median(v for it, v in history["train/step_seconds"] if it > 5)


def plot(curves: list[tuple[str, dict, bool]], path: Path) -> None:
    """Validation curves of every run (all cross-entropy on held-out text) and the training
    curves of the cross-entropy runs (``(label, history, plot_training_loss)``; the distilled
    student's training objective is KL + CE, not comparable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, history, training), color in zip(curves, ("C0", "C1", "C2")):
        if training:
            steps, values = zip(*history["train/loss"])
            ax.plot(steps, values, "-", color=color, alpha=0.35, label=f"{label}: training")
        steps, values = zip(*history["valid/loss"])
        ax.plot(steps, values, "o-", color=color, markersize=4, label=f"{label}: validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy, nats per token")
    ax.set_ylim(top=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/demo")
    # The teacher: 1920 of the ~3500 samples of its documents (it sees each once; in a second
    # pass its held-out loss rose, 6.68 -> 6.76 from step 225 to 300 of a longer run, as the
    # 131072-row embeddings memorise), its WSD cooldown over the last 24 steps. The students:
    # 384 samples, about one pass over their ~380.
    parser.add_argument("--teacher-iters", type=int, default=120)
    parser.add_argument("--student-iters", type=int, default=24)
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    start = time.perf_counter()
    for stale in ("teacher", "logits", "student-distilled", "student-ce"):  # a previous demo's
        shutil.rmtree(out / stale, ignore_errors=True)
    data = preprocess(out)
    teacher = pretrain_teacher(out, data, args.teacher_iters)
    student_data = data_args(out, data["student"], data["valid"], args.student_iters)
    logits_seconds = run(
        "tools/generate_teacher_logits.py",
        "--load",
        str(out / "teacher"),
        "--logits-dir",
        str(out / "logits"),
        "--topk",
        str(TOPK),
        *student_data,
    )
    distilled = train_student(
        out,
        data,
        args.student_iters,
        "student-distilled",
        ["--distill-logits-path", str(out / "logits"), "--kd-alpha", "0.9"],
    )
    baseline = train_student(out, data, args.student_iters, "student-ce", [])
    plot(
        [
            ("teacher", teacher, True),
            ("student distilled", distilled, False),
            ("student CE only", baseline, True),
        ],
        out / "loss.png",
    )
    final = lambda history: history["valid/loss"][-1][1]  # noqa: E731
    summary = {
        "teacher_validation_loss": {"start": teacher["valid/loss"][0][1], "end": final(teacher)},
        "teacher_validation_curve": teacher["valid/loss"],
        "teacher_resumed_at_iteration": teacher["resumed_at_iteration"],
        "student_distilled_validation_loss": final(distilled),
        "student_ce_only_validation_loss": final(baseline),
        "student_distilled_validation_curve": distilled["valid/loss"],
        "student_ce_only_validation_curve": baseline["valid/loss"],
        **unigram_baselines(data),
        "training_tokens": {name: len(tokens(data[name])) for name in ("teacher", "student")},
        "uniform_entropy": math.log(131072),
        "teacher_logits_seconds": logits_seconds,
        "teacher_logits_bytes": sum(
            f.stat().st_size for f in (out / "logits").rglob("*") if f.is_file()
        ),
        "step_seconds_teacher": median_step_seconds(teacher),
        "step_seconds_distilled": median_step_seconds(distilled),
        "step_seconds_ce_only": median_step_seconds(baseline),
        "loss_plot": str(out / "loss.png"),
        "precision": PRECISION[1],
        "machine": torch.cuda.get_device_name() if DEVICE == "cuda" else cpu_name(),
        "wall_seconds": time.perf_counter() - start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if "curve" not in k}, indent=2))


if __name__ == "__main__":
    cli.run(main)
