"""Sampled teacher stores end to end (``--sampling random``): the draws follow the teacher's
distribution, do not depend on the parallel layout or the block size, resume, follow packed
documents, train a student (which resumes exactly; with Goldfish, and quantization-aware, its
loss is the sampled estimate on the kept tokens), and a wrong-kind, corrupted, truncated or
other-data store is refused in one line. Real subprocesses, real tokenizer, the embedded
corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.apertus import checkpoint
from megatron.apertus.data.batches import document_lengths
from megatron.apertus.data.goldfish import GoldfishConfig, goldfish_drop_mask
from megatron.apertus.distill.logit_store import (
    HEADER_FILE,
    INDEX_FILE,
    LogitStoreReader,
    block_path,
    draw_uniforms,
)
from megatron.apertus.quant.config import QuantConfig
from megatron.apertus.tokenizer.tokenizers import build_tokenizer
from tests.conftest import (
    PRETRAIN,
    SMALL_TOKENIZER,
    cpu_models,
    read_json,
    run_entry,
    run_script,
    series,
)
from tests.distill.test_distillation import teacher  # noqa: F401  (module fixture)
from tests.distill.test_distillation import (
    GENERATE,
    SAMPLES_PER_BLOCK,
    STUDENT,
    STUDENT_DATA,
    block_digests,
    student_train_data,
    teacher_logprobs,
)
from tests.quant.test_qad import QAD_RUN

DRAWS = 64
STORED_SAMPLES = 24  # the student's 6 steps of 4 samples
SAMPLING_SEED = 11  # --seed of STUDENT_DATA: the default sampling seed
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
LOSS_RTOL = 1e-6
"""A logged fp32 loss against its float64 estimate (measured within 5e-8)."""


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
    reader = LogitStoreReader(store)
    rows = reader.read(range(STORED_SAMPLES))
    k = rows.ids.shape[-1]
    weights = torch.zeros(rows.ids.shape[0] * rows.ids.shape[1], reader.header.vocab_size)
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
    args = ["--load", str(teacher), "--logits-dir", str(sampled)]
    args += ["--samples-per-block", str(SAMPLES_PER_BLOCK), "--topk", str(DRAWS), *STUDENT_DATA]
    proc = run_script(GENERATE, args)
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
    proc = run_script(PRETRAIN, [*student, "--distill-logits-path", str(store)])
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


def inverse_cdf_weights(logprobs: torch.Tensor, uniforms: np.ndarray) -> torch.Tensor:
    """counts / N over the vocabulary [s, V] of the ids drawn from ``logprobs [s, V]`` at
    ``uniforms [s, N]``: the id whose CDF interval holds each uniform (float64 CDF)."""
    cdf = (logprobs.double() - logprobs.double().amax(-1, keepdim=True)).exp().cumsum(-1)
    point = torch.from_numpy(uniforms) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, point, right=True).clamp_max(cdf.shape[-1] - 1)
    weights = torch.zeros(cdf.shape, dtype=torch.float64)
    return weights.scatter_add_(
        1, ids, torch.full(ids.shape, 1 / ids.shape[1], dtype=torch.float64)
    )


def document_logprobs(model, sample: dict, eod: int) -> tuple[torch.Tensor, int]:
    """The teacher ``model``'s log-probabilities [s, V] on each document of ``sample`` run
    alone (positions from 0), which document masking must reproduce; and the number of
    documents."""
    tokens = torch.as_tensor(sample["tokens"]).long()
    lengths = document_lengths(tokens[None], eod)
    with torch.no_grad():
        logits = [
            model(doc[None], torch.arange(len(doc))[None], None)[0] for doc in tokens.split(lengths)
        ]
    return torch.log_softmax(torch.cat(logits).float(), -1), len(lengths)


def stored_weights(rows, i: int, vocab_size: int) -> torch.Tensor:
    """Row ``i`` of a read: its weights over the vocabulary [s, V]."""
    weights = torch.zeros(rows.ids.shape[1], vocab_size, dtype=torch.float64)
    return weights.scatter_(1, rows.ids[i], rows.probs[i].double())


def test_packed_documents_draw_from_each_document_alone(teacher, sampled, tmp_path):  # noqa: F811
    """With --reset-attention-mask --reset-position-ids the draws of every stored sample are
    those of the teacher on each of its documents alone, at the store's uniforms; samples that
    span documents draw otherwise than the unpacked store. (The packed attention sums in
    another order than a lone document's: a draw within fp32 round-off of a CDF boundary may
    move, so 99.9% of the draws must agree.)"""
    packed = tmp_path / "packed"
    generate_sampled(teacher, packed, extra=PACKED)
    positions = range(STORED_SAMPLES)
    stored = LogitStoreReader(packed).read(positions)
    unpacked = LogitStoreReader(sampled).read(positions)
    eod = build_tokenizer("HuggingFaceTokenizer", SMALL_TOKENIZER).eod
    vocab_size = LogitStoreReader(packed).header.vocab_size
    shared, spanning = [], []
    with cpu_models() as models:
        model = models.build(load=teacher).eval()
        train = student_train_data(checkpoint.load_model_config(teacher).seq_length)
        for position in positions:
            logprobs, documents = document_logprobs(model, train[position], eod)
            uniforms = draw_uniforms(SAMPLING_SEED, position, logprobs.shape[0], DRAWS)
            expected = inverse_cdf_weights(logprobs, uniforms)
            got = stored_weights(stored, position, vocab_size)
            shared.append(torch.minimum(got, expected).sum(1).mean().item())
            if documents > 1:
                spanning.append(position)
                assert not torch.equal(
                    got, stored_weights(unpacked, position, vocab_size)
                ), position
    assert spanning, "no sample spans two documents: the test shows nothing"
    assert min(shared) > 0.999, shared


def first_step_reference(model, store: Path) -> tuple[float, float]:
    """Step 1's loss (the first global batch, positions 0-3) of a Goldfish student ``model``
    (k=50, h=50) reading the sampled ``store``, from the full-vocabulary log-softmax: per label
    position 0.9 KL(counts/N || student) + 0.1 CE, averaged over the positions Goldfish keeps;
    and the same average over all positions (what a run without Goldfish would log)."""
    train = student_train_data(LogitStoreReader(store).header.seq_length)
    samples = [train[p] for p in range(4)]
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).double()
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    logq = torch.log_softmax(logits.double(), -1)
    stored = LogitStoreReader(store).read(range(4))
    w = stored.probs.double()
    kl = torch.where(w > 0, w * (w.clamp_min(1e-30).log() - logq.gather(-1, stored.ids)), 0)
    ce = -logq.gather(-1, labels[..., None])[..., 0]
    per_token = 0.9 * kl.sum(-1) + 0.1 * ce
    dropped = goldfish_drop_mask(labels, GoldfishConfig(), torch.tensor([], dtype=torch.int64))
    assert dropped.any(), "Goldfish drops nothing here: the test shows nothing"
    keep = mask.masked_fill(dropped, 0)
    average = lambda m: float((per_token * m).sum() / m.sum())  # noqa: E731
    return average(keep), average(mask)


def self_distillation(teacher: Path, store: Path, log: Path, *quant: str) -> list[str]:
    """The teacher fine-tuned (``--finetune``: weights only, step 0) on its own sampled store
    with Goldfish, optionally quantization-aware."""
    return QAD_RUN + [
        "--load",
        str(teacher),
        "--finetune",
        "--distill-logits-path",
        str(store),
        "--kd-alpha",
        "0.9",
        "--log-json",
        str(log),
        *quant,
    ]


def test_goldfish_student_takes_the_sampled_estimate_on_kept_tokens(
    teacher, sampled, tmp_path  # noqa: F811
):
    """A Goldfish student's first loss from a sampled store is the in-process estimate over the
    tokens Goldfish keeps, not over all tokens."""
    log = tmp_path / "student.json"
    run_entry(PRETRAIN, self_distillation(teacher, sampled, log))
    steps, losses = series(read_json(log), "train/loss")
    with cpu_models() as models:
        kept, everything = first_step_reference(models.build(load=teacher).eval(), sampled)
    assert steps[0] == 1 and losses[0] == pytest.approx(kept, rel=LOSS_RTOL)
    assert abs(everything - kept) > 10 * LOSS_RTOL * kept, "Goldfish does not show"


def test_qad_from_a_sampled_store_takes_the_estimate(teacher, sampled, tmp_path):  # noqa: F811
    """Quantization-aware distillation (the teacher's own weights fake-quantized) from a
    sampled store: its first loss is the estimate of the quantized teacher, with Goldfish, and
    not that of the unquantized one. int2: the test teacher is barely trained, and int4 moves
    its first loss by only ~4e-6 (relative), too close to the tolerance to tell."""
    log = tmp_path / "qad.json"
    quant = QuantConfig(quant_format="int2", quant_group_size=16)
    flags = ["--quant-format", quant.quant_format, "--quant-group-size", "16"]
    run_entry(PRETRAIN, self_distillation(teacher, sampled, log, *flags))
    steps, losses = series(read_json(log), "train/loss")
    with cpu_models() as models:
        kept, _ = first_step_reference(models.build(load=teacher, quant=quant).eval(), sampled)
        plain, _ = first_step_reference(models.build(load=teacher).eval(), sampled)
    assert steps == [1, 2, 3, 4, 5, 6] and all(np.isfinite(losses))
    assert losses[0] == pytest.approx(kept, rel=LOSS_RTOL)
    assert abs(plain - kept) > 10 * LOSS_RTOL * kept, "quantization does not show"
