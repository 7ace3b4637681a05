"""JSON lines -> megatron-core indexed datasets (``PREFIX_KEY_document.bin/.idx``).

Guarantees:

* Bad input loses nothing and stops nothing. A line that is not valid UTF-8, not valid JSON,
  not a JSON object, lacks one of the ``--json-keys``, or has an empty (whitespace-only) text is
  counted, reported with its file and line number (the first few in full), and skipped; every
  good document is written. A line missing any key is skipped for every key, so the outputs
  of several keys stay aligned document by document.
* Outputs are written under ``*.tmp.bin/.tmp.idx`` and renamed only when complete; an error,
  Ctrl-C or SIGTERM removes them. Input without a single usable line writes nothing and is an
  error (megatron-core cannot open an empty dataset).
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

import argparse
import contextlib
import glob
import gzip
import hashlib
import io
import json
import logging
import multiprocessing
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator, Protocol

import numpy as np

from megatron.apertus.cli import atomic_outputs, die_with_parent
from megatron.apertus.data.indexed import RECORD_SUFFIX
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import add_arguments, flag_help, from_arguments, switch
from megatron.apertus.prep.indexed_writer import IndexedDatasetWriter
from megatron.apertus.tokenizer.config import TokenizerConfig
from megatron.apertus.tokenizer.tokenizers import Tokenizer, checked_tokenizer

log = logging.getLogger("apertus.preprocess")

Line = tuple[int, int, bytes]  # (input file index, 1-based line number, raw bytes)


@dataclass(kw_only=True, frozen=True)
class CorpusOptions:
    """The flags every JSON-lines tokenizing tool shares beside the tokenizer's, with
    Megatron-LM's names; :func:`corpus_config` turns them into :class:`PreprocessConfig`'s
    fields of the same names (``input``'s patterns into the files ``inputs``)."""

    input: list[str] = flag_help("JSON-lines files (.jsonl, .gz, .zst); shell-style globs allowed")
    output_prefix: str = flag_help("where the datasets go: their names begin with OUTPUT_PREFIX")
    workers: int = flag_help("processes that tokenize", 1)
    max_reported: int = flag_help("bad lines reported in full", 10, ours=True)


@dataclass(kw_only=True, frozen=True)
class DocumentOptions:
    """Which texts of a line are documents and how each begins and ends: the flags
    ``tools/preprocess_data.py`` and ``tools/tokenize_corpus.py`` share."""

    json_keys: list[str] = flag_help(
        "the keys of each line whose texts are tokenized, one dataset per key",
        default_factory=lambda: ["text"],
    )
    append_eod: bool = switch(
        "end every document with </s> (the default; kept for Megatron-LM compatibility)"
    )
    no_eod: bool = switch("do not append </s>", ours=True)
    no_bos: bool = switch("do not prepend <s>", ours=True)

    def __post_init__(self) -> None:
        if self.append_eod and self.no_eod:
            raise ConfigError("--append-eod and --no-eod: give one of them")

    @property
    def add_bos(self) -> bool:
        """Every document begins with ``<s>``."""
        return not self.no_bos

    @property
    def add_eod(self) -> bool:
        """Every document ends with ``</s>``."""
        return not self.no_eod


@dataclass(kw_only=True, frozen=True)
class SentenceOptions:
    """Megatron-LM's sentence-level datasets (``PREFIX_KEY_sentence``) with nltk's Punkt."""

    split_sentences: bool = switch(
        "one index entry per sentence (nltk Punkt, punkt_tab data); writes "
        "PREFIX_KEY_sentence.bin/.idx"
    )
    lang: str = flag_help("Punkt model of --split-sentences", "english")
    keep_newlines: bool = switch(
        "with --split-sentences: keep the whitespace (newlines included) between sentences with "
        "the sentence before it, so that the sentences concatenate to the text"
    )


@dataclass(kw_only=True, frozen=True)
class PreprocessConfig(TokenizerConfig, DocumentOptions, SentenceOptions):
    """What :func:`preprocess` writes. Its tokenizer, document and sentence fields are flag
    groups (the tools add them); the rest are :class:`CorpusOptions`' flags, or library
    settings that no tool changes (``lines_per_task``)."""

    inputs: list[Path]
    output_prefix: str
    workers: int = 1
    lines_per_task: int = 64
    max_reported: int = 10
    """Rejected lines reported in full; the rest are only counted."""
    log_interval: int = 1000
    """Log documents and tokens per second every this many documents."""


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """``tools/preprocess_data.py``'s flags beyond the documents': progress, the exit status,
    and two flags of Megatron-LM's tool that change nothing here."""

    partitions: int = flag_help(
        "accepted for Megatron-LM compatibility: --workers already tokenizes in parallel, and "
        "the output is in input order whatever its value",
        1,
    )
    keep_sequential_samples: bool = switch(
        "accepted for Megatron-LM compatibility: documents always keep their input order"
    )
    log_interval: int = flag_help("log progress every this many documents", 1000)
    strict: bool = switch("exit 1 when any line was rejected", ours=True)


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every JSON-lines tokenizing tool shares: :class:`CorpusOptions`' and the
    tokenizer's (the trainer's group)."""
    add_arguments(parser, CorpusOptions, title="input and output")
    add_arguments(parser, TokenizerConfig, title="tokenizer")


def corpus_config(args: argparse.Namespace) -> PreprocessConfig:
    """The config of a tool's flags: :func:`add_corpus_arguments`' and those of any group of
    :class:`PreprocessConfig` the tool added (one it did not add keeps its defaults). Globs
    expand in sorted order; a name that matches nothing stays, for :func:`preprocess` to
    report as missing."""
    inputs = [Path(p) for pattern in args.input for p in (sorted(glob.glob(pattern)) or [pattern])]
    return from_arguments(PreprocessConfig, argparse.Namespace(**vars(args), inputs=inputs))


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
        raise ValueError(
            "--split-sentences needs nltk's punkt_tab data: " "python -m nltk.downloader punkt_tab"
        ) from None
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
"""The line encoder of this process; forked workers inherit it."""


def decode_line(raw: bytes) -> str:
    """One input line as text without its line ending (so that a JSON error's column is on
    this line); ``ValueError`` when it is not UTF-8 or blank."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 (byte {err.start})") from None
    if not text.strip():
        raise ValueError("blank line")
    return text.rstrip("\r\n")


