"""tools/preprocess_data.py: exact round trip through megatron-core's reader, bad input, workers."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.tokenizer.tokenizers import build_tokenizer, bundled_tekken_path
from tests.conftest import REPO

TOOL = REPO / "tools" / "preprocess_data.py"
DOCS = embedded_documents()


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tekken():
    return build_tokenizer("TekkenTokenizer")


def read_documents(prefix: str) -> list[np.ndarray]:
    dataset = IndexedDataset(prefix)
    return [np.array(dataset[i]) for i in range(len(dataset))]  # copies: the mmap closes with it


@pytest.mark.parametrize("compression", ["", ".gz", ".zst"])
def test_round_trip_through_megatron_reader(tmp_path, tekken, compression):
    source = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    if compression == ".gz":
        source = source.with_suffix(".jsonl.gz")
        source.write_bytes(gzip.compress((tmp_path / "corpus.jsonl").read_bytes()))
    elif compression == ".zst":
        import zstandard

        source = source.with_suffix(".jsonl.zst")
        source.write_bytes(
            zstandard.ZstdCompressor().compress((tmp_path / "corpus.jsonl").read_bytes())
        )
    workers = "2" if compression == "" else "1"
    proc = run_tool(
        "--input", str(source), "--output-prefix", str(tmp_path / "out"), "--workers", workers
    )
    assert proc.returncode == 0, proc.stderr
    documents = read_documents(str(tmp_path / "out_text_document"))
    assert tekken.vocab_size == 131072
    assert len(documents) == len(DOCS)
    for got, text in zip(documents, DOCS):
        assert got.dtype == np.int32
        assert got.tolist() == tekken.encode_document(text)
    assert not list(tmp_path.glob("*.tmp*")), "temporary files must be renamed when complete"
    assert f"wrote {len(DOCS)} documents" in proc.stdout


def test_broken_lines_are_reported_skipped_and_counted(tmp_path, tekken):
    good = DOCS[:6]
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',  # line 2: invalid JSON
        json.dumps({"text": good[1]}).encode(),
        json.dumps({"title": "no text key"}).encode(),  # line 4: missing key
        json.dumps({"text": good[2]}).encode(),
        b'{"text": "caf\xe9 latin-1"}',  # line 6: not UTF-8
        json.dumps({"text": "   "}).encode(),  # line 7: empty document
        json.dumps(["a", "list"]).encode(),  # line 8: not an object
        json.dumps({"text": good[3]}).encode(),
        json.dumps({"text": 42}).encode(),  # line 10: not a string
        json.dumps({"text": good[4]}).encode(),
        json.dumps({"text": good[5]}).encode(),
    ]
    source = tmp_path / "broken.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    proc = run_tool("--input", str(source), "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    for number in (2, 4, 6, 7, 8, 10):
        assert f"{source}:{number}: skipped" in proc.stderr
    assert "wrote 6 documents" in proc.stdout
    assert "rejected 6 lines" in proc.stdout
    for reason in (
        "invalid JSON",
        "missing key 'text'",
        "not UTF-8",
        "empty document in key 'text'",
        "not a JSON object but list",
        "key 'text' is int, not a string",
    ):
        assert reason in proc.stdout
    documents = read_documents(str(tmp_path / "out_text_document"))
    assert [d.tolist() for d in documents] == [tekken.encode_document(t) for t in good]


def test_workers_do_not_change_the_output(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", DOCS[:30])
    for workers in ("1", "2"):
        proc = run_tool(
            "--input",
            str(source),
            "--output-prefix",
            str(tmp_path / f"w{workers}"),
            "--workers",
            workers,
        )
        assert proc.returncode == 0, proc.stderr
    for suffix in (".bin", ".idx"):
        one = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        assert one == (tmp_path / f"w2_text_document{suffix}").read_bytes()


def test_missing_input_fails_before_any_work(tmp_path):
    proc = run_tool(
        "--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "out")
    )
    assert proc.returncode == 2
    assert "input file(s) not found" in proc.stderr and "nope.jsonl" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_unknown_tokenizer_fails_before_any_work(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", DOCS[:2])
    proc = run_tool(
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    proc = run_tool(
        "--input",
        str(source),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tmp_path / "x"),
    )
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def tool_actions(parser) -> dict:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


def test_the_data_tools_add_the_trainers_tokenizer_group():
    """One declaration (``TokenizerConfig``): the same flags, help, default and choices in the
    trainer and in every tokenizing tool; a tool's parser builds ``PreprocessConfig``."""
    import pretrain_gpt
    from tests.test_cli import load_tool

    trainer = tool_actions(pretrain_gpt.build_parser())
    for name in ("preprocess_data", "tokenize_corpus", "preprocess_chat", "preprocess_preferences"):
        module = load_tool(REPO / "tools" / f"{name}.py")
        if name == "tokenize_corpus":
            parser = module.argparse.ArgumentParser()
            for title, group in module.GROUPS.items():
                module.add_arguments(parser, group, title=title)
        else:
            parser = module.ArgumentParser()
            module.add_corpus_arguments(parser)
        tool = tool_actions(parser)
        for flag in ("--tokenizer-type", "--tokenizer-model"):
            ours, theirs = tool[flag], trainer[flag]
            assert (ours.help, ours.default, ours.choices) == (
                theirs.help,
                theirs.default,
                theirs.choices,
            ), (name, flag)
    config, strict = load_tool(TOOL).parse_args(
        [
            "--input",
            "a.jsonl",
            "--output-prefix",
            "o",
            "--no-bos",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--strict",
        ]
    )
    assert (config.add_bos, config.add_eod, config.tokenizer_type, strict) == (
        False,
        True,
        "HuggingFaceTokenizer",
        True,
    )


