"""A Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) read only once it is whole.

megatron-core's index reader asserts on a wrong header and fails inside numpy on an index cut
short; a ``.bin`` shorter or longer than its index describes is not noticed at all until a
sample beyond its end is read (or, in a merge, silently shifts every later part). Every reader
of the package (training's ``--data-path``, the merge, the mixture and ``--data-path`` list
tools) goes through :func:`read_index`, which refuses such a pair in one line naming the file:
the index's arrays must fit in the ``.idx`` and the ``.bin`` must hold exactly the bytes the
index points to, which costs reading the index's last pointer, not the data.

``PREFIX.meta.json``, the record the preprocessing tools write beside the pair, is read here
too (:func:`read_dataset_record`): merges and mixtures compare the records of their parts
(:func:`same_tokenizer`), and training refuses data whose record names another tokenizer than
its own or a larger vocabulary than its tokenizer's (:func:`check_tokenizer`). A tokenizer's
identity is the SHA-256 of its file; records written before they held it are compared by what
they hold (training then checks the vocabulary size only).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.apertus.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import _IndexReader

REPAIR = "write it again with the tool that made it (tools/preprocess_*.py)"
RECORD_SUFFIX = ".meta.json"
"""``PREFIX.meta.json`` sits beside ``PREFIX.bin/.idx`` (the preprocessing tools write it): which
tokenizer and document rules made the dataset, so that merges and mixtures can refuse parts
that do not belong together, and training data of another vocabulary."""
RECORD_KEYS = ("tokenizer", "add_bos", "add_eod", "documents", "tokens")
"""What a record must hold to be read."""


def _named(source: str, text: str) -> str:
    return f"{source}: {text}" if source else text


def check_pair_exists(source: str, prefix: str) -> None:
    """Refuse a prefix whose ``.bin`` or ``.idx`` (or both) is missing."""
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    if not bin_path.is_file() and not idx_path.is_file():
        hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise ConfigError(_named(source, f"neither {bin_path} nor {idx_path} exists{hint}"))
    for missing, present in ((bin_path, idx_path), (idx_path, bin_path)):
        if not missing.is_file():
            raise ConfigError(
                _named(source, f"{missing} is missing ({present} is there); {REPAIR}")
            )


def read_index(source: str, prefix: str) -> _IndexReader:
    """megatron-core's reader of ``prefix``'s index, refused in one line (prefixed with
    ``source``, the flag or folder it came from) when either file is missing or damaged."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, _IndexReader

    check_pair_exists(source, prefix)
    idx_path, bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
    with idx_path.open("rb") as stream:
        if stream.read(len(_INDEX_HEADER)) != _INDEX_HEADER:
            raise ConfigError(
                _named(
                    source,
                    f"{idx_path} is not a Megatron index file (wrong header: truncated or "
                    "another format)",
                )
            )
    try:
        index = _IndexReader(str(idx_path), multimodal=False)
    except (AssertionError, ValueError, KeyError, struct.error) as err:
        raise ConfigError(
            _named(source, f"{idx_path} is damaged or cut short ({err}); {REPAIR}")
        ) from None
    expected, found = data_bytes(index), bin_path.stat().st_size
    if found != expected:
        raise ConfigError(
            _named(
                source,
                f"{bin_path} is damaged: {found} bytes, but {idx_path.name} describes "
                f"{expected}; {REPAIR}",
            )
        )
    return index


def data_bytes(index: _IndexReader) -> int:
    """The size of the ``.bin`` that ``index`` describes: its last sequence's end."""
    if index.sequence_count == 0:
        return 0
    return int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size


def read_dataset_record(prefix: str) -> dict | None:
    """The record of ``prefix``, or None for a dataset written without one; one that is not a
    JSON object (damaged, or another file under its name) is refused naming it."""
    path = Path(prefix + RECORD_SUFFIX)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is damaged (not JSON: {err}); {REPAIR}") from None
    missing = [key for key in RECORD_KEYS if not isinstance(record, dict) or key not in record]
    if missing:
        raise ConfigError(f"{path} is damaged (no {', '.join(missing)}); {REPAIR}")
    return record


def same_tokenizer(ours: dict, theirs: dict) -> bool:
    """Whether two records' tokenizers are one: the same file content (SHA-256), whatever its
    name; a record without the hash (written before records held it) by the fields both
    hold."""
    if "sha256" in ours and "sha256" in theirs:
        return ours["sha256"] == theirs["sha256"]
    return all(ours[key] == theirs[key] for key in ours.keys() & theirs.keys())


def describe_tokenizer(made: dict) -> str:
    """``TekkenTokenizer tekken.json (sha256 0123456789ab)``: a record's tokenizer in a line."""
    digest = f" (sha256 {made['sha256'][:12]})" if "sha256" in made else ""
    return f"{made.get('type')} {made.get('file')}{digest}"


@functools.cache
def file_sha256(path: Path) -> str:
    """The SHA-256 of a tokenizer file (once per run: a blend may list thousands of prefixes)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_tokenizer(
    source: str, prefix: str, vocab_size: int, tokenizer_file: Path | None = None
) -> None:
    """Refuse a dataset whose record says it was tokenized with another tokenizer than the
    run's (``tokenizer_file``, None for a tokenizer without a file: ids only), or with a larger
    vocabulary (``vocab_size``): its ids would mean other tokens, or index past the embedding
    table (an ``IndexError`` on the CPU, a device-side assert on a GPU, at the first batch). A
    dataset without a record, or whose record predates the tokenizer's hash, is checked for
    what can be: its vocabulary size, or nothing."""
    record = read_dataset_record(prefix)
    if record is None:
        return
    made = record["tokenizer"]
    again = (
        "preprocess it again with this run's --tokenizer-type and --tokenizer-model, or train "
        "with the tokenizer it was made with"
    )
    if made.get("vocab_size", 0) > vocab_size:
        raise ConfigError(
            _named(
                source,
                f"{prefix} was tokenized with {made.get('type')} {made.get('file')} "
                f"({made['vocab_size']} ids, {prefix}{RECORD_SUFFIX}), but this run's "
                f"tokenizer has {vocab_size}: {again}",
            )
        )
    if tokenizer_file is not None and "sha256" in made:
        run_hash = file_sha256(Path(tokenizer_file).resolve())
        if made["sha256"] != run_hash:
            raise ConfigError(
                _named(
                    source,
                    f"{prefix} was tokenized with {describe_tokenizer(made)} "
                    f"({prefix}{RECORD_SUFFIX}), but this run's tokenizer is {tokenizer_file} "
                    f"(sha256 {run_hash[:12]}): {again}",
                )
            )
