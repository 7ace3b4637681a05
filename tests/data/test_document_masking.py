"""Packed documents: no attention across documents, positions restart at each one."""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.data.batches import BatchConfig, collate, document_lengths
from megatron.apertus.data.datasets import DatasetConfig
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import cpu_models

SEQ = 160


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_tokenizer("TekkenTokenizer")
    with cpu_models() as models:
        yield tokenizer, models.build().eval()


def documents(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Real documents (long enough) cut to ``lengths`` tokens, each ``<s> ... </s>``."""
    encoded = [tokenizer.encode_document(t) for t in embedded_documents()[10:40]]
    long_enough = [ids for ids in encoded if len(ids) >= max(lengths)]
    return [ids[: n - 1] + [tokenizer.eod] for ids, n in zip(long_enough, lengths)]


def packed_batch(rows: list[list[int]], eod: int, pack: bool = True):
    samples = [
        {
            "tokens": torch.tensor(r),
            "labels": torch.tensor(r[1:] + [eod]),
            "loss_mask": torch.ones(len(r)),
        }
        for r in rows
    ]
    return collate(samples, BatchConfig(eod=eod, pack_documents=pack))


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(
            batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params
        )


def test_segments_and_positions_restart(setup):
    tokenizer, _ = setup
    a, b, c = documents(tokenizer, [50, 70, 40])
    batch = packed_batch([a + b + c[:40]], tokenizer.eod)
    assert batch.packed_seq_params.cu_seqlens_q.tolist() == [0, 50, 120, 160]
    positions = batch.position_ids[0].tolist()
    assert positions[:3] == [0, 1, 2] and positions[50] == 0 and positions[120] == 0
    assert document_lengths(torch.tensor([[5, 2, 7, 2]]), eod=2) == [2, 2]


def test_perturbing_one_document_leaves_the_others_bitwise_unchanged(setup):
    tokenizer, model = setup
    a, b, c, d = documents(tokenizer, [50, 70, 40, 160])
    reference = logits(model, packed_batch([a + b + c, d], tokenizer.eod))
    noise = torch.randint(1000, 100000, (len(a) - 2,), generator=torch.Generator().manual_seed(0))
    a_perturbed = [a[0], *noise.tolist(), a[-1]]
    changed = logits(model, packed_batch([a_perturbed + b + c, d], tokenizer.eod))
    assert not torch.equal(changed[:, :50], reference[:, :50])
    assert torch.equal(changed[:, 50:], reference[:, 50:])

    # Without packing the same perturbation leaks into later documents: the test can fail.
    unpacked = logits(model, packed_batch([a + b + c], tokenizer.eod, pack=False))
    unpacked_changed = logits(model, packed_batch([a_perturbed + b + c], tokenizer.eod, pack=False))
    assert not torch.allclose(unpacked[:, 50:], unpacked_changed[:, 50:])


def test_a_document_inside_a_pack_equals_the_document_alone(setup):
    tokenizer, model = setup
    a, b, c = documents(tokenizer, [50, 70, 40])
    packed = logits(model, packed_batch([a + b + c], tokenizer.eod))
    alone = logits(model, packed_batch([b], tokenizer.eod))
    torch.testing.assert_close(packed[:, 50:120], alone, rtol=1e-5, atol=1e-5)


def test_position_reset_requires_document_masking():
    with pytest.raises(ValueError, match="--reset-attention-mask"):
        DatasetConfig(reset_position_ids=True)
