"""The tokenizer of an export: the training run's, as a Hugging Face fast tokenizer.

Our data pipeline writes every document as ``<s> text </s>``, and tokenizes special-token
strings inside the text as text. A scorer (lm-evaluation-harness, vLLM, ``pipeline``) calls
the tokenizer with its defaults, so the exported tokenizer is configured to produce what the
model saw at the start of every training document:

* ``<s>`` first (the post-processor is ``<s> $A``); no ``</s>`` at the end, because the
  pipeline puts it only where a document ends, and a prompt or a scored context does not;
* special tokens are not split (transformers' default, and the published Apertus tokenizer's):
  ``apply_chat_template(..., tokenize=True)`` with its defaults maps the rendered control
  tokens to their ids, as training did. The price: a literal control string in plain text
  (``</s>``, ``<|assistant_start|>``) becomes that control token, where our data pipeline
  (:mod:`megatron.apertus.tokenizer.tokenizers`) keeps it as text; ``split_special_tokens=True`` in
  the call gives the pipeline's ids for such text;
* the chat template: for tekken the Apertus chat format (:mod:`megatron.apertus.data.chat`);
  for a Hugging Face tokenizer the one beside its ``tokenizer.json``, if any, so an
  import followed by an export keeps it;
* ``tokenizer_class`` ``PreTrainedTokenizerFast``, a name every transformers version since
  4.x resolves (transformers 5 would write its own ``TokenizersBackend``).

Each tokenizer family converts with transformers' own converters (tekken:
``convert_tekken_tokenizer``; SentencePiece: the ``.model`` reader of ``from_pretrained``;
a ``tokenizer.json`` is used as is), and :func:`write_hf_tokenizer` refuses to finish an
export whose tokenizer encodes any check text differently from ours.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron.apertus.cache import default_cache_dir
from megatron.apertus.convert.hf import ConversionError, SpecialTokenIds
from megatron.apertus.data.chat import CHAT_TEMPLATE, CONTROL_TOKENS
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import Tokenizer, build_tokenizer, bundled_tekken_path

TOKENIZER_FLAG_HELP = "a tekken JSON, a tokenizer.json or its directory, or a SentencePiece model"
CHECK_DOCUMENTS = 6
"""Documents of the embedded corpus every export encodes with both tokenizers."""


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer as training names it (``--tokenizer-type``/``--tokenizer-model``)."""

    type: str
    model: str | None
    origin: str
    """Where it was found, for messages and the model card."""

    def describe(self) -> str:
        model = self.model or f"the bundled {bundled_tekken_path().name}"
        return f"{self.type} ({model})"


def tokenizer_type_of(path: Path) -> str:
    """The tokenizer family of a ``--tokenizer`` path: a directory, or a JSON file with the keys
    of a ``tokenizer.json``, is a Hugging Face tokenizer; a JSON file with tekken's keys is
    tekken; any other file is read as a SentencePiece model (a binary protobuf, whatever its
    name: mistral-common ships ``tokenizer.model.v1``)."""
    if path.is_dir():
        return "HuggingFaceTokenizer"
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no such file or directory")
    with open(path, "rb") as f:
        if f.read(64).lstrip()[:1] != b"{":
            return "SentencePieceTokenizer"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"--tokenizer {path}: not valid JSON ({err})") from None
    keys = set(data) if isinstance(data, dict) else set()
    if {"model", "added_tokens"} <= keys:
        return "HuggingFaceTokenizer"
    if {"config", "vocab"} <= keys:
        return "TekkenTokenizer"
    raise ConversionError(f"--tokenizer {path}: neither a tekken JSON nor a tokenizer.json")


def tokenizer_source(
    checkpoint: Path, run_info: dict | None, override: str | None
) -> TokenizerSource:
    """``--tokenizer`` when given, else the tokenizer the checkpoint's training run recorded."""
    if override is not None:
        path = Path(override).resolve()
        return TokenizerSource(tokenizer_type_of(path), str(path), "--tokenizer")
    if run_info is None or "tokenizer" not in run_info:
        raise ConversionError(
            f"{checkpoint} records no training run (no apertus_run.json), so its tokenizer is "
            f"unknown; pass --tokenizer ({TOKENIZER_FLAG_HELP})"
        )
    recorded = run_info["tokenizer"]
    if recorded["type"] == "NullTokenizer":
        raise ConversionError(
            f"the run that saved {checkpoint} trained with --tokenizer-type NullTokenizer (ids, "
            f"no vocabulary), which a Hugging Face model cannot carry; pass --tokenizer"
        )
    model = recorded.get("model")
    if model is not None and not Path(model).exists():
        raise ConversionError(
            f"the run that saved {checkpoint} used the tokenizer {model}, which is not there; "
            "pass --tokenizer"
        )
    return TokenizerSource(recorded["type"], model, "the checkpoint's apertus_run.json")


def _backend(source: TokenizerSource, ours: Tokenizer):
    """The ``tokenizers.Tokenizer`` of ``source``, converted by transformers where needed."""
    if source.type == "TekkenTokenizer":
        return _converted_tekken(Path(ours.path))
    if source.type == "HuggingFaceTokenizer":
        from tokenizers import Tokenizer as FastTokenizer

        return FastTokenizer.from_file(str(ours.path))
    from transformers import PreTrainedTokenizerFast

    # transformers converts a SentencePiece model found as ``tokenizer.model`` in a directory.
    with tempfile.TemporaryDirectory() as spm_dir:
        shutil.copyfile(ours.path, Path(spm_dir) / "tokenizer.model")
        return PreTrainedTokenizerFast.from_pretrained(spm_dir).backend_tokenizer


