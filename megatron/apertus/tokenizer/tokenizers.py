"""Tokenizers with the ids training needs: ``bos`` (begin of document), ``eod``, ``pad``.

Four families, one interface (:class:`Tokenizer`):

* ``TekkenTokenizer``: Mistral's tekken JSON (the Apertus family, 131072 tokens). The default
  is the ``tekken_240718.json`` that ships inside the ``mistral-common`` wheel, so demos and
  tests use a real production tokenizer offline.
* ``HuggingFaceTokenizer``: a ``tokenizer.json``, a directory holding one, or a hub name
  (``org/name``) found in the local Hugging Face cache.
* ``SentencePieceTokenizer``: a ``.model`` file.
* ``NullTokenizer`` (Megatron-LM's, for ``--mock-data`` and benchmark runs): ids ``0 ..
  vocab_size - 1`` with no vocabulary behind them, the end of document the last id unless given,
  no padding id (-1) unless given, as megatron-core 0.19's (0.16's had one id more, the end of
  document after ``vocab_size``). Only training builds it (:func:`null_tokenizer`): what reads
  or writes text refuses it in one line (:data:`NO_VOCABULARY`).

Raw text is always tokenized as text: a literal ``</s>`` in a web page stays the characters
``<``, ``/``, ``s``, ``>`` and never becomes the end-of-document id (Megatron's upstream tool
turns such strings into special tokens, silently splitting or merging documents).
The objects also serve megatron-core's ``GPTDataset``, which reads ``eod`` and ``pad``.
"""

from __future__ import annotations

import functools
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence, get_args

from megatron.apertus.cache import default_cache_dir
from megatron.apertus.errors import ConfigError
from megatron.apertus.tokenizer.config import TokenizerType

DEFAULT_TEKKEN = "tekken_240718.json"
TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)


def bundled_tekken_path(name: str = DEFAULT_TEKKEN) -> Path:
    """Path of a tekken JSON file shipped in the mistral-common wheel."""
    import mistral_common

    path = Path(os.path.dirname(mistral_common.__file__)) / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is mistral-common installed?")
    return path


class Tokenizer(ABC):
    """Text <-> ids, plus the special ids of a document: ``<s> text </s>``."""

    vocab_size: int
    bos: int
    eod: int
    pad: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with no special tokens added or parsed."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def special_piece(self, token_id: int) -> str:
        """The vocabulary's string for ``token_id`` (control tokens included)."""

    def special_ids(self) -> list[int]:
        """The ids of control tokens (begin and end of document, padding, chat tokens, ...)."""
        return sorted({self.bos, self.eod, self.pad})

    def encode_document(self, text: str) -> list[int]:
        """``<s> text </s>``: every document carries its begin and end tokens."""
        return [self.bos, *self.encode(text), self.eod]

    # megatron-core's tokenizer interface, as GPTDataset and friends use it.
    @property
    def unique_identifiers(self) -> dict:
        """Part of the key of megatron-core's cached sample indices."""
        return {"class": type(self).__name__, "path": str(getattr(self, "path", ""))}

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.decode(ids)


NO_VOCABULARY = (
    "--tokenizer-type NullTokenizer has ids but no vocabulary (Megatron-LM's tokenizer for "
    "--mock-data runs): {what} needs a real tokenizer"
)
"""The refusal of whatever needs text from a :class:`NullTokenizer`; ``{what}``: what needs it."""


class NullTokenizer(Tokenizer):
    """Megatron-LM's synthetic tokenizer: ``vocab_size`` ids, no text. The end of document is
    ``eod`` (default: the last id), ``pad`` -1 means none (megatron-core's datasets then mask
    nothing as padding); there is no begin-of-document id."""

    def __init__(self, vocab_size: int, eod: int | None = None, pad: int = -1) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1 if eod is None else eod
        self.pad = pad

    @property
    def bos(self) -> int:
        raise ConfigError(NO_VOCABULARY.format(what="a begin-of-document token"))

    def encode(self, text: str) -> list[int]:
        raise ConfigError(NO_VOCABULARY.format(what="tokenizing text"))

    def decode(self, ids: Sequence[int]) -> str:
        raise ConfigError(NO_VOCABULARY.format(what="decoding ids"))

    def special_piece(self, token_id: int) -> str:
        raise ConfigError(NO_VOCABULARY.format(what="naming a token"))

    def special_ids(self) -> list[int]:
        return sorted({self.eod, self.pad} - {-1})

    @property
    def unique_identifiers(self) -> dict:
        """The ids are all there is of this tokenizer: they key megatron-core's sample indices."""
        return {
            "class": type(self).__name__,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }


