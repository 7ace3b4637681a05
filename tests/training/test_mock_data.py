"""Megatron-LM's --mock-data: megatron-core's synthetic MockGPTDataset, built by its dataset
builder, trains deterministically, resumes bitwise, carries the end-of-document tokens document
masking needs, and is refused beside any other data in one line (by the tools that read a
run's data too)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.gpt_dataset import MockGPTDataset

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import read_run_info
from megatron.apertus.convert.model_card import MOCK_DATA, model_card
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.tokenizer.tokenizers import checked_tokenizer
from megatron.apertus.training.loop import train
from tests.conftest import REPO, SMALL_TOKENIZER, SMALL_VOCABULARY, run_script
from tests.training.test_first_hour import refused

MOCK = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--log-interval 1 --lr 3e-3 --seed 5 --train-iters 4"
).split() + SMALL_VOCABULARY


def _losses(history: dict) -> list[list]:
    return history["train/loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The losses of an uninterrupted run of 4 iterations, of the same run stopped after 2 and
    resumed to 4, and of the uninterrupted run with another seed; the checkpoint's record of
    its run."""
    save = tmp_path_factory.mktemp("mock") / "ckpt"
    whole = train(pretrain_gpt.parse_args(MOCK))
    train(pretrain_gpt.parse_args(MOCK + ["--exit-interval", "2", "--save", str(save)]))
    resumed = train(pretrain_gpt.parse_args(MOCK + ["--save", str(save), "--load", str(save)]))
    other_seed = train(pretrain_gpt.parse_args(MOCK + ["--seed", "6"]))
    return {
        "whole": _losses(whole),
        "resumed": _losses(resumed),
        "seed 6": _losses(other_seed),
        "run info": read_run_info(checkpoint.find_checkpoint(save)),
        "model": checkpoint.load_model_config(save),
    }


def test_mock_data_trains_and_the_seed_decides_the_losses(runs):
    steps, losses = zip(*runs["whole"])
    assert steps == (1, 2, 3, 4)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert runs["seed 6"] != runs["whole"], "another seed shuffles other samples"


def test_mock_data_resumes_bitwise(runs):
    assert runs["resumed"] == runs["whole"]


def test_the_checkpoint_and_its_model_card_name_the_synthetic_data(runs):
    info = runs["run info"]
    assert info["mock_data"] is True and info["data_path"] == []
    card = model_card(
        name="mock",
        model=runs["model"],
        checkpoint=Path("ckpt"),
        run_info=info,
        tokenizer="bpe4096",
        dtype="bfloat16",
        export_command=None,
    )
    assert f"## Training data\n\n{MOCK_DATA}, " in card


def test_mock_documents_end_in_eod_so_document_masking_finds_them():
    """The samples come from megatron-core's MockGPTDataset, shuffled by the seed; its documents
    end in the tokenizer's end-of-document token, where --reset-attention-mask cuts."""
    tokenizer = checked_tokenizer("HuggingFaceTokenizer", str(SMALL_TOKENIZER))
    build = dict(seq_length=64, num_samples=(32, 4, 0))
    train_part, valid_part, test_part = build_datasets(
        DatasetConfig(mock_data=True), tokenizer, seed=5, **build
    )
    assert isinstance(train_part, MockGPTDataset) and isinstance(valid_part, MockGPTDataset)
    assert test_part is None
    tokens = np.stack([train_part[i]["tokens"].numpy() for i in range(32)])
    # a document counts 1, 2, ..., n-1 then ends in EOD: EOD then 1 is a document boundary
    ends = (tokens[:, :-1] == tokenizer.eod) & (tokens[:, 1:] == 1)
    assert ends.any(), "documents end in EOD"
    again = build_datasets(DatasetConfig(mock_data=True), tokenizer, seed=5, **build)[0]
    other = build_datasets(DatasetConfig(mock_data=True), tokenizer, seed=6, **build)[0]
    assert all(np.array_equal(again[i]["tokens"], tokens[i]) for i in range(32))
    assert not all(np.array_equal(other[i]["tokens"], tokens[i]) for i in range(32))


def test_mock_data_trains_with_document_masking(runs):
    """Other losses than without it: the samples' documents are masked from each other."""
    history = train(
        pretrain_gpt.parse_args(
            MOCK + ["--train-iters", "2", "--reset-position-ids", "--reset-attention-mask"]
        )
    )
    masked = _losses(history)
    assert all(math.isfinite(loss) for _, loss in masked)
    assert masked[1][1] != runs["whole"][1][1]


@pytest.mark.parametrize(
    "extra, line",
    [
        (
            ["--data-path", "corpus_text_document"],
            "--mock-data trains on synthetic data with its own train/valid/test parts: drop "
            "--data-path",
        ),
        (
            ["--split", "90,10,0", "--sft"],
            "--mock-data trains on synthetic data with its own train/valid/test parts: drop "
            "--split and --sft",
        ),
        (
            ["--distill-logits-path", "teacher"],
            "--mock-data and --distill-logits-path exclude each other: a teacher store holds "
            "the logits of the samples of the dataset it was made from",
        ),
        (
            ["--align-objective", "dpo"],
            "--mock-data and --align-objective exclude each other: alignment reads preference "
            "pairs",
        ),
    ],
    ids=["data-path", "split-sft", "distillation", "alignment"],
)
def test_mock_data_beside_other_data_is_refused(extra, line):
    assert refused(["--mock-data", *extra]) == line


@pytest.mark.parametrize(
    "tool, args, line",
    [
        (
            "generate_teacher_logits.py",
            ["--load", "teacher"],
            "--mock-data: a teacher store is made for a student that trains on real data",
        ),
        (
            "quantize.py",
            ["--load", "ckpt", "--save", "out", "--method", "rtn", "--quant-format", "fp8"],
            "--mock-data: GPTQ calibrates on the samples of the --distill-logits-path store's run",
        ),
    ],
    ids=["teacher-logits", "quantize"],
)
def test_the_tools_that_read_run_data_refuse_mock_data(tool, args, line):
    proc = run_script(REPO / "tools" / tool, [*args, "--mock-data"])
    errors = [e for e in proc.stderr.splitlines() if ": error: " in e]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith(f"{tool}: error: {line}")
