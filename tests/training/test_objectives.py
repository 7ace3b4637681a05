"""The run's objective is chosen once from the flags, and what an objective cannot serve is
refused before it reads any data or builds a model. (The objectives' losses are checked end to
end by the golden curve, tests/distill/test_distillation.py and tests/align/.)"""

from __future__ import annotations

import pytest

import pretrain_gpt
from megatron.apertus.errors import ConfigError
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from megatron.apertus.training.objectives import build_objective, format_quantities, metric_name

TINY = ["--model-preset", "tiny", "--train-iters", "1", "--global-batch-size", "2"]
ALIGN = ["--no-fused-output-loss", "--align-objective", "dpo", "--train-data-path", "pairs"]


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (
            [*ALIGN, "--distill-logits-path", "store"],
            "--align-objective and --distill-logits-path are two objectives",
        ),
        (
            ["--no-fused-output-loss", "--distill-logits-path", "store"],
            "--distill-logits-path needs the fused output-layer loss",
        ),
        (
            [*ALIGN, "--calculate-per-token-loss"],
            "--calculate-per-token-loss cannot run with --align-objective: the preference loss "
            "is one value per example",
        ),
    ],
)
def test_objectives_refuse_what_they_cannot_serve_before_reading_data(flags, refusal):
    cfg = pretrain_gpt.parse_args(TINY + flags)
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        build_objective(cfg, tokenizer=build_tokenizer(), dp=1, dp_rank=0)


def test_quantities_keep_their_log_names():
    assert metric_name("quantile-signed log-ratio") == "quantile_signed_log_ratio"
    assert format_quantities({"reward margin": 0.25}) == " | reward margin: 2.500000E-01"
