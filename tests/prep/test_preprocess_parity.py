"""tools/preprocess_data.py's Megatron-LM flags on real text: ``--no-bos --append-eod`` is
upstream's token stream, ``--split-sentences`` (nltk Punkt) writes sentence-level datasets,
``--keep-newlines``, ``--log-interval``, ``--partitions``, ``--strict``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import REPO

TOOL = REPO / "tools" / "preprocess_data.py"
DOCS = embedded_documents()[:12]


@pytest.fixture(scope="module")
def tekken():
    return build_tokenizer("TekkenTokenizer")


@pytest.fixture(scope="module")
def punkt_data(tmp_path_factory) -> Path:
    """An nltk data directory with an English ``punkt_tab`` model: Punkt's default parameters
    plus two abbreviations (the published model needs a download)."""
    root = tmp_path_factory.mktemp("nltk_data")
    english = root / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (english / name).write_text("")
    (english / "abbrev_types.txt").write_text("e.g\ni.e\n")
    return root


def run_tool(tmp_path: Path, *args: str, nltk_data: Path | None = None):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    env = dict(os.environ, PYTHONPATH=str(REPO), NLTK_DATA=str(nltk_data or tmp_path / "none"))
    return subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--input",
            str(source),
            "--output-prefix",
            str(tmp_path / "out"),
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_no_bos_append_eod_is_upstreams_token_stream(tmp_path, tekken):
    proc = run_tool(
        tmp_path,
        "--no-bos",
        "--append-eod",
        "--partitions",
        "2",
        "--keep-sequential-samples",
        "--log-interval",
        "5",
    )
    assert proc.returncode == 0, proc.stderr
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    # Megatron-LM's Encoder: tokenize(text), then the eod id appended; no <s>
    for i, text in enumerate(DOCS):
        assert np.array(dataset[i]).tolist() == [*tekken.encode(text), tekken.eod]
    assert "processed 5 documents" in proc.stderr and "processed 10 documents" in proc.stderr


@pytest.mark.parametrize("keep_newlines", [False, True])
def test_split_sentences_writes_one_entry_per_sentence(
    tmp_path, tekken, punkt_data, keep_newlines, monkeypatch
):
    from nltk.tokenize.punkt import PunktTokenizer

    flags = ["--split-sentences", *(["--keep-newlines"] if keep_newlines else [])]
    proc = run_tool(tmp_path, *flags, nltk_data=punkt_data)
    assert proc.returncode == 0, proc.stderr
    dataset = IndexedDataset(str(tmp_path / "out_text_sentence"))
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(punkt_data), *nltk.data.path])
    punkt = PunktTokenizer("english")
    boundaries = dataset.document_indices
    assert len(boundaries) == len(DOCS) + 1
    for d, text in enumerate(DOCS):
        spans = list(punkt.span_tokenize(text))
        if keep_newlines:
            starts = [a for a, _ in spans]
            sentences = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
            assert "".join(sentences) == text[starts[0] :]
        else:
            sentences = [text[a:b] for a, b in spans]
        expected = [tekken.encode(s) for s in sentences]
        expected[0] = [tekken.bos, *expected[0]]
        expected[-1] = [*expected[-1], tekken.eod]
        got = [np.array(dataset[i]).tolist() for i in range(boundaries[d], boundaries[d + 1])]
        assert got == expected
    assert boundaries[-1] > 2 * len(DOCS)  # the documents do have several sentences


def test_split_sentences_without_punkt_data_fails_in_one_line(tmp_path):
    proc = run_tool(tmp_path, "--split-sentences")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("python -m nltk.downloader punkt_tab")
    assert "Traceback" not in proc.stderr and not list(tmp_path.glob("out*"))


def test_strict_exit_status_says_lines_were_rejected(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"text": DOCS[0]}) + "\n{broken\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        str(TOOL),
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "out"),
    ]
    lenient = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    strict = subprocess.run(
        [*command, "--strict"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert (lenient.returncode, strict.returncode) == (0, 1)
    assert "rejected 1 lines" in strict.stdout
