"""The teacher logit store: round trip and its error bound, random access, data-parallel reads,
two writer processes, resume, corruption, data fingerprints and background prefetch.

Samples are real text (embedded documents tokenized with tekken); the teacher distributions
are synthetic but shaped like a trained model's: Zipf-distributed ids, a peaked head, and a
top-k mass below one.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.apertus.distill.logit_store import (
    LogitStoreError,
    LogitStoreReader,
    LogitStoreWriter,
    StoreHeader,
    block_path,
    default_samples_per_block,
    sample_key,
)

VOCAB, SEQ, K, SAMPLES, PER_BLOCK = 131072, 32, 16, 22, 5  # 5 blocks, the last one partial


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    """int64 [SAMPLES, SEQ]: real text, cut into samples."""
    from megatron.apertus.prep.corpus import embedded_documents
    from megatron.apertus.tokenizer.tokenizers import build_tokenizer

    tokenizer = build_tokenizer("TekkenTokenizer")
    ids = np.concatenate([tokenizer.encode_document(d) for d in embedded_documents()[:4]])
    return ids[: SAMPLES * SEQ].reshape(SAMPLES, SEQ).astype(np.int64)


def teacher(samples: int, seq: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids [samples, seq, k], logprobs [samples, seq, k]): distinct Zipf-popular ids per row,
    peaked log-probabilities that sum to a top-k mass between 0.5 and 1."""
    rng = np.random.default_rng(seed)
    rows = samples * seq
    popularity = -1.1 * np.log(np.arange(1, 4097)) + rng.gumbel(size=(rows, 4096))
    ids = np.argpartition(-popularity, k, axis=1)[:, :k] * 31 % VOCAB  # spread over the vocab
    logits = rng.standard_normal((rows, k)) * 2.5
    logits[:, 0] += rng.exponential(3.0, rows)
    mass = rng.uniform(0.5, 1.0, rows)
    logprobs = logits - np.log(np.exp(logits).sum(1, keepdims=True)) + np.log(mass)[:, None]
    return ids.reshape(samples, seq, k), logprobs.astype(np.float32).reshape(samples, seq, k)


def header(**overrides) -> StoreHeader:
    fields = dict(
        k=K,
        vocab_size=VOCAB,
        seq_length=SEQ,
        num_samples=SAMPLES,
        samples_per_block=PER_BLOCK,
        teacher="tiny@iter200",
        dataset_hash="data-v1",
    )
    return StoreHeader(**{**fields, **overrides})


def write_store(directory: Path, tokens: np.ndarray, rank: int = 0, world: int = 1) -> None:
    ids, logprobs = teacher(SAMPLES, SEQ, K)
    writer = LogitStoreWriter(directory, header(), rank=rank, world_size=world)
    for block in writer.pending_blocks():
        p = writer.block_positions(block)
        keys = [sample_key(t) for t in tokens[p.start : p.stop]]
        writer.write_block(
            block, np.array(keys, np.uint64), ids[p.start : p.stop], logprobs[p.start : p.stop]
        )


@pytest.fixture
def store(tmp_path: Path, tokens: np.ndarray) -> Path:
    write_store(tmp_path / "store", tokens)
    LogitStoreWriter(tmp_path / "store", header()).finalize()
    return tmp_path / "store"


def renormalised_kl(ids, logprobs, decoded_ids, decoded_probs) -> np.ndarray:
    """KL(p || p') per row of the exact and decoded top-k rows, aligned by id."""
    k = ids.shape[-1]
    ids, logprobs = ids.reshape(-1, k), logprobs.reshape(-1, k)
    decoded_ids, decoded_probs = decoded_ids.reshape(-1, k), decoded_probs.reshape(-1, k)
    a, b = np.argsort(ids, 1), np.argsort(decoded_ids, 1)
    np.testing.assert_array_equal(
        np.take_along_axis(ids, a, 1), np.take_along_axis(decoded_ids, b, 1)
    )
    p = np.exp(np.take_along_axis(logprobs, a, 1).astype(np.float64))
    q = np.take_along_axis(decoded_probs, b, 1).astype(np.float64)
    p, q = p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)
    return (p * np.log(p / q)).sum(1)