def parse_line(raw: bytes, keys: list[str]) -> dict[str, str]:
    """The texts of ``keys`` in one JSON line; ``ValueError`` says why the line is rejected."""
    text = decode_line(raw)
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
) -> list[np.ndarray]:
    """A document split into sentences, one array each (``<s>`` before the first, ``</s>``
    after the last), as Megatron-LM's sentence-level datasets hold them."""
    pieces = [tokenizer.encode(s) for s in sentences]
    if add_bos:
        pieces[0] = [tokenizer.bos, *pieces[0]]
    if add_eod:
        pieces[-1] = [*pieces[-1], tokenizer.eod]
    return [np.asarray(piece, dtype=np.int32) for piece in pieces]


class LineEncoder(Protocol):
    """One input line -> one document per output; ``ValueError`` rejects the line."""

    def __call__(self, raw: bytes) -> dict[str, np.ndarray | list[np.ndarray]]:
        """The line's document per output (a list: one document of several sequences)."""

    def outputs(self, prefix: str) -> dict[str, tuple[str, type]]:
        """Per output name: its dataset prefix (under ``--output-prefix``) and index dtype."""


class TextEncoder:
    """The pretraining encoder: ``<s> text </s>`` of every ``--json-keys`` key of a line (with
    --split-sentences, one sequence per sentence)."""

    def __init__(self, config: PreprocessConfig, tokenizer: Tokenizer) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.splitter = None
        if config.split_sentences:
            self.splitter = sentence_splitter(config.lang, config.keep_newlines)

    def __call__(self, raw: bytes) -> dict[str, np.ndarray | list[np.ndarray]]:
        texts = parse_line(raw, self.config.json_keys)
        return {key: self._encode(text) for key, text in texts.items()}

    def _encode(self, text: str) -> np.ndarray | list[np.ndarray]:
        config = self.config
        if self.splitter is not None:
            return encode_sentences(
                self.tokenizer, self.splitter(text), config.add_bos, config.add_eod
            )
        return encode_document(self.tokenizer, text, config.add_bos, config.add_eod)

    def outputs(self, prefix: str) -> dict[str, tuple[str, type]]:
        level = "sentence" if self.config.split_sentences else "document"
        dtype = index_dtype(self.tokenizer.vocab_size)
        return {key: (output_prefix(prefix, key, level), dtype) for key in self.config.json_keys}


