"""JSON lines -> megatron-core indexed datasets (``PREFIX_KEY_document.bin/.idx``).

Guarantees:

* Bad input loses nothing and stops nothing. A line that is not valid UTF-8, not valid JSON,
  not a JSON object, lacks one of the ``--json-keys``, or has an empty (whitespace-only) text is
  counted, reported with its file and line number (the first few in full), and skipped; every
  good document is written. A line missing any key is skipped for every key, so the outputs
  of several keys stay aligned document by document.
* Outputs are written under ``*.tmp.bin/.tmp.idx`` and renamed only when complete.
* Documents keep their input order whatever the number of workers.
* Every document is ``<s> text </s>`` by default (``--no-bos`` drops ``<s>``, ``--no-eod``
  drops ``</s>``); special-token strings inside the text are tokenized as text.

* Beside each ``PREFIX.bin/.idx`` goes ``PREFIX.meta.json``: the tokenizer (type, file, hash,
  special ids), the ``<s>``/``</s>`` rules, dtype, documents and tokens, which merges and
  mixtures check.
* ``split_sentences`` writes Megatron-LM's sentence-level datasets (``PREFIX_KEY_sentence``).

Inputs may be plain, gzip (``.gz``) or zstd (``.zst``, ``.zstd``) JSON lines.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np

from megatron.apertus.data.tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger("apertus.preprocess")

Line = tuple[int, int, bytes]  # (input file index, 1-based line number, raw bytes)


@dataclass(kw_only=True, frozen=True)
class PreprocessConfig:
    inputs: list[Path]
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    output_prefix: str
    tokenizer_type: str = "TekkenTokenizer"
    tokenizer_model: str | None = None
    add_bos: bool = True
    add_eod: bool = True
    workers: int = 1
    lines_per_task: int = 64
    max_reported: int = 10
    """Rejected lines reported in full; the rest are only counted."""
    split_sentences: bool = False
    """Megatron-LM's sentence-level datasets (``PREFIX_KEY_sentence``) with nltk's Punkt."""
    lang: str = "english"
    """The Punkt model of ``split_sentences``."""
    keep_newlines: bool = False
    """With ``split_sentences``: the whitespace between sentences (newlines included) stays
    with the sentence before it, so the sentences concatenate to the text."""
    log_interval: int = 1000
    """Log documents and tokens per second every this many documents."""


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    rejected: Counter = field(default_factory=Counter)
    reported: int = 0

    @property
    def rejected_lines(self) -> int:
        return sum(self.rejected.values())


def output_prefix(prefix: str, key: str, level: str = "document") -> str:
    return f"{prefix}_{key}_{level}"


def sentence_splitter(lang: str, keep_newlines: bool) -> Callable[[str], list[str]]:
    """nltk's Punkt model for ``lang`` (``punkt_tab``: plain-text parameters, no pickle) as a
    text -> sentences function; ``ValueError`` saying what to install when it is missing."""
    try:
        from nltk.tokenize.punkt import PunktTokenizer
    except ImportError:
        raise ValueError("--split-sentences needs nltk: pip install nltk") from None
    try:
        punkt = PunktTokenizer(lang)
    except LookupError:
        raise ValueError("--split-sentences needs nltk's punkt_tab data: "
                         "python -m nltk.downloader punkt_tab") from None  # fmt: skip
    if not keep_newlines:
        return punkt.tokenize

    def split_keeping_whitespace(text: str) -> list[str]:
        starts = [start for start, _ in punkt.span_tokenize(text)]
        return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]

    return split_keeping_whitespace


def open_lines(path: Path) -> BinaryIO:
    """A binary line reader over a plain, gzip or zstd file."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix in (".zst", ".zstd"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def iter_lines(paths: list[Path]) -> Iterator[Line]:
    for file_index, path in enumerate(paths):
        with open_lines(path) as stream:
            for number, raw in enumerate(stream, start=1):
                yield file_index, number, raw


def _chunks(lines: Iterator[Line], size: int) -> Iterator[list[Line]]:
    while chunk := list(islice(lines, size)):
        yield chunk


# -- worker side -------------------------------------------------------------------------------

_worker: dict = {}
"""The config and tokenizer of this process; forked workers inherit them."""


