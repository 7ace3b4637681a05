"""Alignment end to end on a tiny model: preference data, reference log-probs stored once and
checked, DPO and QRPO steps, exact resume."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest

import pretrain_gpt
from examples.chat_demo import docstring_preferences, docstring_rewards
from megatron.apertus.align import reference
from megatron.apertus.align.data import PreferenceDataset
from megatron.apertus.data.chat import encode_conversation, parse_messages
from megatron.apertus.distill.logit_store import LogitStoreError
from megatron.apertus.errors import ConfigError
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from megatron.apertus.training.loop import train
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_TOKENIZER,
    SMALL_TOKENIZER_FLAGS,
    SMALL_VOCABULARY,
    read_json,
    run_entry,
    run_script,
    series,
)

TOOL = REPO / "tools" / "preprocess_preferences.py"
TINY = [
    "--model-preset",
    "tiny",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--log-interval",
    "1",
    "--lr",
    "1e-3",
    *SMALL_VOCABULARY,
]


def preprocess(tmp, objective: str, records: list[dict], extra_lines: tuple[str, ...] = ()):
    source = tmp / f"{objective}.jsonl"
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    proc = run_entry(
        TOOL,
        [
            "--objective",
            objective,
            "--input",
            str(source),
            "--output-prefix",
            str(tmp / objective),
            "--max-tokens",
            "129",
            *SMALL_TOKENIZER_FLAGS,
        ],
    )
    return str(tmp / f"{objective}_pref_document"), proc


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref")
    dpo, _ = preprocess(
        root, "dpo", [r for r in docstring_preferences()[:40] if len(r["chosen"]) < 150][:16]
    )
    qrpo, _ = preprocess(
        root, "qrpo", [r for r in docstring_rewards()[:60] if len(r["completion"]) < 150][:16]
    )
    run_entry(
        PRETRAIN, TINY + ["--train-iters", "1", "--eval-iters", "0", "--save", str(root / "base")]
    )
    return {"dpo": dpo, "qrpo": qrpo, "base": str(root / "base")}


def test_examples_hold_their_completions_masks_and_quantiles(tmp_path):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", SMALL_TOKENIZER)
    pairs = docstring_preferences()[:3]
    bad = (
        '{"prompt": [{"role": "user", "content": "q"}], "chosen": "a"}',  # no rejected
        json.dumps(
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": "a",
                "rejected": "b",
            }
        ),
    )
    prefix, proc = preprocess(tmp_path, "dpo", pairs, bad)
    assert "dpo.jsonl:4: skipped: missing 'rejected'" in proc.stderr
    assert "dpo.jsonl:5: skipped: the prompt must end with a user turn" in proc.stderr
    data = PreferenceDataset(prefix, "dpo", seq_length=128, pad=tokenizer.pad)
    assert len(data) == 3
    for i, pair in enumerate(pairs):
        for j, key in enumerate(("chosen", "rejected")):
            messages = parse_messages(
                {"messages": [*pair["prompt"], {"role": "assistant", "content": pair[key]}]}
            )
            ids, mask = encode_conversation(tokenizer, messages)  # one assistant turn: all of it
            got_ids, got_mask = data.sequence(2 * i + j)
            assert got_ids.tolist() == ids.tolist() and got_mask.tolist() == mask.tolist()
    rewards = docstring_rewards()[:4]
    prefix, _ = preprocess(
        tmp_path,
        "qrpo",
        rewards,
        ('{"prompt": [], "completion": "x", ' '"reward": NaN, "ref_rewards": [1]}',),
    )
    qrpo = PreferenceDataset(prefix, "qrpo", seq_length=128, pad=tokenizer.pad)
    for i, record in enumerate(rewards):
        want = np.mean(np.array(record["ref_rewards"]) <= record["reward"])
        assert qrpo[i]["quantile"].item() == want
        assert qrpo[i]["ref_count"].item() == len(record["ref_rewards"])


def test_reference_file_round_trip_corruption_and_other_data(tmp_path):
    values = reference.ReferenceLogps(
        keys=np.arange(5, dtype=np.uint64) * 977,
        logps=-np.pi * np.arange(5.0),
        lengths=np.arange(5, dtype=np.int32),
    )
    path = tmp_path / "train.bin"
    reference.write(path, values, data_hash="ab" * 16, reference="ckpt")
    stored, header = reference.read(path, data_hash="ab" * 16)
    assert header["reference"] == "ckpt" and stored.logps.tobytes() == values.logps.tobytes()
    assert np.array_equal(stored.keys, values.keys)
    with pytest.raises(LogitStoreError, match="made for other data"):
        reference.read(path, data_hash="cd" * 16)
    raw = bytearray(path.read_bytes())
    raw[-30] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(LogitStoreError, match="checksum mismatch"):
        reference.read(path, data_hash="ab" * 16)


def align_args(data, tmp_path, objective: str, iters: int, *extra: str) -> list[str]:
    return TINY + [
        "--no-fused-output-loss",
        "--finetune",
        "--load",
        data["base"],
        "--align-objective",
        objective,
        "--ref-logps-path",
        str(tmp_path / "ref"),
        "--train-data-path",
        data[objective],
        "--train-iters",
        str(iters),
        "--eval-iters",
        "0",
        *extra,
    ]


@pytest.mark.slow
def test_dpo_starts_at_log_2_and_resumes_exactly(data, tmp_path):
    straight = train(pretrain_gpt.parse_args(align_args(data, tmp_path, "dpo", 4)))
    losses = [v for _, v in straight["train/loss"]]
    # The first step's policy is the reference: every pair's loss is -log sigmoid(0).
    assert losses[0] == pytest.approx(np.log(2.0), abs=1e-6)
    assert len(set(losses)) > 1
    stored = (tmp_path / "ref" / "train.bin").read_bytes()
    first = align_args(
        data, tmp_path, "dpo", 4, "--save", str(tmp_path / "ck"), "--exit-interval", "2"
    )
    train(pretrain_gpt.parse_args(first))
    resume = align_args(data, tmp_path, "dpo", 4, "--save", str(tmp_path / "ck"))
    resume[resume.index("--finetune") : resume.index("--finetune") + 3] = [
        "--load",
        str(tmp_path / "ck"),
    ]
    # A corrupted store is refused when the run restarts, and the run is left as it was.
    raw = bytearray(stored)
    raw[len(raw) // 2] ^= 0xFF
    (tmp_path / "ref" / "train.bin").write_bytes(bytes(raw))
    proc = run_script(PRETRAIN, resume)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checksum mismatch" in proc.stderr.strip().splitlines()[-1]
    (tmp_path / "ref" / "train.bin").write_bytes(stored)
    resumed = train(pretrain_gpt.parse_args(resume))
    assert [v for _, v in resumed["train/loss"]][-2:] == losses[2:]
    assert (tmp_path / "ref" / "train.bin").read_bytes() == stored, "computed once"


def test_qrpo_trains_and_logs_its_own_quantities(data, tmp_path, capfd, caplog):
    caplog.set_level(logging.INFO, logger="apertus")
    args = align_args(
        data,
        tmp_path,
        "qrpo",
        3,
        "--align-length-normalization",
        "--qrpo-transform",
        "log",
        "--valid-data-path",
        data["qrpo"],
        "--eval-iters",
        "1",
        "--eval-interval",
        "3",
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    )
    history = train(pretrain_gpt.parse_args(args))
    losses = [v for _, v in history["train/loss"]]
    assert len(losses) == 3 and all(np.isfinite(losses))
    err, out = capfd.readouterr().err, caplog.text
    # The reference pass shows its progress and time left (tqdm), per dataset.
    assert re.search(r"reference log-probs \(train\): 100%.*16/16 \[\d\d:\d\d<00:00", err)
    assert "reference log-probs (valid): 100%" in err
    line = next(x for x in out.splitlines() if "iteration        1/" in x)
    assert "qrpo loss: " in line and "lm loss" not in line
    assert " | mean target: " in line and " | mean beta-log-ratio: " in line
    valid = next(x for x in out.splitlines() if x.count("validation loss at iteration 3"))
    assert "qrpo loss value: " in valid and "PPL" not in valid and "mean target: " in valid
    # At the first step the policy is the reference: beta * log-ratio is 0, and the mean target
    # is that of the log transform, log max(q, 1/n) - beta/len * log(beta/len / (1 + beta/len)).
    assert history["train/mean_beta_log_ratio"][0] == [1, 0.0]
    for name in (
        "train/mean_target",
        "valid/mean_target",
        "valid/mean_beta_log_ratio",
        "valid/quantile_signed_log_ratio",
    ):
        assert np.isfinite(history[name][-1][1]), name
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/mean_target", "train/mean_beta_log_ratio", "valid/mean_target"} <= tags
    assert "qrpo loss validation" in tags and "lm loss validation" not in tags, sorted(tags)


@pytest.mark.parametrize(
    "objective, extra, quantity",
    [
        pytest.param("dpo", (), "reward_margin", marks=pytest.mark.slow),  # the same reduction
        ("qrpo", ("--align-length-normalization",), "mean_target"),
    ],
)
def test_context_parallel_alignment_matches_one_process(data, tmp_path, objective, extra, quantity):
    """CP=2 (two processes, p2p): each row's log-probability and completion length are summed
    over the ranks' shares; the reference pass stores the one-process values, and the losses,
    gradient norms and the objective's quantities of three steps are the one-process ones."""
    runs, stored = {}, {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        args = align_args(data, out, objective, 3, *extra, "--log-json", str(out / "log.json"))
        run_entry(PRETRAIN, args + ["--context-parallel-size", str(cp)], nproc=cp)
        runs[cp] = read_json(out / "log.json")
        data_hash = reference.dataset_hash(data[objective])
        stored[cp], _ = reference.read(out / "ref" / "train.bin", data_hash=data_hash)
    np.testing.assert_allclose(stored[2].logps, stored[1].logps, rtol=1e-6)
    for name, rtol in (("loss", 2e-6), ("grad_norm", 5e-4), (quantity, 1e-5)):
        steps, values = series(runs[2], f"train/{name}")
        assert steps == [1, 2, 3], name
        np.testing.assert_allclose(values, series(runs[1], f"train/{name}")[1], rtol=rtol)
    losses = series(runs[1], "train/loss")[1]
    assert np.ptp(losses) > 100 * 2e-6 * abs(losses[0])  # the steps move the losses


def test_reference_logps_carried_by_the_data_replace_the_reference_pass(
    data, tmp_path, capfd, caplog
):
    """A run on data that carries the reference log-probabilities (TRL's and swiss-ai's column
    names) trains exactly as the run whose reference pass computed them, with no pass."""
    caplog.set_level(logging.INFO, logger="apertus")
    computed = train(pretrain_gpt.parse_args(align_args(data, tmp_path, "dpo", 2)))
    assert computed["train/reward_margin"][0] == [1, 0.0]  # the policy is the reference
    assert computed["train/reward_accuracy"][0] == [1, 0.0]
    assert "dpo loss: " in caplog.text
    stored, _ = reference.read(
        tmp_path / "ref" / "train.bin", data_hash=reference.dataset_hash(data["dpo"])
    )
    records = [r for r in docstring_preferences()[:40] if len(r["chosen"]) < 150][:16]
    names = (
        ("ref_chosen_logps", "ref_rejected_logps"),
        ("ref_chosen_logprob", "ref_rejected_logprob"),
    )
    carried = [
        {
            **r,
            names[i % 2][0]: float(stored.logps[2 * i]),
            names[i % 2][1]: float(stored.logps[2 * i + 1]),
        }
        for i, r in enumerate(records)
    ]
    prefix, _ = preprocess(tmp_path, "dpo", carried)
    args = align_args({**data, "dpo": prefix}, tmp_path, "dpo", 2)
    del args[args.index("--ref-logps-path") : args.index("--ref-logps-path") + 2]
    capfd.readouterr()
    given = train(pretrain_gpt.parse_args(args))
    assert given["train/loss"] == computed["train/loss"]
    assert "reference log-probabilities of 32 train sequences read from the data" in caplog.text
    assert "reference log-probs (train)" not in capfd.readouterr().err, "no reference pass"
    no_values = align_args(data, tmp_path, "dpo", 2)
    del no_values[no_values.index("--ref-logps-path") : no_values.index("--ref-logps-path") + 2]
    with pytest.raises(ConfigError, match="carries no reference log-probabilities: give --ref"):
        train(pretrain_gpt.parse_args(no_values))


def test_alignment_chooses_the_unfused_output_loss_itself(data, tmp_path, caplog):
    """DPO without --no-fused-output-loss takes the unfused output loss by itself, says so on
    its start line and in apertus_run.json, and trains exactly as the run given the flag."""
    caplog.set_level(logging.INFO, logger="apertus")
    flagged = align_args(data, tmp_path / "flagged", "dpo", 2)
    assert "--no-fused-output-loss" in flagged
    save = tmp_path / "ck"
    chosen = align_args(data, tmp_path / "chosen", "dpo", 2, "--save", str(save))
    chosen.remove("--no-fused-output-loss")
    config = pretrain_gpt.parse_args(chosen)
    assert not config.training.fused_output_loss
    with_flag = train(pretrain_gpt.parse_args(flagged))
    caplog.clear()
    without = train(config)
    assert len(without["train/loss"]) == 2 and without["train/loss"] == with_flag["train/loss"]
    assert (
        "output layer + loss unfused (--align-objective needs per-token log-probabilities)"
        in caplog.text
    )
    record = json.loads((save / "iter_0000002" / "apertus_run.json").read_text())
    assert record["fused_output_loss"] is False


@pytest.mark.parametrize("flag", ["--fused-output-loss", "--cross-entropy-loss-fusion"])
def test_a_fused_output_loss_asked_for_with_alignment_is_refused(flag, capsys):
    argv = ["--align-objective", "dpo", "--train-data-path", "x", "--train-iters", "1"]
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(argv + [flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert (
        ": error: --fused-output-loss (--cross-entropy-loss-fusion) cannot run with "
        "--align-objective: alignment needs each token's log-probability"
    ) in err[0]
    assert not pretrain_gpt.parse_args(argv + ["--no-fused-output-loss"]).training.fused_output_loss


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--align-beta", "nan"], "--align-beta must be a finite number > 0, got nan"),
        (["--align-beta", "inf"], "--align-beta must be a finite number > 0, got inf"),
        (["--qrpo-max-beta", "-1"], "--qrpo-max-beta must be a finite number > 0, got -1.0"),
        (
            ["--qrpo-transform", "sqrt"],
            "--qrpo-transform must be one of identity, log, normal-icdf",
        ),
        (
            ["--qrpo-transform", "log", "--qrpo-log-partition", "approx"],
            "--qrpo-log-partition approx applies to --qrpo-transform identity",
        ),
        (
            ["--align-length-normalization-of", "loss"],
            "--align-length-normalization-of needs --align-length-normalization",
        ),
    ],
)
def test_bad_alignment_flags_are_refused(flags, message, capsys):
    base = [
        "--align-objective",
        "qrpo",
        "--no-fused-output-loss",
        "--train-data-path",
        "x",
        "--train-iters",
        "1",
    ]
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(base + flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--align-beta", "0.5"], "--align-beta"),
        (["--align-length-normalization"], "--align-length-normalization"),
        (["--qrpo-transform", "log"], "--qrpo-transform"),
        (["--ref-logps-path", "ref"], "--ref-logps-path"),
    ],
)
def test_alignment_flags_without_an_objective_are_refused(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.parse_args(["--train-iters", "1", *flags])
    assert exit_.value.code == 2
    assert f"{named} needs --align-objective (dpo or qrpo)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain_gpt.parse_args(
            ["--train-iters", "1", "--align-objective", "dpo", "--qrpo-transform", "log"]
        )
    assert "--qrpo-transform applies to --align-objective qrpo only" in capsys.readouterr().err
