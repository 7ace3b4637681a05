"""Teacher top-k logit storage on real teacher logits: size, speed and error of three formats.

    python bench/bench_logit_storage.py [--teacher-checkpoint SAVE_DIR] [--k 256] [--device cuda]
        [--draws 12 32]

The teacher runs over held-out real text (the last 10% of the embedded corpus's documents,
the demo's validation split, tokenized with tekken) cut into samples of its sequence length;
its log_softmax + topk(k) are the exact values. Without ``--teacher-checkpoint`` it is the
demo's teacher (``runs/demo/teacher``, written by ``make demo``). Formats, compared in one run
on the same logits, one core:

* ``ours``: ``megatron.apertus.distill.logit_codec`` (rank-coded id differences, sqrt-grid
  probabilities, zstd) wrapped as a block file with its checksums;
* ``seed (fp32 probs + int32 ids, gzip)``: the Apertus-v1.1 paper's format, gzip level 6;
* ``fp16 logprobs + 17-bit ids, zstd 3``: NVIDIA Megatron-LM PR 5019's format.

Each encodes all tokens as one block (the held-out text is smaller than a 131k-token block)
and decodes to what training consumes: int64 ids and float32 probabilities. Speeds are tokens
per CPU-second of the one thread that runs the format (median of ``--repeat``), which stays
meaningful on a machine shared with other jobs. KL is KL(p || p')
per token between the exact and the decoded top-k distributions, both renormalised over the
top-k ids; ``mass_err_max`` is the largest error of a row's top-k mass S. The store rows
time the real file path (``LogitStoreWriter.write_block`` with fsync, ``LogitStoreReader.read``
with crc checks). The sampled rows store, for the same tokens, ``--draws`` ids drawn from the
teacher's full distribution (``--sampling random``), through the same file path.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
import zstandard
from _common import write_results

from megatron.apertus.distill import logit_store
from megatron.apertus.distill.logit_codec import BlockDecoder, encode_block

REPO = Path(__file__).resolve().parents[1]
DEMO_TEACHER = REPO / "runs" / "demo" / "teacher"
VALID_SHARE = 0.1  # the demo's --split 90,10,0
VOCAB = 131072  # tekken


# -- the teacher and its logits -----------------------------------------------------------------


def teacher_checkpoint(path: str | None) -> Path:
    """The given checkpoint, or the demo's teacher (``make demo`` writes it)."""
    checkpoint = Path(path) if path else DEMO_TEACHER
    if not (checkpoint / "latest_checkpointed_iteration.txt").is_file():
        raise SystemExit(
            f"{checkpoint}: no checkpoint here; run `make demo` first "
            "or pass --teacher-checkpoint SAVE_DIR"
        )
    return checkpoint


def held_out_samples(seq_length: int) -> np.ndarray:
    """int64 [n, seq_length]: the held-out documents as ``<s> text </s>``, concatenated."""
    from megatron.apertus.prep.corpus import training_documents
    from megatron.apertus.tokenizer.tokenizers import build_tokenizer

    documents = training_documents()
    held_out = documents[int(round(len(documents) * (1 - VALID_SHARE))) :]
    tokenizer = build_tokenizer("TekkenTokenizer")
    tokens = np.concatenate([tokenizer.encode_document(d) for d in held_out]).astype(np.int64)
    n = len(tokens) // seq_length
    return tokens[: n * seq_length].reshape(n, seq_length)


