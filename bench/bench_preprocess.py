"""Preprocessing throughput on real text with the 131072-token tekken tokenizer.

Compares, in one run: our tool's pipeline (validation, ordered multi-process tokenization,
megatron-core's IndexedDatasetBuilder, atomic rename) at 1 and 2 workers, against the
straightforward baseline (one process: json.loads, encode, add_document, no checks).
Corpus: the Python reference topics (``pydoc_data``) repeated ``--copies`` times.

    python bench/bench_preprocess.py [--copies 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import write_results
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron.apertus.data.corpus import embedded_documents
from megatron.apertus.data.preprocess import PreprocessConfig, preprocess
from megatron.apertus.data.tokenizer import build_tokenizer


def baseline(source: Path, prefix: str) -> int:
    tokenizer = build_tokenizer("TekkenTokenizer")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    tokens = 0
    with open(source, encoding="utf-8") as lines:
        for line in lines:
            ids = tokenizer.encode_document(json.loads(line)["text"])
            builder.add_document(np.asarray(ids, dtype=np.int32), [len(ids)])
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return tokens


def ours(source: Path, prefix: str, workers: int) -> int:
    config = PreprocessConfig(inputs=[source], output_prefix=prefix, workers=workers)
    return preprocess(config).tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "corpus.jsonl"
        docs = embedded_documents() * args.copies
        source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        runs = [("baseline (1 process, no checks)", 1, lambda p: baseline(source, p))]
        runs += [(f"ours, {w} worker(s)", w, lambda p, w=w: ours(source, p, w)) for w in (1, 2)]
        for name, workers, fn in runs:
            start = time.perf_counter()
            tokens = fn(str(Path(tmp) / name.split()[0]))
            seconds = time.perf_counter() - start
            rows.append({"name": name, "workers": workers, "documents": len(docs), "tokens": tokens,
                         "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds),
                         "tokens_per_s_per_worker": round(tokens / seconds / workers)})  # fmt: skip
            print(f"{name:34s} {tokens:8d} tokens {seconds:6.2f} s {tokens / seconds:10,.0f} tokens/s "
                  f"{tokens / seconds / workers:10,.0f} tokens/s/worker")  # fmt: skip
    path = write_results(
        "preprocess", rows, {"tokenizer": "tekken_240718 (131072)", "cores": os.cpu_count()}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
