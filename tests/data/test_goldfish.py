"""Goldfish masks: rate, context determinism, and parity of the Apertus rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.apertus.data.batches import BatchConfig, collate
from megatron.apertus.data.goldfish import (
    APERTUS_TABLE_SEED,
    APERTUS_TABLE_SIZE,
    GoldfishConfig,
    goldfish_drop_mask,
)
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer


@pytest.fixture(scope="module")
def stream() -> torch.Tensor:
    """The embedded corpus as one real token stream (~109k tekken tokens)."""
    tokenizer = build_tokenizer("TekkenTokenizer")
    ids = [t for doc in embedded_documents() for t in tokenizer.encode_document(doc)]
    return torch.tensor(ids, dtype=torch.int64)


def samples(stream: torch.Tensor, length: int) -> torch.Tensor:
    n = stream.numel() // length
    return stream[: n * length].view(n, length)


def test_mix64_drops_one_in_k_on_real_text(stream):
    config = GoldfishConfig(k=50, h=50, hash="mix64")
    labels = samples(stream, 4096)
    drop = goldfish_drop_mask(labels, config)
    rate = drop[:, config.h - 1 :].float().mean().item()
    assert abs(rate - 1 / 50) < 0.1 * (1 / 50), rate


@pytest.mark.parametrize("rule", ["mix64", "apertus"])
def test_repeated_passage_gets_the_same_mask_in_any_sample(stream, rule):
    config = GoldfishConfig(k=4, h=13, hash=rule)
    passage = stream[5000:5600]
    first = torch.cat([stream[:137], passage, stream[9000:9263]])
    second = torch.cat([stream[20000:20411], passage])
    mask_a = goldfish_drop_mask(first.unsqueeze(0), config)[0, 137:737]
    mask_b = goldfish_drop_mask(second.unsqueeze(0), config)[0, 411:1011]
    # From the h-th token of the passage on, every window lies inside the passage.
    assert torch.equal(mask_a[config.h - 1 :], mask_b[config.h - 1 :])
    assert mask_a[config.h - 1 :].any()


def _independent_apertus_mask(labels: list[int], k: int, h: int, table: np.ndarray) -> list[bool]:
    """The Apertus rule written out with Python integers and explicit two's-complement wrap."""
    mask = [False] * len(labels)
    for i in range(h - 1, len(labels)):
        product = 1
        for token in labels[i - h + 1 : i + 1]:
            product = (product * token) & 0xFFFFFFFFFFFFFFFF
        if product >= 1 << 63:
            product -= 1 << 64
        mask[i] = bool(table[product % APERTUS_TABLE_SIZE] < 1 / k)
    return mask


def test_apertus_rule_matches_an_independent_implementation(stream):
    config = GoldfishConfig(k=50, h=50, hash="apertus")
    table = torch.rand(
        APERTUS_TABLE_SIZE, generator=torch.Generator().manual_seed(APERTUS_TABLE_SEED)
    )
    labels = samples(stream[:8192], 2048)
    ours = goldfish_drop_mask(labels, config)
    for row, mask in zip(labels.tolist(), ours.tolist()):
        assert mask == _independent_apertus_mask(row, config.k, config.h, table.numpy())
    assert not ours[:, : config.h - 1].any(), "the first h-1 positions are never dropped"


def test_apertus_rule_realised_rate_is_below_one_in_k(stream):
    """Documented quirk: wrapped products of 0 share one table entry."""
    config = GoldfishConfig(k=50, h=50, hash="apertus")
    rate = goldfish_drop_mask(samples(stream, 4096), config)[:, 49:].float().mean().item()
    assert 0 < rate < 1 / 50


def test_collate_masks_a_copy_and_counts(stream):
    sample_list = [
        {
            "tokens": stream[i : i + 512],
            "labels": stream[i + 1 : i + 513],
            "loss_mask": torch.ones(512),
        }
        for i in (0, 700)
    ]
    before = [s["loss_mask"].clone() for s in sample_list]
    batch = collate(sample_list, BatchConfig(eod=2, goldfish=GoldfishConfig(k=8, h=8)))
    for sample, original in zip(sample_list, before):
        assert torch.equal(sample["loss_mask"], original), "dataset arrays must not be mutated"
    assert batch.goldfish_dropped == int((batch.loss_mask == 0).sum()) > 0
    assert batch.loss_positions == 1024


def test_bad_goldfish_settings_are_refused():
    with pytest.raises(ValueError, match="--goldfish-k"):
        GoldfishConfig(k=1)
    with pytest.raises(ValueError, match="--goldfish-hash"):
        GoldfishConfig(hash="md5")


@pytest.mark.parametrize("rule", ["mix64", "apertus"])
def test_exempting_special_tokens_keeps_them_and_changes_nothing_else(stream, rule):
    """--goldfish-exempt-special: no control-token label is dropped; every other decision is the
    default's, and the default drops special labels like any other (Apertus-1 behaviour)."""
    tokenizer = build_tokenizer()
    labels = samples(stream, 256)
    special = torch.tensor(tokenizer.special_ids())
    default = goldfish_drop_mask(labels, GoldfishConfig(k=4, h=3, hash=rule), special)
    exempt = goldfish_drop_mask(
        labels, GoldfishConfig(k=4, h=3, hash=rule, exempt_special=True), special
    )
    is_special = torch.isin(labels, special)
    assert is_special.sum() > 100 and (default & is_special).sum() > 10
    assert not (exempt & is_special).any()
    assert torch.equal(exempt, default & ~is_special)
    assert set(tokenizer.special_ids()) == set(range(1000))  # tekken's reserved control ids