def parse_line(raw: bytes, keys: list[str]) -> dict[str, str]:
    """The texts of ``keys`` in one JSON line; ``ValueError`` says why the line is rejected."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 (byte {err.start})") from None
    if not text.strip():
        raise ValueError("blank line")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"not a JSON object but {type(record).__name__}")
    return parse_record(record, keys)


def parse_record(record: dict, keys: list[str]) -> dict[str, str]:
    """The texts of ``keys`` in one parsed record (a JSON object or a Parquet row)."""
    texts = {}
    for key in keys:
        if key not in record:
            raise ValueError(f"missing key {key!r}")
        value = record[key]
        if not isinstance(value, str):
            raise ValueError(f"key {key!r} is {type(value).__name__}, not a string")
        if not value.strip():
            raise ValueError(f"empty document in key {key!r}")
        texts[key] = value
    return texts


def encode_document(tokenizer: Tokenizer, text: str, add_bos: bool, add_eod: bool) -> np.ndarray:
    """The ids of one document: ``[<s>] text [</s>]``."""
    ids = tokenizer.encode(text)
    if add_bos:
        ids = [tokenizer.bos, *ids]
    if add_eod:
        ids.append(tokenizer.eod)
    return np.asarray(ids, dtype=np.int32)


def encode_sentences(
    tokenizer: Tokenizer, sentences: list[str], add_bos: bool, add_eod: bool
) -> tuple[np.ndarray, list[int]]:
    """The ids of a document split into sentences (``<s>`` before the first, ``</s>`` after
    the last) and the length of each sentence, as Megatron-LM's sentence-level datasets hold."""
    pieces = [tokenizer.encode(s) for s in sentences]
    if add_bos:
        pieces[0] = [tokenizer.bos, *pieces[0]]
    if add_eod:
        pieces[-1] = [*pieces[-1], tokenizer.eod]
    ids = np.asarray([i for piece in pieces for i in piece], dtype=np.int32)
    return ids, [len(piece) for piece in pieces]


def _encode_text(text: str) -> tuple[np.ndarray, list[int]]:
    config, tokenizer = _worker["config"], _worker["tokenizer"]
    if config.split_sentences:
        return encode_sentences(tokenizer, _worker["splitter"](text), config.add_bos,
                                config.add_eod)  # fmt: skip
    ids = encode_document(tokenizer, text, config.add_bos, config.add_eod)
    return ids, [ids.size]


def encode_chunk(chunk: list[Line]) -> list[tuple[int, int, dict | None, str | None]]:
    """(file, line, {key: (ids, sentence lengths)} or None, rejection reason or None) for every
    line of the chunk."""
    config = _worker["config"]
    results = []
    for file_index, number, raw in chunk:
        try:
            texts = parse_line(raw, config.json_keys)
        except ValueError as err:
            results.append((file_index, number, None, str(err)))
            continue
        ids = {key: _encode_text(text) for key, text in texts.items()}
        results.append((file_index, number, ids, None))
    return results


# -- writer side -------------------------------------------------------------------------------


