"""Codec of one block of teacher top-k distributions: numpy arrays <-> compressed bytes.

A *row* is one token position: k distinct vocabulary ids and their teacher log-probabilities
(log-softmax over the full vocabulary), t_i = exp(logprob_i), S = sum_i t_i <= 1. The layout,
the error bound and the measurements behind each choice are in ``docs/teacher_logits.md``.

* **Ids.** A per-block *rank table* lists every id that occurs in the block, most frequent
  first; rows store ranks, not ids, so the ids a teacher proposes everywhere (punctuation,
  frequent words) become small numbers. Each row is sorted by rank and stored as differences
  d_0 = r_0 + 1, d_j = r_j - r_{j-1} >= 1, as 16 bits in two byte planes (low bytes, then high
  bytes; the high plane is nearly free when the differences are small); 65535 is an escape whose
  excess sits in a uint32 escape stream, for blocks with more than 65535 distinct ids. Decoding
  is a shift, an or, one cumulative sum and one gather through the table (shifted by one so that
  no ``- 1`` pass is needed).
* **Probabilities.** The row is renormalised over its top-k, p_i = t_i / S, and coded as
  c_i = round(L * sqrt(p_i)) in one byte (L = ``levels``). KL(p || p') ~ 2 sum (sqrt p - sqrt p')^2
  (the Fisher metric is flat in sqrt p), so a uniform grid in sqrt p spends its resolution where
  the KL is sensitive: fine for the head, coarse for the tail. Each code decodes to the mean of
  the p that were coded to it in this block (a 256-entry *centroid table*), the value that
  minimises the generalised KL of the bin; the decoded row is renormalised and scaled back to
  the stored mass S. The mass outside the top-k, 1 - S, is stored as float16, so the decoded
  probabilities sum to the teacher's S (to float16 precision of 1 - S): the "rest bucket" of
  the distillation loss keeps the teacher's tail, and KL(p || p') is the only other error.
* **Bytes.** Every multi-byte stream is split into byte planes (all low bytes, then all high
  bytes) before zstd: the planes have very different statistics and zstd's entropy stage
  codes each well. Each sample is three zstd frames (rank differences; probability codes;
  float16 rest masses and escapes), so a reader decodes only the samples it needs and each
  stream gets its own entropy tables.

Invariants: rows are sorted by rank (not by id); decoded ids are exactly the stored set;
decoded probabilities are > 0 wherever the teacher's were and sum to 1 - rest.
This module is numpy + zstandard only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import zstandard

ESCAPE = 0xFFFF
"""A 16-bit rank difference of 65535 means: the difference is 65535 + the next escape value."""
MAX_EXCESS_MASS = 1e-2
"""Top-k probabilities may sum above 1 by rounding in low-precision teachers, not by more."""
_local = threading.local()  # zstd contexts are not thread-safe, and cost ~10 us to create


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


@dataclass(frozen=True)
class CodecParams:
    """The codec settings a store records in its header."""

    levels: int = 255
    """Grid of sqrt(p): codes 0..levels, step 1/levels (<= 255: one byte per value)."""
    zstd_level: int = 3
    """zstd compression level (decoding speed hardly depends on it)."""

    def __post_init__(self) -> None:
        if not 15 <= self.levels <= 255:
            raise ValueError(f"levels must be in [15, 255] (one byte per code), got {self.levels}")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level must be in [1, 22], got {self.zstd_level}")


class EncodedBlock(NamedTuple):
    """A block's shared tables and each sample's payload of three zstd frames."""

    tables: bytes
    """zstd frame: the centroid table (levels + 1 float32) and the rank table (uint32 ids)."""
    table_size: int
    """Number of ids in the rank table."""
    payloads: list[bytes]
    frame_sizes: np.ndarray
    """uint32 [n, 2]: sizes of the first two frames of each payload (the third is the rest)."""
    escapes: np.ndarray
    """uint32 [n]: number of escaped rank differences of each sample."""


def _planes(array: np.ndarray) -> bytes:
    """Byte planes of a little-endian array: every element's byte 0, then every byte 1, ..."""
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return array.view(np.uint8).reshape(-1, array.itemsize).T.tobytes()