def _converted_tekken(path: Path):
    """transformers' ``convert_tekken_tokenizer`` of the tekken file ``path``, kept as its
    ``tokenizer.json`` in the package's cache directory (named by the file's SHA-256 and the
    transformers version, headed by the SHA-256 of the JSON): the conversion rebuilds the BPE
    merges of 130k tokens in Python, about 5 s of CPU per export, where reading them back takes
    0.6 s. A cache that is missing, damaged or cannot be written costs only the speed; what is
    exported is checked against our tokenizer either way (:func:`check_hf_tokenizer`)."""
    import transformers
    from tokenizers import Tokenizer as FastTokenizer

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    cache = default_cache_dir() / f"hf-tekken-{digest}-transformers-{transformers.__version__}"
    with contextlib.suppress(OSError, ValueError):
        checksum, text = cache.read_text(encoding="utf-8").split("\n", 1)
        if checksum == hashlib.sha256(text.encode()).hexdigest():
            return FastTokenizer.from_str(text)
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    backend = convert_tekken_tokenizer(str(path)).backend_tokenizer
    text = backend.to_str()
    _write_atomically(cache, f"{hashlib.sha256(text.encode()).hexdigest()}\n{text}")
    return backend


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` under a unique temporary name beside ``path``, then rename it (exports
    running together never read a partial file); skip it where the disk refuses."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temporary)


def _literal_specials(specials: Sequence[str]) -> str:
    """A text holding the special-token strings as plain text."""
    return "special tokens as text: " + " and ".join(specials) + " end"


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_hf_tokenizer(
    hf_dir: Path, ours: Tokenizer, texts: Sequence[str], *, split_special_tokens: bool = False
) -> None:
    """``AutoTokenizer.from_pretrained(hf_dir)(text)`` must equal ``<s>`` + our ids of ``text``
    (with ``split_special_tokens``, for text that holds control strings)."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in texts:
        expected = [ours.bos, *ours.encode(text)]
        got = theirs(text, split_special_tokens=split_special_tokens)["input_ids"]
        if got != expected:
            at = _first_difference(got, expected)
            raise ConversionError(
                f"the Hugging Face tokenizer converted from {getattr(ours, 'path', '?')} encodes "
                f"{text[:40]!r}... differently from ours (first difference at token {at}: "
                f"{got[at:at + 4]} vs {expected[at:at + 4]}); this tokenizer cannot be exported"
            )


def write_hf_tokenizer(
    source: TokenizerSource, dest: Path, *, model_max_length: int, vocab_size: int
) -> SpecialTokenIds:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``dest``, check them against
    our tokenizer, and return the special ids that ``config.json`` must name."""
    from transformers import PreTrainedTokenizerFast

    ours = build_tokenizer(source.type, source.model)
    if ours.vocab_size > vocab_size:
        raise ConversionError(
            f"the tokenizer {source.describe()} from {source.origin} has {ours.vocab_size} "
            f"tokens, more than the model's vocabulary of {vocab_size}"
        )
    backend = _backend(source, ours)
    bos, eos, pad = (backend.id_to_token(i) for i in (ours.bos, ours.eod, ours.pad))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        add_bos_token=True,
        add_eos_token=False,
        split_special_tokens=False,
        model_max_length=model_max_length,
    )
    hf.save_pretrained(str(dest))
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if source.type == "TekkenTokenizer":
        add_apertus_chat_format(dest)
    elif source.type == "HuggingFaceTokenizer":
        config |= copy_chat_template(Path(source.model), dest)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    check_hf_tokenizer(dest, ours, embedded_documents()[:CHECK_DOCUMENTS])
    check_hf_tokenizer(
        dest, ours, [_literal_specials(sorted({bos, eos, pad}))], split_special_tokens=True
    )
    return SpecialTokenIds(bos=ours.bos, eos=ours.eod, pad=ours.pad)


def copy_chat_template(source: Path, dest: Path) -> dict:
    """Carry the chat template of a Hugging Face tokenizer (``source``: its directory or its
    ``tokenizer.json``) into the export ``dest``: ``chat_template.jinja`` is copied; a template
    kept in ``tokenizer_config.json`` (older transformers) is returned as the config entries to
    add. No template: nothing."""
    directory = source if source.is_dir() else source.parent
    if (directory / "chat_template.jinja").is_file():
        shutil.copyfile(directory / "chat_template.jinja", dest / "chat_template.jinja")
        return {}
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    template = json.loads(config.read_text()).get("chat_template")
    return {} if template is None else {"chat_template": template}


def add_apertus_chat_format(directory: Path) -> None:
    """Name the reserved slots 61..72 of a converted tekken tokenizer with the Apertus control
    tokens and install the Apertus chat template (:mod:`megatron.apertus.data.chat`), so that
    ``apply_chat_template(..., tokenize=True)`` gives the ids training used."""
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    names = {f"<SPECIAL_{token_id}>": name for name, token_id in CONTROL_TOKENS.items()}
    for token in spec["added_tokens"]:
        token["content"] = names.get(token["content"], token["content"])
    vocab = spec["model"]["vocab"]
    for old, new in names.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(spec, ensure_ascii=False))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