def check_inputs(config: PreprocessConfig) -> Tokenizer:
    """Fail before any work on missing inputs, an unknown tokenizer or an unwritable prefix."""
    missing = [str(p) for p in config.inputs if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    if not config.json_keys:
        raise ValueError("--json-keys needs at least one key")
    out_dir = Path(config.output_prefix).parent
    if not out_dir.is_dir():
        raise FileNotFoundError(f"--output-prefix directory {out_dir} does not exist")
    if config.keep_newlines and not config.split_sentences:
        raise ValueError("--keep-newlines only applies with --split-sentences")
    if config.split_sentences:
        sentence_splitter(
            config.lang, config.keep_newlines
        )  # fails here, before any work, when missing
    return build_tokenizer(config.tokenizer_type, config.tokenizer_model)


def index_dtype(vocab_size: int) -> type:
    # megatron-core's rule (DType.optimal_dtype): uint16 below 65500 ids, else int32.
    return np.uint16 if vocab_size < 65500 else np.int32


def report_rejected(
    summary: Summary, where: str, reason: str, max_reported: int, warn: Callable = log.warning
) -> None:
    """Count a rejected line by reason; show the first ``max_reported`` as ``FILE:LINE: ...``."""
    summary.rejected[reason.split(" (")[0]] += 1
    if summary.reported < max_reported:
        warn(f"{where}: skipped: {reason}")
        summary.reported += 1
    elif summary.reported == max_reported:
        warn("further rejected lines are counted but not shown")
        summary.reported += 1


def preprocess(config: PreprocessConfig) -> Summary:
    """Tokenize every input line into one indexed dataset per JSON key."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tqdm import tqdm

    tokenizer = check_inputs(config)
    dtype = index_dtype(tokenizer.vocab_size)
    level = "sentence" if config.split_sentences else "document"
    prefixes = {k: output_prefix(config.output_prefix, k, level) for k in config.json_keys}
    builders = {
        key: IndexedDatasetBuilder(f"{p}.tmp.bin", dtype=dtype) for key, p in prefixes.items()
    }
    summary = Summary()
    key_tokens = Counter()
    chunks = _chunks(iter_lines(config.inputs), config.lines_per_task)
    start = time.perf_counter()
    with _pool(config, tokenizer) as pool, tqdm(
        unit=" docs", desc="preprocess", mininterval=1.0
    ) as bar:
        results = pool.imap(encode_chunk, chunks) if pool else map(encode_chunk, chunks)
        for batch in results:
            for file_index, number, ids, reason in batch:
                if ids is None:
                    where = f"{config.inputs[file_index]}:{number}"
                    report_rejected(summary, where, reason, config.max_reported)
                    continue
                for key, (array, lengths) in ids.items():
                    builders[key].add_document(array, lengths)
                    key_tokens[key] += array.size
                summary.documents += 1
                summary.tokens += sum(a.size for a, _ in ids.values())
                if summary.documents % config.log_interval == 0:
                    _log_progress(summary, time.perf_counter() - start)
            bar.update(len(batch))
            rate = summary.tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
    record = tokenizer_record(config.tokenizer_type, tokenizer)
    for key, prefix in prefixes.items():
        builders[key].finalize(f"{prefix}.tmp.idx")
        for suffix in (".bin", ".idx"):
            os.replace(f"{prefix}.tmp{suffix}", f"{prefix}{suffix}")
        per_key = Summary(documents=summary.documents, tokens=key_tokens[key])
        write_dataset_record(
            prefix, dataset_record(record, config.add_bos, config.add_eod, per_key)
        )
    return summary


def _log_progress(summary: Summary, elapsed: float) -> None:
    log.info(f"processed {summary.documents} documents ({summary.documents / elapsed:,.0f} docs/s, "
             f"{summary.tokens / elapsed:,.0f} tokens/s)")  # fmt: skip


class _NoPool:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _pool(config: PreprocessConfig, tokenizer: Tokenizer):
    """Worker processes, or none (tokenize in this process) for ``--workers 1``.

    Workers are forked so that they inherit the loaded tokenizer instead of each loading its
    own (about a second for tekken) and re-importing the entry point.
    """
    _worker.update(config=config, tokenizer=tokenizer)
    if config.split_sentences:
        _worker["splitter"] = sentence_splitter(config.lang, config.keep_newlines)
    if config.workers <= 1:
        return _NoPool()
    return multiprocessing.get_context("fork").Pool(config.workers)


RECORD_SUFFIX = ".meta.json"
"""``PREFIX.meta.json`` sits beside ``PREFIX.bin/.idx``: which tokenizer and document rules made
the dataset, so that merges and mixtures can refuse parts that do not belong together."""


def tokenizer_record(tokenizer_type: str, tokenizer: Tokenizer) -> dict:
    """What identifies a tokenizer: its type, file name, content hash and special ids."""
    path = Path(tokenizer.path)
    return {
        "type": tokenizer_type,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "vocab_size": tokenizer.vocab_size,
        "bos": tokenizer.bos,
        "eod": tokenizer.eod,
    }


def dataset_record(tokenizer: dict, add_bos: bool, add_eod: bool, summary: Summary) -> dict:
    return {
        "tokenizer": tokenizer,
        "add_bos": add_bos,
        "add_eod": add_eod,
        "dtype": np.dtype(index_dtype(tokenizer["vocab_size"])).name,
        "documents": summary.documents,
        "tokens": summary.tokens,
    }


def write_dataset_record(prefix: str, record: dict) -> None:
    """Write ``PREFIX.meta.json`` under a temporary name, then rename it."""
    path = prefix + RECORD_SUFFIX
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        json.dump(record, out, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def read_dataset_record(prefix: str) -> dict | None:
    """The record of ``prefix``, or None for a dataset written without one."""
    path = Path(prefix + RECORD_SUFFIX)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def format_summary(summary: Summary, elapsed: float) -> str:
    lines = [
        f"wrote {summary.documents} documents, {summary.tokens} tokens in {elapsed:.1f} s "
        f"({summary.tokens / max(elapsed, 1e-9):,.0f} tokens/s)",
        f"rejected {summary.rejected_lines} lines"
        + "".join(f"\n  {count:8d}  {reason}" for reason, count in summary.rejected.most_common()),
    ]
    return "\n".join(lines)
