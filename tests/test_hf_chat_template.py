"""The exported tokenizer's chat template reproduces the training tokens exactly, with
transformers' defaults (control tokens are tokens, as in the published Apertus tokenizer), and
an export of an exported tokenizer (an import followed by an export) keeps it."""

from __future__ import annotations

import json

import pytest

from examples.chat_demo import docstring_conversations
from megatron.apertus.convert.hf_tokenizer import TokenizerSource, write_hf_tokenizer
from megatron.apertus.data.chat import CONTROL_TOKENS, encode_conversation
from megatron.apertus.tokenizer.tokenizers import build_tokenizer

TRICKY = [
    {"role": "user", "content": "Is <b> a tag?\n  Answer in two lines."},
    {"role": "assistant", "content": " Yes:\nit ends a turn. Ünïcödé, 数字 and emoji 🙂 too."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def exported_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    source = TokenizerSource("TekkenTokenizer", None, "the bundled tekken")
    write_hf_tokenizer(source, directory, model_max_length=4096, vocab_size=131072)
    return directory


@pytest.fixture(scope="module")
def exported(exported_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(exported_dir))


def check_training_tokens(tokenizer) -> None:
    """``apply_chat_template`` with transformers' defaults gives the ids training used."""
    tekken = build_tokenizer()
    conversations = [c["messages"] for c in docstring_conversations()[:20]] + [TRICKY]
    for messages in conversations:
        ids, _ = encode_conversation(tekken, messages)
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert list(rendered) == ids[:-1].tolist()  # training adds the end-of-document </s>
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=True, return_dict=False, add_generation_prompt=True
        )
        start = len(prompt)
        assert list(prompt) == ids[:start].tolist()
        assert prompt[-1] == CONTROL_TOKENS["<|assistant_start|>"]
    assert tokenizer.convert_ids_to_tokens(68) == "<|assistant_end|>"


def test_apply_chat_template_gives_the_training_tokens(exported):
    check_training_tokens(exported)


def test_literal_control_strings_in_plain_text(exported):
    """As in the published Apertus tokenizer, a control string in plain text is the control
    token; ``split_special_tokens=True`` gives our pipeline's ids (text) instead."""
    text = "a literal <|assistant_start|> here"
    tekken = build_tokenizer()
    assert CONTROL_TOKENS["<|assistant_start|>"] in exported(text)["input_ids"]
    split = exported(text, split_special_tokens=True)["input_ids"]
    assert split == [tekken.bos, *tekken.encode(text)]


@pytest.mark.parametrize("given", ["directory", "tokenizer.json", "template in config"])
def test_exporting_an_exported_tokenizer_keeps_its_chat_template(exported_dir, tmp_path, given):
    """What an import followed by an export does with ``--tokenizer HF_DIR``: the template of
    the Hugging Face tokenizer is carried over (transformers 4 kept it in the config)."""
    from transformers import AutoTokenizer

    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (source / name).write_bytes((exported_dir / name).read_bytes())
    if given == "template in config":
        config = json.loads((source / "tokenizer_config.json").read_text())
        config["chat_template"] = (source / "chat_template.jinja").read_text()
        (source / "tokenizer_config.json").write_text(json.dumps(config))
        (source / "chat_template.jinja").unlink()
    model = source / "tokenizer.json" if given == "tokenizer.json" else source
    dest = tmp_path / "dest"
    write_hf_tokenizer(
        TokenizerSource("HuggingFaceTokenizer", str(model), "--tokenizer"),
        dest,
        model_max_length=4096,
        vocab_size=131072,
    )
    check_training_tokens(AutoTokenizer.from_pretrained(str(dest)))
