"""Sampled teacher stores end to end (``--sampling random``): the draws follow the teacher's
distribution, do not depend on the parallel layout or the block size, resume, train a student
(which resumes exactly), and a wrong-kind, corrupted, truncated or other-data store is refused
in one line. Real subprocesses, real tokenizer, the embedded corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.apertus.distill.logit_store import (
    HEADER_FILE,
    INDEX_FILE,
    LogitStoreReader,
    block_path,
)
from tests.conftest import PRETRAIN, REPO, read_json, run_entry, series
from tests.distill.test_distillation import (
    GENERATE,
    SAMPLES_PER_BLOCK,
    STUDENT,
    STUDENT_DATA,
    block_digests,
    teacher,  # noqa: F401  (module fixture)
    teacher_logprobs,
)

DRAWS = 64


def generate_sampled(teacher: Path, out: Path, *, nproc: int = 1, extra: list[str] = ()) -> str:
    args = [
        "--load",
        str(teacher),
        "--logits-dir",
        str(out),
        "--sampling",
        "random",
        "--samples",
        str(DRAWS),
        "--samples-per-block",
        str(SAMPLES_PER_BLOCK),
        *STUDENT_DATA,
        *extra,
    ]
    proc = run_entry(GENERATE, args, nproc=nproc)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def sampled(teacher, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("sampled") / "store"
    generate_sampled(teacher, out)
    return out


def test_draws_follow_the_teachers_distribution(teacher, sampled):  # noqa: F811
    """Per position, counts / N estimates the teacher's p without bias: summed over all
    tokens of four samples, the stored weight of every token's teacher argmax and of its
    label agree with the teacher's probabilities within 4 standard errors."""
    reader = LogitStoreReader(sampled)
    assert reader.header.kind == "sampled" and reader.header.k == DRAWS
    positions = [0, 7, 8, 23]
    logprobs, keys = teacher_logprobs(teacher, positions)
    stored = reader.read(positions)
    assert stored.sample_keys.tolist() == keys
    assert torch.allclose(stored.probs.sum(-1), torch.ones(()), atol=1e-6)
    p = logprobs.exp()
    drawn = torch.zeros_like(p).scatter_(-1, stored.ids, stored.probs)  # weights over the vocab
    assert (p[drawn > 0] > 0).all()
    for chosen in (p.argmax(-1, keepdim=True), p[..., :1000].argmin(-1, keepdim=True)):
        p_c, w_c = p.gather(-1, chosen).double(), drawn.gather(-1, chosen).double()
        standard_error = (p_c * (1 - p_c) / DRAWS).sum().sqrt()
        assert abs((w_c - p_c).sum()) < 4 * standard_error + 1e-9, (w_c.sum(), p_c.sum())


def drawn_weights(store: Path) -> torch.Tensor:
    """Every position's weights over the vocabulary, [positions, V]."""
    rows = LogitStoreReader(store).read(range(24))
    k = rows.ids.shape[-1]
    weights = torch.zeros(rows.ids.shape[0] * rows.ids.shape[1], 131072)
    return weights.scatter_(1, rows.ids.reshape(-1, k), rows.probs.reshape(-1, k))


def test_draws_do_not_depend_on_layout_or_block_size_and_resume(
    teacher, sampled, tmp_path  # noqa: F811
):
    """DP=2 writes the same bytes, and regenerates a lost block to the same bytes; another block
    size stores the same draws. TP=2 computes the teacher's logits with other fp32 roundings
    (its top-k probabilities differ by ~1e-6 too), so a draw within that distance of an interval
    boundary moves: over 99.9% of the draws are the same."""
    dp2, tp2, small_blocks = tmp_path / "dp2", tmp_path / "tp2", tmp_path / "small_blocks"
    generate_sampled(teacher, dp2, nproc=2)
    assert block_digests(dp2, 3) == block_digests(sampled, 3)
    block_path(dp2, 1).unlink()
    generate_sampled(teacher, dp2, nproc=2)
    assert block_digests(dp2, 3) == block_digests(sampled, 3)

    generate_sampled(teacher, small_blocks, extra=["--samples-per-block", "5"])
    reference = drawn_weights(sampled)
    assert torch.equal(drawn_weights(small_blocks), reference)

    generate_sampled(teacher, tp2, nproc=2, extra=["--tensor-model-parallel-size", "2"])
    shared = torch.minimum(drawn_weights(tp2), reference).sum(1).mean()
    assert shared > 0.999, f"TP=2 shares only {shared:.4%} of the draws"


