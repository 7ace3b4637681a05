"""The Apertus slot modules against independent references (Hugging Face, megatron-core)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.apertus.model import preset
from megatron.apertus.model.attention import SDPAttention
from megatron.apertus.model.layers import XIELU, RMSNorm
from megatron.apertus.ops.xielu import xielu_reference


@pytest.fixture
def tiny_setup(tiny_cpu):
    model = preset("tiny", vocab_size=512)
    return model, tiny_cpu.config(model)


def test_xielu_initial_alphas_are_the_published_ones(tiny_setup):
    _, config = tiny_setup
    act = XIELU(config, beta=0.5, eps=-1e-6)
    assert F.softplus(act.alpha_p).item() == pytest.approx(0.8)
    assert 0.5 + F.softplus(act.alpha_n).item() == pytest.approx(0.8)


def test_xielu_module_matches_huggingface(tiny_setup):
    from transformers.activations import XIELUActivation

    _, config = tiny_setup
    ours = XIELU(config, beta=0.5, eps=-1e-6)
    hf = XIELUActivation(dtype=torch.float32)
    with torch.no_grad():
        ours.alpha_p.fill_(0.3)
        ours.alpha_n.fill_(-0.2)
        hf.alpha_p.fill_(0.3)
        hf.alpha_n.fill_(-0.2)
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(ours(x), hf._xielu_python(x), rtol=1e-6, atol=1e-6)


def test_xielu_reference_gradcheck_fp64():
    # Random points: the derivative jumps at 0 (beta vs beta - alpha_n), where finite
    # differences are meaningless.
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    a_p = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
    a_n = torch.tensor([-0.9], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(xielu_reference, (x, a_p, a_n))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rmsnorm_matches_huggingface(tiny_setup, dtype, tol):
    from transformers.models.apertus.modeling_apertus import ApertusRMSNorm

    _, config = tiny_setup
    ours, hf = RMSNorm(config, 48, eps=1e-5), ApertusRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        weight = torch.rand(48) + 0.5
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    x = torch.randn(3, 5, 48).to(dtype)
    torch.testing.assert_close(ours.to(dtype)(x), hf.to(dtype)(x), rtol=tol, atol=tol)


def test_sdpa_attention_matches_megatron_dot_product_attention(tiny_setup):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    _, config = tiny_setup
    kwargs = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    ours, reference = SDPAttention(**kwargs), DotProductAttention(**kwargs)
    seq, batch, heads, groups, dim = (
        11,
        2,
        config.num_attention_heads,
        config.num_query_groups,
        config.kv_channels,
    )
    q = torch.randn(seq, batch, heads, dim)
    k, v = torch.randn(seq, batch, groups, dim), torch.randn(seq, batch, groups, dim)
    torch.testing.assert_close(ours(q, k, v, None), reference(q, k, v, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("queries", [1, 4])
def test_sdpa_attention_with_fewer_queries_than_keys_is_the_end_of_causal(tiny_setup, queries):
    """Under a KV cache the queries are the last tokens of the keys (megatron-core then passes no
    mask): their output is the last rows of causal attention over the whole sequence."""
    from megatron.core.transformer.enums import AttnMaskType

    _, config = tiny_setup
    attention = SDPAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    seq, heads, groups, dim = 9, config.num_attention_heads, config.num_query_groups, 16
    q = torch.randn(seq, 1, heads, dim)
    k, v = torch.randn(seq, 1, groups, dim), torch.randn(seq, 1, groups, dim)
    whole = attention(q, k, v, None)
    last = attention(q[-queries:], k, v, None)
    torch.testing.assert_close(last, whole[-queries:], rtol=1e-6, atol=1e-6)
    # negative control: what SDPA's own causal mask gives (query i sees keys 0 .. i only)
    first_aligned = attention(q[-queries:], k[:queries], v[:queries], None)
    assert not torch.allclose(first_aligned, whole[-queries:], atol=1e-3)


@pytest.mark.parametrize("untied", [True, False])
def test_parameter_count_formula_matches_megatron(tiny_cpu, untied):
    model = preset("tiny", vocab_size=512, untie_embeddings_and_output_weights=untied)
    chunk = tiny_cpu.build(model)
    assert sum(p.numel() for p in chunk.parameters()) == model.num_parameters()


def test_published_sizes():
    assert preset("apertus-8b").num_parameters() / 1e9 == pytest.approx(8.05, abs=0.05)
    assert preset("apertus-70b").num_parameters() / 1e9 == pytest.approx(70.6, abs=0.3)
