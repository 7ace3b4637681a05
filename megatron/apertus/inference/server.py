"""An OpenAI-style completions endpoint over one loaded checkpoint: the ``/completions`` request
that evaluation harnesses send (lm-evaluation-harness's ``local-completions`` model) and that
Megatron-LM's text generation server answers.

Each request is decoded with :class:`megatron.apertus.inference.generate.TextGenerator`, the
loop of ``tools/generate_text.py``: the same tokens and log-probabilities for the same prompt,
sampling and seed. Requests are served one at a time (one model, one KV cache), each prompt of a
request in turn, one sampling generator per request seeded by its ``seed``.

Fields (OpenAI's names; what the lm-evaluation-harness sends): ``prompt`` (a string, a list of
strings, a list of token ids or a list of such lists), ``max_tokens`` (16), ``temperature``
(1.0; 0 is greedy), ``top_k`` (0: no cut; megatron-core's), ``top_p`` (1.0: no cut),
``logprobs`` (the n most likely tokens at each position; 0: the chosen tokens' only; absent:
none), ``echo`` (the prompt's tokens too, and their log-probabilities), ``stop`` (strings that
end the text), ``seed``. ``n`` or ``best_of`` above 1 are refused. A text prompt is encoded as
the start of a training document (``<s>`` first, which ``echo`` leaves out: its first token's
log-probability is that of following ``<s>``); token ids are fed as given (the first has no
log-probability, ``null``).

Served with the standard library's ``http.server``: one endpoint taking and giving JSON needs
no web framework, and the package adds no dependency for it (megatron-core's own server needs
Flask and its CUDA engine).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch

from megatron.apertus.errors import ConfigError
from megatron.apertus.inference.config import SamplingConfig
from megatron.apertus.inference.generate import (
    EOS,
    Completion,
    ModelSource,
    TextGenerator,
    check_request,
    loaded_model,
    prompt_tokens,
)

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/completions", "/v1/completions")
MAX_LOGPROBS = 20
"""The most alternatives a request may ask for at each position (OpenAI allows 5)."""


class BadRequest(Exception):
    """A request the server refuses with status 400 and this message."""


@dataclass(frozen=True)
class PromptInput:
    ids: list[int]
    """The tokens fed to the model."""
    text: str
    """What ``echo`` repeats: the prompt's text (decoded, for token ids)."""
    added: int
    """Leading tokens fed but not part of the prompt (the ``<s>`` of a text prompt)."""


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[PromptInput]
    sampling: SamplingConfig
    echo: bool
    logprobs: int | None
    stop: list[str]
    model: str | None


