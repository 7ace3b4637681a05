"""tools/preprocess_chat.py: chat datasets of exactly the format's tokens and assistant-only
mask, bad conversations reported and skipped."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.data.chat import CONTROL_TOKENS, encode_conversation
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import REPO
from tests.data.test_chat import CONVERSATION

TOOL = REPO / "tools" / "preprocess_chat.py"


@pytest.fixture(scope="module")
def tekken():
    return build_tokenizer("TekkenTokenizer")


def test_tool_writes_tokens_and_mask_and_skips_bad_lines(tmp_path, tekken):
    good = [
        CONVERSATION,
        CONVERSATION[1:3],
        [
            {"role": "user", "content": "Name a sorting " "function."},
            {"role": "assistant", "content": "sorted() returns a new list."},
        ],
    ]
    lines = [
        json.dumps({"messages": good[0]}),
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),  # line 2: role
        json.dumps({"messages": good[1]}),
        json.dumps({"messages": [{"role": "user", "content": ""}]}),  # line 4: empty
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "word " * 300},
                    {"role": "assistant", "content": "ok"},
                ]
            }
        ),  # 5: over-long
        json.dumps({"messages": good[2]}),
        '{"messages": [',  # line 7: invalid JSON
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = tmp_path / "sft"
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--input",
            str(source),
            "--output-prefix",
            str(prefix),
            "--max-tokens",
            "256",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for line, reason in (
        (2, "unknown role 'robot'"),
        (4, "empty content"),
        (5, "over-long"),
        (7, "invalid JSON"),
    ):
        assert f"{source}:{line}: skipped: {reason}" in proc.stderr
    assert "wrote 3 conversations" in proc.stdout
    tokens = IndexedDataset(f"{prefix}_chat_document")
    masks = IndexedDataset(f"{prefix}_chat_document_loss_mask")
    assert len(tokens) == len(masks) == 3
    for i, messages in enumerate(good):
        ids, mask = encode_conversation(tekken, messages)
        assert np.array(tokens[i]).tolist() == ids.tolist()
        assert np.array(masks[i]).tolist() == mask.tolist()
    assert not list(tmp_path.glob("*.tmp*"))


def test_tool_refuses_a_missing_input_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--input",
            str(tmp_path / "none.jsonl"),
            "--output-prefix",
            str(tmp_path / "x"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("preprocess_chat.py: error: input")


def test_trl_sft_layouts_learn_the_completion_only(tmp_path, tekken, caplog):
    """TRL's prompt-completion layout (messages or text) and language-modelling text: the
    conversational one gives the ids of the same messages and learns the completion alone,
    the text ones are plain text; bad lines are named FILE:LINE with their reason."""
    spec = importlib.util.spec_from_file_location("preprocess_chat", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    prompt, completion = CONVERSATION[:4], CONVERSATION[4]
    lines = [
        {"prompt": prompt, "completion": [completion]},
        {"prompt": prompt, "completion": completion["content"]},
        {"prompt": "The sky is", "completion": " blue."},
        {"text": "The sky is blue."},
        {"prompt": prompt, "completion": [completion, CONVERSATION[1]]},  # 5
        {"prompt": "The sky is", "completion": [completion]},  # 6
        {"text": ""},  # 7
        {"conversation": CONVERSATION},  # 8
    ]
    source = tmp_path / "sft.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    prefix = tmp_path / "sft"
    assert tool.main(["--input", str(source), "--output-prefix", str(prefix)]) == 0
    logged = caplog.text
    for line, reason in (
        (5, "'completion' must be one assistant message, not [assistant, user]"),
        (6, "'completion' is a list of messages but the prompt is text"),
        (7, "'text' is not a non-empty string"),
        (8, "no 'messages', 'prompt' or 'text' field"),
    ):
        assert f"{source}:{line}: skipped: {reason}" in logged
    tokens = IndexedDataset(f"{prefix}_chat_document")
    masks = IndexedDataset(f"{prefix}_chat_document_loss_mask")
    ids = [np.array(tokens[i]).tolist() for i in range(len(tokens))]
    mask = [np.array(masks[i]).tolist() for i in range(len(masks))]
    assert len(ids) == 4
    whole, whole_mask = encode_conversation(tekken, CONVERSATION)
    assert ids[0] == ids[1] == whole.tolist() and mask[0] == mask[1]
    learned = [i for i, m in zip(ids[0], mask[0]) if m]
    assert learned == [*tekken.encode(completion["content"]), CONTROL_TOKENS["<|assistant_end|>"]]
    assert sum(mask[0]) < int(whole_mask.sum()), "the prompt's assistant turn is not learned"
    sky, blue = tekken.encode("The sky is"), tekken.encode(" blue.")
    assert ids[2] == [tekken.bos, *sky, *blue, tekken.eod]
    assert mask[2] == [0] * (1 + len(sky)) + [1] * (len(blue) + 1)
    text = tekken.encode("The sky is blue.")
    assert ids[3] == [tekken.bos, *text, tekken.eod] and mask[3] == [0] + [1] * (len(text) + 1)