def test_a_store_of_another_kind_is_not_resumed(teacher, sampled):  # noqa: F811
    proc = subprocess.run(
        [
            sys.executable,
            str(GENERATE),
            "--load",
            str(teacher),
            "--logits-dir",
            str(sampled),
            "--samples-per-block",
            str(SAMPLES_PER_BLOCK),
            "--topk",
            str(DRAWS),
            *STUDENT_DATA,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and "belongs to another run" in proc.stderr
    assert "kind: 'topk' != 'sampled'" in proc.stderr


def test_student_distils_from_a_sampled_store_and_resumes(sampled, tmp_path):
    distil = ["--distill-logits-path", str(sampled), "--kd-alpha", "0.9"]
    run_entry(PRETRAIN, STUDENT + distil + ["--log-json", str(tmp_path / "full.json")])
    save = tmp_path / "ckpt"
    run_entry(PRETRAIN, STUDENT + distil + ["--save", str(save), "--exit-interval", "3"])
    resumed = [
        "--save",
        str(save),
        "--load",
        str(save),
        "--log-json",
        str(tmp_path / "resumed.json"),
    ]
    run_entry(PRETRAIN, STUDENT + distil + resumed)
    full = series(read_json(tmp_path / "full.json"), "train/loss")
    assert full == series(read_json(tmp_path / "resumed.json"), "train/loss")
    assert len(full[0]) == 6 and all(np.isfinite(full[1]))


def refusal(store: Path, student: list[str] = STUDENT) -> str:
    """The one error line of a student run on ``store`` (exit code 2, no traceback)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(PRETRAIN), *student, "--distill-logits-path", str(store)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return errors[0]


def copy_store(store: Path, to: Path) -> Path:
    (to / "blocks").mkdir(parents=True)
    for path in store.rglob("*"):
        if path.is_file():
            (to / path.relative_to(store)).write_bytes(path.read_bytes())
    return to


def test_damaged_or_mislabelled_stores_are_refused_in_one_line(sampled, tmp_path):
    kind = copy_store(sampled, tmp_path / "kind")  # a sampled store's header relabelled top-k
    header = json.loads((kind / "header.json").read_text())
    header.update(kind="topk", codec="rank-diff8+sqrt8/zstd")
    del header["seed"]
    (kind / "header.json").write_text(json.dumps(header))
    assert "was written for another header.json" in refusal(kind)

    flipped = copy_store(sampled, tmp_path / "flipped")
    data = bytearray(block_path(flipped, 0).read_bytes())
    data[-10] ^= 0xFF  # inside the last sample's payload
    block_path(flipped, 0).write_bytes(bytes(data))
    assert "checksum mismatch in the sample at position 7" in refusal(flipped)

    truncated = copy_store(sampled, tmp_path / "truncated")
    path = block_path(truncated, 2)
    path.write_bytes(path.read_bytes()[:-100])
    assert "truncated" in refusal(truncated)

    unknown = copy_store(sampled, tmp_path / "unknown")
    header = json.loads((unknown / "header.json").read_text())
    (unknown / "header.json").write_text(json.dumps({**header, "kind": "stratified"}))
    (unknown / INDEX_FILE).unlink()
    assert "unknown kind of store 'stratified'" in refusal(unknown)

    other_data = [a if a != "11" else "12" for a in STUDENT]
    assert "do not match the training data" in refusal(sampled, other_data)


def test_pipeline_stages_write_the_same_bytes(teacher, sampled, tmp_path):  # noqa: F811
    """PP=2: the first stage runs the embedding and two layers, the last draws; the store is
    one process's, byte for byte."""
    pp2 = tmp_path / "pp2"
    generate_sampled(teacher, pp2, nproc=2, extra=["--pipeline-model-parallel-size", "2"])
    for name in (HEADER_FILE, INDEX_FILE):
        assert (pp2 / name).read_bytes() == (sampled / name).read_bytes()
    assert block_digests(pp2, 3) == block_digests(sampled, 3)
