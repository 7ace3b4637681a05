"""The embedded default corpus: real English text that ships with Python itself.

* ``pydoc_data.topics``: the ~465k characters of the Python language reference, one document
  per topic (79 documents, ~109k tekken tokens);
* the docstrings of the standard library's modules (tests excluded), one document per module
  (~375 documents, ~1.6M characters with Python 3.11).

Both come from the running interpreter, so the text, and with it a run's losses, differ between
Python versions (Python 3.11 gives 454 documents, 3.12 gives 418).

Together (``training_documents``) about half a million tokens: enough for the demo to train
for a few hundred steps without repeating its data. The corpus is written as JSON lines and
preprocessed with the same code users run (``tools/preprocess_data.py``), once per tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

from megatron.apertus.cli import exclusive
from megatron.apertus.prep.preprocess import PreprocessConfig, output_prefix, preprocess
from megatron.apertus.tokenizer.tokenizers import Tokenizer


def embedded_documents() -> list[str]:
    """The documents of the embedded corpus, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def stdlib_docstring_documents() -> list[str]:
    """One document per standard-library module: its module, class and function docstrings."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "site-packages", "idlelib", "lib2to3"}
    documents = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in skipped or p.startswith("test") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        text = "\n\n".join(d for d in docstrings if d and len(d) > 40)
        if len(text) > 200:
            documents.append(text)
    return documents


def training_documents() -> list[str]:
    """The embedded corpus that training uses by default, in a fixed shuffled order so that a
    split by document ranges (megatron-core's ``--split``) holds out a representative sample."""
    import random

    documents = embedded_documents() + stdlib_docstring_documents()
    random.Random(20251122).shuffle(documents)
    return documents


def write_jsonl(path: Path, documents: list[str]) -> Path:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for text in documents:
            out.write(json.dumps({"text": text}) + "\n")
    tmp.replace(path)
    return path


def embedded_corpus_prefix(cache: Path, tokenizer: Tokenizer, *, build: bool = True) -> Path:
    """``PREFIX`` of the embedded corpus tokenized by ``tokenizer`` (preprocessed if missing).

    The corpus is this interpreter's documentation, which changes between Python releases, so
    the cache is keyed by the Python version as well as the tokenizer: two interpreters sharing
    a cache never train on each other's text."""
    source = f"{getattr(tokenizer, 'path', type(tokenizer).__name__)}|{platform.python_version()}"
    tag = hashlib.sha256(source.encode()).hexdigest()[:12]
    directory = cache / f"embedded-v3-{tag}"
    prefix = Path(output_prefix(str(directory / "python_docs"), "text"))
    if build and not prefix.with_suffix(".idx").is_file():
        with exclusive(cache / f"embedded-v3-{tag}.lock"):
            if not prefix.with_suffix(".idx").is_file():
                directory.mkdir(parents=True, exist_ok=True)
                source = write_jsonl(directory / "python_docs.jsonl", training_documents())
                preprocess(
                    PreprocessConfig(
                        inputs=[source],
                        output_prefix=str(directory / "python_docs"),
                        tokenizer_type=type(tokenizer).__name__,
                        tokenizer_model=str(tokenizer.path),
                    )
                )
    return prefix
