"""The embedded end-to-end demo: preprocess real text, pretrain a tiny Apertus model with the
Apertus recipe on CPU, stop half way, resume, and report.

    python examples/demo.py [--out runs/demo] [--iters 300]

1. ``tools/preprocess_data.py`` tokenizes real text shipped with Python (the language reference
   topics and the standard library's docstrings, ~0.5M tokens) with the 131072-token tekken
   tokenizer into ``OUT/data``.
2. ``pretrain_gpt.py`` trains the ``tiny`` preset with Goldfish (k=50, h=50), AdEMAMix, a WSD
   schedule with 1-sqrt cooldown, document masking and ``<s>``/``</s>`` documents, stops at
   half the steps with a checkpoint (``--exit-interval``), then resumes from it to the end.
3. The summary (``OUT/summary.json``) gives the validation loss before and after training,
   the unigram entropy of the data (the loss of the best context-free model), and the loss plot.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)


def preprocess(out: Path) -> str:
    from megatron.apertus.data.corpus import training_documents, write_jsonl

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    source = write_jsonl(data / "python_docs.jsonl", training_documents())
    run("tools/preprocess_data.py", "--input", str(source), "--output-prefix", str(data / "python_docs"),
        "--workers", "2")  # fmt: skip
    return str(data / "python_docs_text_document")


def unigram_entropies(prefix: str, valid_share: float) -> dict[str, float]:
    """Entropy in nats of the unigram distribution of the whole corpus and of the held-out
    documents alone (the last ``valid_share`` of them, as megatron-core's split takes them)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    documents = [np.array(dataset[i]) for i in range(len(dataset))]
    first_valid = int(round(len(documents) * (1 - valid_share)))

    def entropy(tokens: np.ndarray) -> float:
        counts = np.bincount(tokens).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    return {
        "unigram_entropy_corpus_nats": entropy(np.concatenate(documents)),
        "unigram_entropy_validation_nats": entropy(np.concatenate(documents[first_valid:])),
    }


def train_args(out: Path, data: str, iters: int) -> list[str]:
    return [
        "pretrain_gpt.py", "--model-preset", "tiny", "--data-path", data, "--split", "90,10,0",
        "--data-cache-path", str(out / "cache"),
        "--train-iters", str(iters), "--global-batch-size", "8", "--micro-batch-size", "4",
        "--optimizer", "ademamix", "--lr", "1e-3", "--min-lr", "1e-4", "--weight-decay", "0.1",
        "--ademamix-alpha", "2", "--ademamix-beta3", "0.999", "--ademamix-alpha-warmup", str(iters),
        "--ademamix-beta3-warmup", str(iters), "--clip-grad", "1.0",
        "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "1-sqrt", "--lr-warmup-iters", str(iters // 20),
        "--lr-wsd-decay-iters", str(iters // 5),
        "--goldfish-loss", "--goldfish-k", "50", "--goldfish-h", "50",
        "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
        "--eval-interval", str(iters // 4), "--eval-iters", "4", "--log-interval", "10",
        "--save", str(out / "checkpoints"), "--loss-plot", str(out / "loss.png"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    data = preprocess(out)
    common = train_args(out, data, args.iters)
    run(*common, "--exit-interval", str(args.iters // 2), "--log-json", str(out / "part1.json"))
    run(*common, "--load", str(out / "checkpoints"), "--log-json", str(out / "part2.json"))
    first = json.loads((out / "part1.json").read_text())
    whole = json.loads((out / "part2.json").read_text())  # the resumed run continues the history
    valid = whole["valid/loss"]
    summary = {
        "validation_loss_start": valid[0][1],
        "validation_loss_end": valid[-1][1],
        "validation_curve": valid,
        **unigram_entropies(data, valid_share=0.1),
        "uniform_entropy_nats": math.log(131072),
        "resumed_at_iteration": first["train/loss"][-1][0],
        "loss_plot": str(out / "loss.png"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "validation_curve"}, indent=2))


if __name__ == "__main__":
    main()
