"""Students distilled with each kind of teacher target, same steps, seeds and data, one process.

    python bench/bench_kd_estimators.py --teacher-checkpoint SAVE_DIR [--steps 40] [--batch 4]
        [--distinct 12] [--lr-wsd-decay-iters 0] [--teacher-temperature 1] [--sampling-seed 0]
        [--modes ce topk256 topk256-renormalize topk12 sampled full]
        [--train-data-path PREFIX --valid-data-path PREFIX] [--reset-attention-mask] [--device cpu]

The teacher (a ``pretrain_gpt.py`` checkpoint) and six students (``--modes``: some of them) of the
tiny preset (same initialisation) run in one process on documents cut into samples of the teacher's
sequence length: the embedded corpus (the first 90% of the documents train, the last 10% are held
out), or the token files of ``--train-data-path`` and ``--valid-data-path``
(``tools/preprocess_data.py`` prefixes, e.g. a demo's ``data/student_text_document`` and
``data/valid_text_document``). With ``--reset-attention-mask`` every forward packs the documents
(attention and positions restart after each end of document, as ``pretrain_gpt.py`` does with that
flag). Each step runs the teacher once on the step's batch, and each student takes one AdamW step on
it with one loss, at a constant learning rate or, with ``--lr-wsd-decay-iters N``, the recipe's WSD
schedule whose last N steps cool down as 1 - sqrt (the trainer's scheduler, megatron-core's). With
``--teacher-temperature T`` every target comes from the teacher's logits divided by T: T < 1
sharpens a weak teacher towards an LLM's next-token entropy (a few nats), the regime a sampled store
is made for. The students' targets are:

* ``cross-entropy``: labels only;
* ``top-k 256`` and ``top-k 12``: 0.9 KL to the teacher's top-k (``--kd-tail label``, the
  default) + 0.1 CE, the targets a top-k store holds;
* ``top-k 256 renormalize``: the same with the top-k renormalised to sum to 1
  (``--kd-tail renormalize``), the top-k target of Sparse Logit Sampling's comparison and of
  most offline distillation trainers;
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
MODES = {  # --modes key: the student's name (the sampled one's names its draw count)
    "ce": "cross-entropy",
    "topk256": "top-k 256",
    "topk256-renormalize": "top-k 256 renormalize",
    "topk12": "top-k 12",
    "sampled": None,
    "full": "full KD (online)",
}


def windows(documents: list[np.ndarray], seq_length: int) -> np.ndarray:
    """int64 [n, seq_length + 1] windows of the documents' concatenated tokens."""
    tokens = np.concatenate(documents).astype(np.int64)
    n = (len(tokens) - 1) // seq_length
    return np.stack([tokens[i * seq_length : (i + 1) * seq_length + 1] for i in range(n)])