def encode_chunk(chunk: list[Line]) -> list[tuple[int, int, dict | None, str | None]]:
    """(file, line, {output: ids} or None, rejection reason or None) for every line of the chunk."""
    encoder = _worker["encoder"]
    results = []
    for file_index, number, raw in chunk:
        try:
            arrays = encoder(raw)
        except ValueError as err:
            results.append((file_index, number, None, str(err)))
            continue
        results.append((file_index, number, arrays, None))
    return results


# -- writer side -------------------------------------------------------------------------------


def check_input_files(paths: Iterable[str | Path]) -> None:
    """Refuse ``--input`` names that are not files before any work: a directory or a missing
    name would otherwise read as input without a single line. fsspec URLs are left to their
    reader."""
    local = [Path(p) for p in paths if "://" not in str(p)]
    directories = [str(p) for p in local if p.is_dir()]
    if directories:
        raise ConfigError(
            f"--input {', '.join(directories)}: a directory, not a file (give its files, "
            "e.g. DIR/*.jsonl)"
        )
    missing = [str(p) for p in local if not p.is_file()]
    if missing:
        raise ConfigError(f"input file(s) not found: {', '.join(missing)}")


def require_documents(inputs: Iterable[str | Path], summary: Summary) -> None:
    """Refuse input without a single usable line, as every tokenizing tool does: megatron-core
    cannot open an empty dataset, and a run that kept nothing is a mistake to report, not a
    success."""
    if summary.documents:
        return
    names = ", ".join(str(p) for p in inputs)
    if not summary.rejected_lines:
        raise ConfigError(f"--input {names}: no lines; nothing written")
    reasons = ", ".join(f"{n} {reason}" for reason, n in summary.rejected.most_common())
    raise ConfigError(
        f"--input {names}: all {summary.rejected_lines} lines were rejected ({reasons}); "
        "nothing written"
    )


def check_inputs(config: PreprocessConfig) -> Tokenizer:
    """Fail before any work on missing inputs, an unknown tokenizer or a missing output
    directory, naming the flag."""
    check_input_files(config.inputs)
    if not config.json_keys:
        raise ConfigError("--json-keys needs at least one key")
    out_dir = Path(config.output_prefix).parent
    if not out_dir.is_dir():
        raise ConfigError(f"--output-prefix: directory {out_dir} does not exist")
    if config.keep_newlines and not config.split_sentences:
        raise ConfigError("--keep-newlines only applies with --split-sentences")
    if config.workers < 1:
        raise ConfigError(f"--workers {config.workers}: must be at least 1")
    if config.split_sentences:  # fails here, before any work, when nltk or its data is missing
        try:
            sentence_splitter(config.lang, config.keep_newlines)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return checked_tokenizer(config.tokenizer_type, config.tokenizer_model)


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


def preprocess(
    config: PreprocessConfig, encoder: Callable[[Tokenizer], LineEncoder] | None = None
) -> Summary:
    """Tokenize every input line into one indexed dataset per output of the encoder that
    ``encoder(tokenizer)`` builds (default: one per JSON key, :class:`TextEncoder`).

    ``ConfigError`` (nothing written) for bad flags, an unwritable output directory, or input
    without a single usable line: megatron-core cannot even open an empty dataset."""
    tokenizer = check_inputs(config)
    try:
        line_encoder = encoder(tokenizer) if encoder else TextEncoder(config, tokenizer)
    except ValueError as err:  # e.g. a tokenizer without the chat format's control tokens
        raise ConfigError(f"--tokenizer-model: {err}") from None
    outputs = line_encoder.outputs(config.output_prefix)
    finals = [f"{prefix}{suffix}" for prefix, _ in outputs.values() for suffix in (".bin", ".idx")]
    with atomic_outputs(*finals) as temporary:
        writers = _open_writers(config, outputs, temporary[::2])
        summary, key_tokens = _tokenize_all(config, line_encoder, outputs, writers)
        for writer, idx_path in zip(writers.values(), temporary[1::2]):
            writer.finalize(idx_path)
        require_documents(config.inputs, summary)
    record = tokenizer_record(config.tokenizer_type, tokenizer)
    for key, (prefix, dtype) in outputs.items():
        if dtype in TOKEN_DTYPES:
            per_key = Summary(documents=summary.documents, tokens=key_tokens[key])
            write_dataset_record(
                prefix, dataset_record(record, config.add_bos, config.add_eod, per_key)
            )
    return summary


TOKEN_DTYPES = (np.int32, np.uint16)
"""Outputs of these dtypes hold token ids (the others, e.g. loss masks, are not counted)."""


