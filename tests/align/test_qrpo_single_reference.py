"""QRPO's normal-icdf transform on quantiles from one reference reward is refused at the start:
those quantiles are 0 or 1 and their transform is infinite, so no step could train."""

from __future__ import annotations

import json
from pathlib import Path

from examples.chat_demo import docstring_rewards
from megatron.apertus import checkpoint
from tests.conftest import PRETRAIN, REPO, run_entry, run_script

TOOL = REPO / "tools" / "preprocess_preferences.py"


def single_reference_data(tmp_path: Path) -> str:
    """Four QRPO examples with one reference reward each, kept by --qrpo-min-ref-rewards 1."""
    records = [
        dict(r, ref_rewards=r["ref_rewards"][:1])
        for r in docstring_rewards()[:40]
        if len(r["completion"]) < 150
    ][:4]
    source = tmp_path / "qrpo.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    args = ["--objective", "qrpo", "--input", str(source), "--output-prefix", str(tmp_path / "q")]
    run_entry(TOOL, args + ["--max-tokens", "129", "--qrpo-min-ref-rewards", "1"])
    return str(tmp_path / "q_pref_document")


def test_normal_icdf_on_single_reference_rewards_is_refused(tmp_path: Path) -> None:
    prefix = single_reference_data(tmp_path)
    args = [
        "--model-preset",
        "tiny",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--no-fused-output-loss",
        "--align-objective",
        "qrpo",
        "--qrpo-transform",
        "normal-icdf",
        "--train-data-path",
        prefix,
        "--ref-logps-path",
        str(tmp_path / "ref"),
        "--train-iters",
        "1",
        "--eval-iters",
        "0",
        "--save",
        str(tmp_path / "ck"),
    ]
    proc = run_script(PRETRAIN, args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "--qrpo-transform normal-icdf" in lines[-1] and prefix in lines[-1]
    assert "--qrpo-min-ref-rewards 1" in lines[-1]
    assert (
        checkpoint.find_checkpoint(str(tmp_path / "ck")) is None
    ), "nothing trained, nothing saved"
