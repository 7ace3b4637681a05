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
from megatron.apertus.data.indexed import RECORD_SUFFIX, read_dataset_record, read_index
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
        "merge parts that have no .meta.json (their tokenizer is unknown; dtypes are still "
        "checked)",
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
    """The shared record of ``prefixes`` (None when unchecked); refuse any mismatch."""
    if not prefixes:
        raise MergeError("nothing to merge: no .bin/.idx pairs")
    dtypes = {p: index_dtype_of(p) for p in prefixes}
    first = prefixes[0]
    for prefix, dtype in dtypes.items():
        if dtype != dtypes[first]:
            raise MergeError(f"{prefix}: dtype {dtype} differs from {first}'s {dtypes[first]}")
    if not require_records:
        return None
    records = {}
    for prefix in prefixes:
        records[prefix] = read_dataset_record(prefix)
        if records[prefix] is None:
            raise MergeError(
                f"{prefix}{RECORD_SUFFIX} is missing: the tokenizer of {prefix} is "
                "unknown (--no-tokenizer-check merges anyway)"
            )
    keys = ("tokenizer", "add_bos", "add_eod")
    for prefix, record in records.items():
        for key in keys:
            if record[key] != records[first][key]:
                raise MergeError(
                    f"{prefix}: {key} {record[key]} differs from {first}'s "
                    f"{records[first][key]}"
                )
    return records[first] | {
        "documents": sum(r["documents"] for r in records.values()),
        "tokens": sum(r["tokens"] for r in records.values()),
    }


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
