"""The Apertus chat format: exact tokens, the assistant-only mask, bad conversations refused
with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.apertus.data.chat import (
    CONTROL_TOKENS,
    ConversationError,
    control_token_ids,
    encode_conversation,
    parse_messages,
)
from megatron.apertus.tokenizer.tokenizers import build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You answer questions about the Python standard library."},
    {"role": "user", "content": "What does len() return?"},
    {"role": "assistant", "content": "The number of items in a container."},
    {"role": "user", "content": "And abs()?"},
    {"role": "assistant", "content": "The absolute value of a number."},
]


@pytest.fixture(scope="module")
def tekken():
    return build_tokenizer("TekkenTokenizer")


def test_tokens_and_mask_of_a_hand_written_conversation(tekken):
    ids, mask = encode_conversation(tekken, CONVERSATION)
    c, enc = CONTROL_TOKENS, tekken.encode
    expected, learned = [tekken.bos], []
    expected += [c["<|system_start|>"], *enc(CONVERSATION[0]["content"]), c["<|system_end|>"]]
    expected += [
        c["<|developer_start|>"],
        *enc("Deliberation: disabled\nTool Capabilities: " "disabled"),
        c["<|developer_end|>"],
    ]
    for turn in CONVERSATION[1:]:
        if turn["role"] == "user":
            expected += [c["<|user_start|>"], *enc(turn["content"]), c["<|user_end|>"]]
        else:
            expected += [c["<|assistant_start|>"]]
            span = [*enc(turn["content"]), c["<|assistant_end|>"]]
            learned.append(range(len(expected), len(expected) + len(span)))
            expected += span
    expected.append(tekken.eod)
    assert ids.tolist() == expected
    want = np.zeros(len(expected), dtype=np.uint8)
    for span in learned:
        want[span.start : span.stop] = 1
    assert mask.tolist() == want.tolist()
    # The learned tokens are exactly the two answers, each closed by <|assistant_end|>.
    pieces = [tekken.decode(ids[s.start : s.stop - 1].tolist()) for s in learned]
    assert pieces == [CONVERSATION[2]["content"], CONVERSATION[4]["content"]]
    assert all(ids[s.stop - 1] == c["<|assistant_end|>"] for s in learned)


def test_control_token_strings_in_content_stay_text(tekken):
    messages = [
        {"role": "user", "content": "say <|assistant_end|>"},
        {"role": "assistant", "content": "<|user_start|> is a token name"},
    ]
    ids, mask = encode_conversation(tekken, messages)
    control = set(CONTROL_TOKENS.values())
    assert sum(int(i) in control for i in ids) == 6  # developer, user, assistant start/end only


def test_bad_conversations_are_refused_with_a_reason():
    cases = {
        "unknown role 'tool'": [{"role": "tool", "content": "x"}],
        "empty content in message 1": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "  "},
        ],
        "system message at position 1": [
            {"role": "user", "content": "q"},
            {"role": "system", "content": "s"},
        ],
        "no assistant message": [{"role": "user", "content": "q"}],
        r"content of message 1 \(assistant\) is int, not a string": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": 3},
        ],
    }
    for reason, messages in cases.items():
        with pytest.raises(ConversationError, match=reason):
            parse_messages({"messages": messages})


def test_a_tokenizer_without_the_control_slots_is_refused():
    from megatron.apertus.tokenizer.tokenizers import bundled_tekken_path

    sp = build_tokenizer("SentencePieceTokenizer", str(bundled_tekken_path("tokenizer.model.v1")))
    with pytest.raises(ValueError, match="not an Apertus-family tokenizer"):
        control_token_ids(sp)
