"""The embedded default corpus: real English text that ships with Python itself.

``pydoc_data.topics`` holds the ~465k characters of the Python language reference topics;
each topic is one document. Documents are split deterministically into train and
validation sets so the validation text is held out.
"""

from __future__ import annotations

import numpy as np

from megatron.apertus.data.tokenizer import TekkenTokenizer


def embedded_documents() -> list[str]:
    """The documents of the embedded corpus, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def tokenize_documents(tokenizer: TekkenTokenizer, documents: list[str]) -> np.ndarray:
    """One int32 stream of ``<s> doc </s>`` documents back to back."""
    ids = [tok for doc in documents for tok in tokenizer.encode_document(doc)]
    return np.asarray(ids, dtype=np.int32)


def train_valid_streams(
    tokenizer: TekkenTokenizer, valid_every: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """Token streams of the embedded corpus: every ``valid_every``-th document is validation."""
    docs = embedded_documents()
    valid = [d for i, d in enumerate(docs) if i % valid_every == 0]
    train = [d for i, d in enumerate(docs) if i % valid_every != 0]
    return tokenize_documents(tokenizer, train), tokenize_documents(tokenizer, valid)
