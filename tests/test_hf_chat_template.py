"""The exported tokenizer's chat template reproduces the training tokens exactly."""

from __future__ import annotations

import pytest

from megatron.apertus.convert.hf_tokenizer import TokenizerSource, write_hf_tokenizer
from megatron.apertus.data.chat import CONTROL_TOKENS, encode_conversation
from megatron.apertus.data.chat_demo import docstring_conversations
from megatron.apertus.data.tokenizer import build_tokenizer

TEMPLATE_KWARGS = {"split_special_tokens": False}
"""The rendered template's control tokens are tokens, not text (plain documents keep them text)."""
TRICKY = [
    {"role": "user", "content": "Is <b> a tag?\n  Answer in two lines."},
    {"role": "assistant", "content": " Yes:\nit ends a turn. Ünïcödé, 数字 and emoji 🙂 too."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tok")
    source = TokenizerSource("TekkenTokenizer", None, "the bundled tekken")
    write_hf_tokenizer(source, directory, model_max_length=4096, vocab_size=131072)
    return AutoTokenizer.from_pretrained(str(directory))


def test_apply_chat_template_gives_the_training_tokens(exported):
    tekken = build_tokenizer()
    conversations = [c["messages"] for c in docstring_conversations()[:20]] + [TRICKY]
    for messages in conversations:
        ids, _ = encode_conversation(tekken, messages)
        rendered = exported.apply_chat_template(
            messages, tokenize=True, return_dict=False, tokenizer_kwargs=TEMPLATE_KWARGS
        )
        assert list(rendered) == ids[:-1].tolist()  # training adds the end-of-document </s>
        prompt = exported.apply_chat_template(messages[:-1], tokenize=True, return_dict=False,
                                              add_generation_prompt=True,
                                              tokenizer_kwargs=TEMPLATE_KWARGS)  # fmt: skip
        start = len(prompt)
        assert list(prompt) == ids[:start].tolist()
        assert prompt[-1] == CONTROL_TOKENS["<|assistant_start|>"]
    assert exported.convert_ids_to_tokens(68) == "<|assistant_end|>"
