"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) written with numpy alone.

The bytes are exactly those of megatron-core's ``IndexedDatasetBuilder`` (tested against it);
reading stays megatron-core's. The writer exists because importing megatron-core's
``indexed_dataset`` module runs ``megatron.core``'s package import, which loads torch and the
parallel layers: 5 s on an idle machine and 15 s or more on a loaded login node, longer than
tokenizing a small corpus, for a tool that needs none of it.

Format (megatron-core ``indexed_dataset._IndexWriter``): the header ``MMIDIDX\\0\\0``, version 1
(``<Q``), the dtype code (``<B``), the number of sequences and of document boundaries (``<Q``
each), then the sequence lengths (int32), the byte offset of each sequence in the ``.bin``
(int64) and the document boundaries as sequence indices starting with 0 (int64).
"""

from __future__ import annotations

import struct
from typing import BinaryIO

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
"""megatron-core's ``DType`` enum."""


class IndexedDatasetWriter:
    """Documents of one or more sequences appended to a ``.bin``; the ``.idx`` at the end."""

    def __init__(self, bin_path: str, dtype: type = np.int32) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"no indexed-dataset code for dtype {dtype}")
        self.dtype = dtype
        self.data_file: BinaryIO = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens: np.ndarray, lengths: list[int]) -> None:
        """One document: ``tokens`` holds its sequences back to back, of ``lengths``."""
        self.data_file.write(np.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the index to ``idx_path``."""
        self.data_file.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        itemsize = np.dtype(self.dtype).itemsize
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
        with open(idx_path, "wb") as index:
            index.write(INDEX_HEADER)
            index.write(struct.pack("<Q", 1))
            index.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            index.write(struct.pack("<Q", len(lengths)))
            index.write(struct.pack("<Q", len(self.document_indices)))
            index.write(lengths.tobytes(order="C"))
            index.write(pointers.tobytes(order="C"))
            index.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))

    def close(self) -> None:
        """Close the ``.bin`` without an index (the output is abandoned)."""
        self.data_file.close()
