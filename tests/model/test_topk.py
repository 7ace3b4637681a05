"""The teacher's last stage takes its top-k from the final hidden states, a chunk of tokens at a
time: ids and log-probabilities are bitwise those of megatron-core's full logits (the reference:
the plain GPTModel's output, then :func:`global_topk`)."""

from __future__ import annotations

import pytest
import torch

from megatron.apertus.model.topk import default_topk_chunk_rows, global_topk, row_chunks
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer

TOPK = 16


def test_row_chunks_cover_all_rows_without_a_short_last_chunk():
    assert row_chunks(256, 64) == [slice(0, 64), slice(64, 128), slice(128, 192), slice(192, 256)]
    assert row_chunks(256, 96) == [slice(0, 96), slice(96, 256)]
    assert row_chunks(50, 64) == [slice(0, 50)]


def test_default_chunk_is_about_256_mib_of_logits():
    assert default_topk_chunk_rows(131072, torch.float32) == 512
    assert default_topk_chunk_rows(65536, torch.bfloat16) == 2048
    assert default_topk_chunk_rows(10**7, torch.bfloat16) == 64  # never fewer rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_topk_is_bitwise_the_full_logits_topk(tiny_cpu, dtype):
    plain = tiny_cpu.build(params_dtype=dtype).eval()
    chunked = tiny_cpu.build(params_dtype=dtype, topk=TOPK).eval()
    chunked.load_state_dict(plain.state_dict())
    ids = build_tokenizer("TekkenTokenizer").encode_document(embedded_documents()[3])[:256]
    tokens = torch.tensor([ids[:128], ids[128:]])
    positions = torch.arange(128).expand(2, -1)
    with torch.no_grad():
        want_ids, want_logprobs = global_topk(
            plain(tokens, positions, None), TOPK, group=plain.pg_collection.tp
        )
        # 4 chunks; 96 + 160 (the remainder joins the last); one chunk; the default
        for rows in (64, 96, 256, None):
            chunked.chunk_rows = rows
            got_ids, got_logprobs = chunked(tokens, positions, None)
            assert got_ids.shape == (2, 128, TOPK)
            assert torch.equal(got_ids, want_ids), rows
            assert torch.equal(got_logprobs, want_logprobs), rows
