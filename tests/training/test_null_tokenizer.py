"""Megatron-LM's --tokenizer-type NullTokenizer: --vocab-size ids and no vocabulary, for
--mock-data runs. A tiny run trains on it and resumes bitwise, its checkpoint names it (and
--use-checkpoint-args takes it back); what needs text refuses it in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
from megatron.core.datasets.gpt_dataset import MockGPTDataset

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import read_run_info
from megatron.apertus.convert.hf import ConversionError
from megatron.apertus.convert.hf_tokenizer import tokenizer_source
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.errors import ConfigError
from megatron.apertus.tokenizer.tokenizers import NullTokenizer, null_tokenizer
from megatron.apertus.training.loop import train
from tests.conftest import REPO, run_script
from tests.training.test_first_hour import refused

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
RUN = (
    "--model-preset tiny --mock-data --global-batch-size 4 --micro-batch-size 2 --eval-iters 1 "
    "--log-interval 1 --lr 3e-3 --seed 5 --train-iters 4"
).split() + NULL


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The losses of 4 uninterrupted iterations and of 2 + 2 resumed ones; the checkpoint."""
    save = tmp_path_factory.mktemp("null") / "ckpt"
    whole = train(pretrain_gpt.parse_args(RUN))
    train(pretrain_gpt.parse_args(RUN + ["--exit-interval", "2", "--save", str(save)]))
    resumed = train(pretrain_gpt.parse_args(RUN + ["--save", str(save), "--load", str(save)]))
    return {"whole": whole["train/loss"], "resumed": resumed["train/loss"], "save": save}


def test_megatron_lms_ids_the_last_one_the_end_of_document():
    tokenizer = null_tokenizer(1000)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (1000, 999, -1)
    assert tokenizer.special_ids() == [999]
    other = null_tokenizer(1000, eod=0, pad=1)
    assert other.special_ids() == [0, 1]
    assert other.unique_identifiers != tokenizer.unique_identifiers
    for needs_text in (lambda: tokenizer.encode("a"), lambda: tokenizer.decode([1])):
        with pytest.raises(ConfigError, match="NullTokenizer has ids but no vocabulary"):
            needs_text()


def test_mock_documents_are_ids_of_the_vocabulary_ending_in_its_eod():
    tokenizer = NullTokenizer(1000)
    train_part = build_datasets(
        DatasetConfig(mock_data=True), tokenizer, seed=5, seq_length=2048, num_samples=(8, 0, 0)
    )[0]
    assert isinstance(train_part, MockGPTDataset)
    tokens = np.stack([train_part[i]["tokens"].numpy() for i in range(8)])
    assert tokens.min() >= 0 and tokens.max() == 999
    ends = (tokens[:, :-1] == 999) & (tokens[:, 1:] == 1)  # a document counts 1, 2, ... then EOD
    assert ends.any()


def test_a_null_tokenizer_run_trains_and_resumes_bitwise(runs):
    steps, losses = zip(*runs["whole"])
    assert steps == (1, 2, 3, 4)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert abs(losses[0] - math.log(1000)) < 0.5, "a fresh model guesses among 1000 ids"
    assert runs["resumed"] == runs["whole"]


def test_the_checkpoint_names_the_null_tokenizer_and_gives_it_back(runs):
    save = runs["save"]
    info = read_run_info(checkpoint.find_checkpoint(save))
    assert info["tokenizer"] == {"type": "NullTokenizer", "model": None, "eod": None, "pad": -1}
    assert checkpoint.load_model_config(save).vocab_size == 1000
    again = pretrain_gpt.parse_args(
        ["--use-checkpoint-args", "--load", str(save), "--mock-data", "--train-iters", "6"]
    )
    assert again.data.tokenizer_type == "NullTokenizer" and again.model.vocab_size == 1000
    with pytest.raises(ConversionError, match="trained with --tokenizer-type NullTokenizer"):
        tokenizer_source(save, info, None)


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--tokenizer-type", "NullTokenizer", "--mock-data"],
            "--tokenizer-type NullTokenizer needs --vocab-size: its ids are 0 to --vocab-size - 1",
        ),
        (
            NULL,
            "--tokenizer-type NullTokenizer has ids but no vocabulary to read a corpus with: it "
            "trains on --mock-data only",
        ),
        (
            NULL + ["--mock-data", "--null-tokenizer-eod-id", "1000"],
            "--null-tokenizer-eod-id must be an id of the vocabulary (0 to 999, --vocab-size "
            "1000), got 1000",
        ),
        (
            ["--null-tokenizer-pad-id", "0"],
            "--null-tokenizer-eod-id and --null-tokenizer-pad-id are the ids of --tokenizer-type "
            "NullTokenizer; TekkenTokenizer has its own",
        ),
    ],
    ids=["no-vocab-size", "no-mock-data", "eod-outside", "null-ids-of-tekken"],
)
def test_what_a_null_tokenizer_cannot_do_is_refused_in_one_line(flags, line):
    assert refused(flags) == line


def test_preprocessing_text_refuses_it(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "one document"}\n')
    args = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out")]
    proc = run_script(
        REPO / "tools" / "preprocess_data.py", args + ["--tokenizer-type", "NullTokenizer"]
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.splitlines() == [
        "preprocess_data.py: error: --tokenizer-type NullTokenizer has ids but no vocabulary "
        "(Megatron-LM's tokenizer for --mock-data runs): reading or writing text needs a real "
        "tokenizer"
    ]
    assert not list(tmp_path.glob("out*"))
