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
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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
SERVER = REPO / "tools" / "run_text_generation_server.py"
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


@pytest.fixture(scope="module")
def scored_tp1(saved, tmp_path_factory) -> list[dict]:
    """The greedy lines with every log-probability and the top 3 at each position."""
    out = tmp_path_factory.mktemp("scored") / "out.jsonl"
    flags = ("--return-log-probs", "--top-n-logprobs", "3")
    return generate_lines(saved.tp1, saved.prompts_file, out, *flags)


def test_log_probs_equal_transformers_on_the_export(saved, greedy_tp1, scored_tp1):
    """``--return-log-probs``: each prompt token's (after ``<s>``) and each generated token's
    log-probability equals the log-softmax of transformers' logits on the export over the
    whole sequence; ``--top-n-logprobs``: the greedy token heads its position's top-n; asking
    for them changes no token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(saved.hf_dir), dtype=torch.float32).eval()
    lines = scored_tp1
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


# -- the completions server --------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen


@pytest.fixture(scope="module")
def server(saved) -> Iterator[Server]:
    """``tools/run_text_generation_server.py`` on the TP=1 checkpoint, on a port the system
    chose (read from its start line); stopped by SIGTERM at the end, which it must take quietly."""
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    cmd = [sys.executable, str(SERVER), "--load", str(saved.tp1), *TEKKEN, "--port", "0"]
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in process.stderr:  # until the model is loaded and the port bound
        lines.append(line)
        if line.startswith("serving "):
            break
    else:
        pytest.fail("the server ended before serving:\n" + "".join(lines[-30:]))
    drained = threading.Thread(target=lines.extend, args=(process.stderr,), daemon=True)
    drained.start()
    yield Server(line.split(" at ")[1].strip(), process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    drained.join(timeout=10)
    assert not any("Traceback" in line for line in lines), "".join(lines[-30:])


def post(server: Server, payload: dict | bytes, path: str = "") -> tuple[int, dict]:
    """The status and JSON answer of a POST of ``payload`` (JSON unless bytes)."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    url = server.url if not path else server.url.rsplit("/v1/", 1)[0] + path
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)


def test_server_completes_greedily_as_the_tool(server, scored_tp1):
    """Temperature 0 is greedy: each choice's text and log-probabilities are the tool's."""
    status, answer = post(
        server, {"prompt": prose(), "max_tokens": TOKENS, "temperature": 0, "logprobs": 0}
    )
    assert status == 200 and answer["object"] == "text_completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for choice, line in zip(answer["choices"], scored_tp1):
        assert choice["text"] == line["generated_text"]
        text_tokens = [t for t in line["generated_tokens"] if t != load_tokenizer().eod]
        logprobs = choice["logprobs"]
        expected = line["generated_log_probs"][: len(text_tokens)]
        # The tool materialized every prompt position: other GEMM shapes, other round-off.
        assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-5)
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["top_logprobs"] is None  # logprobs 0: the chosen tokens' only
    prompt_tokens = sum(len(line["prompt_tokens"]) for line in scored_tp1)
    assert answer["usage"]["prompt_tokens"] == prompt_tokens


def test_echo_scores_a_prompt_as_the_evaluation_harness_asks(server, scored_tp1):
    """lm-evaluation-harness's log-likelihood request (echo, one token, logprobs 1): a text
    prompt's tokens come back without the ``<s>`` the server put first, with the tool's
    log-probabilities; the same prompt as token ids (``<s>`` included) has no score for its
    first token."""
    text, line = prose()[2], scored_tp1[2]
    request = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    status, answer = post(server, {"prompt": text, **request})
    assert status == 200
    choice = answer["choices"][0]
    assert choice["text"] == text + line["generated_text"][: len(choice["text"]) - len(text)]
    scores = choice["logprobs"]
    shown = len(line["prompt_tokens"]) - 1
    assert scores["token_logprobs"][:shown] == pytest.approx(line["prompt_log_probs"], abs=1e-5)
    best = [list(top.items())[0] for top in line["prompt_top_n_logprobs"]]
    assert [list(top) for top in scores["top_logprobs"][:shown]] == [[t] for t, _ in best]
    starts = scores["text_offset"][:shown]
    assert [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])] == scores["tokens"][:shown]
    status, by_ids = post(server, {"prompt": [line["prompt_tokens"]], **request})
    assert status == 200
    first, *rest = by_ids["choices"][0]["logprobs"]["token_logprobs"][: shown + 1]
    assert first is None and rest == pytest.approx(line["prompt_log_probs"], abs=1e-5)