def _open_writers(
    config: PreprocessConfig, outputs: dict[str, tuple[str, type]], bin_paths: list[str]
) -> dict[str, IndexedDatasetWriter]:
    try:
        return {
            name: IndexedDatasetWriter(path, dtype=dtype)
            for (name, (_, dtype)), path in zip(outputs.items(), bin_paths)
        }
    except OSError as err:
        raise ConfigError(
            f"--output-prefix {config.output_prefix}: cannot write "
            f"{err.filename}: {err.strerror}"
        ) from None


def _tokenize_all(
    config: PreprocessConfig,
    line_encoder: LineEncoder,
    outputs: dict[str, tuple[str, type]],
    writers: dict[str, IndexedDatasetWriter],
) -> tuple[Summary, Counter]:
    """Encode every line (in worker processes for ``--workers`` > 1) and append its documents
    in input order."""
    counted = [name for name, (_, dtype) in outputs.items() if dtype in TOKEN_DTYPES]
    summary = Summary()
    key_tokens = Counter()
    chunks = _chunks(iter_lines(config.inputs), config.lines_per_task)
    start = time.perf_counter()
    with _pool(config, line_encoder) as pool, _progress_bar() as bar:
        results = pool.imap(encode_chunk, chunks) if pool else map(encode_chunk, chunks)
        for batch in results:
            for file_index, number, ids, reason in batch:
                if ids is None:
                    where = f"{config.inputs[file_index]}:{number}"
                    report_rejected(summary, where, reason, config.max_reported)
                    continue
                parts = {key: a if isinstance(a, list) else [a] for key, a in ids.items()}
                for key, sequences in parts.items():  # one document of one or more sequences
                    writers[key].add_document(
                        np.concatenate(sequences), [a.size for a in sequences]
                    )
                    key_tokens[key] += sum(a.size for a in sequences)
                summary.documents += 1
                summary.tokens += sum(a.size for name in counted for a in parts[name])
                if summary.documents % config.log_interval == 0:
                    _log_progress(summary, time.perf_counter() - start)
            bar.update(len(batch))
            rate = summary.tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
    return summary, key_tokens


@contextlib.contextmanager
def _progress_bar() -> Iterator:
    """A bar counting the lines, during which every log record (a rejected line, progress)
    starts a line of its own: on a terminal tqdm clears the bar, prints the record and redraws
    the bar; in a log file, where the bar's carriage returns erase nothing, a newline ends the
    bar's line first, so that ``grep FILE:LINE`` finds the first report as well as the others."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    class Bar(tqdm):
        @classmethod
        def write(cls, s: str, file=None, end: str = "\n", nolock: bool = False) -> None:
            stream = sys.stdout if file is None else file
            if not getattr(stream, "isatty", lambda: False)():
                s = "\n" + s
            super().write(s, file=file, end=end, nolock=nolock)

    with Bar(unit=" docs", desc="preprocess", mininterval=1.0) as bar:
        with logging_redirect_tqdm(tqdm_class=Bar):
            yield bar


def _log_progress(summary: Summary, elapsed: float) -> None:
    log.info(
        f"processed {summary.documents} documents ({summary.documents / elapsed:,.0f} docs/s, "
        f"{summary.tokens / elapsed:,.0f} tokens/s)"
    )


class _NoPool:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _pool(config: PreprocessConfig, encoder: LineEncoder):
    """Worker processes, or none (tokenize in this process) for ``--workers 1``.

    Workers are forked so that they inherit the encoder and its loaded tokenizer instead of
    each loading its own (about a second for tekken) and re-importing the entry point.
    """
    _worker.update(encoder=encoder)
    if config.workers <= 1:
        return _NoPool()
    return multiprocessing.get_context("fork").Pool(config.workers, initializer=die_with_parent)


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
    with atomic_outputs(prefix + RECORD_SUFFIX) as (temporary,):
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump(record, out, indent=1, sort_keys=True)


def format_summary(summary: Summary, elapsed: float) -> str:
    lines = [
        f"wrote {summary.documents} documents, {summary.tokens} tokens in {elapsed:.1f} s "
        f"({summary.tokens / max(elapsed, 1e-9):,.0f} tokens/s)",
        f"rejected {summary.rejected_lines} lines"
        + "".join(f"\n  {count:8d}  {reason}" for reason, count in summary.rejected.most_common()),
    ]
    return "\n".join(lines)
