"""Teacher logits end to end: generation (TP, PP, DP, chunked output layer, resume), checks
against the teacher's own logits, student training from them (exact resume, alpha=0 equals plain
CE), refusal of logits made for other data. Real subprocesses, real tokenizer, the embedded
corpus."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.apertus import checkpoint, parallel
from megatron.apertus.checkpoint_files import MODEL_CONFIG
from megatron.apertus.data.datasets import DatasetConfig, build_datasets
from megatron.apertus.distill.config import DistillConfig
from megatron.apertus.distill.logit_store import LogitStoreReader, block_path
from megatron.apertus.distill.targets import TeacherLogits, dataset_key
from megatron.apertus.model import ParallelConfig, preset
from megatron.apertus.prep.corpus import embedded_corpus_prefix
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from megatron.apertus.training.loop_config import TrainingConfig
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_TOKENIZER,
    SMALL_TOKENIZER_FLAGS,
    SMALL_VOCABULARY,
    built_once,
    cpu_models,
    read_json,
    run_entry,
    run_script,
    series,
)

GENERATE = REPO / "tools" / "generate_teacher_logits.py"
TOPK = 16
SAMPLES_PER_BLOCK = 8
# The student's run: its order of samples is what the teacher logits must follow.
STUDENT_DATA = [
    "--seed",
    "11",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "6",
    "--eval-iters",
    "1",
    *SMALL_TOKENIZER_FLAGS,
]
STUDENT = [
    "--model-preset",
    "tiny",
    "--num-layers",
    "2",
    "--lr",
    "3e-3",
    "--log-interval",
    "1",
    "--lr-decay-style",
    "WSD",
    "--lr-warmup-iters",
    "2",
    "--lr-wsd-decay-iters",
    "2",
    "--goldfish-loss",
    "--make-vocab-size-divisible-by",
    "128",
    *STUDENT_DATA,
]


TEACHER = [
    "--model-preset",
    "tiny",
    "--seed",
    "3",
    "--lr",
    "3e-3",
    "--train-iters",
    "5",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    *SMALL_VOCABULARY,
]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The tiny teacher (``ckpt``), trained once per pytest run for every module that uses it."""

    def train(folder: Path) -> None:
        run_entry(PRETRAIN, TEACHER + ["--save", str(folder / "ckpt")])

    return built_once(tmp_path_factory, "teacher", TEACHER, train) / "ckpt"


def generate(teacher: Path, out: Path, *, nproc: int = 1, extra: list[str] = ()) -> str:
    proc = run_entry(
        GENERATE,
        [
            "--load",
            str(teacher),
            "--logits-dir",
            str(out),
            "--topk",
            str(TOPK),
            "--samples-per-block",
            str(SAMPLES_PER_BLOCK),
            *STUDENT_DATA,
            *extra,
        ],
        nproc=nproc,
    )
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def logits(teacher, tmp_path_factory) -> Path:
    """The teacher's top-k store of the student's samples, written once per pytest run."""

    def write(folder: Path) -> None:
        generate(teacher, folder / "store")

    return built_once(tmp_path_factory, "logits", (TEACHER, TOPK, STUDENT_DATA), write) / "store"


def block_digests(store: Path, blocks: int) -> list[str]:
    return [hashlib.sha256(block_path(store, b).read_bytes()).hexdigest() for b in range(blocks)]


def student_train_data(seq_length: int):
    """The student's training dataset (STUDENT_DATA); needs parallel.initialize."""
    training = TrainingConfig(
        train_iters=6, global_batch_size=4, micro_batch_size=2, seed=11, eval_iters=1
    )
    train, _, _ = build_datasets(
        DatasetConfig(),
        build_tokenizer("HuggingFaceTokenizer", SMALL_TOKENIZER),
        seq_length=seq_length,
        seed=training.seed,
        num_samples=training.dataset_sizes(),
        default_corpus=embedded_corpus_prefix,
    )
    return train


