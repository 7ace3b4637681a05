"""Context parallelism end to end: gloo processes at CP=2 and CP=4 reproduce one process's run
of the same steps from the same initial checkpoint.

What is compared, against the one-process run of the same flags:

* every step's loss (RTOL) and gradient norm (GRAD_NORM_RTOL), the validation loss, and that the
  steps move the loss by far more than the tolerance (so equality proves something);
* every parameter's gradient of the first step, element by element on every rank
  (tests/parallel/grad_worker.py; GRAD_TOL relative to the parameter's largest gradient); under
  tensor parallelism, each weight put back together from its TP shards along megatron-core's
  ``partition_dim`` (the shards in the other order miss: a control of the gather), the
  replicated parameters the same bits on every TP rank.

For: unpacked samples at CP=2 (``p2p``, ``a2a``), CP=4 (``p2p``), hierarchical CP=4
(``a2a+p2p`` over 2 x 2: all-to-all within pairs, ring over the pairs) and a per-layer
comm-type list; packed documents with Goldfish (CP=2 ``p2p``, CP=4 ``a2a``, hierarchical);
distillation from stored top-k and sampled teacher logits, int4 QAD and SFT loss masks on packed
chats, each at CP=2 ``p2p`` and CP=4 ``a2a`` (the tiny model's 4 heads, one per rank); top-k
distillation at hierarchical CP=4; unpacked samples at CP=2 x TP=2. QAD compares its first step
only (see its test).

Negative controls: for pretraining, top-k, sampled, QAD and SFT, a CP=2 run whose gradients and
loss sums leave out the context-parallel ranks fails the same first-step comparisons; so does
pretraining at CP=2 x TP=2.

Checkpoints and teacher logits: a run saved at CP=2 resumes at CP=1 and CP=4 on the
uninterrupted trajectory; teacher logits generated at CP=2 with ``a2a`` are the same bytes as at
CP=1 (top-k and sampled, packed or not); with ``p2p`` they are not (the ring sums the attention in
another order), and what differs is bounded: sampled stores share over 99.9% of their draws, top-k
stores have the same ids and every probability within one step of the codec's grid.

Tolerances as tests/parallel/test_layout_parity.py: CP changes only the order of the attention's
sums (the ring merges per-block softmaxes) and of the loss and gradient reductions.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from examples.chat_demo import docstring_conversations
from megatron.apertus.distill.logit_store import LogitStoreReader
from tests.conftest import (
    PRETRAIN,
    REPO,
    SMALL_TOKENIZER_FLAGS,
    SMALL_VOCABULARY,
    read_json,
    run_entry,
    series,
)

GENERATE = REPO / "tools" / "generate_teacher_logits.py"
GRAD_WORKER = REPO / "tests" / "parallel" / "grad_worker.py"
CHAT_TOOL = REPO / "tools" / "preprocess_chat.py"
COMMON = [
    "--model-preset",
    "tiny",
    "--seed",
    "7",
    "--lr",
    "3e-3",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
    "--log-interval",
    "1",
    "--adam-eps",
    "1e-4",
    "--seq-length",
    "64",
    "--device",
    "cpu",
    # Context-parallel shares of packed or masked micro-batches hold different numbers of loss
    # tokens: without it each rank's share is averaged over its own count (Megatron-LM's
    # default), which no one-process run computes (tests/training/test_per_token_loss.py).
    "--calculate-per-token-loss",
    *SMALL_VOCABULARY,
]
STEPS = 3
RTOL = 2e-6
GRAD_NORM_RTOL = 5e-4
GRAD_TOL = 2e-6
"""Largest difference of a first-step gradient element, relative to the largest magnitude of its
parameter's gradient: fp32 round-off of sums in another order (the attention's softmax merges,
the loss and the gradient reductions over CP ranks). Measured, largest over every parameter and
rank: 1.0e-6 at p2p CP=4; 9e-7 at a2a+p2p 2 x 2 and at p2p CP=2 (pretraining, top-k, SFT); 8e-7
sampled, 7e-7 QAD; 6.3e-7 at CP=2 x TP=2 (its whole weights put back together from the TP
shards); a2a at most 5.3e-7; largest absolute difference 3.0e-8. The negative controls (no
reduction over the CP ranks) miss by 0.41-0.79; the TP shards put together in the other order
by 0.79 or more."""
SCALAR_GRAD_TOL = 1e-4
"""The same for one-number parameters (xIELU's alphas): each is a sum over every token and
feature of its layer that cancels to ~4e-7, so the same ~1e-11 of round-off is 2e-5 of it, as
much at p2p CP=2 as at a2a+p2p 2 x 2 (largest measured: 2.1e-5, a per-layer comm-type list)."""
HIERARCHICAL = ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"]
HIER = HIERARCHICAL + ["--cp-comm-type", "a2a+p2p"]
PER_LAYER = HIERARCHICAL + ["--cp-comm-type", "a2a+p2p", "p2p", "a2a", "a2a+p2p"]
"""One entry per layer of the tiny model (4 layers)."""
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
GOLDFISH = ["--goldfish-loss", "--goldfish-k", "4", "--goldfish-h", "13"]
TOPK = ["--topk", "8", "--samples-per-block", "4"]
SAMPLED = ["--sampling", "random", "--samples", "16", "--samples-per-block", "4"]
GENERATION = [
    "--seed",
    "7",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "1",
    "--train-iters",
    str(STEPS),
    "--seq-length",
    "64",
    "--device",
    "cpu",
    *SMALL_TOKENIZER_FLAGS,
]
"""The runs' samples, in the order the students read them."""


def _cp(size: int, comm: str = "p2p") -> list[str]:
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The shared initial checkpoint (also the teacher of the distillation case)."""
    root = tmp_path_factory.mktemp("cp")
    run_entry(
        PRETRAIN, COMMON + ["--train-iters", "0", "--eval-iters", "0", "--save", str(root / "init")]
    )
    return root


def _run(
    root,
    name: str,
    args: list[str],
    nproc: int = 1,
    steps: int = STEPS,
    grads: bool = False,
    unreduced: bool = False,
) -> dict:
    """The run ``name`` from the initial checkpoint; with ``grads``, its first step's gradients
    too: ``["ranks"]`` as each rank wrote them (grad_worker.py), ``["grads"]`` one whole-model
    dict per tensor-parallel group (:func:`_whole_gradients`; per rank without TP); with
    ``unreduced``, the negative control: nothing is reduced over the context-parallel ranks."""
    out = root / f"{name}.json"
    flags = (
        COMMON
        + args
        + ["--train-iters", str(steps), "--load", str(root / "init"), "--log-json", str(out)]
    )
    prefix = root / f"{name}-grads"
    if grads:
        control = ["--without-cp-reduction"] if unreduced else []
        run_entry(GRAD_WORKER, [str(prefix), *control, "--", *flags], nproc=nproc)
    else:
        run_entry(PRETRAIN, flags, nproc=nproc)
    history = read_json(out)
    if grads:
        history["ranks"] = [torch.load(f"{prefix}.rank{r}.pt") for r in range(nproc)]
        history["grads"] = _whole_gradients(history["ranks"])
    return history


def _unshard(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The tensor that megatron-core split over the tensor-parallel ranks as ``shards`` (in
    TP-rank order): cut into ``stride x TP`` equal pieces along ``dim``, rank r holds pieces
    r, r + TP, r + 2 TP, ... (``_initialize_affine_weight_cpu``); stride 1 is a plain
    concatenation.

    Fused QKV weights need no regrouping: megatron-core lays ``linear_qkv``'s rows out query
    group by query group (``[q..., k, v]`` per group, ``get_query_key_value_tensors``), and each
    rank's rows are a contiguous run of whole groups (with more ranks than groups, a contiguous
    part of one group, which the attention all-gathers), so the ranks' rows in rank order are one
    process's fused rows; a checkpoint saved at TP=1 loads at TP=2 by the same contiguous split.
    Apertus's fc1 is not gated (``fc2(xIELU(fc1(x)))``): no ``[gate; up]`` halves per rank
    either. The comparison checks the order: the shards put together in the other order miss
    (:func:`_assert_shard_order_matters`)."""
    pieces = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([rank[i] for i in range(stride) for rank in pieces], dim)


def _whole_gradients(ranks: list[dict]) -> list[dict]:
    """One ``{name: gradient}`` per tensor-parallel group (rank files of grad_worker.py): a
    weight split over the group is its ranks' shards put back together along megatron-core's
    ``partition_dim`` and ``partition_stride``; any other parameter (norms, QK-norm, xIELU's
    alphas) must be the same on every rank of the group, bit for bit (each rank computes it
    from the same activations, or megatron-core sums it over the group), and is one copy."""
    groups = {tuple(rank["tp_ranks"]): [ranks[r] for r in rank["tp_ranks"]] for rank in ranks}
    whole = []
    for group in groups.values():
        first = group[0]
        grads = {}
        for name, grad in first["grads"].items():
            copies = [rank["grads"][name] for rank in group]
            if name in first["splits"]:
                grads[name] = _unshard(copies, *first["splits"][name])
            else:
                assert all(torch.equal(c, grad) for c in copies), f"{name} differs over TP"
                grads[name] = grad
        whole.append(grads)
    return whole


def _gradient_errors(got: dict, expected: dict) -> dict[str, float]:
    """Each parameter's largest first-step gradient difference over every rank (every
    tensor-parallel group), relative to the largest magnitude of one process's gradient."""
    (reference,) = expected["grads"]
    errors = dict.fromkeys(reference, 0.0)
    for grads in got["grads"]:
        assert grads.keys() == reference.keys()
        for name, want in reference.items():
            assert grads[name].shape == want.shape, name
            scale = want.abs().max().item()
            assert scale > 0, f"{name}: a zero gradient compares nothing"
            error = (grads[name] - want).abs().max().item() / scale
            errors[name] = max(errors[name], error)
    return errors


def _assert_same_gradients(got: dict, expected: dict) -> None:
    """Every rank's first-step gradient of every parameter, element by element, against one
    process's, relative to the largest magnitude of that parameter's gradient."""
    (reference,) = expected["grads"]
    for name, error in _gradient_errors(got, expected).items():
        tolerance = GRAD_TOL if reference[name].numel() > 1 else SCALAR_GRAD_TOL
        assert error < tolerance, (name, error)


def _assert_losses_move(history: dict) -> None:
    """The steps move the losses by far more than the tolerance: equality proves something."""
    steps, losses = series(history, "train/loss")
    assert steps == list(range(1, STEPS + 1))
    assert np.ptp(losses) > 100 * RTOL * abs(losses[0])


def _assert_same_run(got: dict, expected: dict, validation: bool = True) -> None:
    """Every step's loss and gradient norm, and (``validation``) the validation loss."""
    steps, losses = series(got, "train/loss")
    ref_steps, ref_losses = series(expected, "train/loss")
    assert steps == ref_steps == list(range(1, STEPS + 1))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    np.testing.assert_allclose(
        series(got, "train/grad_norm")[1],
        series(expected, "train/grad_norm")[1],
        rtol=GRAD_NORM_RTOL,
    )
    if validation:
        np.testing.assert_allclose(
            series(got, "valid/loss")[1], series(expected, "valid/loss")[1], rtol=RTOL
        )
    _assert_losses_move(expected)


def _assert_same_first_step(got: dict, expected: dict, key: str = "train/loss") -> None:
    """The first step's ``key`` (its loss by default)."""
    rtol = GRAD_NORM_RTOL if key == "train/grad_norm" else RTOL
    (got_step, *_), (got_first, *_) = series(got, key)
    (ref_step, *_), (ref_first, *_) = series(expected, key)
    assert got_step == ref_step == 1
    np.testing.assert_allclose(got_first, ref_first, rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def references(root):
    """``reference(name, args)``: the one-process run of ``args`` with its first-step gradients,
    run once for all the module's tests that compare with it."""
    runs: dict[str, dict] = {}

    def reference(name: str, args: list[str]) -> dict:
        if name not in runs:
            runs[name] = _run(root, name, args, grads=True)
        return runs[name]

    return reference


@pytest.fixture(scope="module")
def unpacked(references):
    return references("pretraining", [])


TP2 = ["--tensor-model-parallel-size", "2"]


def _assert_shard_order_matters(got: dict, expected: dict) -> None:
    """Negative control of :func:`_unshard`: every split weight's shards put together in the
    other tensor-parallel order (at TP=2 with 2 query groups: fused QKV with its groups
    swapped) miss one process's gradient by far more than the tolerance, so the comparison
    holds the gather's row and column order, not only its values."""
    flipped = [dict(rank, tp_ranks=rank["tp_ranks"][::-1]) for rank in got["ranks"]]
    errors = _gradient_errors({"grads": _whole_gradients(flipped)}, expected)
    splits = got["ranks"][0]["splits"]
    assert splits
    for name in splits:
        assert errors[name] > 100 * GRAD_TOL, (name, errors[name])


@pytest.mark.parametrize(
    "name, args, nproc",
    [
        pytest.param("cp2-p2p", _cp(2), 2, marks=pytest.mark.smoke),
        ("cp2-a2a", _cp(2, "a2a"), 2),
        ("cp4-p2p", _cp(4), 4),
        ("cp2-tp2", _cp(2) + TP2, 4),
    ],
)
def test_unpacked_context_parallel_matches_one_process(root, unpacked, name, args, nproc):
    """The losses, and every gradient element of the first step on every rank.

    CP=2 x TP=2: each tensor-parallel pair's shards of the split weights (QKV, attention
    output, fc1, fc2, embedding, output layer) are put back together along megatron-core's
    ``partition_dim`` (:func:`_whole_gradients`) and compared whole, with the shards in the
    other order as a control; the replicated parameters (norms, QK-norm, xIELU's alphas) are
    the same bits on both ranks of a pair. The vocabulary has one process's 4096 rows: the test
    tokenizer's 4096 pieces are a multiple of 128 x 2 already, so TP=2 pads none (the shapes are
    compared)."""
    got = _run(root, name, args, nproc, grads=True)
    _assert_same_run(got, unpacked)
    _assert_same_gradients(got, unpacked)
    if TP2[0] in args:
        _assert_shard_order_matters(got, unpacked)


@pytest.mark.slow
def test_context_parallel_with_pipeline_stages_matches_one_process(root, unpacked):
    args = _cp(2) + ["--pipeline-model-parallel-size", "2"]
    _assert_same_run(_run(root, "cp2-pp2", args, 4), unpacked)


@pytest.mark.parametrize(
    "name, args",
    [pytest.param("cp4-hierarchical", HIER, marks=pytest.mark.smoke), ("cp4-per-layer", PER_LAYER)],
)
def test_hierarchical_context_parallel_matches_one_process(root, unpacked, name, args):
    """a2a+p2p at 2 x 2 (and a per-layer mix of p2p, a2a and a2a+p2p): the losses, and every
    gradient element of the first step on every rank."""
    got = _run(root, name, args, 4, grads=True)
    _assert_same_run(got, unpacked)
    _assert_same_gradients(got, unpacked)


@pytest.fixture(scope="module")
def packed_goldfish(references):
    return references("packed", PACKED + GOLDFISH)


@pytest.mark.parametrize(
    "name, args, nproc", [("packed-cp2-p2p", _cp(2), 2), ("packed-cp4-a2a", _cp(4, "a2a"), 4)]
)
def test_packed_documents_with_goldfish_match_one_process(root, packed_goldfish, name, args, nproc):
    got = _run(root, name, PACKED + GOLDFISH + args, nproc, grads=True)
    _assert_same_run(got, packed_goldfish)
    _assert_same_gradients(got, packed_goldfish)


@pytest.mark.slow
def test_packed_documents_with_pipeline_stages_match_one_process(root, packed_goldfish):
    """Documents padded per CP rank make micro-batch lengths vary: the stages exchange shapes."""
    args = PACKED + GOLDFISH + _cp(2) + ["--pipeline-model-parallel-size", "2"]
    _assert_same_run(_run(root, "packed-cp2-pp2", args, 4), packed_goldfish)


def test_packed_hierarchical_context_parallel_with_goldfish_matches_one_process(
    root, packed_goldfish
):
    got = _run(root, "packed-cp4-hierarchical", PACKED + GOLDFISH + HIER, 4, grads=True)
    _assert_same_run(got, packed_goldfish)
    _assert_same_gradients(got, packed_goldfish)


def _store_digest(store) -> dict[str, str]:
    files = sorted(p for p in store.rglob("*") if p.is_file())
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def logits(root):
    """The initial checkpoint's top-k logits over the runs' samples, generated at CP=1."""
    store = root / "logits"
    run_entry(
        GENERATE, ["--load", str(root / "init"), "--logits-dir", str(store), *TOPK, *GENERATION]
    )
    return store


def test_teacher_logits_at_cp2_are_the_same_bytes(root, logits):
    store = root / "logits-cp2"
    run_entry(
        GENERATE,
        [
            "--load",
            str(root / "init"),
            "--logits-dir",
            str(store),
            *TOPK,
            *GENERATION,
            *_cp(2, "a2a"),
        ],
        nproc=2,
    )
    assert _store_digest(store) == _store_digest(logits)


def test_teacher_top_k_at_cp2_p2p_within_one_quantization_step(root, logits):
    """p2p's ring sums the attention in another order than one process: the teacher's logits
    differ by fp32 round-off, so the stored top-k ids are the same wherever the k-th and
    (k+1)-th probabilities are not tied within that round-off (here: every row), a probability
    moves by at most one step of the codec's sqrt grid (a code flips only where sqrt(p) sat on
    a bin edge; measured here: no code moves, the decoded values by 5e-7 of a step, as the
    blocks' centroids, means of their bins' probabilities, are sums in another order) and the
    top-k mass by at most one float16 rounding of 1 - S."""
    store = root / "logits-cp2-p2p"
    run_entry(
        GENERATE,
        ["--load", str(root / "init"), "--logits-dir", str(store), *TOPK, *GENERATION, *_cp(2)],
        nproc=2,
    )
    got, want = (LogitStoreReader(s) for s in (store, logits))
    positions = range(want.header.num_samples)
    rows, ref = got.read(positions), want.read(positions)
    np.testing.assert_array_equal(rows.sample_keys, ref.sample_keys)
    same_ids = (rows.ids.sort(-1).values == ref.ids.sort(-1).values).all(-1)
    assert same_ids.float().mean() > 0.999, f"{(~same_ids).sum()} rows of other ids"
    dense = [
        torch.zeros(*r.ids.shape[:2], want.header.vocab_size).scatter_(2, r.ids, r.probs)
        for r in (rows, ref)
    ]
    steps = (dense[0].sqrt() - dense[1].sqrt()).abs()[same_ids] * want.header.levels
    assert steps.max() <= 1, f"a probability moved by {steps.max():.3g} grid steps"
    # The top-k mass is stored as float16 of 1 - S: at most one rounding of it moves.
    rest = 1 - dense[1].sum(-1)[same_ids]
    mass = (dense[0].sum(-1) - dense[1].sum(-1)).abs()[same_ids]
    assert (mass <= 2**-10 * rest + 1e-6).all()


def _generate_sampled(root, name: str, args: list[str], nproc: int = 1):
    store = root / name
    run_entry(
        GENERATE,
        ["--load", str(root / "init"), "--logits-dir", str(store), *SAMPLED, *GENERATION, *args],
        nproc=nproc,
    )
    return store


def _draws(store) -> torch.Tensor:
    """Every stored position's draw weights over the vocabulary [positions, V]."""
    reader = LogitStoreReader(store)
    rows = reader.read(range(reader.header.num_samples))
    k = rows.ids.shape[-1]
    weights = torch.zeros(rows.ids.shape[0] * rows.ids.shape[1], reader.header.vocab_size)
    return weights.scatter_(1, rows.ids.reshape(-1, k), rows.probs.reshape(-1, k))


@pytest.mark.slow
def test_packed_teacher_logits_with_pipeline_stages_are_the_same_bytes(root):
    """CP=2 (a2a) x PP=2 on packed documents: the stages exchange shapes; one process's bytes."""
    stores = {}
    for name, args, nproc in (
        ("packed", [], 1),
        ("packed-cp2-pp2", _cp(2, "a2a") + ["--pipeline-model-parallel-size", "2"], 4),
    ):
        stores[name] = root / f"logits-{name}"
        run_entry(
            GENERATE,
            ["--load", str(root / "init"), "--logits-dir", str(stores[name]), *TOPK, *GENERATION]
            + PACKED
            + args,
            nproc=nproc,
        )
    assert _store_digest(stores["packed-cp2-pp2"]) == _store_digest(stores["packed"])


@pytest.fixture(scope="module")
def sampled_logits(root):
    """The initial checkpoint's sampled store over the runs' samples, generated at CP=1."""
    return _generate_sampled(root, "sampled", [])


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_sampled_teacher_logits_at_cp2(root, sampled_logits, packed):
    """Draws follow each token, not the rank holding it. a2a runs the one-process attention
    calls: the same bytes. p2p's ring sums the attention in another order, so a draw within fp32
    round-off of a CDF boundary may move: over 99.9% of the draws are the same."""
    args, name = (PACKED, "packed") if packed else ([], "unpacked")
    one = _generate_sampled(root, "sampled-packed", args) if packed else sampled_logits
    a2a = _generate_sampled(root, f"sampled-{name}-a2a", args + _cp(2, "a2a"), nproc=2)
    assert _store_digest(a2a) == _store_digest(one)
    p2p = _generate_sampled(root, f"sampled-{name}-p2p", args + _cp(2), nproc=2)
    shared = torch.minimum(_draws(p2p), _draws(one)).sum(1).mean()
    assert shared > 0.999, f"p2p shares only {shared:.4%} of the draws"


@pytest.fixture(scope="module")
def chats(root):
    """Packed chat documents with assistant-only loss masks (tools/preprocess_chat.py)."""
    source = root / "chats.jsonl"
    records = docstring_conversations()[:200]
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    run_entry(
        CHAT_TOOL,
        ["--input", str(source), "--output-prefix", str(root / "chats"), *SMALL_TOKENIZER_FLAGS],
    )
    return str(root / "chats_chat_document")


QAD = ["--quant-format", "int4", "--quant-group-size", "16"]
FAMILIES = ("pretraining", "topk", "sampled", "qad", "sft")
"""The objectives compared: pretraining, students of stored top-k and sampled teacher logits,
quantization-aware distillation (int4 fake-quantized weights, replicated over the CP ranks like
the weights themselves) and SFT loss masks on packed chat documents."""


def _family_args(request, family: str) -> list[str]:
    """The flags of ``family`` (its stores and chats are the module's fixtures)."""
    if family == "pretraining":
        return []
    if family == "sft":
        return PACKED + [
            "--sft",
            "--data-path",
            request.getfixturevalue("chats"),
            "--eval-iters",
            "0",
        ]
    store = request.getfixturevalue("sampled_logits" if family == "sampled" else "logits")
    quant = QAD if family == "qad" else []
    return ["--distill-logits-path", str(store), "--kd-alpha", "0.9"] + GOLDFISH + quant


@pytest.mark.parametrize(
    "layout, args, nproc",
    [("cp2-p2p", _cp(2), 2), ("cp4-a2a", _cp(4, "a2a"), 4)],
    ids=["cp2-p2p", "cp4-a2a"],
)
@pytest.mark.parametrize("family", FAMILIES[1:])
def test_distillation_and_sft_match_one_process(
    root, references, request, family, layout, args, nproc
):
    """The losses, and every gradient element of the first step on every rank, at CP=2 (p2p)
    and CP=4 (a2a: the tiny model's 4 heads, one per rank; its 2 query groups are repeated per
    head first by the local attention, so the rule allows it, where Transformer Engine's would
    need 4 groups).

    Quantization-aware: step 1 quantizes the same weights in both runs, so its loss and gradient
    agree as fp32 sums in another order do. After an update the weights differ by that round-off
    (up to 3e-6 of a tensor's largest weight); among ~150k weights, whether one lands across an
    int4 rounding boundary depends on the CPU's kernels, and a whole quantization step moves the
    loss by more than round-off. The updates themselves are the unquantized cases' and are
    compared there over every step."""
    flags = _family_args(request, family)
    expected = references(family, flags)
    got = _run(root, f"{family}-{layout}", flags + args, nproc, grads=True)
    if family == "qad":
        _assert_same_first_step(got, expected)
        _assert_same_first_step(got, expected, "train/grad_norm")
        _assert_losses_move(got)
        _assert_losses_move(expected)
    else:
        _assert_same_run(got, expected, validation=family != "sft")
    _assert_same_gradients(got, expected)


def test_distillation_under_hierarchical_context_parallel_matches_one_process(
    root, references, request
):
    """A student of stored top-k teacher logits at a2a+p2p 2 x 2."""
    flags = _family_args(request, "topk")
    expected = references("topk", flags)
    got = _run(root, "topk-cp4-hierarchical", flags + HIER, 4, grads=True)
    _assert_same_run(got, expected)
    _assert_same_gradients(got, expected)


@pytest.mark.parametrize(
    "family, tensor_parallel",
    [(family, []) for family in FAMILIES] + [("pretraining", TP2)],
    ids=[*FAMILIES, "pretraining-tp2"],
)
def test_comparisons_fail_without_the_context_parallel_reduction(
    root, references, request, family, tensor_parallel
):
    """Negative control: at CP=2 (p2p; for pretraining also CP=2 x TP=2) with the gradients and
    the loss sums left unreduced over the CP ranks (tests/parallel/grad_worker.py), each rank
    holds the gradient and loss of its own tokens only, and the first-step comparisons above
    fail. Summed over the CP ranks (one whole-model gradient per TP pair), as the reduction
    would, the gradients are one process's again: the control breaks nothing else."""
    flags = _family_args(request, family)
    expected = references(family, flags)
    name = f"{family}-unreduced" + ("-tp2" if tensor_parallel else "")
    nproc = 4 if tensor_parallel else 2
    got = _run(
        root, name, flags + _cp(2) + tensor_parallel, nproc, steps=1, grads=True, unreduced=True
    )
    with pytest.raises(AssertionError):
        _assert_same_gradients(got, expected)
    with pytest.raises(AssertionError):
        _assert_same_first_step(got, expected)
    shares = got["grads"]
    _assert_same_gradients({"grads": [{k: sum(g[k] for g in shares) for k in shares[0]}]}, expected)


def test_saved_at_cp2_resumes_at_cp1_and_cp4(root, unpacked):
    save = root / "resume-cp2"
    run_entry(
        PRETRAIN,
        COMMON
        + _cp(2)
        + [
            "--train-iters",
            str(STEPS),
            "--load",
            str(root / "init"),
            "--save",
            str(save),
            "--exit-interval",
            "1",
        ],
        nproc=2,
    )
    _, expected = series(unpacked, "train/loss")
    for size in (1, 4):
        out = root / f"resumed-cp{size}.json"
        run_entry(
            PRETRAIN,
            COMMON
            + _cp(size)
            + ["--train-iters", str(STEPS), "--load", str(save), "--log-json", str(out)],
            nproc=size,
        )
        resumed = [(i, loss) for i, loss in zip(*series(read_json(out), "train/loss")) if i > 1]
        assert [i for i, _ in resumed] == list(range(2, STEPS + 1))
        np.testing.assert_allclose([loss for _, loss in resumed], expected[1:], rtol=RTOL, atol=0)
