"""Training datasets through megatron-core's builder: blends, splits, layout-independent order,
and the same batches whatever the number of reader processes and index-builder threads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.apertus import parallel
from megatron.apertus.data.batches import BatchConfig, MicroBatchReader, step_micro_batches
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.errors import ConfigError
from megatron.apertus.model import ParallelConfig
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.prep.preprocess import PreprocessConfig, preprocess
from megatron.apertus.tokenizer.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two real corpora: the first and second half of the embedded documents."""
    root = tmp_path_factory.mktemp("blend")
    docs = embedded_documents()
    prefixes = []
    for name, part in (("first", docs[:40]), ("second", docs[40:])):
        source = root / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        preprocess(PreprocessConfig(inputs=[source], output_prefix=str(root / name)))
        prefixes.append(str(root / f"{name}_text_document"))
    parallel.initialize(ParallelConfig(), device="cpu", seed=1)
    yield root, prefixes, build_tokenizer("TekkenTokenizer")
    parallel.shutdown()


def test_blend_follows_its_weights(corpora):
    root, (first, second), tokenizer = corpora
    config = DatasetConfig(
        data_path=["0.25", first, "0.75", second],
        split="100,0,0",
        data_cache_path=str(root / "cache"),
    )
    train, valid, test = build_datasets(
        config, tokenizer, seq_length=64, seed=3, num_samples=(400, 0, 0)
    )
    assert valid is None and test is None
    share = np.bincount(train.dataset_index[:400], minlength=2) / 400
    np.testing.assert_allclose(share, [0.25, 0.75], atol=0.01)


def test_split_holds_out_documents(corpora):
    root, (first, _), tokenizer = corpora
    config = DatasetConfig(data_path=[first], split="80,20,0", data_cache_path=str(root / "cache"))
    train, valid, _ = build_datasets(
        config, tokenizer, seq_length=64, seed=3, num_samples=(50, 20, 0)
    )
    train_docs = set(train.document_index.tolist())
    valid_docs = set(valid.document_index.tolist())
    assert train_docs and valid_docs and not train_docs & valid_docs


def test_each_part_reads_its_own_data_path(corpora):
    root, (first, second), tokenizer = corpora
    config = DatasetConfig(
        train_data_path=[first], valid_data_path=[second], data_cache_path=str(root / "cache")
    )
    train, valid, test = build_datasets(
        config, tokenizer, seq_length=64, seed=3, num_samples=(50, 20, 0)
    )
    assert test is None
    assert train.dataset.path_prefix == first and valid.dataset.path_prefix == second
    # all of each prefix's documents, no split
    assert set(train.document_index.tolist()) == set(range(len(train.dataset)))
    assert set(valid.document_index.tolist()) == set(range(len(valid.dataset)))
    with pytest.raises(ValueError, match="drop --data-path and --split"):
        DatasetConfig(data_path=[first], train_data_path=[first])
    with pytest.raises(ValueError, match="need --train-data-path"):
        DatasetConfig(valid_data_path=[second])


def test_sample_order_does_not_depend_on_data_parallel_size(corpora):
    root, (first, _), tokenizer = corpora
    config = DatasetConfig(data_path=[first], split="100,0,0", data_cache_path=str(root / "cache"))
    train, _, _ = build_datasets(config, tokenizer, seq_length=32, seed=3, num_samples=(64, 0, 0))
    batch = BatchConfig(eod=tokenizer.eod)

    def step_tokens(dp_size: int) -> list:
        rows = []
        for rank in range(dp_size):
            rows += step_micro_batches(
                train,
                batch,
                consumed_samples=16,
                global_batch_size=8,
                micro_batch_size=2,
                dp_rank=rank,
                dp_size=dp_size,
            )
        return [r.tolist() for b in rows for r in b.tokens]

    assert step_tokens(1) == step_tokens(2) == step_tokens(4)


def _batch_tensors(batches) -> list[list]:
    """Everything a micro-batch carries, as plain lists."""
    out = []
    for b in batches:
        fields = [b.tokens, b.labels, b.loss_mask, b.position_ids]
        if b.packed_seq_params is not None:
            fields.append(b.packed_seq_params.cu_seqlens_q)
        out.append([t.tolist() for t in fields] + [b.goldfish_dropped, b.loss_positions])
    return out


