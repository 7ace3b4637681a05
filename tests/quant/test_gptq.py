"""GPTQ in every format: the blocked Cholesky loop against a float64 column-by-column
reference (the paper's inverse-Hessian elimination, the scale rules written out); its output
error on the calibration inputs is smaller than round-to-nearest's, and its weights lie on the
format's grid with the stated scales. tools/quantize.py end to end on the tiny model, and
evaluation of its fp8/nvfp4 checkpoints with --quant-activations-only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.apertus.checkpoint import load_model_config
from megatron.apertus.convert.hf_io import single_process
from megatron.apertus.convert.quant_io import (
    calibration_hessians,
    calibration_samples,
    read_state,
    rtn_weight,
)
from megatron.apertus.errors import ConfigError
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.quant.formats import (
    fake_fp8,
    fake_nvfp4,
    round_e2m1,
    round_e4m3,
)
from megatron.apertus.quant.gptq import column_grid, gptq, gptq_grid, hessian, rtn
from megatron.apertus.quant.layers import LinearQuantizers, decoder_linears
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_VOCABULARY,
    read_json,
    run_entry,
    run_script,
    series,
)
from tests.distill.test_distillation import (  # noqa: F401 (fixtures)
    STUDENT_DATA,
    logits,
    student_train_data,
    teacher,
)


def correlated_inputs(tokens: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few strong shared directions and some loud channels, as in LLM layers."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, features, generator=g)
    x = torch.randn(tokens, 8, generator=g) @ basis + 0.1 * torch.randn(
        tokens, features, generator=g
    )
    return x * (1 + 4 * (torch.arange(features) % 16 == 0))


@pytest.mark.parametrize("bits,group", [(4, 16), (3, -1), (2, 32)])
def test_gptq_beats_rtn_on_the_calibration_inputs(bits, group):
    x = correlated_inputs(512, 64)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    h = hessian(x)
    q_gptq, q_rtn = gptq(w, h, bits, group), rtn(w, bits, group)

    def error(q: torch.Tensor) -> float:
        return float((x.double() @ (w - q).double().T).pow(2).mean())

    assert error(q_gptq) < 0.7 * error(q_rtn)


def _on_a_grid(group: torch.Tensor, levels: int) -> bool:
    """Whether one scale ``s`` makes every value an integer multiple of ``s`` within
    ``[-levels, levels]``: the largest magnitude is then ``k s`` for some ``k`` in 1..levels."""
    top = group.abs().max()
    if top == 0:
        return True
    for k in range(1, levels + 1):
        multiples = group / (top / k)
        if torch.allclose(multiples, multiples.round(), rtol=0, atol=1e-6):
            return True
    return False


def test_gptq_weights_lie_on_their_groups_grid():
    x = correlated_inputs(256, 64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    q = gptq(w, hessian(x), 4, 16).double().reshape(16 * 4, 16)
    # Codes run over [-8, 7]: a column updated after its group's scale was set can reach -8.
    assert all(_on_a_grid(group, 8) for group in q)
    assert not all(_on_a_grid(group, 8) for group in w.double().reshape(16 * 4, 16))


FORMATS = {
    "int4-g16": QuantConfig(quant_format="int4", quant_group_size=16),
    "fp8-tensor": QuantConfig(quant_format="fp8"),
    "fp8-channel": QuantConfig(quant_format="fp8", quant_fp8_scaling="channel"),
    "nvfp4": QuantConfig(quant_format="nvfp4"),
}
FLOAT_FORMATS = {k: v for k, v in FORMATS.items() if not k.startswith("int")}


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """A scale stored in fp32 (the formats' scales are fp32 numbers), back in float64."""
    return t.float().double()


def _reference_rules(w: torch.Tensor, quant: QuantConfig):
    """(group, scales of a group's current columns, rounding of a column under them) as
    docs/quantization.md states them, float64; ``w`` the weight before any update."""
    a = w.double().abs()
    if quant.quant_format == "int4":

        def int_scales(g: torch.Tensor) -> torch.Tensor:
            s = g.abs().amax(-1) / 7
            return torch.where(s > 0, s, torch.ones_like(s))

        return quant.quant_group_size, int_scales, lambda c, s: (c / s).round().clamp(-8, 7) * s
    if quant.quant_format == "fp8":
        amax = a.amax(-1) if quant.quant_fp8_scaling == "channel" else a.amax()
        scale = _fp32(amax / 448)
        return 0, None, lambda c, _: round_e4m3(c / scale) * scale
    tensor = _fp32(a.amax() / (6 * 448))

    def nvfp4_round(c: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        s = block * tensor
        return torch.where(s > 0, round_e2m1(c / torch.where(s > 0, s, 1)), 0) * s

    return 16, lambda g: round_e4m3(g.abs().amax(-1) / (6 * tensor)), nvfp4_round


def reference_gptq(w: torch.Tensor, h: torch.Tensor, quant: QuantConfig, damp: float = 0.01):
    """GPTQ one column at a time with the paper's update, float64: column ``j`` is rounded,
    the rest move by ``-(w_j - q_j) Hinv[j, k] / Hinv[j, j]``, and ``j`` is eliminated from
    ``Hinv`` (no Cholesky factor, no blocks)."""
    group, scales_of, round_with = _reference_rules(w, quant)
    w = w.double().clone()
    hinv = torch.linalg.inv(h + damp * h.diag().mean() * torch.eye(len(h), dtype=h.dtype))
    q, scales = torch.zeros_like(w), None
    for j in range(w.shape[1]):
        if group and j % group == 0:
            scales = scales_of(w[:, j : j + group])
        q[:, j] = round_with(w[:, j], scales)
        error = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j:] -= error[:, None] * hinv[j, j:]
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q


@pytest.mark.parametrize("name", FORMATS)
def test_gptq_matches_the_float64_reference(name):
    """Same grid point everywhere; values agree to fp32 rounding (a grid step is >= 3%)."""
    x = correlated_inputs(512, 64)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    h = hessian(x)
    got = gptq_grid(w, h, column_grid(w, FORMATS[name]), block_size=32)
    expected = reference_gptq(w, h, FORMATS[name])
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_gptq_beats_rtn_in_the_float_formats(name):
    x = correlated_inputs(512, 64)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    quant = FORMATS[name]
    q_gptq = gptq_grid(w, hessian(x), column_grid(w, quant))
    q_rtn = rtn_weight(w, quant)

    def error(q: torch.Tensor) -> float:
        return float((x.double() @ (w - q).double().T).pow(2).mean())

    assert error(q_gptq) < 0.2 * error(q_rtn)  # measured 0.04-0.05


def on_fp8_grid(q: torch.Tensor, w: torch.Tensor, quant: QuantConfig) -> bool:
    """Whether every value of ``q`` is an e4m3 number times the stated scale of ``w``:
    ``amax / 448`` (fp32) of the tensor, or of each row with channel scaling."""
    a = w.float().abs()
    scale = a.amax(-1, keepdim=True) if quant.quant_fp8_scaling == "channel" else a.amax()
    scale = (scale / 448).double()
    # round_e4m3 saturates at 448, so a value beyond 448 scales fails the comparison
    return torch.equal((round_e4m3(q.double() / scale) * scale).float(), q)


def on_nvfp4_grid(q: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether each 16-value block of every row of ``q`` is e2m1 numbers times one e4m3 block
    scale times the stated tensor scale of ``w``, ``amax / (6 * 448)`` (fp32)."""
    tensor = (w.float().abs().amax() / (6 * 448)).double()

    def block_fits(block: torch.Tensor) -> bool:
        top = block.abs().max()
        for value in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0):  # the e2m1 value the top may have
            scale = round_e4m3(top / (value * tensor)) * tensor
            values = round_e2m1(block / scale)
            if scale > 0 and torch.equal((values * scale).float(), block.float()):
                return True
        return bool(top == 0)

    return all(block_fits(b) for b in q.double().reshape(-1, 16))


def on_grid(q: torch.Tensor, w: torch.Tensor, quant: QuantConfig) -> bool:
    if quant.quant_format == "fp8":
        return on_fp8_grid(q, w, quant)
    return on_nvfp4_grid(q, w)


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_gptq_weights_lie_on_the_float_formats_grid(name):
    quant = FORMATS[name]
    x = correlated_inputs(256, 64)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    q = gptq_grid(w, hessian(x), column_grid(w, quant))
    assert on_grid(q, w, quant)
    assert on_grid(rtn_weight(w, quant), w, quant)
    assert not on_grid(w, w, quant)
    assert not torch.equal(q, rtn_weight(w, quant))


def test_gptq_values_are_not_always_a_fixed_point_of_the_fake_quantizer():
    """Why GPTQ checkpoints are evaluated with --quant-activations-only. fp8, scale 1:
    column 1 holds the maximum, 448, and takes twice column 0's rounding error (401 -> 416;
    its inputs are half column 0's), which brings it to 416; quantizing the result again
    takes the scale 416 / 448, on whose grid column 2's 288 is no longer a value."""
    g = torch.Generator().manual_seed(0)
    x0, x2, noise = torch.randn(3, 256, generator=g)
    x = torch.stack([x0, x0 / 2 + 1e-3 * noise, x2], dim=1)
    w = torch.tensor([[401.0, 448.0, 300.0]])
    quant = QuantConfig(quant_format="fp8")
    q = gptq_grid(w, hessian(x), column_grid(w, quant))
    assert q.tolist() == [[416.0, 416.0, 288.0]]
    assert not torch.equal(fake_fp8(q, per_row=False), q)
    only = LinearQuantizers(
        QuantConfig(quant_format="fp8", quant_activations_only=True),
        row_parallel=False,
        tp_group=None,
    )
    assert only.weight(q) is q


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_activations_only_quantizes_the_inputs_and_not_the_weights(name):
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(32, 64, generator=g), torch.randn(2, 8, 64, generator=g)
    full = LinearQuantizers(FORMATS[name], row_parallel=False, tp_group=None)
    only = LinearQuantizers(
        QuantConfig(**{**FORMATS[name].__dict__, "quant_activations_only": True}),
        row_parallel=False,
        tp_group=None,
    )
    assert only.weight(w) is w
    assert not torch.equal(full.weight(w), w)
    assert torch.equal(only.input(x), full.input(x))
    assert not torch.equal(only.input(x), x)


def test_activations_only_with_an_int_format_is_refused():
    with pytest.raises(ConfigError, match="--quant-activations-only needs --quant-format fp8"):
        QuantConfig(quant_format="int4", quant_activations_only=True)
    args = ["--model-preset", "tiny", "--train-iters", "1", "--quant-format", "int4"]
    proc = run_script(PRETRAIN, [*args, "--quant-activations-only"])
    assert proc.returncode == 2
    assert "error: --quant-activations-only needs --quant-format fp8 or nvfp4" in (
        proc.stderr.strip().splitlines()[-1]
    )
    assert "Traceback" not in proc.stderr


# tools/quantize.py end to end on the tiny teacher, calibrated on its logit store's samples.
CALIBRATION_SAMPLES = 8
EVAL = [
    "--model-preset",
    "tiny",
    "--seed",
    "3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "2",
    "--finetune",
    "--train-iters",
    "0",
    *SMALL_VOCABULARY,
]
FLAGS = {
    "fp8-tensor": ["--quant-format", "fp8"],
    "fp8-channel": ["--quant-format", "fp8", "--quant-fp8-scaling", "channel"],
    "nvfp4": ["--quant-format", "nvfp4"],
}


def quantize(load: Path, save: Path, method: str, name: str, store: Path | None = None) -> Path:
    args = ["--load", str(load), "--save", str(save), "--method", method, *FLAGS[name]]
    if method == "gptq":
        args += [
            "--distill-logits-path",
            str(store),
            "--calibration-samples",
            str(CALIBRATION_SAMPLES),
            *STUDENT_DATA,
        ]
    run_entry(REPO / "tools" / "quantize.py", args)
    return save


def states_and_hessians(teacher: Path, quantized: Path, store: Path):
    """The teacher's and ``quantized``'s tensors, and the teacher's decoder-linear Hessians on
    the calibration samples (the tool's own)."""
    model = load_model_config(teacher)
    with single_process(model) as chunk:
        base, out = read_state(chunk, teacher), read_state(chunk, quantized)
        samples = calibration_samples(
            store,
            CALIBRATION_SAMPLES,
            seq_length=model.seq_length,
            dataset=student_train_data(model.seq_length),
        )
        return base, out, calibration_hessians(chunk, samples)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("fp8-tensor", marks=pytest.mark.slow),
        pytest.param("fp8-channel", marks=pytest.mark.slow),
        "nvfp4",
    ],
)
def test_gptq_tool_in_the_float_formats(teacher, logits, tmp_path, name):  # noqa: F811
    out = quantize(teacher, tmp_path / "gptq", "gptq", name, logits)
    base, quantized, hessians = states_and_hessians(teacher, out, logits)
    quant = FORMATS[name]
    ratios = []
    for layer in hessians:
        key = f"{layer}.weight"
        w, q, h = base[key], quantized[key], hessians[layer]
        assert on_grid(q, w, quant), key

        def error(candidate: torch.Tensor) -> float:
            """``||X W^T - X Q^T||^2 / n`` on the calibration inputs, up to the factor 2."""
            d = w.double() - candidate.double()
            return float(torch.trace(d @ h @ d.T))

        ratios.append(error(q) / error(rtn_weight(w, quant)))
    assert len(ratios) == 4 * 4 and max(ratios) < 1  # measured 0.001-0.81 (layer 0 qkv)
    linears = {f"{layer}.weight" for layer in hessians}
    assert all(torch.equal(base[k], quantized[k]) for k in base if k not in linears)


