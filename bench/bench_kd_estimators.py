"""Students distilled with each kind of teacher target, same steps, seeds and data, one process.

    python bench/bench_kd_estimators.py --teacher-checkpoint SAVE_DIR [--steps 40] [--batch 4]
        [--distinct 12] [--device cpu]

The teacher (a ``pretrain_gpt.py`` checkpoint) and five students of the tiny preset (same
initialisation) run in one process on the embedded corpus, cut into samples of the teacher's
sequence length (the first 90% of the documents train, the last 10% are held out). Each student
takes ``--steps`` AdamW steps on the same batches with one loss:

* ``cross-entropy``: labels only;
* ``top-k 256`` and ``top-k 12``: 0.9 KL to the teacher's top-k (``--kd-tail label``, the
  default) + 0.1 CE, the targets a top-k store holds;
* ``sampled``: 0.9 CE to ``count / N`` of N draws from the teacher (the draws a sampled store
  holds, ``global_samples`` at ``draw_uniforms``) + 0.1 CE; N is the smallest draw count whose
  first batch has at least ``--distinct`` distinct ids per token on average;
* ``full KD (online)``: 0.9 KL to the teacher's full distribution + 0.1 CE (the reference).

Targets come from the teacher in the same process (what the stores would return, before the
top-k codec's probability quantisation); the fused output-layer loss computes every sparse
loss, full KD uses the student's full logits. Columns: held-out cross-entropy, expected
calibration error of the next-token distribution (15 equal-width bins of the top-1
probability), bytes/token of the store of the training tokens (the store's codec on those
targets; online KD stores nothing), median step time (student forward + backward + update)
relative to cross-entropy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from megatron.apertus.distill import logit_store  # noqa: E402
from megatron.apertus.distill.logit_codec import (  # noqa: E402
    CodecParams,
    encode_block,
    encode_sampled_block,
)

ALPHA = 0.9
BINS = 15


def corpus_samples(seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [n, seq_length + 1] windows of the training (first 90%) and held-out documents."""
    from megatron.apertus.data.corpus import training_documents
    from megatron.apertus.data.tokenizer import build_tokenizer

    documents = training_documents()
    cut = int(round(len(documents) * 0.9))
    tokenizer = build_tokenizer("TekkenTokenizer")

    def windows(docs) -> np.ndarray:
        tokens = np.concatenate([tokenizer.encode_document(d) for d in docs]).astype(np.int64)
        n = (len(tokens) - 1) // seq_length
        return np.stack([tokens[i * seq_length : (i + 1) * seq_length + 1] for i in range(n)])

    return windows(documents[:cut]), windows(documents[cut:])