def test_worker_processes_read_the_same_batches(corpora):
    """--num-workers: prefetched steps, a step read without prefetch and a prefetch for another
    batch size (a ramp-up) all give the batches of the training process's own reading."""
    root, (first, second), tokenizer = corpora
    config = DatasetConfig(
        data_path=["0.5", first, "0.5", second],
        split="100,0,0",
        data_cache_path=str(root / "cache"),
    )
    train, _, _ = build_datasets(config, tokenizer, seq_length=48, seed=3, num_samples=(96, 0, 0))
    batch = BatchConfig(eod=tokenizer.eod, pack_documents=True, goldfish=GoldfishConfig(k=4, h=8))
    layout = dict(micro_batch_size=2, dp_rank=1, dp_size=2)
    reader = MicroBatchReader(train, batch, num_workers=2, **layout)
    steps = [(0, 8), (8, 8), (16, 16), (32, 16), (48, 8)]
    reader.prefetch(*steps[0])
    for (consumed, size), following in zip(steps, steps[1:] + [(56, 8)]):
        got = reader.read(consumed, size)
        reader.prefetch(following[0], size)  # the ramp-up step is prefetched at the old size
        expected = step_micro_batches(
            train, batch, consumed_samples=consumed, global_batch_size=size, **layout
        )
        assert _batch_tensors(got) == _batch_tensors(expected)


def test_dataset_builder_threads_build_the_same_indices(corpora):
    root, (first, second), tokenizer = corpora

    def indices(threads: int, cache: str) -> list[np.ndarray]:
        config = DatasetConfig(
            data_path=["0.3", first, "0.7", second],
            split="90,10,0",
            data_cache_path=str(root / cache),
            num_dataset_builder_threads=threads,
        )
        train, valid, _ = build_datasets(
            config, tokenizer, seq_length=40, seed=9, num_samples=(200, 30, 0)
        )
        return [train.dataset_index, train.dataset_sample_index, valid.dataset_index]

    for one, four in zip(indices(1, "cache-1"), indices(4, "cache-4")):
        np.testing.assert_array_equal(one, four)


def test_no_mmap_bin_files_reads_the_same_samples_with_file_reads(corpora):
    root, (first, second), tokenizer = corpora

    def samples(mmap: bool) -> tuple[set[str], list[np.ndarray]]:
        config = DatasetConfig(
            data_path=["0.3", first, "0.7", second],
            split="90,10,0",
            data_cache_path=str(root / "cache-mmap"),
            mmap_bin_files=mmap,
        )
        train, _, _ = build_datasets(
            config, tokenizer, seq_length=40, seed=9, num_samples=(60, 10, 0)
        )
        readers = {type(part.dataset.bin_reader).__name__ for part in train.datasets}
        return readers, [train[i]["tokens"].numpy() for i in range(len(train))]

    (mapped_readers, mapped), (read_readers, read) = samples(True), samples(False)
    assert mapped_readers == {"_MMapBinReader"} and read_readers == {"_FileBinReader"}
    assert len(mapped) == len(read) == 60
    for one, other in zip(mapped, read):
        np.testing.assert_array_equal(one, other)


def test_weighted_blend_with_an_empty_test_split_builds(corpora):
    """Megatron's default split on 40 documents leaves the test part empty; it is asked for no
    samples and must not be built (megatron-core counted epochs of zero tokens forever)."""
    import faulthandler

    root, (first, _), tokenizer = corpora
    config = DatasetConfig(
        data_path=["0.7", first, "0.3", first],
        split="969,30,1",
        data_cache_path=str(root / "cache-default-split"),
    )
    faulthandler.dump_traceback_later(600, exit=True)  # a hang fails the run instead of idling
    try:
        train, valid, test = build_datasets(
            config, tokenizer, seq_length=64, seed=3, num_samples=(50, 10, 0)
        )
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert len(train) >= 50 and len(valid) >= 10 and test is None


def test_a_split_too_small_for_its_samples_is_refused_in_one_line(corpora):
    root, (first, _), tokenizer = corpora
    config = DatasetConfig(
        data_path=["0.7", first, "0.3", first],
        split="969,30,1",
        data_cache_path=str(root / "cache-too-small"),
    )
    with pytest.raises(ConfigError) as refused:
        build_datasets(config, tokenizer, seq_length=64, seed=3, num_samples=(50, 10, 10))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("--split 969,30,1: the test split of " + first)
    assert "holds 0 documents, 0 tokens, and is asked for 7 samples of 64 tokens" in message
    single = DatasetConfig(
        data_path=[first], split="98,2,0", data_cache_path=str(root / "cache-too-small")
    )
    with pytest.raises(
        ConfigError,
        match=r"the valid split of .* holds 1 documents, \d+ tokens, "
        r"and is asked for 1000000 samples",
    ):
        build_datasets(single, tokenizer, seq_length=64, seed=3, num_samples=(50, 1_000_000, 0))
