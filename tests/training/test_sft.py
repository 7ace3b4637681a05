"""Supervised fine-tuning: chat samples carry exactly the stored assistant mask, and
``pretrain_gpt.py --sft --finetune`` lowers the held-out assistant-token loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

from examples.chat_demo import docstring_conversations
from megatron.apertus.data.sft import ChatGPTDataset, MaskedIndexedDataset
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import PRETRAIN, REPO, read_json, run_entry, run_script, series

TOOL = REPO / "tools" / "preprocess_chat.py"
BASE = [
    "--model-preset",
    "tiny",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "4",
    "--log-interval",
    "1",
    "--reset-attention-mask",
    "--reset-position-ids",
]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """The standard-library demo conversations: a training and a held-out chat dataset."""
    root = tmp_path_factory.mktemp("chats")
    conversations = docstring_conversations()
    prefixes = {}
    for part, records in (("train", conversations[:380]), ("valid", conversations[380:])):
        source = root / f"{part}.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        run_entry(TOOL, ["--input", str(source), "--output-prefix", str(root / part)])
        prefixes[part] = str(root / f"{part}_chat_document")
    return prefixes


@pytest.mark.smoke  # megatron-core 0.19 changed what GPTDataset returns
def test_samples_carry_the_stored_mask_of_their_labels(chats, tmp_path):
    prefix = chats["valid"]
    tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + "_loss_mask")
    low = MaskedIndexedDataset(prefix)
    config = GPTDatasetConfig(
        random_seed=3,
        sequence_length=64,
        blend=([prefix], None),
        split="100,0,0",
        path_to_cache=str(tmp_path),
        tokenizer=build_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    dataset = ChatGPTDataset(
        low, prefix, np.arange(len(low), dtype=np.int32), 40, Split.train, config
    )
    assert len(dataset) >= 40
    for i in range(40):
        sample = dataset[i]
        document_ids = dataset._query_document_sample_shuffle_indices(i)[1]
        _, offset = dataset.sample_index[dataset.shuffle_index[i]]
        ids = np.concatenate([np.array(tokens[d]) for d in document_ids])[offset : offset + 65]
        mask = np.concatenate([np.array(masks[d]) for d in document_ids])[offset : offset + 65]
        assert sample["tokens"].tolist() == ids[:-1].tolist()
        assert sample["labels"].tolist() == ids[1:].tolist()
        assert sample["loss_mask"].tolist() == mask[1:].astype(np.float32).tolist()
    assert 0 < float(sum(dataset[i]["loss_mask"].sum() for i in range(40))) < 40 * 64


@pytest.mark.slow
def test_sft_lowers_the_held_out_assistant_loss(chats, tmp_path):
    run_entry(
        PRETRAIN,
        BASE
        + [
            "--train-iters",
            "4",
            "--lr",
            "3e-3",
            "--eval-iters",
            "0",
            "--save",
            str(tmp_path / "base"),
        ],
    )
    log = tmp_path / "sft.json"
    proc = run_entry(
        PRETRAIN,
        BASE
        + [
            "--sft",
            "--finetune",
            "--load",
            str(tmp_path / "base"),
            "--train-iters",
            "12",
            "--lr",
            "3e-3",
            "--train-data-path",
            chats["train"],
            "--valid-data-path",
            chats["valid"],
            "--eval-iters",
            "2",
            "--eval-interval",
            "12",
            "--log-json",
            str(log),
        ],
    )
    assert "--finetune: weights loaded from" in proc.stdout
    assert "goldfish" not in proc.stdout  # off unless asked for
    _, valid = series(read_json(log), "valid/loss")
    assert valid[-1] < valid[0] - 0.3, valid


def test_sft_refuses_a_dataset_without_its_mask(chats, tmp_path):
    plain = tmp_path / "plain_chat_document"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"plain_chat_document{suffix}").write_bytes(
            open(chats["valid"] + suffix, "rb").read()
        )
    proc = run_script(PRETRAIN, [*BASE, "--sft", "--train-iters", "1", "--data-path", str(plain)])
    assert proc.returncode == 2
    assert "_loss_mask.bin is missing" in proc.stderr.strip().splitlines()[-1]