def _field(fields: dict, name: str, kind: type | tuple, default: Any) -> Any:
    value = fields.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool:  # JSON true is not a number
        raise BadRequest(f"{name!r} must be a {_kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise BadRequest(f"{name!r} must be a {_kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def _prompt_inputs(prompt: Any, generator: TextGenerator) -> list[PromptInput]:
    """The prompts of a request's ``prompt`` field, in OpenAI's four shapes."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("'prompt' must be a string, a list of strings or of token-id lists")
    inputs = []
    for item in prompt:
        if isinstance(item, str):
            inputs.append(PromptInput(prompt_tokens(generator.tokenizer, item), item, 1))
        elif _is_ids(item) and item:
            _check_ids(item, generator.tokenizer.vocab_size)
            inputs.append(PromptInput(list(item), generator.tokenizer.decode(item), 0))
        else:
            raise BadRequest("'prompt' must be a string, a list of strings or of token-id lists")
    return inputs


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _check_ids(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def parse_request(body: bytes, generator: TextGenerator, source: ModelSource) -> CompletionRequest:
    """The request in ``body``, every refusal a :class:`BadRequest` naming the field."""
    try:
        fields = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not JSON ({err})") from None
    if not isinstance(fields, dict):
        raise BadRequest("the request body must be a JSON object")
    if "prompt" not in fields:
        raise BadRequest("'prompt' is required")
    for name in ("n", "best_of"):
        if _field(fields, name, int, 1) != 1:
            raise BadRequest(f"{name!r} above 1 is not supported: send the request again")
    prompts = _prompt_inputs(fields["prompt"], generator)
    echo = _field(fields, "echo", bool, False)
    logprobs = _field(fields, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    sampling = _sampling(fields, echo, logprobs)
    for i, prompt in enumerate(prompts):
        try:
            check_request(source, sampling, prompt.ids, f"prompt {i}")
        except ConfigError as err:
            message = str(err).replace("--num-tokens-to-generate", "max_tokens")
            raise BadRequest(message.replace("--top-k", "top_k")) from None
    stop = _field(fields, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings")
    model = _field(fields, "model", str, None)
    return CompletionRequest(prompts, sampling, echo, logprobs, [s for s in stop if s], model)


def _sampling(fields: dict, echo: bool, logprobs: int | None) -> SamplingConfig:
    """The generator's sampling config of a request's fields (OpenAI's defaults and meanings:
    temperature 0 is greedy, top_p 1 no cut)."""
    max_tokens = _field(fields, "max_tokens", int, 16)
    if max_tokens < 0 or (max_tokens == 0 and not echo):
        raise BadRequest(f"'max_tokens' must be at least 1 (0 with 'echo'), got {max_tokens}")
    temperature = float(_field(fields, "temperature", (int, float), 1.0))
    top_k = _field(fields, "top_k", int, 0)
    top_p = float(_field(fields, "top_p", (int, float), 1.0))
    seed = _field(fields, "seed", int, SamplingConfig.seed)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise BadRequest(f"'temperature' must be at least 0, got {temperature}")
    if top_k < 0:
        raise BadRequest(f"'top_k' must be at least 0, got {top_k}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p}")
    top_p = 0.0 if top_p == 1 else top_p
    if temperature == 0:
        temperature, top_k, top_p = 1.0, 1, 0.0
    if top_k > 0 and top_p > 0:
        raise BadRequest(f"'top_k' {top_k} and 'top_p' {top_p}: give one of them")
    return SamplingConfig(
        num_tokens_to_generate=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        return_log_probs=True,
        skip_prompt_log_probs=not echo,
        top_n_logprobs=logprobs or 0,
    )


class CompletionService:
    """Answers completion requests with one loaded model."""

    def __init__(self, generator: TextGenerator, source: ModelSource):
        self.generator = generator
        self.source = source
        self.served = 0

    def respond(self, body: bytes) -> dict:
        request = parse_request(body, self.generator, self.source)
        draws = torch.Generator().manual_seed(request.sampling.seed)
        choices, used, generated = [], 0, 0
        for index, prompt in enumerate(request.prompts):
            completion = self.generator.complete(prompt.ids, request.sampling, draws)
            choices.append(self._choice(index, request, prompt, completion))
            used += len(prompt.ids)
            generated += len(completion.generated_tokens)
        self.served += 1
        return {
            "id": f"cmpl-{self.served}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model or str(self.source.checkpoint),
            "choices": choices,
            "usage": {
                "prompt_tokens": used,
                "completion_tokens": generated,
                "total_tokens": used + generated,
            },
        }

    def _choice(
        self, index: int, request: CompletionRequest, prompt: PromptInput, completion: Completion
    ) -> dict:
        """One prompt's choice: the text (after the prompt's with ``echo``) cut at the first
        stop string, and its tokens' log-probabilities."""
        tokenizer = self.generator.tokenizer
        generated = [t for t in completion.generated_tokens if t != tokenizer.eod]
        text = tokenizer.decode(generated)
        finish = "stop" if completion.finish_reason == EOS else "length"
        cut = min((i for i in (text.find(s) for s in request.stop) if i >= 0), default=None)
        if cut is not None:
            text, finish = text[:cut], "stop"
        offsets = _offsets(tokenizer, generated)
        kept = sum(1 for o in offsets if cut is None or o < cut)
        tokens, scores = generated[:kept], completion.generated_scores
        log_probs, top = scores.log_probs[:kept], scores.top_n[:kept]
        if request.echo:
            shown = prompt.ids[prompt.added :]
            prompt_offsets = _offsets(tokenizer, shown)
            first_unscored = [None] if prompt.added == 0 else []
            prompt_scores = completion.prompt_scores
            log_probs = first_unscored + prompt_scores.log_probs + log_probs
            top = first_unscored + prompt_scores.top_n + top
            offsets = prompt_offsets + [len(prompt.text) + o for o in offsets]
            tokens, text = shown + tokens, prompt.text + text
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if request.logprobs is not None:
            choice["logprobs"] = {
                "tokens": [tokenizer.decode([t]) for t in tokens],
                "token_logprobs": log_probs,
                "top_logprobs": top if request.logprobs else None,
                "text_offset": offsets[: len(tokens)],
            }
        return choice


def _offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text starts in the text of ``ids``."""
    return [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") not in COMPLETION_PATHS:
            self._reply(404, _error(f"no endpoint {self.path}; POST to /v1/completions"))
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            self._reply(200, self.server.service.respond(body))
        except BadRequest as err:
            self._reply(400, _error(str(err)))
        except Exception as err:  # the server outlives a failed request
            log.exception("request failed")
            self._reply(500, _error(f"internal error: {err}"))

    def do_GET(self) -> None:  # noqa: N802
        self._reply(404, _error("POST completion requests to /v1/completions"))

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        log.info("%s %s", self.address_string(), format % args)


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


class CompletionServer(HTTPServer):
    """One request at a time (the model is one); bound when made, serving once it has its
    :class:`CompletionService`."""

    service: CompletionService


def serve(source: ModelSource, host: str, port: int) -> None:
    """Listen (refused in one line when the address cannot be had, before the model loads),
    load the model, then answer requests until interrupted; the line that says where goes to
    standard error once the model is loaded (``--port 0``: the port the system chose)."""
    try:
        server = CompletionServer((host, port), _Handler)
    except OSError as err:
        reason = err.strerror or str(err)
        raise ConfigError(f"--host {host} --port {port}: cannot listen ({reason})") from None
    with server, loaded_model(source.checkpoint, source.model, source.device) as chunk:
        generator = TextGenerator(chunk, source.model, source.tokenizer)
        server.service = CompletionService(generator, source)
        bound_host, bound_port = server.server_address[:2]
        where = f"http://{bound_host}:{bound_port}/v1/completions"
        print(f"serving {source.checkpoint} at {where}", file=sys.stderr, flush=True)
        server.serve_forever()
