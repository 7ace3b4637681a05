"""Alignment end to end on a tiny model: preference data, reference log-probs stored once and
checked, DPO and QRPO steps, exact resume."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import pretrain_gpt
from megatron.apertus.align import reference
from megatron.apertus.align.data import PreferenceDataset
from megatron.apertus.data.chat import encode_conversation, parse_messages
from megatron.apertus.data.chat_demo import docstring_preferences, docstring_rewards
from megatron.apertus.data.tokenizer import build_tokenizer
from megatron.apertus.distill.logit_store import LogitStoreError
from megatron.apertus.training.loop import train
from tests.conftest import PRETRAIN, REPO, run_entry

TOOL = REPO / "tools" / "preprocess_preferences.py"
TINY = ["--model-preset", "tiny", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--log-interval", "1", "--lr", "1e-3"]  # fmt: skip


def preprocess(tmp, objective: str, records: list[dict], extra_lines: tuple[str, ...] = ()):
    source = tmp / f"{objective}.jsonl"
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_entry(TOOL, ["--objective", objective, "--input", str(source), "--output-prefix",
                            str(tmp / objective), "--max-tokens", "129"])  # fmt: skip
    return str(tmp / f"{objective}_pref_document"), proc


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    dpo, _ = preprocess(root, "dpo", [r for r in docstring_preferences()[:40]
                                      if len(r["chosen"]) < 150][:16])  # fmt: skip
    qrpo, _ = preprocess(root, "qrpo", [r for r in docstring_rewards()[:60]
                                        if len(r["completion"]) < 150][:16])  # fmt: skip
    run_entry(PRETRAIN, TINY + ["--train-iters", "1", "--eval-iters", "0",
                                "--save", str(root / "base")])  # fmt: skip
    return {"dpo": dpo, "qrpo": qrpo, "base": str(root / "base")}


def test_examples_hold_their_completions_masks_and_quantiles(tmp_path):
    tekken = build_tokenizer()
    pairs = docstring_preferences()[:3]
    bad = ('{"prompt": [{"role": "user", "content": "q"}], "chosen": "a"}',  # no rejected
           json.dumps({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant",
                       "content": "a"}], "chosen": "a", "rejected": "b"}))  # fmt: skip
    prefix, proc = preprocess(tmp_path, "dpo", pairs, bad)
    assert "dpo.jsonl:4: skipped: empty or missing 'rejected'" in proc.stderr
    assert (
        "dpo.jsonl:5: skipped: the prompt must be messages ending with a user turn" in proc.stderr
    )
    data = PreferenceDataset(prefix, "dpo", seq_length=128, pad=tekken.pad)
    assert len(data) == 3
    for i, pair in enumerate(pairs):
        for j, key in enumerate(("chosen", "rejected")):
            messages = parse_messages(
                {"messages": [*pair["prompt"], {"role": "assistant", "content": pair[key]}]}
            )
            ids, mask = encode_conversation(tekken, messages)
            got_ids, got_mask = data.sequence(2 * i + j)
            assert got_ids.tolist() == ids.tolist() and got_mask.tolist() == mask.tolist()
    rewards = docstring_rewards()[:4]
    prefix, _ = preprocess(
        tmp_path,
        "qrpo",
        rewards,
        ('{"prompt": [], "completion": "x", ' '"reward": NaN, "ref_rewards": [1]}',),
    )
    qrpo = PreferenceDataset(prefix, "qrpo", seq_length=128, pad=tekken.pad)
    for i, record in enumerate(rewards):
        want = np.mean(np.array(record["ref_rewards"]) <= record["reward"])
        assert qrpo[i]["quantile"].item() == want


def test_reference_file_round_trip_corruption_and_other_data(tmp_path):
    values = reference.ReferenceLogps(
        keys=np.arange(5, dtype=np.uint64) * 977, logps=-np.pi * np.arange(5.0),
        lengths=np.arange(5, dtype=np.int32),
    )  # fmt: skip
    path = tmp_path / "train.bin"
    reference.write(path, values, data_hash="ab" * 16, reference="ckpt")
    stored, header = reference.read(path, data_hash="ab" * 16)
    assert header["reference"] == "ckpt" and stored.logps.tobytes() == values.logps.tobytes()
    assert np.array_equal(stored.keys, values.keys)
    with pytest.raises(LogitStoreError, match="made for other data"):
        reference.read(path, data_hash="cd" * 16)
    raw = bytearray(path.read_bytes())
    raw[-30] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(LogitStoreError, match="checksum mismatch"):
        reference.read(path, data_hash="ab" * 16)


def align_args(data, tmp_path, objective: str, iters: int, *extra: str) -> list[str]:
    return TINY + [
        "--no-fused-output-loss", "--finetune", "--load", data["base"], "--align-objective",
        objective, "--ref-logps-path", str(tmp_path / "ref"), "--train-data-path",
        data[objective], "--train-iters", str(iters), "--eval-iters", "0", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_dpo_starts_at_log_2_and_resumes_exactly(data, tmp_path):
    straight = train(pretrain_gpt.parse_args(align_args(data, tmp_path, "dpo", 4)))
    losses = [v for _, v in straight["train/loss"]]
    # The first step's policy is the reference: every pair's loss is -log sigmoid(0).
    assert losses[0] == pytest.approx(np.log(2.0), abs=1e-6)
    assert len(set(losses)) > 1
    stored = (tmp_path / "ref" / "train.bin").read_bytes()
    first = align_args(
        data, tmp_path, "dpo", 4, "--save", str(tmp_path / "ck"), "--exit-interval", "2"
    )
    train(pretrain_gpt.parse_args(first))
    resume = align_args(data, tmp_path, "dpo", 4, "--save", str(tmp_path / "ck"))
    resume[resume.index("--finetune") : resume.index("--finetune") + 3] = ["--load", str(tmp_path / "ck")]  # fmt: skip
    resumed = train(pretrain_gpt.parse_args(resume))
    assert [v for _, v in resumed["train/loss"]][-2:] == losses[2:]
    assert (tmp_path / "ref" / "train.bin").read_bytes() == stored, "computed once"
    # A corrupted store is refused on the next start.
    raw = bytearray(stored)
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "ref" / "train.bin").write_bytes(bytes(raw))
    proc = subprocess.run([sys.executable, str(PRETRAIN), *resume], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 2
    assert "checksum mismatch" in proc.stderr.strip().splitlines()[-1]


def test_qrpo_trains(data, tmp_path):
    history = train(pretrain_gpt.parse_args(align_args(data, tmp_path, "qrpo", 3,
                                                       "--align-length-normalization")))  # fmt: skip
    losses = [v for _, v in history["train/loss"]]
    assert len(losses) == 3 and all(np.isfinite(losses))