def teacher_topk(
    checkpoint: Path, k: int, device: str, draws: int, batch: int = 8
) -> tuple[np.ndarray, ...]:
    """(tokens [n, T], ids int64 [n, T, k], logprobs float32 [n, T, k], sampled int64
    [n, T, draws]) of the fp32 teacher; the draws as the generator makes them (inverse CDF at
    ``draw_uniforms`` of seed 0 and each sample's index)."""
    from megatron.apertus import parallel
    from megatron.apertus.checkpoint import load_model, load_model_config
    from megatron.apertus.model import ParallelConfig
    from megatron.apertus.model.builder import build_model
    from megatron.apertus.model.topk import global_samples

    model = load_model_config(checkpoint)
    layout = ParallelConfig()
    parallel.initialize(layout, device=device, seed=0, model=model)
    try:
        (chunk,) = build_model(
            model, layout, use_cpu_initialization=device == "cpu", perform_initialization=False
        )
        load_model(checkpoint, [chunk])
        chunk.eval()
        tokens = held_out_samples(model.seq_length)
        ids, logprobs, sampled = [], [], []
        positions = torch.arange(model.seq_length, device=device).unsqueeze(0)
        with torch.no_grad():
            for start in range(0, len(tokens), batch):
                x = torch.from_numpy(tokens[start : start + batch]).to(device)
                logits = chunk(x, positions.expand(len(x), -1), None).float()
                top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                ids.append(top.indices.cpu().numpy())
                logprobs.append(top.values.cpu().numpy())
                uniforms = np.stack(
                    [
                        logit_store.draw_uniforms(0, p, model.seq_length, draws)
                        for p in range(start, start + len(x))
                    ]
                )
                drawn = global_samples(
                    logits.reshape(-1, logits.shape[-1]),
                    torch.from_numpy(uniforms.reshape(-1, draws)).to(device),
                    group=chunk.pg_collection.tp,
                )
                sampled.append(drawn.view(len(x), model.seq_length, draws).long().cpu().numpy())
        return tokens, np.concatenate(ids), np.concatenate(logprobs), np.concatenate(sampled)
    finally:
        parallel.shutdown()


# -- the three formats --------------------------------------------------------------------------

Decoded = tuple[np.ndarray, np.ndarray]  # ids int64 [rows, k], probs float32 [rows, k]


def seed_encode(ids: np.ndarray, logprobs: np.ndarray) -> bytes:
    raw = np.exp(logprobs).astype(np.float32).tobytes() + ids.astype(np.int32).tobytes()
    return gzip.compress(raw, compresslevel=6)


def seed_decode(data: bytes, rows: int, k: int) -> Decoded:
    raw = gzip.decompress(data)
    probs = np.frombuffer(raw, np.float32, rows * k).reshape(rows, k)
    ids = np.frombuffer(raw, np.int32, rows * k, 4 * rows * k).reshape(rows, k)
    return ids.astype(np.int64), probs


def nvidia_encode(ids: np.ndarray, logprobs: np.ndarray) -> bytes:
    """fp16 log-probabilities, ids as uint16 low bits + one packed bit 16, zstd level 3."""
    ids = ids.astype(np.int64).ravel()
    raw = (
        logprobs.astype(np.float16).tobytes()
        + (ids & 0xFFFF).astype(np.uint16).tobytes()
        + np.packbits((ids >> 16).astype(np.uint8)).tobytes()
    )
    return zstandard.ZstdCompressor(level=3).compress(raw)