def null_tokenizer(vocab_size: int, eod: int | None = None, pad: int = -1) -> NullTokenizer:
    """:class:`NullTokenizer` of ``vocab_size`` ids, its ``eod`` and ``pad`` checked
    (``--null-tokenizer-eod-id``, ``--null-tokenizer-pad-id``): the end of document is an id of
    the vocabulary, the padding id one too or -1 (none)."""
    tokenizer = NullTokenizer(vocab_size, eod, pad)
    if not 0 <= tokenizer.eod < vocab_size:
        raise ConfigError(
            f"--null-tokenizer-eod-id must be an id of the vocabulary (0 to {vocab_size - 1}, "
            f"--vocab-size {vocab_size}), got {tokenizer.eod}"
        )
    if not -1 <= pad < vocab_size:
        raise ConfigError(
            f"--null-tokenizer-pad-id must be -1 (no padding) or an id of the vocabulary (0 to "
            f"{vocab_size - 1}), got {pad}"
        )
    return tokenizer


def cached_hub_snapshot(name: str) -> Path:
    """The cached snapshot directory of the hub repository ``name`` holding its tokenizer.json.

    Megatron-LM's ``HuggingFaceTokenizer`` takes hub names; compute nodes are offline, so the
    name is looked up only where ``transformers`` looks with the hub offline: huggingface_hub's
    cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``), at the revision ``main`` points to. Nothing
    is downloaded; a missing entry is one line naming the cache and the command that fills it.
    """
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "tokenizer.json")
    except HFValidationError:  # neither an existing path nor a hub name
        raise ConfigError(f"--tokenizer-model {name}: no such file or directory") from None
    if isinstance(cached, str):
        return Path(cached).parent
    raise ConfigError(
        f"--tokenizer-model {name}: no such file or directory, and the Hugging Face cache "
        f"{constants.HF_HUB_CACHE} holds no tokenizer of that hub name (nothing is downloaded "
        f"here); fill the cache where the hub is reachable, with the same HF_HOME or "
        f"HF_HUB_CACHE: `hf download {name} tokenizer.json tokenizer_config.json`"
    )