def test_round_trip_keeps_ids_and_bounds_the_error(store: Path) -> None:
    ids, logprobs = teacher(SAMPLES, SEQ, K)
    batch = LogitStoreReader(store).read(range(SAMPLES))
    assert batch.ids.dtype == torch.int64 and batch.probs.dtype == torch.float32
    assert batch.ids.shape == (SAMPLES, SEQ, K)
    kl = renormalised_kl(ids, logprobs, batch.ids.numpy(), batch.probs.numpy())
    # The documented guarantee: mean KL <= k * step^2 / 2 with step = 1 / 255.
    assert kl.mean() <= K / 255**2 / 2
    assert (batch.probs > 0).all()
    # The top-k mass S is kept: 1 - S is stored as float16 (11 significant bits).
    mass = np.exp(logprobs.astype(np.float64)).sum(-1)
    error = np.abs(batch.probs.double().sum(-1).numpy() - mass)
    assert (error <= (1 - mass) * 2**-11 + 1e-6).all()


def test_kl_at_k256_on_a_peaked_teacher(tmp_path: Path) -> None:
    ids, logprobs = teacher(4, 64, 256, seed=1)
    h = header(k=256, seq_length=64, num_samples=4, samples_per_block=4)
    writer = LogitStoreWriter(tmp_path, h)
    writer.write_block(0, np.arange(4, dtype=np.uint64), ids, logprobs)
    writer.finalize()
    batch = LogitStoreReader(tmp_path).read(range(4))
    kl = renormalised_kl(ids, logprobs, batch.ids.numpy(), batch.probs.numpy())
    assert kl.mean() < 1e-3 and kl.max() < 1e-3


def test_random_access_across_blocks_equals_sequential_reads(store: Path) -> None:
    reader = LogitStoreReader(store, cache_blocks=2)
    everything = reader.read(range(SAMPLES))
    positions = [21, 4, 5, 0, 13, 4, 20]  # across blocks, out of order, repeated
    batch = reader.read(positions)
    assert torch.equal(batch.ids, everything.ids[positions])
    assert torch.equal(batch.probs, everything.probs[positions])
    np.testing.assert_array_equal(batch.sample_keys, everything.sample_keys[positions])


@pytest.mark.parametrize("dp", [2, 4])
def test_any_data_parallel_size_reads_the_same_samples(store: Path, dp: int) -> None:
    """DP ranks read their slices of each global batch; together they see what DP=1 sees."""
    reader = LogitStoreReader(store)
    global_batch = 8
    for start in range(0, SAMPLES - global_batch + 1, global_batch):
        whole = reader.read(range(start, start + global_batch))
        per_rank = global_batch // dp
        parts = [
            reader.read(range(start + r * per_rank, start + (r + 1) * per_rank)) for r in range(dp)
        ]
        assert torch.equal(torch.cat([p.ids for p in parts]), whole.ids)
        assert torch.equal(torch.cat([p.probs for p in parts]), whole.probs)


def _write_rank(directory: str, tokens: np.ndarray, rank: int) -> None:
    write_store(Path(directory), tokens, rank=rank, world=2)


def test_two_writer_processes_write_disjoint_blocks(
    tmp_path: Path, tokens: np.ndarray, store: Path
) -> None:
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=_write_rank, args=(str(tmp_path / "two"), tokens, r)) for r in (1, 0)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    LogitStoreWriter(tmp_path / "two", header()).finalize()
    for block in range(header().num_blocks):  # the same bytes as one writer's
        assert (
            block_path(tmp_path / "two", block).read_bytes()
            == block_path(store, block).read_bytes()
        )
    assert (tmp_path / "two" / "index.bin").read_bytes() == (store / "index.bin").read_bytes()


