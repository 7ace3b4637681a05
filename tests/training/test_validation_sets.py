"""Megatron-LM's --multiple-validation-sets: each --valid-data-path prefix is validated on its
own, with Megatron-LM's log line and tags per set, and gives exactly the loss a run validating
on that prefix alone gives; training is untouched by it. Bad combinations are one line."""

from __future__ import annotations

import json
import logging

import pytest

import pretrain_gpt
from megatron.apertus import checkpoint
from megatron.apertus.checkpoint_files import final_losses
from megatron.apertus.convert.model_card import model_card
from megatron.apertus.prep.corpus import embedded_documents
from megatron.apertus.prep.preprocess import PreprocessConfig, preprocess
from megatron.apertus.training.loop import train
from tests.conftest import SMALL_TOKENIZER, SMALL_VOCABULARY
from tests.test_apertus_launch_args import error_lines

RUN = (
    "--model-preset tiny --global-batch-size 4 --micro-batch-size 2 --log-interval 1 "
    "--lr 3e-3 --seed 5 --train-iters 4 --eval-interval 2 --eval-iters 2"
).split() + SMALL_VOCABULARY


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Two real corpora, tokenized by the small BPE: the embedded documents' halves."""
    root = tmp_path_factory.mktemp("validation-sets")
    documents = embedded_documents()
    prefixes = {}
    for name, part in (("prose", documents[:40]), ("code", documents[40:])):
        source = root / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        preprocess(
            PreprocessConfig(
                inputs=[source],
                output_prefix=str(root / name),
                tokenizer_type="HuggingFaceTokenizer",
                tokenizer_model=str(SMALL_TOKENIZER),
            )
        )
        prefixes[name] = str(root / f"{name}_text_document")
    return prefixes


def _run(corpora: dict[str, str], *valid: str, flags: tuple[str, ...] = ()) -> dict:
    data = ["--train-data-path", corpora["prose"], "--valid-data-path"]
    data += [corpora[name] for name in valid]
    return train(pretrain_gpt.parse_args(RUN + data + list(flags)))


@pytest.fixture(scope="module")
def runs(corpora, tmp_path_factory):
    """One run validating on both corpora as two named sets (saved), and one run on each
    alone."""
    save = tmp_path_factory.mktemp("validation-sets-run") / "ckpt"
    names = ("--multiple-validation-sets", "--validation-set-names", "prose", "code")
    return {
        "both": _run(corpora, "prose", "code", flags=names + ("--save", str(save))),
        "prose": _run(corpora, "prose"),
        "code": _run(corpora, "code"),
        "save": save,
    }


def test_each_set_gives_the_loss_of_a_run_validating_on_it_alone(runs):
    both = runs["both"]
    assert [it for it, _ in both["valid/loss-prose"]] == [0, 2, 4]
    assert both["valid/loss-prose"] == runs["prose"]["valid/loss"]
    assert both["valid/loss-code"] == runs["code"]["valid/loss"]
    assert both["valid/loss-prose"] != both["valid/loss-code"], "two corpora, two losses"
    assert "valid/loss" not in both


def test_validation_sets_leave_training_untouched(runs):
    assert runs["both"]["train/loss"] == runs["prose"]["train/loss"] == runs["code"]["train/loss"]


def test_the_model_card_gives_each_sets_final_loss(runs):
    checkpoint_dir = checkpoint.find_checkpoint(runs["save"])
    losses = final_losses(checkpoint_dir)
    card = model_card(
        name="sets",
        model=checkpoint.load_model_config(runs["save"]),
        checkpoint=checkpoint_dir,
        run_info=None,
        tokenizer="bpe4096",
        dtype="bfloat16",
        export_command=None,
        losses=losses,
    )
    for name in ("prose", "code"):
        iteration, value = runs["both"][f"valid/loss-{name}"][-1]
        assert losses[f"valid/loss-{name}"] == (iteration, value)
        assert f"| final validation loss ({name}) | {value:.4f} (iteration 4) |" in card


def test_unnamed_sets_are_numbered_in_megatron_lms_lines(corpora, caplog):
    with caplog.at_level(logging.INFO, logger="apertus"):
        history = _run(corpora, "code", "prose", flags=("--multiple-validation-sets",))
    lines = [r.getMessage() for r in caplog.records if r.name == "apertus"]
    assert sorted(key for key in history if key.startswith("valid/loss")) == [
        "valid/loss-0",
        "valid/loss-1",
    ]
    for index in (0, 1):
        value = history[f"valid/loss-{index}"][1][1]
        line = f"validation-{index} loss at iteration 2 | lm loss value: {value:.6E} |"
        assert any(found.startswith(line) for found in lines), lines


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--multiple-validation-sets"],
            "--multiple-validation-sets needs --valid-data-path PREFIX [PREFIX ...]",
        ),
        (
            ["--validation-set-names", "a"],
            "--validation-set-names needs --multiple-validation-sets",
        ),
        (
            ["--multiple-validation-sets", "--train-data-path", "t"]
            + ["--valid-data-path", "0.5", "a", "0.5", "b"],
            "--multiple-validation-sets: --valid-data-path takes prefixes without weights",
        ),
        (
            ["--multiple-validation-sets", "--validation-set-names", "a"]
            + ["--train-data-path", "t", "--valid-data-path", "a", "b"],
            "--validation-set-names: 1 names for the 2 validation sets of --valid-data-path",
        ),
    ],
)
def test_bad_combinations_are_one_line(flags, line, capsys):
    (refusal,) = error_lines(capsys, ["--train-iters", "1", "--device", "cpu", *flags])
    assert refusal.startswith(line)