def test_a_stop_string_ends_the_text(server, greedy_tp1):
    full = greedy_tp1[0]["generated_text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    request = {"prompt": prose()[0], "max_tokens": TOKENS, "temperature": 0, "logprobs": 0}
    status, answer = post(server, {**request, "stop": [stop, "never in it"]})
    choice = answer["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.find(stop)] and stop not in choice["text"]
    assert "".join(choice["logprobs"]["tokens"]).startswith(choice["text"])


def test_a_sampled_request_repeats_by_seed(server):
    request = {"prompt": prose()[1], "max_tokens": TOKENS, "temperature": 1, "top_k": 0}
    texts = [post(server, {**request, "seed": seed})[1]["choices"][0]["text"] for seed in (5, 5, 6)]
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize(
    "body, expected",
    [
        (b"{nope", "the request body is not JSON"),
        ({"max_tokens": 3}, "'prompt' is required"),
        ({"prompt": 3}, "'prompt' must be a string"),
        ({"prompt": "x", "n": 2}, "'n' above 1 is not supported"),
        ({"prompt": "x", "temperature": -1}, "'temperature' must be at least 0"),
        ({"prompt": "x", "top_p": 0}, "'top_p' must be in (0, 1]"),
        ({"prompt": "x", "top_k": 5, "top_p": 0.5}, "'top_k' 5 and 'top_p' 0.5"),
        ({"prompt": "x", "logprobs": 50}, "'logprobs' must be in [0, 20]"),
        ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be at least 1 (0 with 'echo')"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens 1000000 exceed the model's"),
        ({"prompt": "x", "top_k": 10**6}, "top_k 1000000 exceeds the vocabulary"),
        ({"prompt": [[1, 10**7]]}, "token id 10000000 is outside the vocabulary"),
        ({"prompt": "x", "echo": "yes"}, "'echo' must be a bool"),
        ({"prompt": "x", "stop": [3]}, "'stop' must be a string or a list of strings"),
    ],
    ids=[
        "not-json",
        "no-prompt",
        "prompt-not-text",
        "n",
        "temperature",
        "top-p",
        "top-k-and-top-p",
        "logprobs",
        "no-tokens",
        "too-long",
        "top-k-above-vocabulary",
        "id-outside-vocabulary",
        "echo-not-bool",
        "stop-not-text",
    ],
)
def test_a_bad_request_is_answered_400(server, body, expected: str):
    status, answer = post(server, body)
    assert status == 400 and expected in answer["error"]["message"]


def test_an_unknown_endpoint_is_answered_404(server):
    status, answer = post(server, {"prompt": "x"}, path="/v1/chat/completions")
    assert status == 404 and "/v1/completions" in answer["error"]["message"]


def test_a_taken_port_is_refused_before_the_model_loads(saved):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused_by(SERVER, "--load", str(saved.tp1), *TEKKEN, "--port", str(port))
    assert f"--port {port}: cannot listen" in line
    assert "--port must be in [0, 65535]" in refused_by(
        SERVER, "--load", str(saved.tp1), "--port", "70000"
    )


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
    return refused_by(TOOL, *args)


def refused_by(script: Path, *args: str) -> str:
    """The one error line of ``script`` run with ``args``: exit 2, no traceback."""
    proc = run_script(script, list(args), timeout=300)
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