def _unplanes(buffer: memoryview | bytes, dtype: np.dtype, count: int) -> np.ndarray:
    dtype = np.dtype(dtype).newbyteorder("<")
    planes = np.frombuffer(buffer, np.uint8, count * dtype.itemsize).reshape(dtype.itemsize, count)
    out = np.empty((count, dtype.itemsize), np.uint8)
    for byte, plane in enumerate(
        planes
    ):  # a long strided copy per plane: ~3x faster than .T.copy()
        out[:, byte] = plane
    return out.view(dtype).reshape(count)


def default_centroids(levels: int) -> np.ndarray:
    """Mean of p = u^2 for u = sqrt(p) uniform in bin c: (c^2 + 1/12) / L^2 (bin 0 is [0, 1/2L])."""
    codes = np.arange(levels + 1, dtype=np.float64)
    return ((codes**2 + 1 / 12) / levels**2).astype(np.float32)


class RowError(ValueError):
    """Invalid input at one row; ``row`` is the flat row index inside the block."""

    def __init__(self, row: int, message: str) -> None:
        super().__init__(message)
        self.row = row


def _first_bad_row(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0])


def _rank_table(ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The block's ids by decreasing count (ties by id), and the rank of every vocabulary id."""
    counts = np.bincount(ids.ravel(), minlength=vocab_size)
    present = np.flatnonzero(counts)
    table = present[np.argsort(-counts[present], kind="stable")].astype(np.uint32)
    rank_of = np.zeros(vocab_size, dtype=np.int32)  # halves the sort's memory traffic
    rank_of[table] = np.arange(len(table))
    return table, rank_of


def _sort_rows(ranks: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by rank, ``values`` permuted alike."""
    order = np.argsort(ranks, axis=1)
    return np.take_along_axis(ranks, order, axis=1), np.take_along_axis(values, order, axis=1)


def _check_inputs(ids: np.ndarray, logprobs: np.ndarray, vocab_size: int) -> None:
    if ids.shape != logprobs.shape or ids.ndim != 2:
        raise ValueError(f"ids {ids.shape} and logprobs {logprobs.shape} must both be [rows, k]")
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        row = _first_bad_row(outside)
        raise RowError(
            row, f"ids outside the vocabulary [0, {vocab_size}): {ids[row][outside[row]][:4]}"
        )
    not_finite = np.isnan(logprobs) | (logprobs == np.inf)
    if not_finite.any():
        raise RowError(_first_bad_row(not_finite), "log-probabilities are NaN or +inf")


def encode_block(
    ids: np.ndarray, logprobs: np.ndarray, *, samples: int, vocab_size: int, params: CodecParams
) -> EncodedBlock:
    """Encode ``samples`` samples given as rows: ids and log-probabilities of shape [rows, k]
    (rows = samples * positions, sample-major). Raises :class:`RowError` on invalid rows."""
    ids = np.asarray(ids).astype(np.int64, copy=False)
    logprobs = np.asarray(logprobs, dtype=np.float32)
    _check_inputs(ids, logprobs, vocab_size)
    rows, k = ids.shape
    table, rank_of = _rank_table(ids, vocab_size)
    probs = np.exp(logprobs)
    mass = probs.sum(axis=1, dtype=np.float64)
    if (mass > 1 + MAX_EXCESS_MASS).any() or (mass <= 0).any():
        row = int(np.flatnonzero((mass > 1 + MAX_EXCESS_MASS) | (mass <= 0))[0])
        raise RowError(row, f"top-k probabilities sum to {mass[row]:.6g}: not a log-softmax")
    ranks, probs = _sort_rows(rank_of[ids], probs)
    diffs = np.diff(ranks, axis=1, prepend=-1)
    if (diffs[:, 1:] == 0).any():
        raise RowError(_first_bad_row(diffs == 0), "repeated ids in one row")
    rest = np.clip(1.0 - mass, 0.0, 1.0).astype(np.float16)
    codes, centroids = _quantise(probs / mass.astype(np.float32)[:, None], params.levels)
    compressor = zstandard.ZstdCompressor(level=params.zstd_level)
    tables = compressor.compress(_planes(centroids) + _planes(table))
    per_sample = rows // samples
    payloads, sizes = [], np.zeros((samples, 2), dtype=np.uint32)
    escapes = np.zeros(samples, dtype=np.uint32)
    for s in range(samples):
        part = slice(s * per_sample, (s + 1) * per_sample)
        frames, escapes[s] = _sample_frames(diffs[part], codes[part], rest[part], compressor)
        sizes[s] = len(frames[0]), len(frames[1])
        payloads.append(b"".join(frames))
    return EncodedBlock(tables, len(table), payloads, sizes, escapes)


def _quantise(p: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes round(L sqrt p) and the block's centroid table (mean p per code)."""
    codes = np.rint(np.sqrt(p) * levels).astype(np.uint8)
    flat = codes.ravel()
    counts = np.bincount(flat, minlength=levels + 1)
    sums = np.bincount(flat, weights=p.ravel(), minlength=levels + 1)
    centroids = default_centroids(levels)
    used = counts > 0
    centroids[used] = (sums[used] / counts[used]).astype(np.float32)
    # A bin holding only exact zeros (log-probability -inf) decodes to 0, which is exact.
    return codes, centroids


def _sample_frames(
    diffs: np.ndarray, codes: np.ndarray, rest: np.ndarray, compressor: zstandard.ZstdCompressor
) -> tuple[list[bytes], int]:
    escaped = diffs >= ESCAPE
    short = np.minimum(diffs, ESCAPE).astype(np.uint16)
    excess = (diffs[escaped] - ESCAPE).astype(np.uint32)
    streams = [_planes(short), codes.tobytes(), _planes(rest) + _planes(excess)]
    return [compressor.compress(stream) for stream in streams], len(excess)


class BlockDecoder:
    """Decodes the samples of one block; holds its tables, built once per block."""

    def __init__(self, tables: bytes, table_size: int, *, positions: int, k: int, levels: int):
        raw = _decompressor().decompress(tables)
        expected = 4 * (levels + 1) + 4 * table_size
        if len(raw) != expected:
            raise ValueError(f"tables decode to {len(raw)} bytes, expected {expected}")
        self.centroids = _unplanes(raw, np.float32, levels + 1)
        # Entry 0 is a placeholder: cumulative sums of the differences are rank + 1.
        ids = _unplanes(memoryview(raw)[4 * (levels + 1) :], np.uint32, table_size)
        self.table = np.concatenate([[0], ids.astype(np.int64)])
        self.positions, self.k = positions, k

    def decode(
        self,
        payload: bytes,
        frame_sizes: tuple[int, int],
        escapes: int,
        ids: np.ndarray,
        probs: np.ndarray,
    ) -> None:
        """Decode one sample's payload into ``ids`` (int64 [T, k]) and ``probs`` (float32
        [T, k]), contiguous arrays owned by the caller (e.g. slices of a pinned batch)."""
        t, n = self.positions, self.positions * self.k
        view = memoryview(payload)
        first, second = frame_sizes
        planes = self._stream(view[:first], 2 * n)
        codes = self._stream(view[first : first + second], n)
        extra = self._stream(view[first + second :], 2 * t + 4 * escapes)
        diffs = planes[n:].astype(np.int32)
        diffs <<= 8
        diffs |= planes[:n]
        if escapes:
            excess = _unplanes(memoryview(extra)[2 * t :], np.uint32, escapes)
            diffs[np.flatnonzero(diffs == ESCAPE)] += excess.astype(np.int32)
        ranks = np.cumsum(diffs.reshape(t, self.k), axis=1, dtype=np.int32)
        if ranks[:, -1].max(initial=0) >= len(self.table):
            raise ValueError("rank outside the block's table")
        # mode="clip" (indices are checked above or are bytes): with the default "raise" numpy
        # buffers ``out`` and the gathers run 5-10x slower.
        np.take(self.table, ranks, out=ids, mode="clip")
        np.take(self.centroids, codes.reshape(t, self.k), out=probs, mode="clip")
        rest = _unplanes(extra, np.float16, t)
        probs *= ((1 - rest.astype(np.float32)) / probs.sum(axis=1))[:, None]

    @staticmethod
    def _stream(frame: memoryview, size: int) -> np.ndarray:
        raw = _decompressor().decompress(frame, max_output_size=size)
        if len(raw) != size:
            raise ValueError(f"a frame decodes to {len(raw)} bytes, expected {size}")
        return np.frombuffer(raw, np.uint8)


# -- sampled rows: distinct token ids drawn from the teacher and how often each was drawn --------


MAX_DRAWS = 0xFFFF
"""Draws per position of a sampled store: a count and a row length fit 16 bits."""


def encode_sampled_block(
    draws: np.ndarray, *, samples: int, vocab_size: int, zstd_level: int
) -> EncodedBlock:
    """Encode ``samples`` samples of sampled rows: ``draws`` int [rows, N], N token ids drawn
    i.i.d. from the teacher at each position (rows = samples * positions, sample-major).

    Each row is stored as its distinct ids (rank differences, as for top-k) and the count of
    each; the counts sum to N. Per sample, three zstd frames: the number of distinct ids of
    every row (uint16 planes), the rank differences (uint16 planes), the counts - 1 (uint16
    planes) followed by the escape excesses. The tables frame holds the rank table only."""
    draws = np.asarray(draws).astype(np.int64, copy=False)
    if draws.ndim != 2 or not 1 <= draws.shape[1] <= MAX_DRAWS:
        raise ValueError(f"draws must be [rows, N] with 1 <= N <= {MAX_DRAWS}, got {draws.shape}")
    outside = (draws < 0) | (draws >= vocab_size)
    if outside.any():
        row = _first_bad_row(outside)
        raise RowError(
            row,
            f"drawn ids outside the vocabulary [0, {vocab_size}): "
            f"{draws[row][outside[row]][:4]}",
        )
    rows, n = draws.shape
    ordered = np.sort(draws, axis=1)
    first = np.ones_like(ordered, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    distinct = first.sum(axis=1)
    unique_ids = ordered[first]  # row-major: each row's distinct ids, ascending
    starts = np.flatnonzero(first.ravel())
    counts = np.diff(np.append(starts, rows * n))
    table, rank_of = _rank_table(unique_ids, vocab_size)
    ranks = rank_of[unique_ids]
    row_of = np.repeat(np.arange(rows), distinct)
    order = np.lexsort((ranks, row_of))  # each row sorted by rank
    ranks, counts = ranks[order], counts[order]
    row_start = np.concatenate([[0], np.cumsum(distinct)[:-1]])
    diffs = np.diff(ranks, prepend=-1)
    diffs[row_start] = ranks[row_start] + 1
    compressor = zstandard.ZstdCompressor(level=zstd_level)
    tables = compressor.compress(_planes(table))
    per_sample = rows // samples
    payloads, sizes = [], np.zeros((samples, 2), dtype=np.uint32)
    escapes = np.zeros(samples, dtype=np.uint32)
    bounds = np.concatenate([[0], np.cumsum(distinct)])
    for s in range(samples):
        lo, hi = bounds[s * per_sample], bounds[(s + 1) * per_sample]
        part = slice(s * per_sample, (s + 1) * per_sample)
        d = diffs[lo:hi]
        escaped = d >= ESCAPE
        excess = (d[escaped] - ESCAPE).astype(np.uint32)
        streams = [
            _planes(distinct[part].astype(np.uint16)),
            _planes(np.minimum(d, ESCAPE).astype(np.uint16)),
            _planes((counts[lo:hi] - 1).astype(np.uint16)) + _planes(excess),
        ]
        frames = [compressor.compress(stream) for stream in streams]
        sizes[s] = len(frames[0]), len(frames[1])
        escapes[s] = len(excess)
        payloads.append(b"".join(frames))
    return EncodedBlock(tables, len(table), payloads, sizes, escapes)


def padding_ids(ids: np.ndarray, distinct: np.ndarray, vocab_size: int) -> np.ndarray:
    """For rows ``ids [T, N]`` whose first ``distinct[r]`` entries are distinct ids, the
    smallest ids not in the row, [T, N] (entry j is the j-th of them): the row's free slots
    take these with weight 0, so every row's ids stay distinct, as the loss requires."""
    t, n = ids.shape
    candidates = np.arange(min(2 * n, vocab_size), dtype=np.int64)
    used = np.arange(n)[None, :] < distinct[:, None]
    member = ((candidates[None, :, None] == ids[:, None, :]) & used[:, None, :]).any(axis=2)
    free_first = np.argsort(member, axis=1, kind="stable")[:, :n]
    return candidates[free_first]


class SampledBlockDecoder:
    """Decodes the sampled rows of one block; holds its rank table."""

    def __init__(
        self, tables: bytes, table_size: int, *, positions: int, draws: int, vocab_size: int
    ) -> None:
        raw = _decompressor().decompress(tables)
        if len(raw) != 4 * table_size:
            raise ValueError(f"tables decode to {len(raw)} bytes, expected {4 * table_size}")
        ids = _unplanes(raw, np.uint32, table_size)
        self.table = np.concatenate([[0], ids.astype(np.int64)])
        self.positions, self.draws, self.vocab_size = positions, draws, vocab_size

    def decode(
        self,
        payload: bytes,
        frame_sizes: tuple[int, int],
        escapes: int,
        ids: np.ndarray,
        probs: np.ndarray,
    ) -> None:
        """Decode one sample into ``ids`` (int64 [T, N]) and ``probs`` (float32 [T, N]): each
        row's distinct ids with weight count / N, then padding ids (:func:`padding_ids`) with
        weight 0. Returns nothing; the number of distinct ids of row r is the count of its
        non-zero weights."""
        t, n = self.positions, self.draws
        view = memoryview(payload)
        first, second = frame_sizes
        distinct = _unplanes(self._stream(view[:first], 2 * t), np.uint16, t).astype(np.int64)
        if distinct.min(initial=1) < 1 or distinct.max(initial=1) > n:
            raise ValueError(f"a row holds outside [1, {n}] distinct ids")
        total = int(distinct.sum())
        diffs = _unplanes(
            self._stream(view[first : first + second], 2 * total), np.uint16, total
        ).astype(np.int64)
        extra = self._stream(view[first + second :], 2 * total + 4 * escapes)
        counts = _unplanes(extra, np.uint16, total).astype(np.int64) + 1
        if escapes:
            excess = _unplanes(memoryview(extra)[2 * total :], np.uint32, escapes)
            diffs[np.flatnonzero(diffs == ESCAPE)] += excess.astype(np.int64)
        row_start = np.concatenate([[0], np.cumsum(distinct)[:-1]])
        cumulative = np.cumsum(diffs)
        ranks = cumulative - np.repeat(cumulative[row_start] - diffs[row_start], distinct)
        if ranks.max(initial=0) >= len(self.table) or ranks.min(initial=1) < 1:
            raise ValueError("rank outside the block's table")
        if not np.array_equal(np.add.reduceat(counts, row_start), np.full(t, n)):
            raise ValueError(f"a row's counts do not sum to {n} draws")
        used = np.arange(n)[None, :] < distinct[:, None]
        ids[used] = self.table[ranks]
        probs[...] = 0.0
        probs[used] = counts / np.float32(n)
        ids[~used] = padding_ids(ids, distinct, self.vocab_size)[
            np.arange(n)[None, :] < (n - distinct)[:, None]
        ]

    _stream = staticmethod(BlockDecoder._stream)
