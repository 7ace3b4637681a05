"""A Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) read only once it is whole.

megatron-core's index reader asserts on a wrong header and fails inside numpy on an index cut
short; a ``.bin`` shorter or longer than its index describes is not noticed at all until a
sample beyond its end is read (or, in a merge, silently shifts every later part). Every reader
of the package (training's ``--data-path``, the merge, the mixture and ``--data-path`` list
tools) goes through :func:`read_index`, which refuses such a pair in one line naming the file:
the index's arrays must fit in the ``.idx`` and the ``.bin`` must hold exactly the bytes the
index points to, which costs reading the index's last pointer, not the data.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

from megatron.apertus.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import _IndexReader

REPAIR = "preprocess it again with tools/preprocess_data.py"


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
