"""The reference policy's sequence log-probabilities: computed once, stored, checked on reading.

One file per dataset (``REF_DIR/train.bin``, ``REF_DIR/valid.bin``), with the guarantees of
the teacher-logit store and its primitives (:mod:`megatron.apertus.distill.logit_store`): every
sequence is stored with its key (:func:`sample_key` of its token ids), the header names the
dataset (a digest of its index file) and the reference weights, a blake2b digest covers the
whole file, and the file is written under a temporary name and renamed when complete. A file
that is corrupt, truncated, or made for other data is refused with :class:`LogitStoreError`.
Values are float64: a resumed run reads exactly what the first start computed.

Layout (little-endian)::

    magic "APREFLP\\0" | u32 version | u32 header bytes | header JSON
    | u64 key [n] | f64 logp [n] | i32 completion tokens [n] | blake2b-128 of all before
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megatron.apertus.distill.logit_store import (
    DIGEST_SIZE,
    LogitStoreError,
    atomic_write,
    sample_key,
    store_digest,
)

MAGIC, VERSION = b"APREFLP\0", 1
_HEAD = struct.Struct("<8sII")


class ReferenceLogps(NamedTuple):
    keys: np.ndarray
    """uint64 [n]: the key of every sequence, in dataset order."""
    logps: np.ndarray
    """float64 [n]: sum of the reference log-probabilities of the sequence's loss tokens."""
    lengths: np.ndarray
    """int32 [n]: the sequence's loss tokens (the completion and its ``<|assistant_end|>``)."""


def dataset_hash(prefix: str) -> str:
    """Fingerprint of an indexed dataset: the digest of its ``.idx`` (lengths and offsets) and
    of its loss mask's."""
    parts = [Path(prefix + ".idx").read_bytes(), Path(prefix + "_loss_mask.idx").read_bytes()]
    return store_digest(*parts).hex()


def sequence_key(tokens: np.ndarray) -> int:
    return sample_key(np.asarray(tokens, dtype=np.int64))


def write(path: Path, values: ReferenceLogps, *, data_hash: str, reference: str) -> None:
    header = json.dumps(
        {
            "format": "apertus-reference-logps",
            "sequences": len(values.keys),
            "dataset_hash": data_hash,
            "reference": reference,
        }
    ).encode()
    body = b"".join(
        [
            _HEAD.pack(MAGIC, VERSION, len(header)),
            header,
            values.keys.astype("<u8").tobytes(),
            values.logps.astype("<f8").tobytes(),
            values.lengths.astype("<i4").tobytes(),
        ]
    )
    atomic_write(path, body + store_digest(body))


def read(path: Path, *, data_hash: str) -> tuple[ReferenceLogps, dict]:
    """The stored values and header; refuses a corrupt file or one made for other data."""
    if not path.is_file():
        raise LogitStoreError(f"{path} not found")
    raw = path.read_bytes()
    if len(raw) < _HEAD.size + DIGEST_SIZE or raw[:8] != MAGIC:
        raise LogitStoreError(f"{path}: not a reference log-probability file")
    body, digest = raw[:-DIGEST_SIZE], raw[-DIGEST_SIZE:]
    if store_digest(body) != digest:
        raise LogitStoreError(f"{path}: checksum mismatch (corrupt or truncated)")
    _, version, size = _HEAD.unpack_from(body)
    if version != VERSION:
        raise LogitStoreError(f"{path}: format version {version}, expected {VERSION}")
    header = json.loads(body[_HEAD.size : _HEAD.size + size])
    if header["dataset_hash"] != data_hash:
        raise LogitStoreError(
            f"{path}: made for other data (dataset hash "
            f"{header['dataset_hash'][:12]}..., this data {data_hash[:12]}...)"
        )
    n, offset = header["sequences"], _HEAD.size + size
    keys = np.frombuffer(body, "<u8", n, offset)
    logps = np.frombuffer(body, "<f8", n, offset + 8 * n)
    lengths = np.frombuffer(body, "<i4", n, offset + 16 * n)
    return ReferenceLogps(keys, logps, lengths), header


def check_keys(path: Path, stored: ReferenceLogps, indices: np.ndarray, tokens: list) -> None:
    """Refuse sequences whose stored key is not the key of the tokens training reads."""
    for index, ids in zip(indices, tokens):
        if int(stored.keys[index]) != sequence_key(ids):
            raise LogitStoreError(
                f"{path}: sequence {index} does not match the data (key "
                f"{int(stored.keys[index]):016x}, data {sequence_key(ids):016x})"
            )