def corpus_samples(seq_length: int, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Windows of the embedded corpus' training (first 90%) and held-out documents."""
    from megatron.apertus.prep.corpus import training_documents

    documents = [np.array(tokenizer.encode_document(d)) for d in training_documents()]
    cut = int(round(len(documents) * 0.9))
    return windows(documents[:cut], seq_length), windows(documents[cut:], seq_length)


def token_file_samples(prefix: str, seq_length: int) -> np.ndarray:
    """Windows of the documents of a ``tools/preprocess_data.py`` output prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return windows([np.array(dataset[i]) for i in range(len(dataset))], seq_length)


class Layout:
    """A window batch as the models take it: ``[b, s]`` rows with causal attention, or (packed
    documents) one ``[1, b*s]`` sequence whose attention and positions restart after each end
    of document (``data/batches.py``)."""

    def __init__(self, window: np.ndarray, eod: int | None) -> None:
        from megatron.apertus.data.batches import BatchConfig, collate

        window = torch.from_numpy(window)
        samples = [
            {"tokens": w[:-1], "labels": w[1:], "loss_mask": torch.ones(len(w) - 1)} for w in window
        ]
        config = BatchConfig(eod=-1 if eod is None else eod, pack_documents=eod is not None)
        self.batch = collate(samples, config)
        self.shape = tuple(window[:, 1:].shape)  # [b, s]

    def forward(self, model, **kwargs) -> torch.Tensor:
        """The model's output on this batch (kwargs: labels, loss_mask, teacher for the fused
        loss, in the batch's layout)."""
        batch = self.batch
        params = {"packed_seq_params": batch.packed_seq_params} if batch.packed_seq_params else {}
        return model(batch.tokens, batch.position_ids, None, **params, **kwargs)

    def log_softmax(self, model, temperature: float = 1.0) -> torch.Tensor:
        """[b, s, V] next-token log-probabilities of the logits divided by ``temperature``."""
        logits = self.forward(model).float()
        return torch.log_softmax(logits / temperature, -1).reshape(*self.shape, -1)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` in the batch's layout."""
        return t.reshape(*self.batch.tokens.shape, *t.shape[2:])

    @property
    def labels(self) -> torch.Tensor:
        return self.batch.labels.reshape(self.shape)


def teacher_logprobs(teacher, layout: Layout, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return layout.log_softmax(teacher, temperature)


def topk_targets(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = logprobs.topk(k, dim=-1)
    return top.indices, top.values.exp()


def sampled_targets(logprobs: torch.Tensor, draws: int, first_position: int, seed: int):
    """(ids [b, s, draws], weights count / draws (0 for the padding ids)) and the draws of a
    store made with ``--sampling-seed seed``."""
    from megatron.apertus import parallel
    from megatron.apertus.model.topk import global_samples

    b, s, v = logprobs.shape
    uniforms = np.stack(
        [logit_store.draw_uniforms(seed, first_position + i, s, draws) for i in range(b)]
    )
    drawn = global_samples(
        logprobs.reshape(-1, v),
        torch.from_numpy(uniforms.reshape(-1, draws)),
        group=parallel.process_groups().tp,
    )
    counts = torch.zeros(b * s, v).scatter_add_(1, drawn.long(), torch.ones(drawn.shape))
    top = counts.topk(draws, dim=-1)  # distinct ids, the drawn ones first, then zero weights
    shape = (b, s, draws)
    return top.indices.view(shape), (top.values / draws).view(shape), drawn.view(shape)


def teacher_spread(logprobs: torch.Tensor) -> dict:
    """How flat the teacher's next-token distributions are: their mean entropy and the mass of
    their 12 most likely ids. The flatter, the more draws a sampled store needs for the same
    noise."""
    p = logprobs.exp()
    return {
        "teacher_entropy_nats": float(-(p * logprobs).sum(-1).mean()),
        "teacher_top12_mass": float(p.topk(12, dim=-1).values.sum(-1).mean()),
    }


def draws_for(logprobs: torch.Tensor, distinct: float, seed: int) -> int:
    """The smallest draw count whose targets have >= ``distinct`` distinct ids per token."""
    for draws in range(int(distinct), 4096):
        _, weights, _ = sampled_targets(logprobs, draws, 0, seed)
        if (weights > 0).sum(-1).float().mean() >= distinct:
            return draws
    raise SystemExit(f"no draw count up to 4096 gives {distinct} distinct ids per token")


def student_loss(student, layout: Layout, mode: str, target) -> torch.Tensor:
    """Mean per-token loss of ``mode`` (``target``: teacher ids/weights or log-probabilities)."""
    from megatron.apertus.model.fused_loss import TeacherTargets

    labels = layout.labels
    if mode == "full KD (online)":
        logq = layout.log_softmax(student)
        kl = (target.exp() * (target - logq)).sum(-1)
        ce = -logq.gather(-1, labels[..., None]).squeeze(-1)
        return (ALPHA * kl + (1 - ALPHA) * ce).mean()
    teacher = None
    if mode != "cross-entropy":
        tail = "ignore" if mode.startswith("sampled") else topk_tail(mode)
        teacher = TeacherTargets(layout.rows(target[0]), layout.rows(target[1]), ALPHA, tail)
    batch = layout.batch
    loss_sum = layout.forward(
        student, labels=batch.labels, loss_mask=batch.loss_mask, teacher=teacher
    )
    return loss_sum / labels.numel()


def held_out(
    model, samples: np.ndarray, batch: int, eod: int | None, temperature: float = 1.0
) -> tuple[float, float]:
    """Mean cross-entropy and expected calibration error of the top-1 next-token probability."""
    losses, confidence, correct = [], [], []
    with torch.no_grad():
        for start in range(0, len(samples), batch):
            layout = Layout(samples[start : start + batch], eod)
            labels = layout.labels
            logq = layout.log_softmax(model, temperature)
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
        k = topk_k(mode)
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


def topk_k(mode: str) -> int:
    """k of a ``top-k K [TAIL]`` mode."""
    return int(mode.split()[1])


def topk_tail(mode: str) -> str:
    """``--kd-tail`` of a ``top-k K [TAIL]`` mode (``label`` unless named)."""
    words = mode.split()
    return words[2] if len(words) > 2 else "label"


def target_of(mode: str, logprobs: torch.Tensor, draws: int, first_position: int, seed: int):
    """(the student's target of ``mode``, the draws of a sampled store or None)."""
    if mode.startswith("top-k"):
        return topk_targets(logprobs, topk_k(mode)), None
    if mode.startswith("sampled"):
        ids, weights, drawn = sampled_targets(logprobs, draws, first_position, seed)
        return (ids, weights), drawn
    return logprobs, None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--teacher-checkpoint", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--distinct", type=float, default=12.0)
    parser.add_argument(
        "--lr-wsd-decay-iters",
        type=int,
        default=0,
        help="the last N steps cool the learning rate down to 0 (1-sqrt); 0: constant",
    )
    parser.add_argument(
        "--teacher-temperature",
        type=float,
        default=1.0,
        help="divide the teacher's logits by T before every target and the teacher's held-out "
        "figures: T < 1 sharpens a weak teacher towards an LLM's next-token entropy",
    )
    parser.add_argument(
        "--sampling-seed",
        type=int,
        default=0,
        help="seed of the sampled student's draws (generate_teacher_logits.py --sampling-seed)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="the students to train (default: all); the step-time ratio needs ce",
    )
    parser.add_argument("--held-out-samples", type=int, default=64)
    parser.add_argument("--train-data-path", help="token files the students train on (prefix)")
    parser.add_argument("--valid-data-path", help="held-out token files (prefix)")
    parser.add_argument(
        "--reset-attention-mask", action="store_true", help="pack documents in every forward"
    )
    parser.add_argument("--device", choices=["cpu"], default="cpu")
    parser.add_argument(
        "--name", default="kd_estimators", help="results file: bench/results/NAME_<device>.json"
    )
    args = parser.parse_args()
    if (args.train_data_path is None) != (args.valid_data_path is None):
        parser.error("give both --train-data-path and --valid-data-path, or neither")
    if args.teacher_temperature <= 0:
        parser.error(f"--teacher-temperature must be positive, not {args.teacher_temperature}")
    return args


def wsd_schedule(optimizer: torch.optim.Optimizer, lr: float, steps: int, decay_steps: int):
    """Constant ``lr``, then over the last ``decay_steps`` steps 1 - sqrt down to 0: the
    trainer's own scheduler with ``--lr-decay-style WSD --lr-wsd-decay-iters decay_steps``,
    one sample a step."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron.apertus.optim.param_scheduler import build_scheduler
    from megatron.apertus.optim.schedule import ScheduleConfig

    schedule = (
        ScheduleConfig(lr_decay_style="WSD", lr_wsd_decay_iters=decay_steps)
        if decay_steps
        else ScheduleConfig()
    )
    config = OptimizerConfig(lr=lr, min_lr=0.0, weight_decay=0.0)
    return build_scheduler(optimizer, schedule, config, global_batch_size=1, train_iters=steps)


def main() -> None:
    args = parse_args()
    from megatron.apertus import parallel
    from megatron.apertus.checkpoint import load_model, load_model_config
    from megatron.apertus.model import ParallelConfig
    from megatron.apertus.model.builder import build_model
    from megatron.apertus.model.config import preset
    from megatron.apertus.tokenizer.tokenizers import build_tokenizer

    teacher_config = load_model_config(args.teacher_checkpoint)
    seq = teacher_config.seq_length
    student_config = preset("tiny", seq_length=seq)
    layout = ParallelConfig()
    parallel.initialize(layout, device="cpu", seed=0, model=teacher_config)
    (teacher,) = build_model(teacher_config, layout, use_cpu_initialization=True)
    load_model(args.teacher_checkpoint, [teacher])
    teacher.eval()
    tokenizer = build_tokenizer("TekkenTokenizer")
    eod = tokenizer.eod if args.reset_attention_mask else None
    if args.train_data_path:
        train = token_file_samples(args.train_data_path, seq)
        valid = token_file_samples(args.valid_data_path, seq)
    else:
        train, valid = corpus_samples(seq, tokenizer)
    valid = valid[: args.held_out_samples]
    first = teacher_logprobs(teacher, Layout(train[: args.batch], eod), args.teacher_temperature)
    draws = draws_for(first, args.distinct, args.sampling_seed)
    spread = teacher_spread(first)
    del first
    modes = [MODES[key] or f"sampled {draws} draws" for key in args.modes]
    teacher_loss, teacher_ece = held_out(teacher, valid, args.batch, eod, args.teacher_temperature)
    print(
        f"{len(train)} training, {len(valid)} held-out samples of {seq} tokens; "
        f"sampled: {draws} draws per token; teacher: held-out {teacher_loss:.4f}, "
        f"ECE {teacher_ece:.4f}; next-token entropy {spread['teacher_entropy_nats']:.2f} nats, "
        f"top-12 mass {spread['teacher_top12_mass']:.2f} (first batch)",
        flush=True,
    )
    students, optimizers = {}, {}
    for mode in modes:  # the same initialisation for every student
        torch.manual_seed(0)
        (students[mode],) = build_model(
            student_config, layout, fused_loss=True, use_cpu_initialization=True
        )
        optimizers[mode] = torch.optim.AdamW(
            students[mode].parameters(), lr=args.lr, weight_decay=0.0
        )
    schedulers = {
        mode: wsd_schedule(optimizer, args.lr, args.steps, args.lr_wsd_decay_iters)
        for mode, optimizer in optimizers.items()
    }
    times = {mode: [] for mode in modes}
    sizes = {mode: [] for mode in modes}
    distinct = []
    for step in range(args.steps):
        start = step * args.batch % (len(train) - args.batch)
        batch = Layout(train[start : start + args.batch], eod)
        logprobs = teacher_logprobs(teacher, batch, args.teacher_temperature)
        for mode in modes:
            target, drawn = target_of(mode, logprobs, draws, start, args.sampling_seed)
            if drawn is not None:
                distinct.append(float((target[1] > 0).sum(-1).float().mean()))
            if step < 4:
                sizes[mode].append(store_bytes(mode, logprobs, drawn))
            began = time.perf_counter()
            optimizers[mode].zero_grad(set_to_none=True)
            student_loss(students[mode], batch, mode, target).backward()
            optimizers[mode].step()
            schedulers[mode].step(1)
            times[mode].append(time.perf_counter() - began)
        print(f"step {step + 1}/{args.steps}", flush=True)
    rows = []
    for mode in modes:
        loss, ece = held_out(students[mode], valid, args.batch, eod)
        row = {
            "mode": mode,
            "held_out_loss": loss,
            "ece": ece,
            "bytes_per_token": statistics.mean(sizes[mode]),
            "step_s": statistics.median(times[mode][1:] or times[mode]),
        }
        if mode.startswith("sampled"):
            row["distinct_ids_per_token"] = statistics.mean(distinct)
        rows.append(row)
        print(
            f"{mode:22s} held-out {loss:.4f}  ECE {ece:.4f}  {row['bytes_per_token']:7.1f} "
            f"B/token  step {row['step_s'] * 1e3:.0f} ms",
            flush=True,
        )
    ce_step = next((row["step_s"] for row in rows if row["mode"] == MODES["ce"]), None)
    for row in rows:
        if ce_step:
            row["step_vs_ce"] = row["step_s"] / ce_step
    parallel.shutdown()
    extra = {
        "teacher_checkpoint": args.teacher_checkpoint,
        "teacher_held_out_loss": teacher_loss,
        "teacher_ece": teacher_ece,
        "train_data_path": args.train_data_path or "embedded corpus",
        "valid_data_path": args.valid_data_path or "embedded corpus",
        "reset_attention_mask": args.reset_attention_mask,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "lr_wsd_decay_iters": args.lr_wsd_decay_iters,
        "teacher_temperature": args.teacher_temperature,
        "draws": draws,
        "sampling_seed": args.sampling_seed,
        **spread,
    }
    print(f"wrote {write_results(args.name, rows, extra)}")


if __name__ == "__main__":
    main()
