"""The embedded default corpus: real English text that ships with Python itself.

``pydoc_data.topics`` holds the ~465k characters of the Python language reference topics;
each topic is one document. It is written as JSON lines and preprocessed with the same tool
users run (``tools/preprocess_data.py``), once per tokenizer, into a cache directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatron.apertus.data.preprocess import PreprocessConfig, output_prefix, preprocess
from megatron.apertus.data.tokenizer import Tokenizer


def embedded_documents() -> list[str]:
    """The documents of the embedded corpus, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def write_jsonl(path: Path, documents: list[str]) -> Path:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for text in documents:
            out.write(json.dumps({"text": text}) + "\n")
    tmp.replace(path)
    return path


def embedded_corpus_prefix(cache: Path, tokenizer: Tokenizer, *, build: bool = True) -> Path:
    """``PREFIX`` of the embedded corpus tokenized by ``tokenizer`` (preprocessed if missing)."""
    tag = hashlib.sha256(
        str(getattr(tokenizer, "path", type(tokenizer).__name__)).encode()
    ).hexdigest()[:12]
    directory = cache / f"embedded-{tag}"
    prefix = Path(output_prefix(str(directory / "pydoc_topics"), "text"))
    if build and not prefix.with_suffix(".idx").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        source = write_jsonl(directory / "pydoc_topics.jsonl", embedded_documents())
        preprocess(
            PreprocessConfig(
                inputs=[source],
                output_prefix=str(directory / "pydoc_topics"),
                tokenizer_type=type(tokenizer).__name__,
                tokenizer_model=str(tokenizer.path),
            )
        )
    return prefix