def test_a_rank_writes_only_its_blocks(tmp_path: Path) -> None:
    writer = LogitStoreWriter(tmp_path, header(), rank=0, world_size=2)
    assert writer.pending_blocks() == [0, 2, 4]
    ids, logprobs = teacher(PER_BLOCK, SEQ, K)
    with pytest.raises(LogitStoreError, match="does not own block 1"):
        writer.write_block(1, np.zeros(PER_BLOCK, np.uint64), ids, logprobs)


def test_resume_skips_finished_blocks_and_removes_stale_tmp(
    tmp_path: Path, tokens: np.ndarray, store: Path
) -> None:
    ids, logprobs = teacher(SAMPLES, SEQ, K)
    keys = np.array([sample_key(t) for t in tokens], np.uint64)
    first = LogitStoreWriter(tmp_path / "s", header())
    for block in (0, 3):
        p = first.block_positions(block)
        first.write_block(
            block, keys[p.start : p.stop], ids[p.start : p.stop], logprobs[p.start : p.stop]
        )
    stale = block_path(tmp_path / "s", 1).with_suffix(".bin.tmp")
    stale.write_bytes(b"half a block")  # killed while writing block 1
    with pytest.raises(
        LogitStoreError, match=r"(?s)cannot finalize, 3 of 5 blocks.*\(block 1\) is missing"
    ):
        first.finalize()
    resumed = LogitStoreWriter(tmp_path / "s", header())
    assert not stale.exists()
    assert resumed.pending_blocks() == [1, 2, 4]
    write_store(tmp_path / "s", tokens)
    assert resumed.pending_blocks() == []
    resumed.finalize()
    assert (tmp_path / "s" / "index.bin").read_bytes() == (store / "index.bin").read_bytes()


def test_a_damaged_block_is_written_again(tmp_path: Path, tokens: np.ndarray) -> None:
    write_store(tmp_path, tokens)
    writer = LogitStoreWriter(tmp_path, header())
    path = block_path(tmp_path, 2)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last sample's frame: only its crc32 sees it
    path.write_bytes(bytes(data))
    assert writer.pending_blocks() == []
    assert writer.pending_blocks(verify_checksums=True) == [2]
    path.write_bytes(bytes(data[:100]))
    assert writer.pending_blocks() == [2]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_sample_names_block_and_sample(store: Path) -> None:
    flip_byte(block_path(store, 1), -5)  # the last sample of block 1: position 9
    reader = LogitStoreReader(store)
    reader.read([0, 4, 5, 8])  # other samples still read
    with pytest.raises(
        LogitStoreError,
        match=r"block-00000001\.bin \(block 1\): checksum mismatch in the sample at position 9",
    ):
        reader.read([9])


def test_flipped_byte_in_block_metadata_names_the_block(store: Path) -> None:
    flip_byte(block_path(store, 3), 100)  # inside the directory
    with pytest.raises(
        LogitStoreError, match=r"\(block 3\): (checksum mismatch in the block metadata|corrupt)"
    ):
        LogitStoreReader(store).read([16])


def test_truncated_files_are_clear_errors(store: Path) -> None:
    path = block_path(store, 2)
    path.write_bytes(path.read_bytes()[:-100])
    reader = LogitStoreReader(store)
    with pytest.raises(
        LogitStoreError,
        match=r"block-00000002\.bin \(block 2\) is truncated or replaced: \d+ bytes, the index "
        r"says \d+",
    ):
        reader.read([10])
    index = store / "index.bin"
    index.write_bytes(index.read_bytes()[:-1])
    with pytest.raises(LogitStoreError, match="index.bin is truncated"):
        LogitStoreReader(store)


def test_unfinished_or_foreign_stores_are_refused(
    tmp_path: Path, tokens: np.ndarray, store: Path
) -> None:
    write_store(tmp_path / "open", tokens)
    with pytest.raises(LogitStoreError, match="not finalized"):
        LogitStoreReader(tmp_path / "open")
    with pytest.raises(LogitStoreError, match=r"dataset_hash: 'other' != 'data-v1'"):
        LogitStoreWriter(store, header(dataset_hash="other"))
    with pytest.raises(LogitStoreError, match=r"k: 8 != 16"):
        LogitStoreWriter(store, header(k=8))


