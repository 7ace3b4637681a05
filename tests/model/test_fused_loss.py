"""The fused output layer + loss gives megatron-core's loss and gradients without the logits."""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer


@pytest.fixture
def models(tiny_cpu):
    plain = tiny_cpu.build()
    fused = tiny_cpu.build(fused_loss=True)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_fused_loss_and_gradients_match_megatron(models):
    plain, fused = models
    ids = build_tokenizer("TekkenTokenizer").encode_document(embedded_documents()[7])[:129]
    tokens = torch.tensor([ids[:-1], ids[1:]])  # two rows
    labels = torch.tensor([ids[1:], ids[:-1]])
    positions = torch.arange(128).expand(2, -1)
    mask = torch.ones(2, 128)
    mask[1, :40] = 0
    per_token = plain(tokens, positions, None, labels=labels)
    expected = (per_token * mask).sum()
    expected.backward()
    got = fused(tokens, positions, None, labels=labels, loss_mask=mask)
    assert got.dim() == 0
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Without labels the fused model still returns logits (generation, export checks).
    logits = fused(tokens, positions, None)
    assert logits.shape == (2, 128, 131072)
