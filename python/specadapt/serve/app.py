"""The OpenAI-compatible web layer of ``specadapt serve`` (FastAPI): ``POST /v1/chat/completions``,
``POST /v1/completions`` (streaming with server-sent events or not), ``GET /v1/models``, ``GET /health``,
``GET /metrics``.

A handler turns the body into a :class:`~specadapt.serve.scheduler.Job` (every field checked, errors name the
field: :mod:`specadapt.serve.protocol`), submits it to the engine thread and waits for its events on an asyncio
queue. A client that disconnects cancels its request (its slot is free at the next round boundary). Errors are
OpenAI's error object: 400 for a bad request, 404 for an unknown model, 503 when the queue is full or the server
is shutting down, 500 when the engine failed on the request (the others go on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from ..engine.metrics import acceptance_length
from ..sampling import SamplingParams
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from .scheduler import Job, QueueFullError, Scheduler, ShuttingDownError

logger = logging.getLogger(__name__)

__all__ = ["ServerState", "create_app", "start_http_thread"]

#: seconds between checks that a non-streaming client is still connected
_DISCONNECT_POLL = 0.5


@dataclass
class ServerState:
    """What the handlers share: the engine's scheduler and metrics, the tokenizer and the served model's name.

    Attributes:
        scheduler: the engine thread (:class:`Scheduler`).
        tokenizer: the target's tokenizer (chat template, decoding).
        model_name: the id listed by ``/v1/models`` and accepted in ``model``.
        context_length: the target's context window in tokens.
        vocab_size: the target's vocabulary size (token ids are checked against it).
        metrics: the :class:`ServerMetrics`.
        stream_interval: tokens between the chunks of a streamed response (``--stream-interval``).
        default_max_tokens: ``max_tokens`` of requests that leave it out (``None``: the rest of the context).
        created: when the server started (Unix seconds, ``/v1/models``).
    """

    scheduler: Scheduler
    tokenizer: object
    model_name: str
    context_length: int
    vocab_size: int
    metrics: ServerMetrics
    stream_interval: int = 1
    default_max_tokens: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.scheduler.engine


def create_app(state: ServerState, start_engine: bool = True, on_shutdown=None) -> FastAPI:
    """The FastAPI application over ``state``. With ``start_engine`` its lifespan starts the engine loop on a
    thread of its own and stops it at the end (then calls ``on_shutdown``, e.g. to stop the TTS trainer);
    without, the caller runs :meth:`Scheduler.run` itself (``specadapt serve`` runs it on its main thread)."""

    @asynccontextmanager
    async def lifespan(app):
        if start_engine:
            state.scheduler.start()
        yield
        if start_engine:
            state.scheduler.stop()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="specadapt", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status), status_code=exc.status)

    @app.get("/health")
    async def health():
        if not state.scheduler.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "specadapt", "max_model_len": state.context_length}]}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: HTTPRequest):
        body = await _parse(raw, ChatCompletionRequest, state)
        prompt = _chat_prompt(state, body)
        return await _serve(raw, state, body, prompt, chat=True)

    @app.post("/v1/completions")
    async def completions(raw: HTTPRequest):
        body = await _parse(raw, CompletionRequest, state)
        prompt = _completion_prompt(state, body)
        return await _serve(raw, state, body, prompt, chat=False)

    return app


def start_http_thread(app: FastAPI, host: str, port: int, log_level: str = "warning", **config):
    """Run ``app`` under uvicorn on a thread of its own and wait until it listens (the engine loop keeps the
    calling thread: see :mod:`specadapt.serve.scheduler`). ``port`` 0 takes a free port.

    Returns:
        ``(server, thread, port)``: stop with ``server.should_exit = True`` and ``thread.join()``.

    Raises:
        RuntimeError: uvicorn stopped before listening (an address it cannot bind; its log says why).
    """
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **config))
    thread = threading.Thread(target=server.run, name="specadapt-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not thread.is_alive():
        raise RuntimeError(f"uvicorn could not serve on {host}:{port}")
    bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
    return server, thread, bound


# ---- request parsing -------------------------------------------------------------------------------------------
async def _parse(raw: HTTPRequest, model, state: ServerState):
    try:
        data = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        state.metrics.reject("invalid")
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        state.metrics.reject("invalid")
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        state.metrics.reject("invalid")
        err = exc.errors()[0]
        # pydantic names the union member it tried ("str", "list[int]", "TextPart"...): keep the field path only
        if err["type"] == "extra_forbidden":
            param = ".".join(str(p) for p in err["loc"])
            raise APIError(400, f"unknown field {param!r} (not supported by this server)", param) from None
        path = [p for p in err["loc"] if isinstance(p, int) or p in _FIELD_NAMES]
        param = ".".join(str(p) for p in path)
        names = [p for p in path if isinstance(p, str)]
        hint = _FIELD_HINTS.get(names[-1]) if names else None
        raise APIError(400, f"{param}: {hint or err['msg']}", param) from None


def _field_names(*models) -> set[str]:
    names = set()
    for m in models:
        for name, info in m.model_fields.items():
            names.add(name)
            for arg in getattr(info.annotation, "__args__", ()) or ():
                for inner in getattr(arg, "__args__", ()) or (arg,):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        names |= _field_names(inner)
    return names


_FIELD_NAMES = _field_names(ChatCompletionRequest, CompletionRequest)
_FIELD_HINTS = {
    "prompt": "must be a string or a list of token ids (one prompt per request)",
    "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (text only)",
    "stop": "must be a string or a list of strings",
}


def _message_text(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": _message_text(m.content)}
                for m in body.messages]
    tok = state.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    else:
        ids = tok("\n".join(m["content"] for m in messages))["input_ids"]
    return [int(i) for i in ids]


def _completion_prompt(state: ServerState, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [int(i) for i in state.tokenizer(prompt)["input_ids"]]
    bad = [t for t in prompt if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary of {state.vocab_size}", "prompt")
    return list(prompt)


def _refuse_unsupported(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed with stream: true", "stream_options")
    if isinstance(body, ChatCompletionRequest) and any(m.name for m in body.messages):
        raise APIError(400, "messages.name: participant names are not supported (the chat template has no place "
                            "for them)", "messages.name")
    if (getattr(body, "max_completion_tokens", None) is not None and body.max_tokens is not None
            and body.max_completion_tokens != body.max_tokens):
        raise APIError(400, "max_tokens and max_completion_tokens differ: set one", "max_completion_tokens")
    if body.n not in (None, 1):
        raise APIError(400, "n: only n = 1 is supported", "n")
    if body.logprobs:
        raise APIError(400, "logprobs: not supported by this server", "logprobs")
    if getattr(body, "top_logprobs", None):
        raise APIError(400, "top_logprobs: not supported by this server", "top_logprobs")
    if getattr(body, "echo", False):
        raise APIError(400, "echo: not supported by this server", "echo")
    if getattr(body, "suffix", None):
        raise APIError(400, "suffix: not supported by this server", "suffix")
    if getattr(body, "best_of", None) not in (None, 1):
        raise APIError(400, "best_of: only 1 is supported", "best_of")


def _sampling(state: ServerState, body) -> SamplingParams | None:
    """The request's sampling settings (``None`` when they equal the server's)."""
    base: SamplingParams = state.engine.sampling
    for name, flag in (("presence_penalty", "--presence-penalty"), ("frequency_penalty", "--frequency-penalty"),
                       ("repetition_penalty", "--repetition-penalty")):
        value = getattr(body, name)
        if value is not None and value != getattr(base, name):
            raise APIError(400, f"{name}: per-request penalties are not supported; the server applies "
                                f"{flag} {getattr(base, name)} to every request", name)
    if body.logit_bias:
        bias = tuple(sorted((int(k), float(v)) for k, v in body.logit_bias.items())) if all(
            k.lstrip("-").isdigit() for k in body.logit_bias) else None
        if bias != tuple(base.logit_bias):
            raise APIError(400, "logit_bias: per-request logit bias is not supported; the server applies "
                                "--logit-bias to every request", "logit_bias")
    temperature = base.temperature if body.temperature is None else body.temperature
    top_p = base.top_p if body.top_p is None else body.top_p
    top_k = base.top_k if body.top_k is None else (0 if body.top_k == -1 else body.top_k)
    min_p = base.min_p if body.min_p is None else body.min_p
    if temperature < 0:
        raise APIError(400, f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must lie in (0, 1], got {top_p}", "top_p")
    if top_k < 0:
        raise APIError(400, f"top_k must be >= 0 (or -1 = off), got {body.top_k}", "top_k")
    try:
        params = SamplingParams(temperature, top_p, top_k, min_p=min_p, repetition_penalty=base.repetition_penalty,
                                frequency_penalty=base.frequency_penalty, presence_penalty=base.presence_penalty,
                                logit_bias=base.logit_bias)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0].rstrip(":")
        raise APIError(400, str(exc), field) from None
    return None if params == base else params


def _build_job(state: ServerState, body, prompt: list[int], sink) -> Job:
    _refuse_unsupported(body)
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist (this server serves {state.model_name!r})",
                       "model", "not_found_error")
    where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if not prompt:
        raise APIError(400, f"{where}: the prompt is empty", where)
    room = state.context_length - len(prompt)
    if room < 1:
        raise APIError(400, f"{where}: the prompt has {len(prompt)} tokens, the model's context is "
                            f"{state.context_length}", where)
    name = "max_tokens"
    max_tokens = body.max_tokens
    if max_tokens is None and getattr(body, "max_completion_tokens", None) is not None:
        name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    if max_tokens is None:
        max_tokens = room if state.default_max_tokens is None else min(room, state.default_max_tokens)
    if max_tokens < 1:
        raise APIError(400, f"{name} must be >= 1, got {max_tokens}", name)
    if max_tokens > room:
        raise APIError(400, f"{name}: {max_tokens} output tokens do not fit: the prompt has {len(prompt)} tokens "
                            f"and the model's context is {state.context_length} (at most {room})", name)
    sampling = _sampling(state, body)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop):
        raise APIError(400, "stop: stop strings must not be empty", "stop")
    stop_ids = list(body.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary of {state.vocab_size}",
                       "stop_token_ids")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise APIError(400, f"seed must lie in [0, 2^63), got {body.seed}", "seed")
    seed = secrets.randbits(63) if body.seed is None else body.seed
    return Job(prompt=prompt, max_tokens=max_tokens, sink=sink, seed=seed, sampling=sampling,
               stop_token_ids=frozenset(stop_ids), stop=stop, ignore_eos=body.ignore_eos or None,
               speculate=body.speculate, tokenizer=state.tokenizer, stream=body.stream,
               stream_interval=state.stream_interval)


# ---- responses ---------------------------------------------------------------------------------------------------
def _meta_info(job: Job) -> dict:
    drafted = sum(r.num_drafted for r in job.rounds)
    accepted = sum(min(r.accepted, r.num_drafted) for r in job.rounds)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.output_ids),
            "spec_verify_ct": len(job.rounds), "spec_accept_length": acceptance_length(job.rounds),
            "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_round_emitted": [r.emitted for r in job.rounds], "finish_reason": job.finish_reason,
            "e2e_latency": None if job.finished_time is None else job.finished_time - job.submitted}


def _usage(job: Job) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.output_ids),
            "total_tokens": len(job.prompt) + len(job.output_ids)}


def _choice_extras(body, job: Job) -> dict:
    extra = {}
    if body.return_meta_info:
        extra["meta_info"] = _meta_info(job)
    if body.return_token_ids:
        extra["token_ids"] = list(job.output_ids)
    return extra


async def _serve(raw: HTTPRequest, state: ServerState, body, prompt: list[int], chat: bool):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(event) -> None:  # engine thread
        loop.call_soon_threadsafe(events.put_nowait, event)

    try:
        job = _build_job(state, body, prompt, sink)
    except APIError:
        state.metrics.reject("invalid")
        raise
    try:
        state.scheduler.submit(job)
    except QueueFullError as exc:
        state.metrics.reject("queue_full")
        raise APIError(503, str(exc), kind="server_overloaded") from None
    except ShuttingDownError as exc:
        state.metrics.reject("shutting_down")
        raise APIError(503, str(exc), kind="server_unavailable") from None
    state.metrics.admitted(len(prompt))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        return StreamingResponse(_stream(state, body, job, events, rid, created, chat),
                                 media_type="text/event-stream")
    try:
        while not job.finished:
            try:
                event = await asyncio.wait_for(events.get(), _DISCONNECT_POLL)
            except asyncio.TimeoutError:
                if await raw.is_disconnected():
                    state.scheduler.cancel(job)
                    return Response(status_code=499)
                continue
            if event.finished:
                break
    finally:
        if not job.finished:
            state.scheduler.cancel(job)
    if job.finish_reason == "error":
        if not state.scheduler.accepting:  # ended by the shutdown, not by a fault of the engine
            raise APIError(503, f"the request did not finish: {job.error}", kind="server_unavailable")
        raise APIError(500, f"the request failed: {job.error}")
    text = job.text()
    choice = {"index": 0, "finish_reason": job.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(_choice_extras(body, job))
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name, "choices": [choice], "usage": _usage(job)}


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(state: ServerState, body, job: Job, events: asyncio.Queue, rid: str, created: int, chat: bool):
    """Server-sent events: a chunk per round that released text, a last chunk with ``finish_reason``, the usage
    chunk when ``stream_options.include_usage``, then ``[DONE]``. A client that goes away cancels the request."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish_reason=None, extras=None) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        if extras:
            choice.update(extras)
        return {"id": rid, "object": kind, "created": created, "model": state.model_name, "choices": [choice]}

    try:
        if chat:
            first = chunk(None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        while True:
            event = await events.get()
            if event.finished and event.finish_reason == "error":
                if event.text:
                    yield _sse(chunk(event.text))
                if not state.scheduler.accepting:  # ended by the shutdown
                    yield _sse(error_body(f"the request did not finish: {event.error}", "server_unavailable", None,
                                          503))
                else:
                    yield _sse(error_body(f"the request failed: {event.error}", "server_error", None, 500))
                break
            if event.text:
                yield _sse(chunk(event.text))
            if event.finished:
                yield _sse(chunk(None, event.finish_reason, _choice_extras(body, job)))
                if body.stream_options is not None and body.stream_options.include_usage:
                    usage = chunk(None)
                    usage["choices"] = []
                    usage["usage"] = _usage(job)
                    yield _sse(usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        if not job.finished:  # the client went away (the generator was closed or cancelled)
            state.scheduler.cancel(job)
