"""tools/preprocess_chat.py: chat datasets of exactly the format's tokens and assistant-only
mask, bad conversations reported and skipped."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.data.chat import encode_conversation
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
