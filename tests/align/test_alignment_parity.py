"""DPO on 2 CPU processes (TP=2, PP=2 plain, with 2 pairs per micro-batch and interleaved,
DP=2) reproduces the single-process run: the stored reference log-probabilities, the losses of
3 steps and the held-out loss and reward margin. 13 training and 5 held-out pairs: the reference
pass's last micro-batch and its count of micro-batches fill no whole group (pipeline stages
send one shape; the interleaved schedule runs groups of one micro-batch per stage).

Tolerances as for pretraining (tests/parallel/test_layout_parity.py): splitting sums over
ranks changes the order of floating-point additions, so equality is to 2e-6 relative on the
losses; reference values to 1e-5 relative (sums of ~100 fp32 token log-probs).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from examples.chat_demo import docstring_preferences
from megatron.apertus.align import reference
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_TOKENIZER_FLAGS,
    SMALL_VOCABULARY,
    read_json,
    run_entry,
    series,
)

TOOL = REPO / "tools" / "preprocess_preferences.py"
COMMON = [
    "--model-preset",
    "tiny",
    "--seed",
    "7",
    "--lr",
    "1e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "1",
    "--log-interval",
    "1",
    "--adam-eps",
    "1e-4",
    "--no-fused-output-loss",
    "--align-objective",
    "dpo",
    "--align-beta",
    "0.5",
    "--train-iters",
    "3",
    "--eval-iters",
    "1",
    "--eval-interval",
    "3",
    *SMALL_VOCABULARY,
]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2-micro-batch-2": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"],
    "pp2-interleaved": [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ],
    "dp2": [],
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("align-parity")
    pairs = [r for r in docstring_preferences() if len(r["chosen"]) < 120]
    prefixes = {}
    for part, records in (("train", pairs[:13]), ("valid", pairs[13:18])):
        source = root / f"{part}.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        run_entry(
            TOOL,
            [
                "--objective",
                "dpo",
                "--input",
                str(source),
                "--output-prefix",
                str(root / part),
                "--max-tokens",
                "129",
                *SMALL_TOKENIZER_FLAGS,
            ],
        )
        prefixes[part] = str(root / f"{part}_pref_document")
    run_entry(
        PRETRAIN,
        COMMON[:12]
        + SMALL_VOCABULARY
        + ["--train-iters", "0", "--eval-iters", "0", "--save", str(root / "init")],
    )
    data = [
        "--finetune",
        "--load",
        str(root / "init"),
        "--train-data-path",
        prefixes["train"],
        "--valid-data-path",
        prefixes["valid"],
    ]
    run_entry(
        PRETRAIN,
        COMMON
        + data
        + ["--ref-logps-path", str(root / "ref-single"), "--log-json", str(root / "single.json")],
    )
    return root, data, prefixes


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_processes_match_one(single, layout):
    root, data, prefixes = single
    out = root / f"{layout}.json"
    run_entry(
        PRETRAIN,
        COMMON
        + LAYOUTS[layout]
        + data
        + ["--ref-logps-path", str(root / f"ref-{layout}"), "--log-json", str(out)],
        nproc=2,
    )
    expected, got = read_json(root / "single.json"), read_json(out)
    for name in ("train/loss", "train/reward_margin", "valid/loss", "valid/reward_margin"):
        np.testing.assert_allclose(
            series(got, name)[1], series(expected, name)[1], rtol=2e-6, atol=1e-7
        )
    for part in ("train", "valid"):
        data_hash = reference.dataset_hash(prefixes[part])
        want, _ = reference.read(root / "ref-single" / f"{part}.bin", data_hash=data_hash)
        have, _ = reference.read(root / f"ref-{layout}" / f"{part}.bin", data_hash=data_hash)
        assert np.array_equal(have.keys, want.keys)
        np.testing.assert_allclose(have.logps, want.logps, rtol=1e-5)
    assert series(expected, "train/loss")[1][0] == pytest.approx(np.log(2.0), abs=1e-6)
