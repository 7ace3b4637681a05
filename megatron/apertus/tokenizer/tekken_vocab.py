"""What encoding with a tekken tokenizer needs, cached so that a tool starts in well under a second.

mistral-common's ``Tekkenizer`` encodes with tiktoken: byte-level BPE over the file's mergeable
ranks and regex pattern, every id shifted by the number of control tokens. Loading it is slow
(about 2 s of CPU: its imports pull in pydantic and requests, it parses a 15 MB JSON file,
base64-decodes 130k tokens and decodes every id once to build a vocabulary list that encoding
never reads). :func:`load_tekken_vocabulary` returns only what encoding needs, as the library
reports it, from a cache file; on a miss it loads the tokenizer with mistral-common, checks that
the vocabulary encodes a probe text exactly as the library does, and writes the cache.

The cache (``CACHE_DIR/tekken-<sha256 of the tokenizer file>-<mistral-common version>.npz``)
holds plain arrays and one JSON header, read with ``allow_pickle=False``; the header carries the
SHA-256 of the arrays, and a file that does not match it is ignored and rewritten. It is written
under a unique temporary name and renamed, so tasks starting together never read a partial file;
a cache directory that cannot be written costs only the speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = 1
PROBE = (
    "Grüezi mitenand! Le 3 mai 2024, 14h05: «Ça va?» — 東京タワー, Ελληνικά, русский. "
    "</s> <s> [INST] <pad>  \t\n\n  def f(x): return x**2  # 🙂🚀 ﬁ\u200b 1234567890"
)
"""Text that encodes differently if the id offset, the ranks or the pattern are off."""


@dataclass(frozen=True)
class TekkenVocabulary:
    """Everything :class:`~megatron.apertus.tokenizer.tokenizers.TekkenTokenizer` encodes with."""

    pattern: str
    ranks: dict[bytes, int]
    """BPE token bytes -> rank; token id = rank + ``num_special_tokens``."""
    num_special_tokens: int
    vocab_size: int
    bos: int
    eos: int
    pad: int

    def encoding(self, name: str):
        """The tiktoken encoding that mistral-common builds from the same file."""
        import tiktoken

        return tiktoken.Encoding(
            name=name, pat_str=self.pattern, mergeable_ranks=self.ranks, special_tokens={}
        )


def load_tekken_vocabulary(path: Path, cache_dir: Path) -> TekkenVocabulary:
    """The vocabulary of the tekken file ``path``, from the cache or from mistral-common."""
    cache = cache_dir / cache_name(path)
    vocabulary = read_cache(cache)
    if vocabulary is None:
        vocabulary = vocabulary_from_mistral_common(path)
        write_cache(cache, vocabulary)
    return vocabulary


def cache_name(path: Path) -> str:
    import mistral_common

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"tekken-{digest}-mistral-common-{mistral_common.__version__}-v{FORMAT}.npz"


def vocabulary_from_mistral_common(path: Path) -> TekkenVocabulary:
    """Load ``path`` with mistral-common and keep what encoding needs, checked on :data:`PROBE`."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    tekken = Tekkenizer.from_file(str(path))
    special = tekken.num_special_tokens
    ranks = {tekken.id_to_byte_piece(i): i - special for i in range(special, tekken.n_words)}
    vocabulary = TekkenVocabulary(
        pattern=json.loads(path.read_bytes())["config"]["pattern"],
        ranks=ranks,
        num_special_tokens=special,
        vocab_size=tekken.n_words,
        bos=tekken.bos_id,
        eos=tekken.eos_id,
        pad=tekken.pad_id,
    )
    ours = [i + special for i in vocabulary.encoding("probe").encode(PROBE)]
    if ours != tekken.encode(PROBE, bos=False, eos=False):
        raise RuntimeError(
            f"{path}: tiktoken over the file's ranks encodes differently from this "
            "mistral-common version, which is not supported"
        )
    return vocabulary


def _payload_digest(lengths: np.ndarray, blob: np.ndarray) -> str:
    return hashlib.sha256(lengths.tobytes() + blob.tobytes()).hexdigest()


def write_cache(cache: Path, vocabulary: TekkenVocabulary) -> None:
    """Write the cache under a unique temporary name, then rename it; skip it if unwritable."""
    tokens = sorted(vocabulary.ranks, key=vocabulary.ranks.__getitem__)
    lengths = np.array([len(t) for t in tokens], dtype=np.uint32)
    blob = np.frombuffer(b"".join(tokens), dtype=np.uint8)
    header = {
        "format": FORMAT,
        "pattern": vocabulary.pattern,
        "num_special_tokens": vocabulary.num_special_tokens,
        "vocab_size": vocabulary.vocab_size,
        "bos": vocabulary.bos,
        "eos": vocabulary.eos,
        "pad": vocabulary.pad,
        "payload_sha256": _payload_digest(lengths, blob),
    }
    header_bytes = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=cache.parent, prefix=cache.stem, suffix=".tmp.npz")
    except OSError:  # a read-only home: the next start loads the slow way again
        return
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(out, header=header_bytes, lengths=lengths, blob=blob)
        os.replace(temporary, cache)
    except BaseException as err:
        os.remove(temporary)
        if not isinstance(err, OSError):  # a full disk only costs the speed; Ctrl-C stops
            raise


def read_cache(cache: Path) -> TekkenVocabulary | None:
    """The cached vocabulary, or None when the file is missing, unreadable or does not match
    its checksum."""
    try:
        with np.load(cache, allow_pickle=False) as arrays:
            header = json.loads(arrays["header"].tobytes())
            lengths, blob = arrays["lengths"], arrays["blob"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if header.get("format") != FORMAT or header["payload_sha256"] != _payload_digest(lengths, blob):
        return None
    data = blob.tobytes()
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    starts = [0, *ends[:-1]]
    ranks = dict(zip([data[s:e] for s, e in zip(starts, ends)], range(len(ends))))
    return TekkenVocabulary(
        pattern=header["pattern"],
        ranks=ranks,
        num_special_tokens=header["num_special_tokens"],
        vocab_size=header["vocab_size"],
        bos=header["bos"],
        eos=header["eos"],
        pad=header["pad"],
    )