def test_append_eod_with_no_eod_is_refused_in_one_line(tmp_path):
    source = write_jsonl(tmp_path / "corpus.jsonl", DOCS[:2])
    out = str(tmp_path / "out")
    proc = run_tool("--input", str(source), "--output-prefix", out, "--append-eod", "--no-eod")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "preprocess_data.py: error: --append-eod and --no-eod: give one of them\n"
    assert run_tool("--input", str(source), "--output-prefix", out, "--append-eod").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "corpus.jsonl"


def test_special_token_strings_in_text_stay_text(tekken):
    ids = tekken.encode_document("a literal </s> and <s> inside a web page")
    assert ids[0] == tekken.bos and ids[-1] == tekken.eod
    assert tekken.bos not in ids[1:-1] and tekken.eod not in ids[1:-1]


def test_other_tokenizer_families(tmp_path, tekken):
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    hf_dir = tmp_path / "hf"
    convert_tekken_tokenizer(str(bundled_tekken_path())).save_pretrained(hf_dir)
    hf = build_tokenizer("HuggingFaceTokenizer", str(hf_dir))
    text = DOCS[3][:2000] + " </s> stays text"
    assert (hf.bos, hf.eod) == (1, 2)
    assert hf.encode_document(text) == tekken.encode_document(text)

    import mistral_common

    spm_path = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    spm = build_tokenizer("SentencePieceTokenizer", str(spm_path))
    ids = spm.encode_document("Hello </s> world")
    assert spm.vocab_size == 32000 and ids[0] == spm.bos and ids[-1] == spm.eod
    assert spm.eod not in ids[1:-1]
    assert spm.decode(ids[1:-1]) == "Hello </s> world"


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_our_writer_writes_megatron_core_bytes(tmp_path, tekken, dtype):
    """The numpy writer of the tools against megatron-core's builder: documents of one and of
    several sequences (sentence datasets), ids near the top of the dtype."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron.apertus.prep.indexed_writer import IndexedDatasetWriter

    top = np.iinfo(dtype).max
    # real ids, folded into the dtype's range for uint16 (a vocabulary below 65500)
    documents = [[(np.asarray(tekken.encode(d)) % (int(top) + 1)).astype(dtype)] for d in DOCS[:5]]
    documents.append([np.asarray([top, 0, 1], dtype=dtype), np.asarray([top], dtype=dtype)])
    theirs = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    ours = IndexedDatasetWriter(str(tmp_path / "ours.bin"), dtype=dtype)
    for sequences in documents:
        for builder in (theirs, ours):
            builder.add_document(np.concatenate(sequences), [s.size for s in sequences])
    theirs.finalize(str(tmp_path / "theirs.idx"))
    ours.finalize(str(tmp_path / "ours.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (
            tmp_path / f"theirs{suffix}"
        ).read_bytes()
    sequences = [d.tolist() for d in read_documents(str(tmp_path / "ours"))]  # one per entry
    assert sequences == [s.tolist() for document in documents for s in document]
    assert IndexedDataset(str(tmp_path / "ours")).document_indices.tolist() == [0, 1, 2, 3, 4, 5, 7]