def nvidia_decode(data: bytes, rows: int, k: int) -> Decoded:
    n = rows * k
    raw = zstandard.ZstdDecompressor().decompress(data)
    logprobs = np.frombuffer(raw, np.float16, n)
    low = np.frombuffer(raw, np.uint16, n, 2 * n)
    high = np.unpackbits(np.frombuffer(raw, np.uint8, -(-n // 8), 4 * n), count=n)
    ids = low.astype(np.int64) | (high.astype(np.int64) << 16)
    return ids.reshape(rows, k), np.exp(logprobs.astype(np.float32)).reshape(rows, k)


def ours_encode(ids: np.ndarray, logprobs: np.ndarray, header: logit_store.StoreHeader) -> bytes:
    """One block file's bytes (tables, frames, crc32s, digest), as the writer stores it."""
    n = header.num_samples
    encoded = encode_block(
        ids, logprobs, samples=n, vocab_size=header.vocab_size, params=header.codec
    )
    return logit_store.block_bytes(0, header, np.zeros(n, np.uint64), encoded)


def ours_decode(data: bytes, header: logit_store.StoreHeader) -> Decoded:
    """Parse and check the block's metadata and every sample's crc32, decode every sample."""
    view = memoryview(data)
    read = lambda offset, size: bytes(view[offset : offset + size])  # noqa: E731
    meta = logit_store.parse_meta(read, len(data), Path("<memory>"), 0, header)
    decoder = BlockDecoder(
        meta.tables, meta.table_size, positions=header.seq_length, k=header.k, levels=header.levels
    )
    shape = (header.num_samples, header.seq_length, header.k)
    ids, probs = np.empty(shape, np.int64), np.empty(shape, np.float32)
    for s, entry in enumerate(meta.directory):
        payload = view[int(entry["offset"]) : int(entry["offset"] + entry["length"])]
        logit_store.check_crc(payload, entry, meta, s)
        sizes = (int(entry["frame_sizes"][0]), int(entry["frame_sizes"][1]))
        decoder.decode(payload, sizes, int(entry["escapes"]), ids[s], probs[s])
    return ids.reshape(-1, header.k), probs.reshape(-1, header.k)


# -- measurements -------------------------------------------------------------------------------


def kl_per_token(ids: np.ndarray, logprobs: np.ndarray, decoded: Decoded) -> dict:
    """KL(p || p') of the renormalised exact and decoded top-k rows (ids aligned by sorting),
    and the largest error of a row's top-k mass."""
    ids_d, probs_d = decoded
    order, order_d = np.argsort(ids, axis=1), np.argsort(ids_d, axis=1)
    if not (np.take_along_axis(ids, order, 1) == np.take_along_axis(ids_d, order_d, 1)).all():
        raise AssertionError("decoded ids differ from the exact ids")
    t = np.exp(np.take_along_axis(logprobs, order, 1).astype(np.float64))
    t_d = np.take_along_axis(probs_d, order_d, 1).astype(np.float64)
    mass, mass_d = t.sum(1), t_d.sum(1)
    p, p_d = t / mass[:, None], t_d / mass_d[:, None]
    with np.errstate(divide="ignore"):
        kl = np.where(p > 0, p * (np.log(p) - np.log(p_d)), 0.0).sum(1)
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "mass_err_max": float(np.abs(mass - mass_d).max()),
    }


def cpu_seconds(fn: Callable[[], object]) -> tuple[float, object]:
    """CPU seconds of this thread for one call, and its result. Every format runs single-threaded
    in the calling thread, so its thread CPU time is its cost on one core, also on a machine
    shared with other jobs (wall time there measures the neighbours)."""
    start = time.thread_time()
    result = fn()
    return time.thread_time() - start, result


class Format(NamedTuple):
    name: str
    encode: Callable[[np.ndarray, np.ndarray], bytes]
    decode: Callable[[bytes], Decoded]


def compare(data: str, ids3: np.ndarray, logprobs3: np.ndarray, repeat: int) -> list[dict]:
    """The three formats on the same [n, T, k] logits, all n samples as one block. The repeats
    go round the formats (median per format), so a change in the machine's load hits all alike."""
    n, seq_length, k = ids3.shape
    ids, logprobs = ids3.reshape(-1, k), logprobs3.reshape(-1, k)
    rows = len(ids)
    header = logit_store.StoreHeader(
        k=k,
        vocab_size=VOCAB,
        seq_length=seq_length,
        num_samples=n,
        samples_per_block=n,
        teacher="bench",
        dataset_hash="bench",
    )
    print(
        f"{data}: {n} samples x {seq_length} tokens, k={k}; top-1 probability mean "
        f"{np.exp(logprobs[:, 0]).mean():.3f}, top-k mass mean "
        f"{np.exp(logprobs).sum(1).mean():.3f}, "
        f"{len(np.unique(ids))} distinct ids"
    )
    formats = [
        Format("ours", lambda i, l: ours_encode(i, l, header), lambda b: ours_decode(b, header)),
        Format(
            "seed (fp32 probs + int32 ids, gzip 6)", seed_encode, lambda b: seed_decode(b, rows, k)
        ),
        Format(
            "fp16 logprobs + 17-bit ids, zstd 3", nvidia_encode, lambda b: nvidia_decode(b, rows, k)
        ),
    ]
    times = {f.name: ([], []) for f in formats}
    blobs, decoded = {}, {}
    for _ in range(repeat):
        for f in formats:
            seconds, blobs[f.name] = cpu_seconds(lambda: f.encode(ids, logprobs))
            times[f.name][0].append(seconds)
            seconds, decoded[f.name] = cpu_seconds(lambda: f.decode(blobs[f.name]))
            times[f.name][1].append(seconds)
    results = []
    for f in formats:
        enc, dec = (statistics.median(t) for t in times[f.name])
        row = {
            "data": data,
            "format": f.name,
            "tokens": rows,
            "k": k,
            "bytes": len(blobs[f.name]),
            "bytes_per_token": len(blobs[f.name]) / rows,
            "encode_tokens_per_s": rows / enc,
            "decode_tokens_per_s": rows / dec,
            **kl_per_token(ids, logprobs, decoded[f.name]),
        }
        print(
            f"{f.name:38s} {row['bytes_per_token']:7.1f} B/token"
            f"  enc {row['encode_tokens_per_s']:9,.0f}"
            f"  dec {row['decode_tokens_per_s']:9,.0f} tokens/s  KL mean {row['kl_mean']:.2e}"
            f" max {row['kl_max']:.2e}",
            flush=True,
        )
        results.append(row)
    speedup = results[0]["decode_tokens_per_s"] / results[1]["decode_tokens_per_s"]
    results[0]["decode_speedup_vs_gzip"] = speedup
    print(f"decode speed-up of ours over the gzip format: {speedup:.1f}x", flush=True)
    return results


def synthetic_stress(
    samples: int, seq_length: int, k: int, seed: int = 0
) -> tuple[np.ndarray, ...]:
    """Harder than a real teacher for the id coding: each row's ids are a Gumbel-top-k draw from a
    Zipf(1.1) popularity over the whole vocabulary (randomly permuted), so nearly every id occurs
    and rows share little; values are peaked (top-1 ~0.5) with a top-k mass between 0.05 and 1."""
    rng = np.random.default_rng(seed)
    rows = samples * seq_length
    popularity = rng.permutation(-1.1 * np.log(np.arange(1, VOCAB + 1))).astype(np.float32)
    ids, logprobs = np.empty((rows, k), np.int64), np.empty((rows, k), np.float32)
    for start in range(0, rows, 256):
        m = min(256, rows - start)
        noisy = popularity + 2 * rng.gumbel(size=(m, VOCAB)).astype(np.float32)
        ids[start : start + m] = np.argpartition(-noisy, k, axis=1)[:, :k]
        logits = -np.sort(-rng.standard_normal((m, k)) * 2.5, axis=1)
        logits[:, 0] += rng.exponential(3.0, m)
        log_mass = np.log(rng.uniform(0.05, 1.0, m))
        logits -= np.log(np.exp(logits).sum(1, keepdims=True)) - log_mass[:, None]
        logprobs[start : start + m] = logits
    return ids.reshape(samples, seq_length, k), logprobs.reshape(samples, seq_length, k)


def store_path(tokens, ids, logprobs, header: logit_store.StoreHeader, repeat: int) -> dict:
    """The real file path: write_block (atomic, fsync) and read (crc checks) of one block."""
    keys = np.array([logit_store.sample_key(t) for t in tokens], dtype=np.uint64)
    write, read = [], []
    with tempfile.TemporaryDirectory() as tmp:
        writer = logit_store.LogitStoreWriter(tmp, header)
        for _ in range(repeat):
            write.append(cpu_seconds(lambda: writer.write_block(0, keys, ids, logprobs))[0])
        writer.finalize()
        size = logit_store.block_path(tmp, 0).stat().st_size
        reader = logit_store.LogitStoreReader(tmp)
        for _ in range(repeat):
            read.append(cpu_seconds(lambda: reader.read(range(header.num_samples)))[0])
    rows = ids.shape[0] * ids.shape[1]
    enc, dec = statistics.median(write), statistics.median(read)
    print(
        f"{'ours, store files (write_block / read)':38s} enc {rows / enc:10,.0f}  dec "
        f"{rows / dec:10,.0f} tokens/s",
        flush=True,
    )
    return {
        "format": "ours, store files (write_block / read)",
        "tokens": rows,
        "bytes_per_token": size / rows,
        "encode_tokens_per_s": rows / enc,
        "decode_tokens_per_s": rows / dec,
    }


def sampled_store_path(tokens, draws: np.ndarray, label: str, repeat: int) -> dict:
    """A sampled store (``--sampling random``) of the same tokens: bytes, distinct ids per
    token, write_sampled_block / read speed through the real files."""
    n, seq_length, samples = draws.shape
    header = logit_store.StoreHeader(
        k=samples,
        vocab_size=VOCAB,
        seq_length=seq_length,
        num_samples=n,
        samples_per_block=n,
        teacher="bench",
        dataset_hash="bench",
        kind="sampled",
        seed=0,
    )
    keys = np.array([logit_store.sample_key(t) for t in tokens], dtype=np.uint64)
    write, read = [], []
    with tempfile.TemporaryDirectory() as tmp:
        writer = logit_store.LogitStoreWriter(tmp, header)
        for _ in range(repeat):
            write.append(cpu_seconds(lambda: writer.write_sampled_block(0, keys, draws))[0])
        writer.finalize()
        size = logit_store.block_path(tmp, 0).stat().st_size
        reader = logit_store.LogitStoreReader(tmp)
        for _ in range(repeat):
            seconds, batch = cpu_seconds(lambda: reader.read(range(n)))
            read.append(seconds)
    rows = n * seq_length
    distinct = float((batch.probs > 0).sum(-1).float().mean())
    enc, dec = statistics.median(write), statistics.median(read)
    name = f"sampled, {samples} draws (store files)"
    print(
        f"{name:38s} {size / rows:7.1f} B/token  enc {rows / enc:9,.0f}  dec {rows / dec:9,.0f}"
        f" tokens/s  {distinct:.1f} distinct ids/token",
        flush=True,
    )
    return {
        "data": label,
        "format": name,
        "tokens": rows,
        "draws": samples,
        "distinct_ids_per_token": distinct,
        "bytes_per_token": size / rows,
        "encode_tokens_per_s": rows / enc,
        "decode_tokens_per_s": rows / dec,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--teacher-checkpoint", help="save dir of pretrain_gpt.py (default: demo teacher)"
    )
    parser.add_argument("--k", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--draws",
        type=int,
        nargs="+",
        default=[12, 32],
        help="draws per token of the sampled stores (one row each)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the teacher runs (the formats always run on one CPU core)",
    )
    parser.add_argument(
        "--stress-samples", type=int, default=64, help="0: no synthetic stress case"
    )
    args = parser.parse_args()
    checkpoint = teacher_checkpoint(args.teacher_checkpoint)
    torch.set_num_threads(2)
    tokens, ids, logprobs, sampled = teacher_topk(checkpoint, args.k, args.device, max(args.draws))
    torch.set_num_threads(1)  # the formats are compared on one core
    label = f"teacher {checkpoint} on held-out text"
    rows = compare(label, ids, logprobs, args.repeat)
    n, seq_length, k = ids.shape
    header = logit_store.StoreHeader(
        k=k,
        vocab_size=VOCAB,
        seq_length=seq_length,
        num_samples=n,
        samples_per_block=n,
        teacher=str(checkpoint),
        dataset_hash="bench",
    )
    rows.append({"data": label, **store_path(tokens, ids, logprobs, header, args.repeat)})
    for draws in args.draws:  # the first ``draws`` of each token's are a store of that size
        rows.append(
            sampled_store_path(
                tokens, np.ascontiguousarray(sampled[..., :draws]), label, args.repeat
            )
        )
    if args.stress_samples:
        stress = synthetic_stress(args.stress_samples, seq_length, k)
        rows += compare("synthetic stress (near-uniform id sets)", *stress, args.repeat)
    extra = {"teacher_checkpoint": str(checkpoint), "held_out_tokens": int(n * seq_length)}
    print(f"wrote {write_results('logit_storage', rows, extra)}")


if __name__ == "__main__":
    main()
