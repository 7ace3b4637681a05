"""A micro-batch's share per context-parallel rank (megatron/apertus/data/context_parallel.py), on
real documents cut at lengths that are not multiples of 2 x CP, so they cross chunk boundaries:
every real token lands on exactly one rank with its label, loss mask, Goldfish decision, teacher
targets and document position; padding carries no loss; the unpacked split is Megatron's."""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.data.batches import BatchConfig, collate
from megatron.apertus.data.context_parallel import padded_document_sources, shard_batch
from megatron.apertus.data.goldfish import GoldfishConfig
from megatron.apertus.model.fused_loss import TeacherTargets
from megatron.apertus.ops.cp_attention import document_partition, sequence_partition
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer

SEQ = 48
LENGTHS = [13, 22, 13]  # one row: 48 tokens, no document a multiple of 4 or 8


@pytest.fixture(scope="module")
def batch_config():
    tokenizer = build_tokenizer("TekkenTokenizer")
    return tokenizer, BatchConfig(
        eod=tokenizer.eod, pack_documents=True, goldfish=GoldfishConfig(k=3, h=5)
    )


def _samples(tokenizer) -> list[dict]:
    encoded = [tokenizer.encode_document(t) for t in embedded_documents()[10:40]]
    docs = [
        ids[: n - 1] + [tokenizer.eod]
        for ids, n in zip([ids for ids in encoded if len(ids) > 30], LENGTHS + LENGTHS[::-1])
    ]
    rows = [sum(docs[:3], []), sum(docs[3:], [])]
    return [
        {
            "tokens": torch.tensor(r),
            "labels": torch.tensor(r[1:] + [tokenizer.eod]),
            "loss_mask": torch.ones(len(r)),
        }
        for r in rows
    ]


def _teacher(batch) -> TeacherTargets:
    ids = torch.arange(batch.tokens.numel() * 2).view(*batch.tokens.shape, 2)
    return TeacherTargets(ids=ids, probs=ids.float() / 1000, alpha=0.5)


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_shares_hold_every_real_token_once(batch_config, cp):
    tokenizer, config = batch_config
    full = collate(_samples(tokenizer), config)
    full.teacher = _teacher(full)
    assert full.packed_seq_params.cu_seqlens_q.tolist() == [0, 13, 35, 48, 61, 83, 96]
    assert full.goldfish_dropped > 0
    sources, real, cu_padded = padded_document_sources(full.packed_seq_params.cu_seqlens_q, cp)
    assert all(n % (2 * cp) == 0 for n in (cu_padded[1:] - cu_padded[:-1]).tolist())
    seen, loss_sum, dropped = [], 0.0, 0
    for rank in range(cp):
        share = shard_batch(full, rank, cp)
        mine = document_partition(cu_padded, cp)[rank]
        keep = real[mine]
        assert share.tokens.shape[1] == cu_padded[-1] // cp
        assert share.loss_mask[0, ~keep].sum() == 0  # padding carries no loss
        source = sources[mine][keep]
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(share, name)[0, keep], getattr(full, name)[0, source])
        assert torch.equal(share.teacher.ids[0, keep], full.teacher.ids[0, source])
        assert share.packed_seq_params.cu_seqlens_q.tolist() == cu_padded.tolist()
        seen += source.tolist()
        loss_sum += float(share.loss_mask.sum())
        dropped += share.goldfish_dropped
    assert sorted(seen) == list(range(full.tokens.shape[1]))
    assert loss_sum == float(full.loss_mask.sum())
    assert dropped == full.goldfish_dropped  # counted once per CP group


def test_unpacked_shares_are_megatrons_chunks(batch_config):
    tokenizer, config = batch_config
    full = collate(_samples(tokenizer), BatchConfig(eod=config.eod))
    for rank in range(2):
        share = shard_batch(full, rank, 2)
        index = sequence_partition(SEQ, 2)[rank]
        assert index.tolist() == list(range(12 * rank, 12 * rank + 12)) + list(
            range(36 - 12 * rank, 48 - 12 * rank)
        )  # chunks i and 3 - i of four
        assert torch.equal(share.tokens, full.tokens[:, index])
        assert torch.equal(share.position_ids, full.position_ids[:, index])
