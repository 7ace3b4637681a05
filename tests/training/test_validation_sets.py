"""Megatron-LM's --multiple-validation-sets: each --valid-data-path prefix is validated on its
own, with Megatron-LM's log line and tags per set, and gives exactly the loss a run validating
on that prefix alone gives; training is untouched by it. --full-validation passes over each set
whole: the same per-token loss whatever the batch sizes. Bad combinations are one line."""

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
from tests.training.test_first_hour import refused

RUN = (
    "--model-preset tiny --global-batch-size 4 --micro-batch-size 2 --log-interval 1 "
    "--lr 3e-3 --seed 5 --train-iters 4 --eval-interval 2 --eval-iters 2"
).split() + SMALL_VOCABULARY


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Real corpora, tokenized by the small BPE: the embedded documents' halves, and two short
    ones for passes over a whole set."""
    root = tmp_path_factory.mktemp("validation-sets")
    documents = embedded_documents()
    prefixes = {}
    for name, part in (
        ("prose", documents[:40]),
        ("code", documents[40:]),
        ("short-a", documents[:4]),
        ("short-b", documents[40:44]),
    ):
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


def test_full_validation_covers_each_set_whole_whatever_the_batch_sizes(corpora):
    # one pass, at the end, of the starting weights (lr 0): the batch sizes decide only how
    # the sets are cut into batches, and 4 x 2 and 5 x 1 fill the last batch differently
    sets = ("--multiple-validation-sets", "--train-iters", "1", "--lr", "0", "--eval-interval", "0")
    passes = []
    for batch, micro, whole in (("4", "2", True), ("5", "1", True), ("4", "2", False)):
        sizes = ("--global-batch-size", batch, "--micro-batch-size", micro)
        full = ("--full-validation",) if whole else ("--eval-iters", "1")
        history = _run(corpora, "short-a", "short-b", flags=sets + sizes + full)
        passes.append([history[f"valid/loss-{i}"] for i in (0, 1)])
    whole, other, first_batch = passes
    for (only,), (other_only,) in zip(whole, other):
        assert only[0] == other_only[0] == 1
        assert other_only[1] == pytest.approx(only[1], rel=1e-6)  # fp32 sums in another order
    losses = [loss for ((_, loss),) in whole]
    assert losses != pytest.approx([loss for ((_, loss),) in first_batch], rel=1e-4)


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


@pytest.mark.parametrize(
    "data, line",
    [
        (["--mock-data"], "--full-validation: --mock-data is synthetic and has no end to reach"),
        (
            ["--train-data-path", "prose", "--valid-data-path", "0.5", "prose", "0.5", "code"],
            "--full-validation: --valid-data-path is a weighted blend, which megatron-core sizes",
        ),
    ],
    ids=["mock-data", "weighted"],
)
def test_full_validation_of_data_without_an_end_is_refused(corpora, data, line):
    data = [corpora.get(flag, flag) for flag in data]
    assert refused(["--full-validation", *data], RUN).startswith(line)
