"""tools/build_mixture.py and tools/data_config.py on real tokenized folders: shares met within
one dataset, reproducible with a seed, ``--exclude`` honoured, and a blend over the generated
``--data-args-path`` realising the mixture's proportions in megatron-core and pretrain_gpt.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.apertus import parallel
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.model import ParallelConfig
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.prep.mixture import folder_parts, identity
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import PRETRAIN, REPO, run_entry
from tests.prep.test_tokenize_corpus import run_tool

BUILD = REPO / "tools" / "build_mixture.py"
DATA_CONFIG = REPO / "tools" / "data_config.py"
DOCS = embedded_documents()


def tokenized_folder(root: Path, name: str, docs: list[str], per_file: int) -> Path:
    """``docs`` in files of ``per_file`` documents, tokenized one dataset per file."""
    raw = root / f"{name}-jsonl"
    raw.mkdir()
    for i in range(0, len(docs), per_file):
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs[i : i + per_file])
        (raw / f"{i // per_file:03d}.jsonl").write_text(lines)
    proc = run_tool(
        REPO / "tools" / "tokenize_corpus.py",
        "--input",
        str(raw / "*.jsonl"),
        "--output-dir",
        str(root / name),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / name


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    web = tokenized_folder(root, "web", DOCS[:48], per_file=4)  # 12 datasets
    code = tokenized_folder(root, "code", DOCS[48:], per_file=3)  # 11 datasets
    return root, web, code


def build(root: Path, name: str, *extra: str, seed: str = "7", max_tokens: str = "16_000"):
    web, code = root / "web", root / "code"
    return run_tool(
        BUILD,
        "--folders",
        str(web),
        str(code),
        "--weights",
        "0.75",
        "0.25",
        "--max-tokens",
        max_tokens,
        "--seq-length",
        "512",
        "--seed",
        seed,
        "--output",
        str(root / name),
        *extra,
    )


@pytest.fixture(scope="module")
def first_mixture(folders):
    root, *_ = folders
    proc = build(root, "phase1")
    assert proc.returncode == 0, proc.stderr
    return root / "phase1", proc.stdout


def test_each_share_is_met_within_one_dataset(folders, first_mixture):
    mixture, report = first_mixture
    record = json.loads((mixture / "mixture.json").read_text())
    for source, weight in zip(record["sources"], (0.75, 0.25)):
        budget = weight * 16_000
        largest = max(p["tokens"] for p in source["parts"])
        assert budget <= source["tokens"] < budget + largest
        for part in source["parts"]:
            assert part["samples"] == (part["tokens"] - 1) // 512
            assert f"{part['tokens']:>14,} {part['samples']:>14,}  {part['link']}" in report
    linked = folder_parts(mixture)
    assert len(linked) == sum(len(s["parts"]) for s in record["sources"])
    assert all(Path(p.prefix + ".bin").is_symlink() for p in linked)


def test_same_seed_same_mixture_other_seed_other_mixture(folders, first_mixture):
    root, *_ = folders
    again, other = build(root, "again"), build(root, "other", seed="8")
    assert again.returncode == other.returncode == 0
    chosen = lambda name: sorted(
        identity(p.prefix) for p in folder_parts(root / name)
    )  # noqa: E731
    assert chosen("again") == chosen("phase1") != chosen("other")


def test_exclude_never_takes_a_dataset_again(folders, first_mixture):
    root, *_ = folders
    proc = build(root, "phase2", "--exclude", str(first_mixture[0]), seed="7")
    assert proc.returncode == 0, proc.stderr
    first = {identity(p.prefix) for p in folder_parts(first_mixture[0])}
    second = {identity(p.prefix) for p in folder_parts(root / "phase2")}
    assert second and not first & second
    too_much = build(
        root,
        "phase3",
        "--exclude",
        str(first_mixture[0]),
        str(root / "phase2"),
        max_tokens="60_000",
    )
    assert too_much.returncode == 2 and "tokens left (after --exclude)" in too_much.stderr
    assert not (root / "phase3").exists() and "Traceback" not in too_much.stderr


def test_blend_of_the_data_args_file_realises_the_mixture(folders, first_mixture, tmp_path):
    mixture, _ = first_mixture
    args_file = tmp_path / "phase1.args"
    proc = run_tool(DATA_CONFIG, str(mixture), "--output", str(args_file))
    assert proc.returncode == 0, proc.stderr
    entries = args_file.read_text().split()
    assert proc.stdout.split() == entries and len(entries) == 2 * len(folder_parts(mixture))
    record = json.loads((mixture / "mixture.json").read_text())
    source_of = {
        str(Path(p["link"]).absolute()): i
        for i, s in enumerate(record["sources"])
        for p in s["parts"]
    }
    sources = [source_of[prefix] for prefix in entries[1::2]]

    # megatron-core's blended dataset over the file, as pretrain_gpt.py builds it
    parallel.initialize(ParallelConfig(), device="cpu", seed=1)
    try:
        config = DatasetConfig(
            data_args_path=str(args_file), split="100,0,0", data_cache_path=str(tmp_path / "cache")
        )
        samples = 4000
        train, *_ = build_datasets(
            config,
            build_tokenizer("TekkenTokenizer"),
            seq_length=64,
            seed=5,
            num_samples=(samples, 0, 0),
        )
    finally:
        parallel.shutdown()
    per_source = np.bincount(np.array(sources)[train.dataset_index[:samples]], minlength=2)
    # megatron-core's blending is deterministic: each dataset within one sample of its share
    assert np.abs(per_source / samples - [0.75, 0.25]).max() <= len(sources) / samples

    run = run_entry(
        PRETRAIN,
        [
            "--model-preset",
            "tiny",
            "--train-iters",
            "2",
            "--global-batch-size",
            "2",
            "--micro-batch-size",
            "1",
            "--eval-iters",
            "0",
            "--data-args-path",
            str(args_file),
            "--split",
            "100,0,0",
            "--log-interval",
            "1",
            "--data-cache-path",
            str(tmp_path / "run-cache"),
        ],
    )
    assert "iteration        2/" in run.stdout
    descriptions = "".join(
        p.read_text() for p in (tmp_path / "run-cache").rglob("*description.txt")
    )
    assert all(prefix in descriptions for prefix in entries[1::2])


def test_data_path_and_data_args_path_are_exclusive(tmp_path):
    args = tmp_path / "blend.args"
    args.write_text("1 /nonexistent/prefix\n")
    with pytest.raises(ValueError, match="--data-path or --data-args-path, not both"):
        DatasetConfig(data_path=["x"], data_args_path=str(args))
    with pytest.raises(ValueError, match="--data-args-path .*missing.args: no such file"):
        DatasetConfig(data_args_path=str(tmp_path / "missing.args"))
