"""Quantization-aware distillation through pretrain_gpt.py: every format trains from the teacher
logits, resumes bitwise, and a TP=2 run gives the losses of one process.

TP tolerance. The fake quantizers see the same full tensors in every layout (maxima spanning
ranks are max-reduced), but TP sums matmuls in another order, so activations and, after the
first update, weights differ by fp32 round-off; an element within that round-off of a rounding
tie then takes the other grid value, and training amplifies the difference step by step.
Weight-only int4: every loss within relative 1e-5 (measured ~1e-7). NVFP4 also quantizes the
activations to eight magnitudes, so such flips happen in every forward pass: the first three
steps agree within 1e-5 (measured ~1e-7), the sixth within 1e-3 (measured 1.4e-4)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import PRETRAIN, REPO, read_json, run_entry, run_script, series
from tests.distill.test_distillation import STUDENT, logits, teacher  # noqa: F401 (fixtures)

TP_RTOL = {"int4": (1e-5, 1e-5), "nvfp4": (1e-5, 1e-3)}
"""(first three steps, all steps)"""
# The distillation test's student run, at the teacher's shape (QAD trains the teacher's own
# weights) and with a fine-tuning learning rate.
_LAYERS = STUDENT.index("--num-layers")
QAD_RUN = STUDENT[:_LAYERS] + STUDENT[_LAYERS + 2 :] + ["--lr", "1e-4"]


def qad(teacher, logits, fmt: str, *extra: str, group: str = "16") -> list[str]:  # noqa: F811
    group_flags = ["--quant-group-size", group] if fmt.startswith("int") else []
    return QAD_RUN + [
        "--load",
        str(teacher),
        "--finetune",
        "--distill-logits-path",
        str(logits),
        "--quant-format",
        fmt,
        *group_flags,
        *extra,
    ]


@pytest.mark.parametrize(
    "fmt",
    [
        "int4",
        pytest.param("fp8", marks=pytest.mark.slow),
        pytest.param("nvfp4", marks=pytest.mark.slow),
    ],
)
def test_qad_resumes_bitwise(teacher, logits, tmp_path, fmt):  # noqa: F811
    run_entry(PRETRAIN, qad(teacher, logits, fmt, "--log-json", str(tmp_path / "full.json")))
    save = tmp_path / "ckpt"
    run_entry(PRETRAIN, qad(teacher, logits, fmt, "--save", str(save), "--exit-interval", "3"))
    resumed = [a for a in qad(teacher, logits, fmt) if a != "--finetune"]
    resumed[resumed.index(str(teacher))] = str(save)
    run_entry(PRETRAIN, resumed + ["--save", str(save), "--log-json", str(tmp_path / "res.json")])
    full = series(read_json(tmp_path / "full.json"), "train/loss")
    assert series(read_json(tmp_path / "res.json"), "train/loss") == full
    assert len(full[0]) == 6

    plain = tmp_path / "plain.json"
    args = qad(teacher, logits, fmt)
    cut = args.index("--quant-format")
    run_entry(PRETRAIN, args[:cut] + ["--log-json", str(plain)])
    assert series(read_json(plain), "train/loss")[1][0] != full[1][0]  # quantization is on


@pytest.mark.parametrize("fmt", ["int4", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_qad_with_tp2_gives_the_single_process_losses(teacher, logits, tmp_path, fmt):  # noqa: F811
    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    run_entry(PRETRAIN, qad(teacher, logits, fmt, "--log-json", str(one)))
    run_entry(
        PRETRAIN,
        qad(teacher, logits, fmt, "--tensor-model-parallel-size", "2", "--log-json", str(two)),
        nproc=2,
    )
    early, late = TP_RTOL[fmt]
    steps, expected = series(read_json(one), "train/loss")
    got_steps, got = series(read_json(two), "train/loss")
    assert steps == got_steps == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(got[:3], expected[:3], rtol=early, atol=0)
    np.testing.assert_allclose(got, expected, rtol=late, atol=0)
    valid = [series(read_json(f), "valid/loss")[1] for f in (one, two)]
    np.testing.assert_allclose(valid[1], valid[0], rtol=late, atol=0)


def test_group_size_that_does_not_divide_is_one_line(teacher, logits):  # noqa: F811
    args = qad(teacher, logits, "int4", group="48")
    proc = run_script(PRETRAIN, args)
    assert proc.returncode == 2
    assert "--quant-group-size 48 does not divide the 64 input features" in proc.stderr
    assert "Traceback" not in proc.stderr
