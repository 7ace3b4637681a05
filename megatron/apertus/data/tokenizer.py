"""Tokenizers with the ids training needs: ``bos`` (begin of document), ``eod``, ``pad``.

The default is the 131072-token "tekken" byte-level BPE that ships inside the
``mistral-common`` wheel (same family as Apertus: ``<unk>``=0, ``<s>``=1, ``</s>``=2), so
demos and tests use a real production tokenizer without network access.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DEFAULT_TEKKEN = "tekken_240718.json"


def bundled_tekken_path(name: str = DEFAULT_TEKKEN) -> Path:
    """Path of a tekken JSON file shipped in the mistral-common wheel."""
    import mistral_common

    path = Path(os.path.dirname(mistral_common.__file__)) / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is mistral-common installed?")
    return path


@dataclass
class TekkenTokenizer:
    """A tekken tokenizer: plain-text encode/decode; special tokens never come from raw text."""

    path: Path

    def __post_init__(self) -> None:
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        self._tok = Tekkenizer.from_file(str(self.path))

    @property
    def vocab_size(self) -> int:
        return self._tok.n_words

    @property
    def bos(self) -> int:
        return self._tok.bos_id

    @property
    def eod(self) -> int:
        return self._tok.eos_id

    @property
    def pad(self) -> int:
        return self._tok.pad_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, bos=False, eos=False)

    def encode_document(self, text: str) -> list[int]:
        """``<s> text </s>``: every document carries its begin and end tokens."""
        return [self.bos, *self.encode(text), self.eod]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(path: str | os.PathLike | None = None) -> TekkenTokenizer:
    """The tekken tokenizer at ``path``, or the one bundled with mistral-common."""
    return TekkenTokenizer(Path(path) if path else bundled_tekken_path())
