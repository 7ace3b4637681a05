"""Training datasets through megatron-core's builder: blends, splits, layout-independent order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron.apertus import parallel
from megatron.apertus.data.batches import BatchConfig, step_micro_batches
from megatron.apertus.data.corpus import embedded_documents
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.data.preprocess import PreprocessConfig, preprocess
from megatron.apertus.data.tokenizer import build_tokenizer
from megatron.apertus.model import ParallelConfig


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
    config = DatasetConfig(data_path=["0.25", first, "0.75", second], split="100,0,0",
                           data_cache_path=str(root / "cache"))  # fmt: skip
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
    config = DatasetConfig(train_data_path=[first], valid_data_path=[second],
                           data_cache_path=str(root / "cache"))  # fmt: skip
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
            rows += step_micro_batches(train, batch, consumed_samples=16, global_batch_size=8,
                                       micro_batch_size=2, dp_rank=rank, dp_size=dp_size)  # fmt: skip
        return [r.tolist() for b in rows for r in b.tokens]

    assert step_tokens(1) == step_tokens(2) == step_tokens(4)