def test_logits_made_for_other_data_are_refused(store: Path, tokens: np.ndarray) -> None:
    reader = LogitStoreReader(store)
    reader.check_dataset("data-v1")
    with pytest.raises(
        LogitStoreError, match="made for dataset 'data-v1'.*student's dataset is 'data-v2'"
    ):
        reader.check_dataset("data-v2")
    positions = [3, 4, 5, 6]
    keys = [sample_key(t) for t in tokens[positions]]
    reader.check_samples(positions, keys)
    other = tokens.copy()
    other[5, 7] += 1  # one token differs in the sample at position 5
    keys = [sample_key(t) for t in other[positions]]
    with pytest.raises(
        LogitStoreError, match=r"sample at position 5 has key 0x[0-9a-f]{16} in the store but 0x"
    ):
        reader.check_samples(positions, keys)


def test_invalid_teacher_rows_name_their_position(tmp_path: Path) -> None:
    ids, logprobs = teacher(PER_BLOCK, SEQ, K)
    ids[3, 17, 5] = ids[3, 17, 9]
    writer = LogitStoreWriter(tmp_path, header())
    with pytest.raises(
        LogitStoreError, match="block 1, sample at position 8, token 17: repeated ids"
    ):
        writer.write_block(1, np.zeros(PER_BLOCK, np.uint64), ids, logprobs)


def test_prefetch_yields_in_order_and_reraises_worker_errors(store: Path) -> None:
    reader = LogitStoreReader(store)
    batches = [[0, 1], [7, 2], [21], [13, 14, 15], [19, 20]]
    for positions, batch in zip(batches, reader.prefetch(batches, depth=3, num_threads=2)):
        assert torch.equal(batch.ids, reader.read(positions).ids)
        assert torch.equal(batch.probs, reader.read(positions).probs)
    flip_byte(block_path(store, 4), -3)  # position 21 is damaged
    seen = []
    with pytest.raises(LogitStoreError, match="position 21"):
        for batch in reader.prefetch([[0], [5], [21], [1]], depth=2):
            seen.append(batch)
    assert len(seen) == 2


def test_sample_key_and_block_size() -> None:
    tokens = np.arange(100)
    assert sample_key(tokens) == sample_key(tokens.astype(np.int32))  # the dtype does not matter
    assert sample_key(tokens) != sample_key(tokens[::-1])
    assert default_samples_per_block(4096) == 32 and default_samples_per_block(128) == 1024
    assert os.fspath(block_path("s", 42)).endswith("blocks/block-00000042.bin")


def test_rank_differences_beyond_16_bits_round_trip() -> None:
    """Every vocabulary id once, so rank = id: rows whose first rank is >= 65535 escape."""
    from megatron.apertus.distill.logit_codec import BlockDecoder, CodecParams, encode_block

    k, rows = 16, VOCAB // 16
    ids = np.arange(VOCAB).reshape(rows, k)
    logprobs = np.log(np.full((rows, k), 1.0 / k, np.float32))
    encoded = encode_block(ids, logprobs, samples=1, vocab_size=VOCAB, params=CodecParams())
    assert encoded.escapes[0] == rows // 2
    decoder = BlockDecoder(encoded.tables, encoded.table_size, positions=rows, k=k, levels=255)
    out_ids, out_probs = np.empty((rows, k), np.int64), np.empty((rows, k), np.float32)
    sizes = (int(encoded.frame_sizes[0, 0]), int(encoded.frame_sizes[0, 1]))
    decoder.decode(encoded.payloads[0], sizes, int(encoded.escapes[0]), out_ids, out_probs)
    np.testing.assert_array_equal(out_ids, ids)
    np.testing.assert_allclose(out_probs, 1.0 / k, rtol=1e-6)
