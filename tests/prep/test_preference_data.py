"""tools/preprocess_preferences.py on lines a user porting a recipe writes: completion-only loss
masks, every rejected line reported as FILE:LINE: skipped: REASON and counted, refusals with
exit code 2 that leave nothing behind."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from megatron.apertus.align.data import PreferenceDataset, precomputed_reference
from megatron.apertus.data.chat import CONTROL_TOKENS
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import REPO

TOOL = REPO / "tools" / "preprocess_preferences.py"
_spec = importlib.util.spec_from_file_location("preprocess_preferences", TOOL)
preprocess_preferences = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preprocess_preferences)

USER = {"role": "user", "content": "What does len do?"}
EARLIER_TURNS = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "x"},
    {"role": "user", "content": "q2"},
]


@pytest.fixture
def captured(capsys, caplog):
    """Output capture that also holds the tool's log lines (pytest routes those to caplog)."""
    capsys.caplog = caplog
    return capsys


def run_tool(captured, tmp_path, objective: str, lines: list[str], *extra: str):
    """(exit code, stdout, stderr with the log lines, input path, dataset prefix) of the tool
    run in-process."""
    source = tmp_path / f"{objective}.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = [
        "--objective",
        objective,
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / objective),
        *extra,
    ]
    captured.caplog.clear()
    code = preprocess_preferences.main(argv)
    out, err = captured.readouterr()
    err = "".join(record.getMessage() + "\n" for record in captured.caplog.records) + err
    return code, out, err, source, str(tmp_path / f"{objective}_pref_document")


def test_masks_cover_the_completion_only_never_earlier_assistant_turns(captured, tmp_path):
    pair = {"prompt": EARLIER_TURNS, "chosen": "a", "rejected": "b"}
    completion = {
        "prompt": EARLIER_TURNS,
        "completion": "a",
        "reward": 1.0,
        "ref_rewards": [0.0, 2.0],
    }
    tekken = build_tokenizer()
    for objective, record in (("dpo", pair), ("qrpo", completion)):
        code, _, err, _, prefix = run_tool(captured, tmp_path, objective, [json.dumps(record)])
        assert code == 0, err
        data = PreferenceDataset(prefix, objective, seq_length=64, pad=tekken.pad)
        for row in range(data.group):
            ids, mask = data.sequence(row)
            assert int(mask.sum()) == 2, "the completion's token and its <|assistant_end|>"
            learned = ids[mask.astype(bool)].tolist()
            assert learned[-1] == CONTROL_TOKENS["<|assistant_end|>"] and ids[-1] == tekken.eod
            assert np.flatnonzero(mask).tolist() == [ids.size - 3, ids.size - 2]
            assert learned[0] == tekken.encode(record.get("completion") or "ab"[row])[0]


