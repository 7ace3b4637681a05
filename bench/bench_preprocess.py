"""Preprocessing throughput on real text with the 131072-token tekken tokenizer.

Compares, in one run, at 1 and 2 workers: our tool's pipeline (validation, ordered
multi-process tokenization, megatron-core's IndexedDatasetBuilder, atomic rename), the datatrove
path of tools/tokenize_corpus.py (local executor, one dataset per task, the corpus in 4 shards),
and a plain loop over the Hugging Face ``tokenizers`` conversion of the same tekken vocabulary
(encode only: the tokenizer's own ceiling); plus the straightforward baseline (one process:
json.loads, encode, add_document, no checks). Corpus: the Python reference topics
(``pydoc_data``) repeated ``--copies`` times.

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

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.prep.preprocess import PreprocessConfig, preprocess
from megatron.apertus.tokenizer.tokenizers import bundled_tekken_path


def baseline(source: Path, prefix: str) -> int:
    """Megatron-LM's loop, with the tokenizer as mistral-common loads it (no vocabulary cache)."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tokenizer = Tekkenizer.from_file(str(bundled_tekken_path()))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    tokens = 0
    with open(source, encoding="utf-8") as lines:
        for line in lines:
            ids = tokenizer.encode(json.loads(line)["text"], bos=True, eos=True)
            builder.add_document(np.asarray(ids, dtype=np.int32), [len(ids)])
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return tokens


def ours(source: Path, prefix: str, workers: int) -> int:
    config = PreprocessConfig(inputs=[source], output_prefix=prefix, workers=workers)
    return preprocess(config).tokens


def datatrove_path(shards: list[Path], out: str, workers: int) -> int:
    """tools/tokenize_corpus.py's pipeline and executor, one task per shard."""
    from datatrove.executor import LocalPipelineExecutor

    from megatron.apertus.prep.tokenize_pipeline import (
        IndexedDatasetWriter,
        ShardReader,
        cached_tokenizer,
    )

    cached_tokenizer("TekkenTokenizer", None)  # loaded once, inherited by the forked tasks
    files = [str(s) for s in shards]
    pipeline = [
        ShardReader(files, ["text"]),
        IndexedDatasetWriter(out, ["text"], "TekkenTokenizer", None, True, True, 10),
    ]
    LocalPipelineExecutor(
        pipeline, tasks=len(files), workers=workers, logging_dir=out + "/logs", start_method="fork"
    ).run()
    return sum(json.loads(p.read_text())["tokens"] for p in Path(out).glob("*.meta.json"))


def _hf_encode(texts: list[str]) -> int:
    return sum(
        len(ids) + 2 for ids in (_HF["tok"].encode(t, add_special_tokens=False).ids for t in texts)
    )


_HF: dict = {}


def load_hf_tekken(tmp: str) -> None:
    """The ``tokenizers`` conversion of tekken, made before the clock starts."""
    from tokenizers import Tokenizer as FastTokenizer
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    from megatron.apertus.tokenizer.tokenizers import bundled_tekken_path

    convert_tekken_tokenizer(str(bundled_tekken_path())).save_pretrained(tmp + "/hf")
    _HF["tok"] = FastTokenizer.from_file(tmp + "/hf/tokenizer.json")
    _HF["tok"].encode_special_tokens = True


def hf_loop(docs: list[str], workers: int) -> int:
    """Encode every document with the ``tokenizers`` tekken (+2 for <s>, </s>)."""
    import multiprocessing

    if workers == 1:
        return _hf_encode(docs)
    chunks = [docs[i :: workers * 8] for i in range(workers * 8)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return sum(pool.map(_hf_encode, chunks))


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
        shards = []
        for i in range(4):
            shards.append(Path(tmp) / f"shard{i}.jsonl")
            shards[-1].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::4]))
        runs += [
            (
                f"datatrove, {w} worker(s)",
                w,
                lambda p, w=w: datatrove_path(shards, p + f"-dt{w}", w),
            )
            for w in (1, 2)
        ]
        runs += [
            (f"HF tokenizers loop, {w} worker(s)", w, lambda p, w=w: hf_loop(docs, w))
            for w in (1, 2)
        ]
        load_hf_tekken(tmp)
        for name, workers, fn in runs:
            start = time.perf_counter()
            tokens = fn(str(Path(tmp) / name.split()[0].strip(",")))
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "name": name,
                    "workers": workers,
                    "documents": len(docs),
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "tokens_per_s": round(tokens / seconds),
                    "tokens_per_s_per_worker": round(tokens / seconds / workers),
                }
            )
            print(
                f"{name:36s} {tokens:8d} tokens {seconds:6.2f} s {tokens / seconds:10,.0f} tokens/s "
                f"{tokens / seconds / workers:10,.0f} tokens/s/worker"
            )
    path = write_results(
        "preprocess", rows, {"tokenizer": "tekken_240718 (131072)", "cores": os.cpu_count()}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
