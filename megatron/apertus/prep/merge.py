"""Merge indexed datasets into one, refusing parts made with different tokenizers or dtypes.

The merged ``.bin/.idx`` are megatron-core's ``IndexedDatasetBuilder.add_index`` of the parts in
order, so merging the per-task outputs of ``tools/tokenize_corpus.py`` gives, byte for byte,
what one ``tools/preprocess_data.py`` run over all inputs writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron.apertus.cli import atomic_outputs
from megatron.apertus.data.indexed import (
    RECORD_SUFFIX,
    describe_tokenizer,
    read_dataset_record,
    read_index,
    same_tokenizer,
)
from megatron.apertus.errors import ConfigError
from megatron.apertus.flags import flag_help, switch
from megatron.apertus.prep.preprocess import write_dataset_record


class MergeError(ConfigError):
    """Parts that cannot be merged; the message names the part."""


@dataclass(kw_only=True, frozen=True)
class MergeOptions:
    """``tools/merge_datasets.py``'s flags: Megatron-LM's, and the check this merge adds."""

    input: str = flag_help("directory holding the .bin/.idx pairs to merge")
    output_prefix: str = flag_help("writes OUTPUT_PREFIX.bin/.idx (and .meta.json)")
    no_tokenizer_check: bool = switch(
        "merge parts that have no .meta.json (their tokenizer is unknown; dtypes, and the "
        "tokenizers of the parts that have one, are still checked)",
        ours=True,
    )


def dataset_prefixes(folder: str | os.PathLike) -> list[str]:
    """The prefixes of the ``.bin/.idx`` pairs directly in ``folder``, sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MergeError(f"{folder} is not a directory")
    prefixes = []
    for idx in sorted(folder.glob("*.idx")):
        if idx.name.endswith(".tmp.idx"):
            continue
        prefix = str(idx.with_suffix(""))
        if not Path(prefix + ".bin").is_file():
            raise MergeError(f"{idx} has no {Path(prefix).name}.bin")
        prefixes.append(prefix)
    return prefixes


def index_dtype_of(prefix: str) -> np.dtype:
    """The token dtype of ``prefix``, a part of ``--input``: refused when damaged."""
    return np.dtype(read_index("--input", prefix).dtype)


def check_compatible(prefixes: list[str], *, require_records: bool = True) -> dict | None:
    """The shared record of ``prefixes`` (None when some have none); refuse any mismatch:
    of dtype, and between the records there are (:func:`check_records`). Without
    ``require_records`` parts without a record are let through unchecked."""
    if not prefixes:
        raise MergeError("nothing to merge: no .bin/.idx pairs")
    dtypes = {p: index_dtype_of(p) for p in prefixes}
    first = prefixes[0]
    for prefix, dtype in dtypes.items():
        if dtype != dtypes[first]:
            raise MergeError(f"{prefix}: dtype {dtype} differs from {first}'s {dtypes[first]}")
    records = {prefix: read_dataset_record(prefix) for prefix in prefixes}
    unknown = [prefix for prefix, record in records.items() if record is None]
    if unknown and require_records:
        raise MergeError(
            f"{unknown[0]}{RECORD_SUFFIX} is missing: the tokenizer of {unknown[0]} is "
            "unknown (--no-tokenizer-check merges anyway)"
        )
    check_records(prefixes)
    if unknown:
        return None
    return records[first] | {
        "documents": sum(r["documents"] for r in records.values()),
        "tokens": sum(r["tokens"] for r in records.values()),
    }


def check_records(prefixes: list[str]) -> None:
    """Refuse datasets whose records name different tokenizers (:func:`same_tokenizer`: the
    file's hash) or ``<s>``/``</s>`` rules; those without a record are not compared."""
    records = {p: r for p in prefixes if (r := read_dataset_record(p)) is not None}
    if not records:
        return
    first, ours = next(iter(records.items()))
    for prefix, record in records.items():
        if not same_tokenizer(ours["tokenizer"], record["tokenizer"]):
            raise MergeError(
                f"{prefix} was tokenized with {describe_tokenizer(record['tokenizer'])}, "
                f"{first} with {describe_tokenizer(ours['tokenizer'])}: datasets of different "
                "tokenizers do not mix"
            )
        for key in ("add_bos", "add_eod"):
            if record[key] != ours[key]:
                raise MergeError(
                    f"{prefix}: {key} {record[key]} differs from {first}'s {ours[key]}"
                )


def merge(prefixes: list[str], output_prefix: str, *, require_records: bool = True) -> int:
    """Write the concatenation of ``prefixes`` to ``output_prefix``; its number of documents.

    megatron-core (and with it torch, 5-8 s) is imported only once the parts are checked and the
    outputs can be written: a refusal costs no start-up."""
    record = check_compatible(prefixes, require_records=require_records)
    if not Path(output_prefix).parent.is_dir():
        raise MergeError(f"--output-prefix directory {Path(output_prefix).parent} does not exist")
    with atomic_outputs(f"{output_prefix}.bin", f"{output_prefix}.idx") as (bin_path, idx_path):
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

        builder = IndexedDatasetBuilder(bin_path, dtype=index_dtype_of(prefixes[0]).type)
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(idx_path)
    if record is not None:
        write_dataset_record(output_prefix, {k: v for k, v in record.items() if k != "rejected"})
    return len(IndexedDataset(output_prefix))
