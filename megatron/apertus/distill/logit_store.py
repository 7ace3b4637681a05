"""Teacher top-k logits on disk: written once by the teacher, read by every student.

A store is a directory (byte layout and rationale: ``docs/teacher_logits.md``)::

    STORE/header.json                 format, version, k, vocabulary, sequence length, number of
                                      samples, samples per block, teacher, dataset hash, codec
    STORE/blocks/block-00000042.bin   samples [42 * spb, 43 * spb) in consumption order
    STORE/index.bin                   written by finalize: per block its size and checksum, per
                                      sample its key (fingerprint of its tokens)

*Positions* are sample indices in consumption order, i.e. the student's training-dataset index:
a data-parallel rank reads the positions of its micro-batches, whatever the data-parallel size.
Block ``b`` holds positions ``b * samples_per_block ...``: position -> (block, slot) is
arithmetic, the block's directory gives the slot's byte range, so access is O(1) and a reader
decodes only the samples it asks for.

Invariants:

* Writes are atomic (``*.tmp`` + fsync + rename): a block file under its final name is complete,
  so a restarted writer skips it (``pending_blocks``); stale ``*.tmp`` files are removed.
* Rank r of w writers owns the blocks ``b % w == r``: ranks never touch the same file.
* Every block carries a blake2b digest of its metadata, which holds a crc32 of each sample's
  payload; the index repeats the digests and file sizes. Any corruption or mismatch raises
  :class:`LogitStoreError` naming the file, block and sample position.
* No pickle anywhere: JSON and fixed little-endian binary layouts.

The writer and the codec are numpy-only; torch is imported by the reader, which returns tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import numbers
import os
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from megatron.apertus.distill.logit_codec import (
    MAX_DRAWS,
    BlockDecoder,
    CodecParams,
    RowError,
    SampledBlockDecoder,
    encode_block,
    encode_sampled_block,
)
from megatron.apertus.errors import ConfigError

if TYPE_CHECKING:
    import torch

FORMAT = "apertus-teacher-topk"
FORMAT_VERSION = 1
CODEC = "rank-diff8+sqrt8/zstd"
SAMPLED_CODEC = "rank-diff16+count16/zstd"
KINDS = ("topk", "sampled")
"""``topk``: the teacher's k most likely ids and their probabilities. ``sampled``: N ids drawn
i.i.d. from the teacher's distribution, stored as the distinct ids and their counts (an
unbiased estimate of the distribution; docs/distillation.md)."""
CODECS = {"topk": CODEC, "sampled": SAMPLED_CODEC}
BLOCK_TOKENS = 131072
"""Target tokens per block: the unit of writing, resuming and checksumming."""
HEADER_FILE, INDEX_FILE, BLOCK_DIR = "header.json", "index.bin", "blocks"
BLOCK_MAGIC, INDEX_MAGIC = b"APTKBLK\0", b"APTKIDX\0"
BLOCK_MAGICS = {"topk": BLOCK_MAGIC, "sampled": b"APSMBLK\0"}
DIGEST_SIZE = 16

# Block file: fixed header, directory (one record per sample), tables frame, digest, payloads.
_BLOCK_HEAD = struct.Struct("<8sIIQQIIIIIIQ")
_BLOCK_HEAD_FIELDS = (
    "magic",
    "version",
    "levels",
    "block",
    "first_position",
    "samples",
    "seq_length",
    "k",
    "vocab_size",
    "table_size",
    "tables_bytes",
    "file_size",
)
_DIRECTORY = np.dtype(
    [
        ("key", "<u8"),
        ("offset", "<u8"),
        ("length", "<u4"),
        ("frame_sizes", "<u4", 2),
        ("escapes", "<u4"),
        ("crc", "<u4"),
    ]
)
# Index file: fixed header, per-block records, per-sample keys, digest of all that.
_INDEX_HEAD = struct.Struct("<8sIIQQ16s")
_INDEX_BLOCK = np.dtype([("size", "<u8"), ("digest", "S16")])


class LogitStoreError(Exception):
    """A store that is corrupt, incomplete, or made for other data or settings."""


class TopKBatch(NamedTuple):
    sample_keys: np.ndarray
    """uint64 [n]: the key of every sample (see :func:`sample_key`)."""
    ids: "torch.Tensor"
    """int64 [n, T, k]: teacher top-k ids of each position, sorted by block rank."""
    probs: "torch.Tensor"
    """float32 [n, T, k]: their probabilities; a row sums to the teacher's top-k mass S <= 1."""


