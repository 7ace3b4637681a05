"""Text generation from a checkpoint, as a user meets it and against an independent reference.

A random tiny-preset checkpoint with the real 131072-token tekken vocabulary (saved by
``tests/hf_interop_helper.py`` with a wide init, so that attention moves every logit) is
exported to Hugging Face; ``tools/generate_text.py``'s greedy tokens equal transformers' greedy
``generate`` on the export for real prose prompts. The same model saved with TP=2 generates
the same lines. Sampling is checked in-process on the loaded model, and bad input as one line
and exit status 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron.apertus.checkpoint import load_model_config
from megatron.apertus.inference.config import Prompt, SamplingConfig
from megatron.apertus.inference.generate import (
    EOS,
    Completion,
    TextGenerator,
    loaded_model,
    next_token,
    prompt_tokens,
)
from megatron.apertus.tokenizer.tokenizers import bundled_tekken_path, load_tokenizer
from tests.conftest import REPO, run_entry, run_script

HELPER = REPO / "tests" / "hf_interop_helper.py"
EXPORT = REPO / "tools" / "checkpoint" / "export_hf.py"
TOOL = REPO / "tools" / "generate_text.py"
SEED = 1234
TOKENS = 12
TEKKEN = ("--tokenizer-type", "TekkenTokenizer")
"""The helper's checkpoints record no training run, so the tool is told the tokenizer."""


def prose() -> list[str]:
    """Real English prose of different lengths from the standard library's documentation."""
    from pydoc_data.topics import topics

    return [topics["assert"][:300], topics["pass"][:120], "The Zürich lake is"]


@dataclass(frozen=True)
class Saved:
    tp1: Path
    tp2: Path
    hf_dir: Path
    prompts_file: Path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    """One seeded model saved with TP=1 and TP=2 (the same weights: megatron-core draws each
    full weight on the CPU and slices it), the TP=1 one exported to Hugging Face."""
    root = tmp_path_factory.mktemp("generate")
    tp1, tp2, hf_dir = root / "tp1", root / "tp2", root / "hf"
    run_entry(HELPER, ["save", "--save", str(tp1), "--seed", str(SEED)])
    run_entry(HELPER, ["save", "--save", str(tp2), "--seed", str(SEED), "--tp", "2"], nproc=2)
    tekken = str(bundled_tekken_path())
    run_entry(EXPORT, ["--load", str(tp1), "--output", str(hf_dir), "--tokenizer", tekken])
    prompts_file = root / "prompts.jsonl"
    lines = [json.dumps({"id": i, "prompt": p}) for i, p in enumerate(prose())]
    prompts_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Saved(tp1, tp2, hf_dir, prompts_file)


