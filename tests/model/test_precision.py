"""Layers out of FP8 (``--bf16-layers``, the FP8 guard's switches): which layers the set names,
that it changes between steps without a rebuild, and the FP8 state a load leaves out."""

from __future__ import annotations

import torch

from megatron.apertus.model.engine import EngineConfig
from megatron.apertus.model.precision import PrecisionTransformerLayer, bf16_layers, set_bf16_layers

GEMMS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def test_the_set_names_global_layer_numbers_and_changes_between_steps(tiny_cpu):
    chunk = tiny_cpu.build(engine=EngineConfig(bf16_layers=[2, 4]))
    layers = chunk.decoder.layers
    assert all(isinstance(layer, PrecisionTransformerLayer) for layer in layers)
    assert [layer.in_bf16 for layer in layers] == [False, True, False, True]
    set_bf16_layers([chunk], [1])
    assert bf16_layers([chunk]) == [1]
    assert bf16_layers([tiny_cpu.build()]) == [], "no flag: every layer in FP8 (when it is on)"


def test_without_fp8_a_layer_in_bf16_computes_the_same(tiny_cpu):
    chunk = tiny_cpu.build().eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        before = chunk(tokens, positions, None)
        set_bf16_layers([chunk], [1, 2, 3, 4])
        assert torch.equal(chunk(tokens, positions, None), before)


def test_a_load_leaves_the_fp8_state_of_layers_in_bf16_out(tiny_cpu):
    """Every linear is offered a saved FP8 state; those of layer 2 (in bf16) receive none
    (megatron-core's linears then default it to None, TE's report it missing, which loads
    allow). Seen from a pre-hook of each linear, which runs where it reads its state."""
    chunk = tiny_cpu.build(engine=EngineConfig(bf16_layers=[2]))
    saved = torch.tensor([7], dtype=torch.uint8)
    state = {k: saved if k.endswith("._extra_state") else v for k, v in chunk.state_dict().items()}
    offered: dict[str, object] = {}

    def record(state_dict, prefix, *args) -> None:
        offered[prefix] = state_dict.get(prefix + "_extra_state")

    linears = [m for n, m in chunk.named_modules() if n.endswith(("_qkv", "_proj", "_fc1", "_fc2"))]
    for linear in linears:
        linear._register_load_state_dict_pre_hook(record)
    chunk.load_state_dict(state, strict=False)
    assert len(offered) == 16
    assert {p for p, value in offered.items() if value is not saved} == {
        f"decoder.layers.1.{gemm}." for gemm in GEMMS
    }
    set_bf16_layers([chunk], [])
    chunk.load_state_dict(state, strict=False)
    assert all(value is saved for value in offered.values())
