"""A Hugging Face cache laid out on disk as ``hf download`` leaves it, for offline tests.

``HF_HOME/hub/models--ORG--NAME/`` holds ``blobs/<git blob sha1>`` (the content),
``snapshots/<commit>/<file>`` (relative symlinks to the blobs) and ``refs/main`` (the commit):
the layout that huggingface_hub's cache lookup and ``transformers`` read with the hub offline.
The Apertus hub repositories get the Apertus tokenizer: the bundled tekken converted by our
exporter (131072 tokens, the Apertus control tokens and chat template).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Iterator

import pytest

APERTUS_REPOS = ("swiss-ai/Apertus-8B-2509", "swiss-ai/Apertus-70B-2509")


def _git_blob_sha1(data: bytes) -> str:
    """The id git (and so the hub, for files outside LFS) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(hub_cache: Path, repo_id: str, source_dir: Path) -> Path:
    """Cache every file of ``source_dir`` as the ``main`` revision of ``repo_id``."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in source_dir.iterdir() if p.is_file())
    commit = hashlib.sha1(
        b"".join(p.name.encode() + _git_blob_sha1(p.read_bytes()).encode() for p in files)
    ).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / _git_blob_sha1(data)
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def apertus_tokenizer(directory: Path) -> Path:
    """The Apertus tokenizer (the bundled tekken through our exporter) written to ``directory``."""
    from megatron.apertus.convert.hf_tokenizer import TokenizerSource, write_hf_tokenizer

    source = TokenizerSource("TekkenTokenizer", None, "the bundled tekken")
    write_hf_tokenizer(source, directory, model_max_length=4096, vocab_size=131072)
    return directory


@contextlib.contextmanager
def offline_hf_home(hf_home: Path) -> Iterator[Path]:
    """``HF_HOME`` set to ``hf_home`` with the hub offline, for this process and its children.

    huggingface_hub reads ``HF_HOME`` when it is imported, as a fresh process does; inside an
    already running test process its derived ``constants.HF_HUB_CACHE`` is set to the same
    ``HF_HOME/hub`` for the duration.
    """
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HOME", str(hf_home))
        patch.delenv("HF_HUB_CACHE", raising=False)
        patch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        yield hf_home / "hub"


@pytest.fixture(scope="module")
def apertus_hf_home(tmp_path_factory) -> Path:
    """An ``HF_HOME`` whose hub cache holds the Apertus 8B and 70B repositories' tokenizer."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    tokenizer = apertus_tokenizer(tmp_path_factory.mktemp("apertus_tokenizer"))
    for repo_id in APERTUS_REPOS:
        add_snapshot(hf_home / "hub", repo_id, tokenizer)
    return hf_home


@pytest.fixture
def apertus_hub_cache(apertus_hf_home) -> Iterator[Path]:
    """The Apertus cache as this test's offline ``HF_HOME``; yields its hub cache directory."""
    with offline_hf_home(apertus_hf_home) as hub_cache:
        yield hub_cache