class TekkenTokenizer(Tokenizer):
    """Encodes with tiktoken over the vocabulary mistral-common reads from the file (cached, see
    :mod:`~megatron.apertus.tokenizer.tekken_vocab`: the same ids, a tenth of the start-up);
    decodes with mistral-common's ``Tekkenizer``, loaded when first needed."""

    def __init__(self, path: str | os.PathLike, cache_dir: Path | None = None) -> None:
        from megatron.apertus.tokenizer.tekken_vocab import load_tekken_vocabulary

        self.path = Path(path)
        vocabulary = load_tekken_vocabulary(self.path, cache_dir or default_cache_dir())
        self._encoding = vocabulary.encoding(self.path.stem)
        self._offset = vocabulary.num_special_tokens
        self.vocab_size = vocabulary.vocab_size
        self.bos, self.eod, self.pad = vocabulary.bos, vocabulary.eos, vocabulary.pad

    @functools.cached_property
    def _tekkenizer(self):
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        return Tekkenizer.from_file(str(self.path))

    def encode(self, text: str) -> list[int]:
        return [i + self._offset for i in self._encoding.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tekkenizer.decode(list(ids))

    def special_piece(self, token_id: int) -> str:
        return self._tekkenizer.id_to_piece(token_id)

    def special_ids(self) -> list[int]:
        """Tekken reserves its first ids for control tokens (1000 in the Apertus vocabulary)."""
        return list(range(self._offset))


class HuggingFaceTokenizer(Tokenizer):
    """A ``tokenizers`` fast tokenizer; special ids from ``tokenizer_config.json`` or the vocab."""

    def __init__(self, path: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(path) if Path(path).exists() else cached_hub_snapshot(str(path))
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"--tokenizer-model {path}: no tokenizer.json in it")
        self.path = file
        self._tok = FastTokenizer.from_file(str(file))
        # Special-token strings inside the text are encoded as text, never as their ids.
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = self._special_names(file.parent / "tokenizer_config.json")
        self.bos = self._id_of(names["bos_token"], "bos_token")
        self.eod = self._id_of(names["eos_token"], "eos_token")
        pad = self._tok.token_to_id(names["pad_token"]) if names["pad_token"] else None
        # a vocabulary without a pad piece pads with eos
        self.pad = self.eod if pad is None else pad

    @staticmethod
    def _special_names(config: Path) -> dict[str, str | None]:
        names = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
        if config.is_file():
            for key, value in json.loads(config.read_text()).items():
                if key in names:
                    names[key] = value["content"] if isinstance(value, dict) else value
        return names

    def _id_of(self, token: str | None, what: str) -> int:
        token_id = self._tok.token_to_id(token) if token else None
        if token_id is None:
            raise ValueError(f"{self.path}: the {what} {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def special_ids(self) -> list[int]:
        added = self._tok.get_added_tokens_decoder()
        return sorted(
            {i for i, token in added.items() if token.special} | set(super().special_ids())
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def special_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str | os.PathLike) -> None:
        import sentencepiece

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no sentencepiece model")
        self._tok = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self._tok.get_piece_size()
        self.bos, self.eod = self._tok.bos_id(), self._tok.eos_id()
        self.pad = self._tok.pad_id() if self._tok.pad_id() >= 0 else self.eod
        if self.bos < 0 or self.eod < 0:
            raise ValueError(f"{self.path}: the model defines no bos/eos ids")

    def encode(self, text: str) -> list[int]:
        # encode() of sentencepiece never maps control-symbol strings in text to their ids.
        return self._tok.encode(text)

    def special_ids(self) -> list[int]:
        controls = (i for i in range(self.vocab_size) if self._tok.is_control(i))
        return sorted(set(controls) | set(super().special_ids()))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def special_piece(self, token_id: int) -> str:
        return self._tok.id_to_piece(token_id)


def build_tokenizer(tokenizer_type: str = "TekkenTokenizer", model: str | None = None) -> Tokenizer:
    """A tokenizer by Megatron-style type name; ``model`` defaults to the bundled tekken.
    ``NullTokenizer`` has no file to read: training builds it with :func:`null_tokenizer`."""
    if tokenizer_type == "TekkenTokenizer":
        return TekkenTokenizer(model or bundled_tekken_path())
    if tokenizer_type == "NullTokenizer":
        raise ConfigError(NO_VOCABULARY.format(what="reading or writing text"))
    if model is None:
        raise ValueError(f"--tokenizer-model is required for --tokenizer-type {tokenizer_type}")
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def checked_tokenizer(tokenizer_type: str, model: str | None) -> Tokenizer:
    """:func:`build_tokenizer` for the flags as given: any failure to read ``--tokenizer-model``
    becomes one line naming it. Each tokenizer library fails in its own way on a file of another
    kind (a JSON error, a ``KeyError``, a protobuf ``RuntimeError``), so every ``Exception`` of
    the load counts as the user's file not being a tokenizer."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(
            f"unknown --tokenizer-type {tokenizer_type!r}; choose one of "
            f"{', '.join(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "NullTokenizer":
        raise ConfigError(NO_VOCABULARY.format(what="reading or writing text"))
    if model is None and tokenizer_type != "TekkenTokenizer":
        raise ConfigError(f"--tokenizer-model is required for --tokenizer-type {tokenizer_type}")
    path = Path(model) if model is not None else None
    if path is not None and tokenizer_type != "HuggingFaceTokenizer":  # hub names: see there
        if not path.exists():
            raise ConfigError(f"--tokenizer-model {model}: no such file or directory")
        if path.is_dir():
            raise ConfigError(
                f"--tokenizer-model {model}: a directory, not a {tokenizer_type} file"
            )
    try:
        return build_tokenizer(tokenizer_type, model)
    except ConfigError:
        raise
    except Exception as err:
        detail = err.strerror if isinstance(err, OSError) and err.strerror else repr(err)
        raise ConfigError(
            f"--tokenizer-model {model}: not a {tokenizer_type} file ({detail})"
        ) from None


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """The tekken tokenizer at ``path``, or the one bundled with mistral-common."""
    return build_tokenizer("TekkenTokenizer", str(path) if path else None)