def teacher_logprobs(teacher, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return torch.log_softmax(teacher(tokens, positions, None).float(), -1)


def topk_targets(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = logprobs.topk(k, dim=-1)
    return top.indices, top.values.exp()


def sampled_targets(logprobs: torch.Tensor, draws: int, first_position: int):
    """(ids [b, s, draws], weights count / draws (0 for the padding ids)) and the draws."""
    from megatron.apertus.model.topk import global_samples

    b, s, v = logprobs.shape
    uniforms = np.stack(
        [logit_store.draw_uniforms(0, first_position + i, s, draws) for i in range(b)]
    )
    drawn = global_samples(logprobs.reshape(-1, v), torch.from_numpy(uniforms.reshape(-1, draws)))
    counts = torch.zeros(b * s, v).scatter_add_(1, drawn.long(), torch.ones(drawn.shape))
    top = counts.topk(draws, dim=-1)  # distinct ids, the drawn ones first, then zero weights
    shape = (b, s, draws)
    return top.indices.view(shape), (top.values / draws).view(shape), drawn.view(shape)


def draws_for(logprobs: torch.Tensor, distinct: float) -> int:
    """The smallest draw count whose targets have >= ``distinct`` distinct ids per token."""
    for draws in range(int(distinct), 4096):
        _, weights, _ = sampled_targets(logprobs, draws, 0)
        if (weights > 0).sum(-1).float().mean() >= distinct:
            return draws
    raise SystemExit(f"no draw count up to 4096 gives {distinct} distinct ids per token")


def student_loss(student, tokens, labels, mode: str, target) -> torch.Tensor:
    """Mean per-token loss of ``mode`` (``target``: teacher ids/weights or log-probabilities)."""
    from megatron.apertus.model.fused_loss import TeacherTargets

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.ones(tokens.shape, dtype=torch.float32)
    n = tokens.numel()
    if mode == "full KD (online)":
        logq = torch.log_softmax(student(tokens, positions, None).float(), -1)
        kl = (target.exp() * (target - logq)).sum(-1)
        ce = -logq.gather(-1, labels[..., None]).squeeze(-1)
        return (ALPHA * kl + (1 - ALPHA) * ce).mean()
    teacher = None
    if mode != "cross-entropy":
        tail = "ignore" if mode.startswith("sampled") else "label"
        teacher = TeacherTargets(target[0], target[1], ALPHA, tail)
    return student(tokens, positions, None, labels=labels, loss_mask=mask, teacher=teacher) / n


def held_out(student, samples: np.ndarray, batch: int) -> tuple[float, float]:
    """Mean cross-entropy and expected calibration error of the top-1 next-token probability."""
    losses, confidence, correct = [], [], []
    with torch.no_grad():
        for start in range(0, len(samples), batch):
            window = torch.from_numpy(samples[start : start + batch])
            tokens, labels = window[:, :-1], window[:, 1:]
            logq = torch.log_softmax(
                student(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).float(), -1
            )
            losses.append(-logq.gather(-1, labels[..., None]).flatten())
            top = logq.max(-1)
            confidence.append(top.values.exp().flatten())
            correct.append((top.indices == labels).float().flatten())
    confidence, correct = torch.cat(confidence), torch.cat(correct)
    bins = (confidence * BINS).long().clamp_max(BINS - 1)
    ece = sum(
        (bins == b).sum() * (correct[bins == b].mean() - confidence[bins == b].mean()).abs()
        for b in range(BINS)
        if (bins == b).any()
    ) / len(confidence)
    return float(torch.cat(losses).mean()), float(ece)


def store_bytes(mode: str, logprobs: torch.Tensor, draws: torch.Tensor | None) -> float:
    """Bytes/token of the store of these training tokens (one block, the store's codec)."""
    b, s, v = logprobs.shape
    if mode in ("cross-entropy", "full KD (online)"):
        return 0.0
    if mode.startswith("sampled"):
        encoded = encode_sampled_block(
            draws.reshape(b * s, -1).numpy(), samples=b, vocab_size=v, zstd_level=3
        )
    else:
        k = int(mode.split()[-1])
        top = logprobs.topk(k, dim=-1)
        encoded = encode_block(
            top.indices.reshape(b * s, k).numpy(),
            top.values.reshape(b * s, k).numpy(),
            samples=b,
            vocab_size=v,
            params=CodecParams(),
        )
    size = len(encoded.tables) + sum(len(p) for p in encoded.payloads) + 36 * b + 88
    return size / (b * s)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher-checkpoint", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--distinct", type=float, default=12.0)
    parser.add_argument("--held-out-samples", type=int, default=64)
    parser.add_argument("--device", choices=["cpu"], default="cpu")
    args = parser.parse_args()

    from megatron.apertus import parallel
    from megatron.apertus.checkpoint import load_model, load_model_config
    from megatron.apertus.model import ParallelConfig
    from megatron.apertus.model.builder import build_model
    from megatron.apertus.model.presets import preset

    teacher_config = load_model_config(args.teacher_checkpoint)
    student_config = preset("tiny", seq_length=teacher_config.seq_length)
    layout = ParallelConfig()
    parallel.initialize(layout, device="cpu", seed=0, model=teacher_config)
    (teacher,) = build_model(teacher_config, layout, use_cpu_initialization=True)
    load_model(args.teacher_checkpoint, [teacher])
    teacher.eval()
    train, valid = corpus_samples(teacher_config.seq_length)
    valid = valid[: args.held_out_samples]
    first = teacher_logprobs(teacher, torch.from_numpy(train[: args.batch, :-1]))
    draws = draws_for(first, args.distinct)
    modes = ["cross-entropy", "top-k 256", "top-k 12", f"sampled {draws} draws", "full KD (online)"]
    print(
        f"{len(train)} training, {len(valid)} held-out samples of {teacher_config.seq_length} "
        f"tokens; sampled: {draws} draws per token"
    )
    rows = []
    for mode in modes:
        torch.manual_seed(0)
        (student,) = build_model(
            student_config, layout, fused_loss=True, use_cpu_initialization=True
        )
        optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
        times, sizes, distinct = [], [], []
        for step in range(args.steps):
            start = step * args.batch % (len(train) - args.batch)
            window = torch.from_numpy(train[start : start + args.batch])
            tokens, labels = window[:, :-1], window[:, 1:]
            logprobs = teacher_logprobs(teacher, tokens)
            drawn, target = None, logprobs
            if mode.startswith("top-k"):
                target = topk_targets(logprobs, int(mode.split()[-1]))
            elif mode.startswith("sampled"):
                ids, weights, drawn = sampled_targets(logprobs, draws, start)
                target = (ids, weights)
                distinct.append(float((weights > 0).sum(-1).float().mean()))
            if step < 4:
                sizes.append(store_bytes(mode, logprobs, drawn))
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            student_loss(student, tokens, labels, mode, target).backward()
            optimizer.step()
            times.append(time.perf_counter() - began)
        loss, ece = held_out(student, valid, args.batch)
        row = {
            "mode": mode,
            "held_out_loss": loss,
            "ece": ece,
            "bytes_per_token": statistics.mean(sizes),
            "step_s": statistics.median(times[1:]),
        }
        if distinct:
            row["distinct_ids_per_token"] = statistics.mean(distinct)
        rows.append(row)
        print(
            f"{mode:22s} held-out {loss:.4f}  ECE {ece:.4f}  {row['bytes_per_token']:7.1f} "
            f"B/token  step {row['step_s'] * 1e3:.0f} ms",
            flush=True,
        )
    for row in rows:
        row["step_vs_ce"] = row["step_s"] / rows[0]["step_s"]
    parallel.shutdown()
    extra = {
        "teacher_checkpoint": args.teacher_checkpoint,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "draws": draws,
    }
    print(f"wrote {write_results('kd_estimators', rows, extra)}")


if __name__ == "__main__":
    main()