def test_rejected_lines_are_reported_with_their_reason_and_counted(captured, tmp_path):
    good = {"prompt": [USER], "chosen": "It counts.", "rejected": "IT COUNTS."}
    lines = [
        json.dumps(good),
        json.dumps({**good, "rejected": good["chosen"]}),
        json.dumps({**good, "prompt": []}),
        json.dumps({**good, "prompt": [{"role": "system", "content": "Be brief."}]}),
        json.dumps({**good, "prompt": [{"role": "user", "content": 5}]}),
        '{"prompt": [',
        json.dumps({**good, "ref_chosen_logps": -3.0}),
        json.dumps({**good, "chosen": 7}),
        json.dumps(
            {**good, "ref_chosen_logp": -1.0, "ref_chosen_logprob": -1.0, "ref_rejected_logp": -2.0}
        ),
        json.dumps({**good, "ref_chosen_logp": 0.5, "ref_rejected_logp": -2.0}),
    ]
    code, out, err, source, prefix = run_tool(captured, tmp_path, "dpo", lines)
    assert code == 0, err
    reasons = {
        2: "chosen and rejected are identical",
        3: "empty prompt (it needs a user turn)",
        4: "no user turn in the prompt",
        5: "content of message 0 (user) is int, not a string",
        6: "invalid JSON (Expecting value at column 13)",
        7: "no reference log-probability of 'rejected' (the other completion has one)",
        8: "'chosen' is int, not a string",
        9: "reference log-probability given twice (ref_chosen_logp, ref_chosen_logprob)",
        10: "'ref_chosen_logp' is 0.5 > 0, not a log-probability",
    }
    for line, reason in reasons.items():
        assert f"{source}:{line}: skipped: {reason}\n" in err
    assert "wrote 1 examples" in out and "rejected 9 lines" in out
    assert "       1  chosen and rejected are identical" in out
    qrpo_line = {"prompt": [USER], "completion": "It counts.", "reward": 1.0, "ref_rewards": [0.5]}
    code, out, err, source, _ = run_tool(
        captured,
        tmp_path,
        "qrpo",
        [json.dumps({**qrpo_line, "ref_rewards": [0.5, 2.0]}), json.dumps(qrpo_line)],
    )
    assert code == 0, err
    assert (
        f"{source}:2: skipped: 1 reference rewards, fewer than --qrpo-min-ref-rewards 2 "
        "(the default)"
    ) in err
    code, out, err, _, _ = run_tool(
        captured, tmp_path, "qrpo", [json.dumps(qrpo_line)], "--qrpo-min-ref-rewards", "1"
    )
    assert code == 0 and "wrote 1 examples" in out


def test_a_file_whose_every_line_is_rejected_is_an_error(tmp_path):
    source = tmp_path / "pairs.jsonl"
    pair = {"prompt": [USER], "chosen": "same", "rejected": "same"}
    source.write_text(json.dumps(pair) + "\n" + json.dumps({**pair, "prompt": []}) + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--objective",
            "dpo",
            "--input",
            str(source),
            "--output-prefix",
            str(tmp_path / "pairs"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"preprocess_preferences.py: error: --input {source}: all 2 lines were rejected (1 chosen "
        "and rejected are identical, 1 empty prompt); nothing written"
    )
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"], "nothing left behind"


def test_reference_logps_on_some_lines_only_are_refused(captured, tmp_path):
    pair = {"prompt": [USER], "chosen": "It counts.", "rejected": "IT COUNTS."}
    carried = {**pair, "ref_chosen_logps": -4.5, "ref_rejected_logps": -9.25}  # TRL's names
    code, out, err, source, prefix = run_tool(
        captured, tmp_path, "dpo", [json.dumps(carried), json.dumps(pair)]
    )
    assert code == 2 and "wrote" not in out, "no success reported before the refusal"
    assert err.strip().splitlines()[-1] == (
        f"preprocess_preferences.py: error: {source}: 2 of 4 sequences carry a reference "
        "log-probability; give it on every line or on none"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dpo.jsonl"]
    swiss = {**pair, "ref_chosen_logprob": -1.0, "ref_rejected_logprob": -2.0}
    code, _, err, _, prefix = run_tool(
        captured, tmp_path, "dpo", [json.dumps(carried), json.dumps(swiss)]
    )
    assert code == 0, err
    assert precomputed_reference(prefix).tolist() == [-4.5, -9.25, -1.0, -2.0]
    code, _, err, _, prefix = run_tool(captured, tmp_path, "dpo", [json.dumps(pair)])
    assert code == 0 and precomputed_reference(prefix) is None


def test_json_errors_name_the_column_on_the_line(captured, tmp_path):
    code, _, err, source, _ = run_tool(
        captured,
        tmp_path,
        "dpo",
        [
            '{"prompt": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"}',
            '{"prompt": [], "chosen": "a"',
            '{"prompt": [] "chosen": "a"}',
        ],
    )
    assert code == 0, err
    assert f"{source}:2: skipped: invalid JSON (Expecting ',' delimiter at column 29)" in err
    assert f"{source}:3: skipped: invalid JSON (Expecting ',' delimiter at column 15)" in err