def sample_key(tokens: np.ndarray) -> int:
    """64-bit fingerprint of one sample's token ids (blake2b of int64 little-endian tokens).

    Teacher and student hash the same array, whatever its dtype: training hashes a sample's
    ``seq_length + 1`` token window (:func:`megatron.apertus.distill.targets.sample_tokens`)."""
    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def draw_uniforms(seed: int, position: int, seq_length: int, draws: int) -> np.ndarray:
    """The uniforms in [0, 1) (float64 [seq_length, draws]) behind the draws of a sampled store
    at sample ``position``: a function of the seed and the position alone, so a regenerated
    block, any parallel layout and any block size give the same draws."""
    return np.random.default_rng([seed, position]).random((seq_length, draws))


def default_samples_per_block(seq_length: int, tokens: int = BLOCK_TOKENS) -> int:
    """Samples per block so that a block holds about ``tokens`` tokens."""
    return max(1, round(tokens / seq_length))


def store_digest(*parts: bytes) -> bytes:
    """blake2b digest (16 bytes) of the concatenated parts: every checksum of the store."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True, kw_only=True)
class StoreHeader:
    """What a store holds and for which data; written to ``header.json``."""

    k: int
    """Teacher ids (and probabilities) per position; of a sampled store: the draws N."""
    vocab_size: int
    seq_length: int
    """Positions per sample (every sample has exactly this many)."""
    num_samples: int
    """Samples in consumption order: positions 0 .. num_samples - 1."""
    samples_per_block: int
    """Chosen so that a block holds ~131k tokens (:func:`default_samples_per_block`)."""
    teacher: str
    """Teacher identifier, e.g. checkpoint path, iteration and a hash of its config."""
    dataset_hash: str
    """Fingerprint of the dataset description; the student compares it with its own."""
    levels: int = CodecParams.levels
    zstd_level: int = CodecParams.zstd_level
    format_version: int = FORMAT_VERSION
    kind: str = "topk"
    """One of :data:`KINDS`; a header without the field is a top-k store."""
    seed: int | None = None
    """Of a sampled store: the seed of the draws (with the position, it fixes them)."""

    def __post_init__(self) -> None:
        for name in ("k", "vocab_size", "seq_length", "num_samples", "samples_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"StoreHeader.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy ints would not serialise
        if not self.k <= self.vocab_size < 2**31:  # ranks are int32
            raise ValueError(f"need k ({self.k}) <= vocab_size ({self.vocab_size}) < 2**31")
        if self.kind not in KINDS:
            raise ValueError(
                f"StoreHeader.kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if (self.kind == "sampled") != (self.seed is not None):
            raise ValueError("StoreHeader.seed is given for, and only for, a sampled store")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, numbers.Integral)
            or self.seed < 0
        ):
            raise ValueError(f"StoreHeader.seed must be a non-negative int, got {self.seed!r}")
        if self.kind == "sampled" and self.k > MAX_DRAWS:
            raise ValueError(f"a sampled store draws at most {MAX_DRAWS} ids per position")
        if not self.teacher or not self.dataset_hash:
            raise ValueError("StoreHeader.teacher and .dataset_hash must be non-empty")
        CodecParams(self.levels, self.zstd_level)  # validates them

    @property
    def codec(self) -> CodecParams:
        return CodecParams(self.levels, self.zstd_level)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.samples_per_block)

    def block_positions(self, block: int) -> range:
        if not 0 <= block < self.num_blocks:
            raise LogitStoreError(f"block {block} outside [0, {self.num_blocks})")
        start = block * self.samples_per_block
        return range(start, min(start + self.samples_per_block, self.num_samples))

    def to_json(self) -> str:
        fields = {"format": FORMAT, "codec": CODECS[self.kind], **dataclasses.asdict(self)}
        if self.kind == "topk":  # top-k headers stay byte-identical to those without kinds
            del fields["kind"], fields["seed"]
        return json.dumps(fields, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str) -> StoreHeader:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as err:
            raise LogitStoreError(f"{source}: not valid JSON ({err})") from None
        kind = fields.get("kind", "topk") if isinstance(fields, dict) else None
        if kind not in KINDS:
            raise LogitStoreError(
                f"{source}: unknown kind of store {kind!r} (this code reads " f"{', '.join(KINDS)})"
            )
        if fields.pop("format", None) != FORMAT or fields.pop("codec", None) != CODECS[kind]:
            raise LogitStoreError(
                f"{source}: not a {FORMAT} store of kind {kind} with codec " f"{CODECS[kind]}"
            )
        if fields.get("format_version") != FORMAT_VERSION:
            raise LogitStoreError(
                f"{source}: format version {fields.get('format_version')}, this code reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            return cls(**fields)
        except (TypeError, ValueError) as err:
            raise LogitStoreError(f"{source}: invalid header ({err})") from None

    def differences(self, other: StoreHeader) -> list[str]:
        """``field: ours != theirs`` for every field that differs."""
        ours, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return [f"{k}: {ours[k]!r} != {theirs[k]!r}" for k in ours if ours[k] != theirs[k]]


def _digest_matches(f, length: int, chunk: int = 64 << 20) -> bool:
    """Whether the first ``length`` bytes of ``f`` hash to the digest that follows them."""
    f.seek(0)
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for start in range(0, length, chunk):
        h.update(f.read(min(chunk, length - start)))
    return h.digest() == f.read(DIGEST_SIZE)


def _read_header(directory: Path) -> StoreHeader:
    path = directory / HEADER_FILE
    if not path.is_file():
        raise LogitStoreError(f"{path} not found: not a teacher logit store")
    return StoreHeader.from_json(path.read_text(), str(path))


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def block_path(directory: str | os.PathLike, block: int) -> Path:
    return Path(directory) / BLOCK_DIR / f"block-{block:08d}.bin"


# -- block files ------------------------------------------------------------------------------


class BlockMeta(NamedTuple):
    """A block's metadata, checked against the store header and its digest."""

    path: Path
    block: int
    directory: np.ndarray
    tables: bytes
    table_size: int
    file_size: int
    digest: bytes


