"""Which parameters the optimizer decays: megatron-core's rule (no decay on 1-D parameters and
biases: the norms, the QK-norms, xIELU's alphas), and Megatron-LM's --apply-wd-to-qk-layernorm
(and its deprecated spelling --no-weight-decay-cond-type apply_wd_to_qk_layernorm), which decays
the query and key norms' weights as well; for Adam and AdEMAMix, read from the built optimizer's
param groups on the tiny model."""

from __future__ import annotations

import pytest

import pretrain_gpt
from megatron.apertus.optim import AdEMAMixSettings, get_apertus_optimizer
from megatron.apertus.training.optimizer import megatron_optimizer_config
from megatron.apertus.training.step import wrap_ddp
from tests.optim.megatron_worker import weight_decay_by_name

WD = 0.05
QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def _decay(tiny_cpu, flags: list[str]) -> dict[str, float]:
    """Each parameter's weight decay in the optimizer that ``flags`` build."""
    settings = pretrain_gpt.parse_args(
        ["--device", "cpu", "--train-iters", "1", "--weight-decay", str(WD), *flags]
    ).optimizer
    chunk = tiny_cpu.build()
    model = wrap_ddp([chunk], chunk.config, use_distributed_optimizer=False)
    config = megatron_optimizer_config(settings, "fp32")
    extra = AdEMAMixSettings() if settings.optimizer == "ademamix" else None
    return weight_decay_by_name(model, get_apertus_optimizer(config, model, extra))


@pytest.mark.parametrize("optimizer", ["adam", "ademamix"])
@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--apply-wd-to-qk-layernorm"],
        ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"],
    ],
    ids=["default", "apply-wd-to-qk-layernorm", "no-weight-decay-cond-type"],
)
def test_qk_layernorm_decay(tiny_cpu, optimizer, flags):
    decay = _decay(tiny_cpu, ["--optimizer", optimizer, *flags])
    qk = {name: wd for name, wd in decay.items() if name.endswith(QK_NORMS)}
    others_1d = {
        name: wd
        for name, wd in decay.items()
        if name not in qk and ("norm" in name or "alpha" in name or name.endswith(".bias"))
    }
    matrices = {name: wd for name, wd in decay.items() if name not in qk and name not in others_1d}
    assert len(qk) == 2 * tiny_cpu.model.num_layers, "a query and a key norm in each layer"
    assert set(qk.values()) == {WD if flags else 0.0}
    assert others_1d and set(others_1d.values()) == {0.0}, "the other norms and alphas stay"
    assert matrices and set(matrices.values()) == {WD}