def teacher_logprobs(teacher: Path, positions: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Full-vocabulary log-probabilities of the teacher on the student's samples at
    ``positions`` (one process), and those samples' store keys."""
    with cpu_models() as models:
        chunk = models.build(load=teacher).eval()
        train = student_train_data(checkpoint.load_model_config(teacher).seq_length)
        tokens = torch.stack([torch.as_tensor(train[p]["tokens"]) for p in positions]).long()
        positions_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():
            logits = chunk(tokens, positions_ids, None)
        return torch.log_softmax(logits.float(), -1), [dataset_key(train, p) for p in positions]


def test_stored_topk_is_the_teachers_topk(teacher, logits):
    reader = LogitStoreReader(logits)
    assert reader.header.k == TOPK and reader.header.num_samples == 24
    positions = [0, 7, 8, 23]  # across block boundaries
    logprobs, keys = teacher_logprobs(teacher, positions)
    stored = reader.read(positions)
    assert stored.sample_keys.tolist() == keys
    exact_values, exact_ids = logprobs.topk(TOPK, dim=-1)
    assert torch.equal(stored.ids.sort(-1).values, exact_ids.sort(-1).values)
    # stored probabilities, in the exact ids' order, against the exact ones
    order = stored.ids.argsort(-1)
    got = stored.probs.gather(-1, order)
    want = exact_values.exp().gather(-1, exact_ids.argsort(-1))
    assert torch.allclose(got, want, atol=2e-3, rtol=0.05)


def test_bf16_generation_reads_the_16_bit_logits(teacher, logits, tmp_path):
    """A bf16 teacher (no fp32 copy of its logits: top-k and row statistics read them directly)
    stores nearly the fp32 teacher's top-k: bf16 rounding moves only ids near the k-th value."""
    generate(teacher, tmp_path / "bf16", extra=["--precision", "bf16"])
    fp32 = LogitStoreReader(logits).read(range(24))
    bf16 = LogitStoreReader(tmp_path / "bf16").read(range(24))
    assert np.array_equal(bf16.sample_keys, fp32.sample_keys)
    shared = (bf16.ids[..., :, None] == fp32.ids[..., None, :]).any(-1).float().mean().item()
    assert shared > 0.9, f"only {shared:.1%} of the bf16 top-{TOPK} ids are the fp32 ones"
    mass_error = (bf16.probs.sum(-1) - fp32.probs.sum(-1)).abs().max().item()
    assert mass_error < 0.02, f"top-{TOPK} mass differs by {mass_error:.3g}"


def test_chunked_generation_writes_the_same_bytes(teacher, logits, tmp_path):
    """The last stage's logits in chunks of 96 tokens (96 + 160 of a micro-batch's 256: the
    remainder joins the last chunk) give the bytes of one chunk, megatron-core's own product."""
    generate(teacher, tmp_path / "chunked", extra=["--topk-chunk-rows", "96"])
    assert block_digests(tmp_path / "chunked", 3) == block_digests(logits, 3)
    assert (tmp_path / "chunked" / "index.bin").read_bytes() == (logits / "index.bin").read_bytes()


def test_parallel_generation_matches_one_process_and_resumes(teacher, logits, tmp_path):
    """TP=2 (global top-k over the vocabulary shards) gives the same store, also in chunks with
    sequence parallelism (bytes: with two ranks, both layouts add the same two partial sums);
    DP=2 writes disjoint blocks from two processes and gives the same bytes; a lost block is
    regenerated alone by re-running the command."""
    tp2, tp2_chunked, dp2 = tmp_path / "tp2", tmp_path / "tp2_chunked", tmp_path / "dp2"
    generate(teacher, tp2, nproc=2, extra=["--tensor-model-parallel-size", "2"])
    generate(
        teacher,
        tp2_chunked,
        nproc=2,
        extra=[
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--topk-chunk-rows",
            "64",
        ],
    )
    generate(teacher, dp2, nproc=2)
    reference = LogitStoreReader(logits).read(range(24))
    sharded = LogitStoreReader(tp2).read(range(24))
    assert np.array_equal(sharded.sample_keys, reference.sample_keys)
    assert torch.equal(sharded.ids.sort(-1).values, reference.ids.sort(-1).values)
    assert torch.allclose(sharded.probs.sum(-1), reference.probs.sum(-1), atol=1e-3)
    assert block_digests(tp2_chunked, 3) == block_digests(tp2, 3)
    assert block_digests(dp2, 3) == block_digests(logits, 3)

    kept = {b: block_path(dp2, b).stat().st_mtime_ns for b in (0, 2)}
    block_path(dp2, 1).unlink()
    output = generate(teacher, dp2, nproc=2)
    assert "1/1" in output  # the owner of block 1 had one block to do
    assert {b: block_path(dp2, b).stat().st_mtime_ns for b in (0, 2)} == kept
    assert block_digests(dp2, 3) == block_digests(logits, 3)


def test_pipeline_stages_write_the_same_bytes(teacher, logits, tmp_path):
    """PP=2: the first stage runs the embedding and two layers, the last takes the top-k; the
    store is one process's, byte for byte."""
    pp2 = tmp_path / "pp2"
    generate(teacher, pp2, nproc=2, extra=["--pipeline-model-parallel-size", "2"])
    for name in ("header.json", "index.bin"):
        assert (pp2 / name).read_bytes() == (logits / name).read_bytes()
    assert block_digests(pp2, 3) == block_digests(logits, 3)


def test_virtual_pipeline_stages_write_the_same_bytes(teacher, tmp_path):
    """PP=2 x 2 virtual stages in blocks of 6 samples: 3 micro-batches per block, padded to
    whole groups of one per stage for megatron-core's interleaved schedule; the store is one
    process's, byte for byte."""
    blocks = ["--samples-per-block", "6"]
    interleaved = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size"]
    one, vpp = tmp_path / "one", tmp_path / "vpp"
    generate(teacher, one, extra=blocks)
    generate(teacher, vpp, nproc=2, extra=[*blocks, *interleaved, "2"])
    for name in ("header.json", "index.bin"):
        assert (vpp / name).read_bytes() == (one / name).read_bytes()
    assert LogitStoreReader(vpp).header.samples_per_block == 6
    assert block_digests(vpp, 4) == block_digests(one, 4)


def test_student_distils_and_resumes_at_the_right_logit_position(logits, tmp_path):
    distil = ["--distill-logits-path", str(logits), "--kd-alpha", "0.9"]
    run_entry(PRETRAIN, STUDENT + distil + ["--log-json", str(tmp_path / "full.json")])
    save = tmp_path / "ckpt"
    run_entry(PRETRAIN, STUDENT + distil + ["--save", str(save), "--exit-interval", "3"])
    run_entry(
        PRETRAIN,
        STUDENT
        + distil
        + ["--save", str(save), "--load", str(save), "--log-json", str(tmp_path / "resumed.json")],
    )
    full = series(read_json(tmp_path / "full.json"), "train/loss")
    resumed = series(read_json(tmp_path / "resumed.json"), "train/loss")
    assert full == resumed and len(full[0]) == 6

    # alpha = 0 ignores the teacher: bitwise the cross-entropy run
    run_entry(
        PRETRAIN,
        STUDENT
        + [
            "--distill-logits-path",
            str(logits),
            "--kd-alpha",
            "0",
            "--log-json",
            str(tmp_path / "alpha0.json"),
        ],
    )
    run_entry(PRETRAIN, STUDENT + ["--log-json", str(tmp_path / "ce.json")])
    ce = series(read_json(tmp_path / "ce.json"), "train/loss")
    assert series(read_json(tmp_path / "alpha0.json"), "train/loss") == ce
    assert full[1] != ce[1]


def test_logits_of_other_data_are_refused_naming_the_sample(logits):
    other_order = [a if a != "11" else "12" for a in STUDENT]  # another data seed
    proc = run_script(PRETRAIN, [*other_order, "--distill-logits-path", str(logits)])
    assert proc.returncode != 0
    assert "do not match the training data" in proc.stderr
    assert "sample" in proc.stderr and "position 0" in proc.stderr


@pytest.mark.parametrize(
    "mistake",
    ["logits-dir under a file", "missing data", "top-k above the vocabulary", "empty blocks"],
)
def test_generation_refuses_bad_flags_in_one_line_before_loading_the_teacher(tmp_path, mistake):
    """The teacher checkpoint holds its config and no weights: a refusal that came after
    loading it would be another error."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / MODEL_CONFIG).write_text(preset("tiny").to_json())
    vocab = preset("tiny").vocab_size
    (tmp_path / "file").touch()
    args, expected = {
        "logits-dir under a file": (
            ["--logits-dir", str(tmp_path / "file" / "store")],
            f"--logits-dir {tmp_path / 'file' / 'store'}: {tmp_path / 'file'} is a file",
        ),
        "missing data": (
            ["--logits-dir", str(tmp_path / "store"), "--data-path", str(tmp_path / "none")],
            f"--data-path: neither {tmp_path / 'none'}.bin nor",
        ),
        "top-k above the vocabulary": (
            ["--logits-dir", str(tmp_path / "store"), "--topk", "200000"],
            f"--topk 200000 is more than the teacher's vocabulary of {vocab} ids",
        ),
        "empty blocks": (
            ["--logits-dir", str(tmp_path / "store"), "--samples-per-block", "0"],
            "--samples-per-block must be at least 1, got 0",
        ),
    }[mistake]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_script(GENERATE, ["--load", str(teacher), *args, *STUDENT_DATA], env=env)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    (line,) = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert line.startswith(f"generate_teacher_logits.py: error: {expected}"), line


def test_micro_batches_take_their_rows_of_the_prefetched_step(logits):
    """The loop prefetches a step's samples as the previous step starts; each of its micro-batches
    (STUDENT_DATA: two of 2 samples) is served from that one decode."""
    reader = LogitStoreReader(logits)
    parallel.initialize(ParallelConfig(), device="cpu", seed=0)
    teacher = None
    try:
        train = student_train_data(reader.header.seq_length)
        config = DistillConfig(distill_logits_path=str(logits))
        teacher = TeacherLogits(
            config,
            dataset=train,
            dataset_hash=train.unique_description_hash,
            seq_length=reader.header.seq_length,
            vocab_size=reader.header.vocab_size,
            first_position=0,
            last_position=24,
        )
        teacher.prefetch([0, 1, 2, 3])
        for step in range(3):
            positions = list(range(4 * step, 4 * step + 4))
            micro_batches = [
                teacher.targets(half, [train[p] for p in half])
                for half in (positions[:2], positions[2:])
            ]
            step_batch = teacher._ahead_batch  # the decode these micro-batches came from
            teacher.prefetch([p + 4 for p in positions])  # the next step, as the loop does
            assert step_batch is not None and step_batch.sample_keys.tolist() == [
                dataset_key(train, p) for p in positions
            ]
            for half, got in zip((positions[:2], positions[2:]), micro_batches):
                want = reader.read(half)
                assert torch.equal(got.ids, want.ids) and torch.equal(got.probs, want.probs)
    finally:
        if teacher is not None:
            teacher.close()
        parallel.shutdown()