@pytest.mark.parametrize("name", [pytest.param("fp8-tensor", marks=pytest.mark.slow), "nvfp4"])
def test_rtn_tool_and_activations_only_evaluation(teacher, tmp_path, name):  # noqa: F811
    """RTN through the tool stores the fake quantizer's weights, bitwise; evaluated with
    --quant-activations-only it gives the fake-quantized teacher's validation loss, exactly."""
    out = quantize(teacher, tmp_path / "rtn", "rtn", name)
    quant = FORMATS[name]
    model = load_model_config(teacher)
    with single_process(model) as chunk:
        base, quantized = read_state(chunk, teacher), read_state(chunk, out)
        linears = {f"{layer}.weight" for layer, _ in decoder_linears(chunk)}
    for key in base:
        fake = (
            fake_nvfp4
            if quant.quant_format == "nvfp4"
            else (lambda t: fake_fp8(t, per_row=quant.quant_fp8_scaling == "channel"))
        )
        assert torch.equal(quantized[key], fake(base[key]) if key in linears else base[key]), key

    def valid_loss(load: Path, *flags: str) -> float:
        log = tmp_path / f"eval{len(list(tmp_path.glob('*.json')))}.json"
        run_entry(PRETRAIN, EVAL + ["--load", str(load), "--log-json", str(log), *flags])
        return series(read_json(log), "valid/loss")[1][0]

    only = [*FLAGS[name], "--quant-activations-only"]
    fake_quantized_teacher = valid_loss(teacher, *FLAGS[name])
    assert valid_loss(out, *only) == fake_quantized_teacher
    assert valid_loss(teacher, *only) != fake_quantized_teacher  # its weights stay as loaded
