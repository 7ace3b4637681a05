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
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.align.data import PreferenceDataset, precomputed_reference
from megatron.apertus.data.chat import CONTROL_TOKENS, loss_mask_prefix
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


SYSTEM = {"role": "system", "content": "Answer in one sentence."}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def stored(prefix: str) -> tuple[list[list[int]], list[list[int]]]:
    """Every sequence's ids and loss mask as the tool wrote them."""
    tokens, masks = IndexedDataset(prefix), IndexedDataset(loss_mask_prefix(prefix))
    return (
        [np.array(tokens[i]).tolist() for i in range(len(tokens))],
        [np.array(masks[i]).tolist() for i in range(len(masks))],
    )


def test_trl_layouts_give_the_tokens_and_masks_of_the_explicit_layout(captured, tmp_path):
    """TRL's conversational preference layout (explicit and implicit prompt) and its text
    layouts (explicit and implicit prompt) give the ids and masks of their explicit form,
    and the mask covers the completion and its end token only."""
    tekken = build_tokenizer()
    prompt = [SYSTEM, *EARLIER_TURNS]
    chosen, rejected = "It is blue.", "It is green."
    conversational = [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},  # the layout these tools read
        {"prompt": prompt, "chosen": [assistant(chosen)], "rejected": [assistant(rejected)]},
        {"chosen": [*prompt, assistant(chosen)], "rejected": [*prompt, assistant(rejected)]},
    ]
    text = [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    ]
    code, _, err, _, prefix = run_tool(
        captured, tmp_path, "dpo", [json.dumps(r) for r in conversational + text]
    )
    assert code == 0, err
    ids, masks = stored(prefix)
    assert len(ids) == 2 * 5
    for example in (1, 2):
        assert ids[2 * example : 2 * example + 2] == ids[0:2]
        assert masks[2 * example : 2 * example + 2] == masks[0:2]
    end = CONTROL_TOKENS["<|assistant_end|>"]
    for row, completion in enumerate((chosen, rejected)):
        learned = [i for i, m in zip(ids[row], masks[row]) if m]
        assert learned == [*tekken.encode(completion), end], "not the prompt's assistant turn"
    assert ids[6:8] == ids[8:10] and masks[6:8] == masks[8:10]
    for row, completion in zip((6, 7), (" blue.", " green.")):
        prompt_ids, completion_ids = tekken.encode("The sky is"), tekken.encode(completion)
        assert ids[row] == [tekken.bos, *prompt_ids, *completion_ids, tekken.eod]
        assert masks[row] == [0] * (1 + len(prompt_ids)) + [1] * (len(completion_ids) + 1)
    assert ids[6] != ids[0], "text layouts are plain text, not the chat format"
    completion = {"prompt": prompt, "reward": 1.0, "ref_rewards": [0.0, 2.0]}
    code, _, err, _, prefix = run_tool(
        captured,
        tmp_path,
        "qrpo",
        [
            json.dumps({**completion, "completion": chosen}),
            json.dumps({**completion, "completion": [assistant(chosen)]}),
        ],
    )
    assert code == 0, err
    qrpo_ids, qrpo_masks = stored(prefix)
    assert qrpo_ids == [ids[0], ids[0]] and qrpo_masks == [masks[0], masks[0]]


def test_bad_trl_layout_lines_are_reported_with_their_reason(captured, tmp_path):
    user, other = {"role": "user", "content": "Sky colour?"}, {"role": "user", "content": "Grass?"}
    good = {"chosen": [user, assistant("Blue.")], "rejected": [user, assistant("Green.")]}
    lines = [
        good,
        {"prompt": "Sky colour?", "chosen": [assistant("Blue.")], "rejected": "Green."},
        {"prompt": [user], "chosen": [user, assistant("Blue.")], "rejected": "Green."},
        {"chosen": [user, assistant("Blue.")], "rejected": [other, assistant("Green.")]},
        {"chosen": "Yes.", "rejected": "No."},
        {
            "chosen": [user, assistant("a"), other, assistant("b")],
            "rejected": [user, assistant("c"), other, assistant("b")],
        },
        {"chosen": "The sky is blue.", "rejected": [user, assistant("Green.")]},
        {"prompt": [user], "chosen": [assistant(" ")], "rejected": "Green."},
        {"chosen": good["chosen"], "rejected": good["chosen"]},
        {"chosen": [user, assistant("Blue.")], "rejected": [user]},
    ]
    code, out, err, source, _ = run_tool(
        captured, tmp_path, "dpo", [json.dumps(line) for line in lines]
    )
    assert code == 0, err
    reasons = {
        2: "'chosen' is a list of messages but the prompt is text",
        3: "'chosen' must be one assistant message, not [user, assistant]",
        4: "chosen and rejected share no prompt (their first messages differ)",
        5: "chosen and rejected share no prompt (no common first words)",
        6: "chosen and rejected differ before their last message (the implicit prompt is what "
        "they share)",
        7: "one of chosen and rejected is text, the other a list of messages",
        8: "empty content in message 0 (assistant)",
        9: "chosen and rejected are identical",
        10: "'rejected' has no reply after the prompt both share",
    }
    for line, reason in reasons.items():
        assert f"{source}:{line}: skipped: {reason}\n" in err
    assert "wrote 1 examples" in out and "rejected 9 lines" in out
    qrpo = {"completion": "Blue.", "reward": 1.0, "ref_rewards": [0.0, 2.0]}
    code, out, err, source, _ = run_tool(
        captured, tmp_path, "qrpo", [json.dumps({**qrpo, "prompt": [user]}), json.dumps(qrpo)]
    )
    assert code == 0 and f"{source}:2: skipped: no 'prompt' (text or a list of messages)" in err