def generate_lines(load: Path, prompts_file: Path, output: Path, *args: str) -> list[dict]:
    run_entry(
        TOOL,
        ["--load", str(load), *TEKKEN, "--prompts-file", str(prompts_file)]
        + ["--output", str(output), "--num-tokens-to-generate", str(TOKENS), *args],
    )
    return [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def greedy_tp1(saved, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("greedy") / "out.jsonl"
    lines = generate_lines(saved.tp1, saved.prompts_file, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no temporary left
    return lines


def test_greedy_equals_transformers_generate_on_the_export(saved, greedy_tp1):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(saved.hf_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(saved.hf_dir))
    assert [line["id"] for line in greedy_tp1] == [0, 1, 2]  # the input's fields, in order
    for line, text in zip(greedy_tp1, prose()):
        assert line["prompt"] == text
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        assert line["prompt_tokens"] == ids[0].tolist()
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False
            )
        theirs = out[0, ids.shape[1] :].tolist()
        assert line["generated_tokens"] == theirs
        assert line["finish_reason"] == (EOS if theirs[-1] == tokenizer.eos_token_id else "length")
        assert line["generated_text"] == tokenizer.decode(theirs, skip_special_tokens=True)
    # Not one continuation repeated: the prompts steer the model.
    assert len({tuple(line["generated_tokens"]) for line in greedy_tp1}) == 3


def test_prompts_as_arguments_print_their_lines(saved, greedy_tp1):
    texts = prose()[1:]
    flags = ["--load", str(saved.tp1), *TEKKEN, "--num-tokens-to-generate", str(TOKENS)]
    proc = run_entry(TOOL, [*flags, "--prompts", *texts])
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == texts
    assert [line["generated_tokens"] for line in lines] == [
        line["generated_tokens"] for line in greedy_tp1[1:]
    ]


def test_tp2_checkpoint_generates_as_tp1(saved, greedy_tp1, tmp_path):
    assert generate_lines(saved.tp2, saved.prompts_file, tmp_path / "out.jsonl") == greedy_tp1


def test_log_probs_equal_transformers_on_the_export(saved, greedy_tp1, tmp_path):
    """``--return-log-probs``: each prompt token's (after ``<s>``) and each generated token's
    log-probability equals the log-softmax of transformers' logits on the export over the
    whole sequence; ``--top-n-logprobs``: the greedy token heads its position's top-n; asking
    for them changes no token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(saved.hf_dir), dtype=torch.float32).eval()
    flags = ("--return-log-probs", "--top-n-logprobs", "3")
    lines = generate_lines(saved.tp1, saved.prompts_file, tmp_path / "out.jsonl", *flags)
    tokenizer = load_tokenizer()
    for line, plain in zip(lines, greedy_tp1):
        assert line["generated_tokens"] == plain["generated_tokens"]
        prompt, generated = line["prompt_tokens"], line["generated_tokens"]
        ids = torch.tensor([prompt + generated])
        with torch.no_grad():
            theirs = hf(ids).logits[0].log_softmax(-1)
        targets = ids[0, 1:]
        expected = theirs[:-1].gather(1, targets[:, None])[:, 0]
        ours = torch.tensor(line["prompt_log_probs"] + line["generated_log_probs"])
        assert len(line["prompt_log_probs"]) == len(prompt) - 1
        torch.testing.assert_close(ours, expected, rtol=0, atol=2e-4)
        assert len(line["generated_top_n_logprobs"]) == len(generated)
        assert len(line["prompt_top_n_logprobs"]) == len(prompt) - 1
        for token, score, top in zip(
            generated, line["generated_log_probs"], line["generated_top_n_logprobs"]
        ):
            assert len(top) == 3 and max(top.values()) == pytest.approx(score, abs=1e-6)
            assert max(top, key=top.get) == tokenizer.decode([token])
    # The prompts steer the model: its log-probabilities are not one repeated profile.
    assert len({round(line["prompt_log_probs"][-1], 4) for line in lines}) == 3


# -- sampling, in-process on the loaded model -------------------------------------------------


@pytest.fixture(scope="module")
def generator(saved):
    tokenizer = load_tokenizer()
    with loaded_model(saved.tp1, load_model_config(saved.tp1), "cpu") as chunk:
        yield TextGenerator(chunk, load_model_config(saved.tp1), tokenizer)


def complete(generator: TextGenerator, seed: int = 0, **sampling) -> list[int]:
    config = SamplingConfig(num_tokens_to_generate=TOKENS, seed=seed, **sampling)
    prompt = prompt_tokens(generator.tokenizer, prose()[1])
    draws = torch.Generator().manual_seed(seed)
    return generator.complete(prompt, config, draws).generated_tokens


def test_sampling_is_reproducible_by_seed(generator, greedy_tp1):
    first = complete(generator, seed=5, top_k=0)
    assert complete(generator, seed=5, top_k=0) == first
    assert complete(generator, seed=6, top_k=0) != first
    assert first != greedy_tp1[1]["generated_tokens"]  # it samples
    assert complete(generator, seed=5, top_k=40) != complete(generator, seed=6, top_k=40)


def test_top_k_1_and_a_vanishing_top_p_are_greedy(generator, greedy_tp1):
    greedy = greedy_tp1[1]["generated_tokens"]
    assert complete(generator, seed=5, top_k=1, temperature=3.0) == greedy
    assert complete(generator, seed=5, top_k=0, top_p=1e-9) == greedy


def test_generation_stops_after_the_end_of_document_token(generator, greedy_tp1):
    """With the output row of ``</s>`` made twice that of the third greedy token, ``</s>``
    outscores every token by the third step at the latest (there the largest logit is that
    token's, positive, and doubled): generation ends with it, the greedy tokens before it."""
    greedy = greedy_tp1[1]["generated_tokens"]
    weight = generator.chunk.output_layer.weight
    eod, original = generator.tokenizer.eod, weight.detach().clone()
    try:
        with torch.no_grad():
            weight[eod] = 2 * weight[greedy[2]]
        tokens = complete(generator)
    finally:
        with torch.no_grad():
            weight.copy_(original)
    stop = len(tokens) - 1
    assert stop <= 2 and tokens == [*greedy[:stop], eod]
    prompt = Prompt("x", {"prompt": "x"}, "--prompt 1")
    completion = Completion([1], [*greedy[:2], eod], EOS)
    line = generator.output_line(prompt, completion, SamplingConfig())
    assert line["generated_text"] == generator.tokenizer.decode(greedy[:2])
    assert line["finish_reason"] == EOS


def test_scoring_a_prompt_equals_the_training_loss(generator):
    """``--num-tokens-to-generate 0 --return-log-probs`` scores the prompt: its
    log-probabilities are minus the per-token loss of the model's training forward (no KV
    cache, the loss's own cross-entropy), and nothing is generated."""
    prompt = prompt_tokens(generator.tokenizer, prose()[0])
    sampling = SamplingConfig(num_tokens_to_generate=0, return_log_probs=True)
    scored = generator.complete(prompt, sampling, torch.Generator())
    assert scored.generated_tokens == [] and scored.generated_scores.log_probs == []
    ids = torch.tensor([prompt])
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad():
        loss = generator.chunk(ids[:, :-1], positions[:, :-1], None, labels=ids[:, 1:])
    ours = torch.tensor(scored.prompt_scores.log_probs)
    torch.testing.assert_close(ours, -loss[0].float(), rtol=0, atol=1e-4)
    assert ours.std() > 0.1  # tokens differ in how expected they are
    skipped = SamplingConfig(
        num_tokens_to_generate=2, return_log_probs=True, skip_prompt_log_probs=True
    )
    decoded = generator.complete(prompt, skipped, torch.Generator())
    assert decoded.prompt_scores is None and len(decoded.generated_scores.log_probs) == 2


def test_top_k_and_top_p_draw_from_the_cut_only():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).log_softmax(-1)
    probs = logits.softmax(-1).tolist()  # about 0.64, 0.24, 0.09, 0.03, 0.01
    draws = torch.Generator().manual_seed(0)
    top2 = {next_token(logits, SamplingConfig(top_k=2), draws) for _ in range(300)}
    assert top2 == {0, 1}
    # top-p keeps the most likely tokens up to the one that crosses p: 0.7 -> tokens 0 and 1
    assert probs[0] < 0.7 < probs[0] + probs[1]
    nucleus = {next_token(logits, SamplingConfig(top_k=0, top_p=0.7), draws) for _ in range(300)}
    assert nucleus == {0, 1}
    everything = {next_token(logits, SamplingConfig(top_k=0), draws) for _ in range(2000)}
    assert everything == {0, 1, 2, 3, 4}


# -- bad input ----------------------------------------------------------------------------------


def refused(*args: str) -> str:
    """The one error line of the tool run with ``args``, which must exit 2 without a traceback."""
    proc = run_script(TOOL, list(args), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def test_a_missing_checkpoint_is_refused(tmp_path):
    line = refused("--load", str(tmp_path / "nothing"), "--prompt", "Hi")
    assert f"--load {tmp_path / 'nothing'} holds no Apertus checkpoint" in line


def test_a_missing_iteration_is_refused(saved):
    line = refused("--load", str(saved.tp1), "--ckpt-step", "7", "--prompt", "Hi", *TEKKEN)
    assert "--ckpt-step 7" in line and "iterations 0" in line


@pytest.mark.parametrize(
    "content, expected",
    [
        ("", "holds no prompts"),
        ("\n\n", "holds no prompts"),
        ('{"prompt": "a"}\n{"prompt": \n', "prompts.jsonl:2: not a JSON line"),
        ('{"prompt": "a"}\n{"text": "b"}\n', "prompts.jsonl:2: not a JSON object with a string"),
        ('["a"]\n', "prompts.jsonl:1: not a JSON object"),
    ],
    ids=["empty", "blank", "bad-json", "no-prompt-field", "not-an-object"],
)
def test_a_bad_prompts_file_is_refused(saved, tmp_path, content: str, expected: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content, encoding="utf-8")
    assert expected in refused("--load", str(saved.tp1), "--prompts-file", str(prompts))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--top_k", "5", "--top_p", "0.9"], "--top-k 5 and --top-p 0.9"),
        (["--top-k", "-1"], "--top-k must be at least 0"),
        (["--top_p", "1.5", "--top_k", "0"], "--top-p must be in [0, 1]"),
        (["--temperature", "0"], "--temperature must be positive"),
        (["--num-tokens-to-generate", "0"], "--num-tokens-to-generate must be at least 1"),
        (["--skip-prompt-log-probs"], "--skip-prompt-log-probs needs --return-log-probs"),
        (["--top-n-logprobs", "-1"], "--top-n-logprobs must be at least 0"),
        (["--top_k", "x"], "--top-k"),
        (["--ckpt-step", "-1"], "--ckpt-step must be >= 0"),
        (["--top_k", "200000", *TEKKEN], "--top-k 200000 exceeds the vocabulary"),
        (["--num-tokens-to-generate", "5000", *TEKKEN], "exceed the model's"),
        (["--tokenizer-type", "Nope"], "--tokenizer-type 'Nope'"),
        ([], "records no training run"),
        (["--output", str(REPO / "docs")], "is a directory, not a file"),
    ],
    ids=[
        "top-k-and-top-p",
        "negative-top-k",
        "top-p-above-1",
        "zero-temperature",
        "no-tokens",
        "skip-without-log-probs",
        "negative-top-n",
        "top-k-not-a-number",
        "negative-step",
        "top-k-above-vocabulary",
        "too-long",
        "unknown-tokenizer",
        "no-tokenizer",
        "output-is-a-directory",
    ],
)
def test_bad_flags_are_refused(saved, flags: list[str], expected: str):
    assert expected in refused("--load", str(saved.tp1), "--prompt", "Hi", *flags)


def test_prompts_are_required_and_exclusive(saved, tmp_path):
    assert "--prompt" in refused("--load", str(saved.tp1))
    both = ("--prompt", "Hi", "--prompts-file", str(tmp_path / "p.jsonl"))
    assert "not allowed with" in refused("--load", str(saved.tp1), *both)
    missing = tmp_path / "missing.jsonl"
    line = refused("--load", str(saved.tp1), "--prompts-file", str(missing))
    assert f"--prompts-file {missing}: no such file" in line