ReadAt = Callable[[int, int], bytes]
"""``read(offset, size)``: up to ``size`` bytes of a block file from ``offset``."""


def _file_reader(fd: int) -> ReadAt:
    return lambda offset, size: os.pread(fd, size, offset)


def _read_exact(
    read: ReadAt, offset: int, size: int, path: Path, block: int, file_size: int
) -> bytes:
    data = read(offset, size)
    if len(data) != size:
        raise LogitStoreError(
            f"{path} (block {block}) is truncated: needed bytes [{offset}, {offset + size}), "
            f"the file has {file_size}"
        )
    return data


def _read_meta(path: Path, block: int, header: StoreHeader) -> BlockMeta:
    """Read and check a block's metadata (not its sample frames)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise LogitStoreError(f"{path} (block {block}) is missing") from None
    try:
        return parse_meta(_file_reader(fd), os.fstat(fd).st_size, path, block, header)
    finally:
        os.close(fd)


def parse_meta(
    read: ReadAt, file_size: int, path: Path, block: int, header: StoreHeader
) -> BlockMeta:
    """Parse and check the metadata of block ``block`` (``path`` names it in errors)."""
    head_bytes = _read_exact(read, 0, _BLOCK_HEAD.size, path, block, file_size)
    head = dict(zip(_BLOCK_HEAD_FIELDS, _BLOCK_HEAD.unpack(head_bytes)))
    positions = header.block_positions(block)
    expected = {
        "magic": BLOCK_MAGICS[header.kind],
        "version": FORMAT_VERSION,
        "levels": header.levels,
        "block": block,
        "first_position": positions.start,
        "samples": len(positions),
        "seq_length": header.seq_length,
        "k": header.k,
        "vocab_size": header.vocab_size,
    }
    wrong = [f"{f}={head[f]!r} (expected {v!r})" for f, v in expected.items() if head[f] != v]
    if wrong:
        raise LogitStoreError(
            f"{path} (block {block}): corrupt or foreign block header: {', '.join(wrong)}"
        )
    meta_size = len(positions) * _DIRECTORY.itemsize + head["tables_bytes"]
    rest = _read_exact(read, _BLOCK_HEAD.size, meta_size + DIGEST_SIZE, path, block, file_size)
    digest = store_digest(head_bytes, rest[:meta_size])
    if digest != rest[meta_size:]:
        raise LogitStoreError(f"{path} (block {block}): checksum mismatch in the block metadata")
    if file_size != head["file_size"]:
        raise LogitStoreError(
            f"{path} (block {block}) is truncated or overwritten: {file_size} bytes, "
            f"its header says {head['file_size']}"
        )
    directory = np.frombuffer(rest, _DIRECTORY, len(positions))
    tables = rest[directory.nbytes : meta_size]
    return BlockMeta(path, block, directory, tables, head["table_size"], file_size, digest)


def _check_payloads(read: ReadAt, meta: BlockMeta, header: StoreHeader) -> None:
    for slot, entry in enumerate(meta.directory):
        payload = _read_exact(
            read, int(entry["offset"]), int(entry["length"]), meta.path, meta.block, meta.file_size
        )
        check_crc(payload, entry, meta, header.block_positions(meta.block)[slot])


def check_crc(payload: bytes, entry: np.void, meta: BlockMeta, position: int) -> None:
    if zlib.crc32(payload) != int(entry["crc"]):
        raise LogitStoreError(
            f"{meta.path} (block {meta.block}): checksum mismatch in the sample at position "
            f"{position}"
        )


def block_bytes(block: int, header: StoreHeader, keys: np.ndarray, encoded) -> bytes:
    positions = header.block_positions(block)
    n = len(positions)
    meta_size = _BLOCK_HEAD.size + n * _DIRECTORY.itemsize + len(encoded.tables) + DIGEST_SIZE
    lengths = np.array([len(p) for p in encoded.payloads], dtype=np.int64)
    directory = np.zeros(n, _DIRECTORY)
    directory["key"] = keys
    directory["offset"] = meta_size + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    directory["length"] = lengths
    directory["frame_sizes"] = encoded.frame_sizes
    directory["escapes"] = encoded.escapes
    directory["crc"] = [zlib.crc32(p) for p in encoded.payloads]
    head = _BLOCK_HEAD.pack(
        BLOCK_MAGICS[header.kind],
        FORMAT_VERSION,
        header.levels,
        block,
        positions.start,
        n,
        header.seq_length,
        header.k,
        header.vocab_size,
        encoded.table_size,
        len(encoded.tables),
        meta_size + int(lengths.sum()),
    )
    meta = head + directory.tobytes() + encoded.tables
    return b"".join([meta, store_digest(meta), *encoded.payloads])


# -- writing ----------------------------------------------------------------------------------


def check_store_dir(directory: str | os.PathLike, flag: str = "--logits-dir") -> None:
    """Create the store's directory and write a file there: the writer opens the store only
    once the teacher is loaded, minutes in, so a directory this process cannot write is refused
    here, before that, with ``ConfigError`` naming ``flag``. The directories this check made
    are removed again: a run refused later (its data, its layout) leaves no empty store behind,
    and the writer creates them when it starts."""
    path = Path(directory)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"{flag} {path}: {blocker} is a file, not a directory")
    blocks = path / BLOCK_DIR
    made = [p for p in (blocks, *blocks.parents) if not p.exists()]
    try:
        blocks.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=blocks):
            pass
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot write there ({err.strerror})") from None
    finally:
        for created in made:  # deepest first
            with contextlib.suppress(OSError):
                created.rmdir()


class LogitStoreWriter:
    """Writes the blocks one rank owns; rank 0 creates the store and finalizes it.

    Usage on every rank::

        writer = LogitStoreWriter(store, header, rank=rank, world_size=world)
        for block in writer.pending_blocks():
            positions = writer.block_positions(block)
            ...  # run the teacher on these samples
            writer.write_block(block, keys, top_ids, top_logprobs)
        barrier()
        if rank == 0:
            writer.finalize()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        header: StoreHeader,
        *,
        rank: int = 0,
        world_size: int = 1,
        wait_s: float = 600.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.directory, self.header = Path(directory), header
        self.rank, self.world_size = rank, world_size
        if rank == 0:
            self._create()
        else:
            self._wait_for_header(wait_s)
        self._remove_stale_tmp()

    def _create(self) -> None:
        (self.directory / BLOCK_DIR).mkdir(parents=True, exist_ok=True)
        if (self.directory / HEADER_FILE).exists():
            self._check_existing()
        else:
            atomic_write(self.directory / HEADER_FILE, self.header.to_json().encode())

    def _wait_for_header(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while not (self.directory / HEADER_FILE).exists():
            if time.monotonic() > deadline:
                raise LogitStoreError(
                    f"rank {self.rank}: {self.directory / HEADER_FILE} did not appear within "
                    f"{wait_s:.0f} s (rank 0 creates it)"
                )
            time.sleep(0.05)
        self._check_existing()

    def _check_existing(self) -> None:
        existing = _read_header(self.directory)
        differences = self.header.differences(existing)
        if differences:
            raise LogitStoreError(
                f"{self.directory / HEADER_FILE} belongs to another run (ours != existing): "
                + "; ".join(differences)
            )

    def _remove_stale_tmp(self) -> None:
        """Temporary files of this rank's blocks are leftovers of an interrupted write."""
        for tmp in (self.directory / BLOCK_DIR).glob("block-*.bin.tmp"):
            block = int(tmp.name[len("block-") :].split(".")[0])
            if block % self.world_size == self.rank:
                tmp.unlink(missing_ok=True)

    def block_positions(self, block: int) -> range:
        return self.header.block_positions(block)

    def pending_blocks(self, *, verify_checksums: bool = False) -> list[int]:
        """This rank's blocks that are not yet written. A block file counts as written when its
        metadata is intact (digest, sizes, header fields); ``verify_checksums`` also checks every
        sample's crc32, reading the whole file. A damaged block is pending again."""
        owned = range(self.rank, self.header.num_blocks, self.world_size)
        return [b for b in owned if not self._is_complete(b, verify_checksums)]

    def _is_complete(self, block: int, verify_checksums: bool) -> bool:
        path = block_path(self.directory, block)
        if not path.exists():
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            meta = parse_meta(_file_reader(fd), os.fstat(fd).st_size, path, block, self.header)
            if verify_checksums:
                _check_payloads(_file_reader(fd), meta, self.header)
            return True
        except LogitStoreError:
            return False
        finally:
            os.close(fd)

    def write_block(
        self, block: int, sample_keys: np.ndarray, ids: np.ndarray, logprobs: np.ndarray
    ) -> None:
        """Encode and atomically write block ``block``.

        ``sample_keys``: uint64 [n], :func:`sample_key` of each sample's tokens; ``ids``: int
        [n, seq_length, k] distinct top-k ids per position (any order); ``logprobs``: float32
        [n, seq_length, k] their log-softmax over the full vocabulary.
        """
        if block % self.world_size != self.rank:
            raise LogitStoreError(
                f"rank {self.rank} of {self.world_size} does not own block {block} "
                f"(block % world_size = {block % self.world_size})"
            )
        self._check_kind(block, "topk")
        positions = self.block_positions(block)
        shape = (len(positions), self.header.seq_length, self.header.k)
        sample_keys = np.asarray(sample_keys, dtype=np.uint64)
        if sample_keys.shape != shape[:1] or ids.shape != shape or logprobs.shape != shape:
            raise LogitStoreError(
                f"block {block}: expected keys [{shape[0]}], ids and logprobs {list(shape)}; got "
                f"{list(sample_keys.shape)}, {list(ids.shape)}, {list(logprobs.shape)}"
            )
        rows = shape[0] * shape[1]
        self._write(
            block,
            sample_keys,
            lambda: encode_block(
                ids.reshape(rows, -1),
                logprobs.reshape(rows, -1),
                samples=shape[0],
                vocab_size=self.header.vocab_size,
                params=self.header.codec,
            ),
        )

    def write_sampled_block(self, block: int, sample_keys: np.ndarray, draws: np.ndarray) -> None:
        """Encode and atomically write block ``block`` of a sampled store. ``draws``: int
        [n, seq_length, N] ids drawn i.i.d. from the teacher at each position (any order)."""
        self._check_kind(block, "sampled")
        positions = self.block_positions(block)
        shape = (len(positions), self.header.seq_length, self.header.k)
        sample_keys = np.asarray(sample_keys, dtype=np.uint64)
        if sample_keys.shape != shape[:1] or draws.shape != shape:
            raise LogitStoreError(
                f"block {block}: expected keys [{shape[0]}] and draws "
                f"{list(shape)}; got {list(sample_keys.shape)}, "
                f"{list(draws.shape)}"
            )
        rows = shape[0] * shape[1]
        self._write(
            block,
            sample_keys,
            lambda: encode_sampled_block(
                draws.reshape(rows, -1),
                samples=shape[0],
                vocab_size=self.header.vocab_size,
                zstd_level=self.header.zstd_level,
            ),
        )

    def _check_kind(self, block: int, kind: str) -> None:
        if self.header.kind != kind:
            raise LogitStoreError(f"block {block}: {kind} rows given to a {self.header.kind} store")

    def _write(self, block: int, sample_keys: np.ndarray, encode: Callable) -> None:
        positions = self.block_positions(block)
        try:
            encoded = encode()
        except RowError as err:
            t = self.header.seq_length
            raise LogitStoreError(
                f"block {block}, sample at position {positions[err.row // t]}, token "
                f"{err.row % t}: {err}"
            ) from None
        atomic_write(
            block_path(self.directory, block),
            block_bytes(block, self.header, sample_keys, encoded),
        )

    def finalize(self) -> None:
        """Write the index once every block of every rank exists (call on one rank after a
        barrier; idempotent). Lists the missing or damaged blocks otherwise."""
        metas, problems = [], []
        for block in range(self.header.num_blocks):
            try:
                metas.append(_read_meta(block_path(self.directory, block), block, self.header))
            except LogitStoreError as err:
                problems.append(str(err))
        if problems:
            raise LogitStoreError(
                f"{self.directory}: cannot finalize, {len(problems)} of {self.header.num_blocks} "
                "blocks are missing or damaged:\n  "
                + "\n  ".join(problems[:20])
                + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
            )
        records = np.zeros(len(metas), _INDEX_BLOCK)
        records["size"] = [m.file_size for m in metas]
        records["digest"] = [m.digest for m in metas]
        keys = np.concatenate([m.directory["key"] for m in metas]).astype("<u8")
        header_digest = store_digest((self.directory / HEADER_FILE).read_bytes())
        head = _INDEX_HEAD.pack(
            INDEX_MAGIC, FORMAT_VERSION, 0, len(metas), self.header.num_samples, header_digest
        )
        body = head + records.tobytes() + keys.tobytes()
        atomic_write(self.directory / INDEX_FILE, body + store_digest(body))


# -- reading ----------------------------------------------------------------------------------


class _OpenBlock(NamedTuple):
    meta: BlockMeta
    decoder: BlockDecoder


class LogitStoreReader:
    """Random access to a finalized store by sample position.

    ``verify`` checks the index digest on open, each block's metadata digest when it is first
    opened, and each sample payload's crc32 on every read. A small LRU cache keeps the last few
    opened blocks (directory and decoded tables); samples are decoded on demand, so a
    reader that needs a few samples of a block never decodes the whole block, and sequential
    reading decodes every sample exactly once.
    """

    def __init__(
        self, directory: str | os.PathLike, *, verify: bool = True, cache_blocks: int = 8
    ) -> None:
        self.directory, self.verify = Path(directory), verify
        self.header = _read_header(self.directory)
        self._blocks, self.keys = self._read_index()
        self._cache: OrderedDict[int, _OpenBlock] = OrderedDict()
        self._cache_size = cache_blocks
        self._lock = threading.Lock()

    def _read_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-block records and per-sample keys, memory-mapped: at 1.7T tokens of 4096-token
        samples the keys alone are 3.3 GB, shared through the page cache by a node's ranks."""
        path = self.directory / INDEX_FILE
        if not path.is_file():
            raise LogitStoreError(
                f"{path} not found: the store is not finalized (LogitStoreWriter.finalize)"
            )
        header = self.header
        records_size = header.num_blocks * _INDEX_BLOCK.itemsize
        expected = _INDEX_HEAD.size + records_size + 8 * header.num_samples + DIGEST_SIZE
        size = path.stat().st_size
        if size != expected:
            raise LogitStoreError(
                f"{path} is truncated or not an index: {size} bytes, expected {expected}"
            )
        with open(path, "rb") as f:
            magic, version, _, blocks, samples, header_digest = _INDEX_HEAD.unpack(
                f.read(_INDEX_HEAD.size)
            )
            if self.verify and not _digest_matches(f, size - DIGEST_SIZE):
                raise LogitStoreError(f"{path}: checksum mismatch")
        if magic != INDEX_MAGIC or version != FORMAT_VERSION:
            raise LogitStoreError(f"{path}: not an index of format version {FORMAT_VERSION}")
        if (blocks, samples) != (header.num_blocks, header.num_samples):
            raise LogitStoreError(
                f"{path}: {blocks} blocks / {samples} samples, header says "
                f"{header.num_blocks} / {header.num_samples}"
            )
        if header_digest != store_digest((self.directory / HEADER_FILE).read_bytes()):
            raise LogitStoreError(f"{path} was written for another {HEADER_FILE}")
        records = np.memmap(path, _INDEX_BLOCK, "r", _INDEX_HEAD.size, (blocks,))
        keys = np.memmap(path, "<u8", "r", _INDEX_HEAD.size + records_size, (samples,))
        return records, keys

    def check_dataset(self, dataset_hash: str) -> None:
        """Refuse logits made for another dataset description."""
        if dataset_hash != self.header.dataset_hash:
            raise LogitStoreError(
                f"{self.directory}: logits were made for dataset {self.header.dataset_hash!r}, "
                f"the student's dataset is {dataset_hash!r}"
            )

    def sample_keys(self, positions: Sequence[int]) -> np.ndarray:
        return np.array(self.keys[self._positions(positions)])

    def check_samples(self, positions: Sequence[int], expected_keys: Sequence[int]) -> None:
        """Refuse samples whose tokens differ from those the teacher saw, naming the first."""
        positions = self._positions(positions)
        expected = np.asarray(expected_keys, dtype=np.uint64)
        if expected.shape != positions.shape:
            raise ValueError(f"{len(expected)} keys for {len(positions)} positions")
        bad = np.flatnonzero(self.keys[positions] != expected)
        if len(bad):
            i = bad[0]
            raise LogitStoreError(
                f"{self.directory}: the sample at position {positions[i]} has key "
                f"{int(self.keys[positions[i]]):#018x} in the store but {int(expected[i]):#018x} "
                f"in the student's data ({len(bad)} of {len(positions)} samples differ): the "
                "logits were made for other data"
            )

    def _positions(self, positions: Sequence[int]) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        outside = (positions < 0) | (positions >= self.header.num_samples)
        if outside.any():
            raise LogitStoreError(
                f"position {positions[outside][0]} outside the store [0, {self.header.num_samples})"
            )
        return positions

    def read(self, positions: Sequence[int], *, pin_memory: bool = False) -> TopKBatch:
        """Top-k ids and probabilities of the samples at ``positions`` (any order, repeats ok).

        Of a sampled store: each position's distinct drawn ids with weights count / N (a row
        sums to 1), then padding ids of weight 0, as wide as the batch's most distinct ids."""
        import torch

        positions = self._positions(positions)
        h = self.header
        shape = (len(positions), h.seq_length, h.k)
        pin = pin_memory and torch.cuda.is_available()  # pinning needs a CUDA driver
        ids = torch.empty(shape, dtype=torch.int64, pin_memory=pin)
        probs = torch.empty(shape, dtype=torch.float32, pin_memory=pin)
        ids_np, probs_np = ids.numpy(), probs.numpy()
        blocks = positions // h.samples_per_block
        for block in np.unique(blocks):
            where = np.flatnonzero(blocks == block)
            self._decode(int(block), positions[where], where, ids_np, probs_np)
        if h.kind == "sampled":  # the slots past the batch's most distinct ids are all padding
            width = max(int((probs_np > 0).sum(axis=2).max(initial=1)), 1)
            ids, probs = ids[..., :width], probs[..., :width]
        return TopKBatch(np.array(self.keys[positions]), ids, probs)

    def _decode(
        self,
        block: int,
        positions: np.ndarray,
        where: np.ndarray,
        ids: np.ndarray,
        probs: np.ndarray,
    ) -> None:
        """Decode the block's samples at ``positions`` into rows ``where`` of the outputs: one
        read of the byte range that covers them, then each sample's payload."""
        opened = self._open(block)
        entries = opened.meta.directory[positions - block * self.header.samples_per_block]
        start = int(entries["offset"].min())
        end = int((entries["offset"] + entries["length"]).max())
        with open(opened.meta.path, "rb") as f:
            data = _read_exact(
                _file_reader(f.fileno()),
                start,
                end - start,
                opened.meta.path,
                block,
                opened.meta.file_size,
            )
        for row, position, entry in zip(where, positions, entries):
            offset = int(entry["offset"]) - start
            payload = data[offset : offset + int(entry["length"])]
            if self.verify:
                check_crc(payload, entry, opened.meta, int(position))
            sizes = (int(entry["frame_sizes"][0]), int(entry["frame_sizes"][1]))
            try:
                opened.decoder.decode(payload, sizes, int(entry["escapes"]), ids[row], probs[row])
            except Exception as err:  # zstd or layout errors of a payload that passed its crc
                raise LogitStoreError(
                    f"{opened.meta.path} (block {block}): sample at position {position} does not "
                    f"decode: {err}"
                ) from err

    def _open(self, block: int) -> _OpenBlock:
        with self._lock:
            if block in self._cache:
                self._cache.move_to_end(block)
                return self._cache[block]
        path = block_path(self.directory, block)
        record = self._blocks[block]
        size = path.stat().st_size if path.exists() else None
        if size != record["size"]:
            raise LogitStoreError(
                f"{path} (block {block}) is "
                + ("missing" if size is None else f"truncated or replaced: {size} bytes")
                + f", the index says {int(record['size'])}"
            )
        meta = _read_meta(path, block, self.header)
        if self.verify and meta.digest != record["digest"]:
            raise LogitStoreError(f"{path} (block {block}): digest differs from the index's")
        h = self.header
        if h.kind == "sampled":
            decoder = SampledBlockDecoder(
                meta.tables,
                meta.table_size,
                positions=h.seq_length,
                draws=h.k,
                vocab_size=h.vocab_size,
            )
        else:
            decoder = BlockDecoder(
                meta.tables, meta.table_size, positions=h.seq_length, k=h.k, levels=h.levels
            )
        opened = _OpenBlock(meta, decoder)
        with self._lock:
            self._cache[block] = opened
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return opened

    def prefetch(
        self,
        position_batches: Iterable[Sequence[int]],
        *,
        depth: int = 2,
        num_threads: int = 2,
        pin_memory: bool | None = None,
    ) -> Iterator[TopKBatch]:
        """Yield ``read(positions)`` for each batch in order while up to ``depth`` later batches
        are decoded by ``num_threads`` background threads (zstd and numpy release the GIL).
        ``pin_memory`` (default: when CUDA is available) decodes into page-locked memory, ready
        for a non-blocking copy to the GPU. A worker's error is raised here, at its batch."""
        import torch

        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        batches = iter(position_batches)
        pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="logit-store")
        pending: deque[Future] = deque()
        try:
            for positions in batches:
                pending.append(pool.submit(self.read, positions, pin_memory=pin))
                if len(pending) > depth:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
