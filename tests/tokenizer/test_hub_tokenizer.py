"""``--tokenizer-model ORG/NAME``: a Hugging Face hub name resolved from the local cache, offline.

The cache is a real ``HF_HOME`` layout (blobs, snapshot symlinks, ``refs/main``) holding the
Apertus tokenizer under the Apertus hub names; ``transformers`` reads the same cache offline.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import REPO
from tests.hub_cache import (  # noqa: F401 (fixtures)
    APERTUS_REPOS,
    apertus_hf_home,
    apertus_hub_cache,
    offline_hf_home,
)
from tests.prep.test_preprocess import write_jsonl

DOCS = embedded_documents()[:8]


def test_hub_name_is_the_cached_snapshot(apertus_hub_cache):
    ours = build_tokenizer("HuggingFaceTokenizer", APERTUS_REPOS[0])
    repo = apertus_hub_cache / "models--swiss-ai--Apertus-8B-2509"
    assert ours.path.parent == repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert ours.vocab_size == 131072
    tekken = build_tokenizer("TekkenTokenizer")
    assert (ours.bos, ours.eod) == (tekken.bos, tekken.eod)
    for text in DOCS:
        assert ours.encode(text) == tekken.encode(text)


def test_transformers_reads_the_same_cache_offline(apertus_hub_cache):
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(APERTUS_REPOS[1], local_files_only=True)
    ours = build_tokenizer("HuggingFaceTokenizer", APERTUS_REPOS[1])
    for text in DOCS:
        assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)


def _preprocess(tmp_path, tokenizer_model: str) -> subprocess.CompletedProcess:
    source = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(source),
            "--output-prefix",
            str(tmp_path / "out"),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            tokenizer_model,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_fresh_process_finds_the_name_through_hf_home(apertus_hf_home, tmp_path):
    """The tool's own process: huggingface_hub derives the cache from HF_HOME at start."""
    with offline_hf_home(apertus_hf_home):
        proc = _preprocess(tmp_path, APERTUS_REPOS[0])
    assert proc.returncode == 0, proc.stderr
    tekken = build_tokenizer("TekkenTokenizer")
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [list(dataset[i]) for i in range(len(dataset))] == [
        tekken.encode_document(text) for text in DOCS
    ]


def test_a_name_the_cache_lacks_is_one_line_naming_cache_and_command(tmp_path):
    empty = tmp_path / "empty_home"
    with offline_hf_home(empty):
        proc = _preprocess(tmp_path, "swiss-ai/Apertus-8B-2509")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "--tokenizer-model swiss-ai/Apertus-8B-2509" in line
    assert str(empty / "hub") in line
    assert "`hf download swiss-ai/Apertus-8B-2509 tokenizer.json tokenizer_config.json`" in line
    assert not list(tmp_path.glob("out*"))


def test_a_path_that_is_not_a_hub_name_says_so(tmp_path):
    with pytest.raises(Exception, match="no such file or directory$"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "missing" / "tokenizer"))


def test_a_tokenizer_without_a_pad_piece_pads_with_its_eos(tmp_path):
    """A ``tokenizer.json`` whose vocabulary has bos and eos but no ``<pad>`` (most BPEs
    trained from scratch) pads with eos, as Megatron-LM's GPT tokenizers do."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import WordLevel

    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    FastTokenizer(WordLevel(vocabulary, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert (tokenizer.bos, tokenizer.eod, tokenizer.pad) == (1, 2, 2)
