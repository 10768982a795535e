"""The FastAPI app: OpenAI-compatible endpoints in front of one engine worker.

``create_app(engine)`` builds everything the server needs (worker, queue, metrics) and returns the
app; nothing is global. Every error leaves as an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from causaldraft.api import Engine
from causaldraft.errors import CausalDraftError
from causaldraft.logprobs import TokenLogprob
from causaldraft.serve.logprob_bodies import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    vllm_prompt_logprobs,
)
from causaldraft.serve.metrics import Metrics
from causaldraft.serve.schemas import (
    MAX_REQUEST_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationParams,
    TokenizeRequest,
)
from causaldraft.serve.worker import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    Piece,
    PromptScored,
    QueueFull,
    Started,
    Worker,
    message_param,
    param_of,
)

log = logging.getLogger(__name__)
RequestModel = TypeVar("RequestModel", bound=BaseModel)
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there
KNOWN_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/tokenize",
               "/detokenize", "/tokenizer_info")  # fmt: skip
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error"}  # fmt: skip
RETRY_AFTER_S = 1  # told to clients refused with 429
TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}  # pydantic's union-member names in error paths


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def read_body(request: Request) -> bytes:
    """The request body, refused (413) past MAX_REQUEST_BYTES before it is all read or parsed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_REQUEST_BYTES} bytes", None, "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_REQUEST_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_REQUEST_BYTES} bytes", None,
                               "request_too_large")  # fmt: skip
            chunks.append(chunk)
    except ClientDisconnect:  # the client left mid-body: nobody to answer (counted as 499)
        raise ClientGone() from None
    return b"".join(chunks)


def field_path(location: tuple[int | str, ...]) -> list[str]:
    """An error location without pydantic's type tags: ('stop', 'list[str]') -> ['stop'];
    ('messages', 0, 'content', 'constrained-str') -> ['messages', '0', 'content']."""
    path: list[str] = []
    for part in location:
        text = str(part)
        if isinstance(part, str) and (text in TYPE_TAGS or "[" in text or "-" in text or text[:1].isupper()):
            break
        path.append(text)
    return path


def parse_body(model: type[RequestModel], raw: bytes) -> RequestModel:
    """Validate a JSON body; the first problem becomes a 400 naming the offending parameter."""
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {first['msg']}", None, "invalid_json") from None
        location = field_path(tuple(first["loc"]))
        named = (first.get("ctx") or {}).get("param")  # a whole-body check naming its parameter (schemas.body_error)
        if not location and named:
            raise ApiError(400, first["msg"], named, first["type"]) from None
        if not location:
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_body") from None
        param = ".".join(location)
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"invalid parameter {param}: {message}", location[0], first["type"]) from None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # OpenAI's prompt_tokens_details.cached_tokens: prompt tokens not read again

    def body(self) -> dict[str, Any]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": total, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}  # fmt: skip


class Mailbox:
    """Carries the worker thread's events to the event loop with one wake-up per batch of them:
    a decoding step delivers an event to each of its requests, and waking the loop for each one
    made the two threads trade the interpreter lock several times per step (measured: a batch of 8
    at 68 tokens/s, against 140 without the server)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[tuple[Inbox, Event]] = []
        self.lock = threading.Lock()
        self.scheduled = False

    def post(self, inbox: Inbox, event: Event) -> None:  # called from the worker thread
        with self.lock:
            self.pending.append((inbox, event))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:  # on the event loop
        with self.lock:
            items, self.pending, self.scheduled = self.pending, [], False
        for inbox, event in items:
            inbox.events.put_nowait(event)


class Inbox:
    """Events from the worker thread, awaited on the server's event loop."""

    def __init__(self, mailbox: Mailbox) -> None:
        self.mailbox = mailbox
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.pending: asyncio.Future[Event] | None = None
        self.checked_at = time.monotonic()

    def check_due(self) -> bool:
        """True once per DISCONNECT_POLL_S: time to ask whether the client is still connected."""
        now = time.monotonic()
        if now - self.checked_at < DISCONNECT_POLL_S:
            return False
        self.checked_at = now
        return True

    def deliver(self, event: Event) -> None:  # called from the worker thread
        self.mailbox.post(self, event)

    async def next(self, timeout: float | None) -> Event | None:
        """The next event, or None after ``timeout`` seconds (the pending read is kept, never lost)."""
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait({self.pending}, timeout=timeout)
        if not done:
            return None
        event = self.pending.result()
        self.pending = None
        return event

    def close(self) -> None:
        if self.pending is not None:
            self.pending.cancel()


@dataclass(frozen=True)
class Echo:
    """The prompt a completion's answer starts with (``echo``): as sent (or its ids decoded) and its ids."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class Reply:
    """How one endpoint formats its answers: completions and chat differ only in the choice body."""

    chat: bool
    model: str
    request_id: str
    created: int
    texts: TokenTexts  # the tokens' texts, for log-probabilities
    logprobs: int | None = None  # alternatives per token in ``logprobs``; None: the request asked for none
    prompt_logprobs: int | None = None  # vLLM's ``prompt_logprobs`` (alternatives per prompt token); None: none

    def choice(
        self, text: str, finish_reason: str | None, stream: bool, entries: Sequence[TokenLogprob] = (), offset: int = 0,
        index: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """A choice with ``entries``' log-probabilities when asked for (``offset``: the text before, streaming)."""
        logprobs = None
        if self.logprobs is not None:
            logprobs = (
                chat_logprobs(entries, self.texts) if self.chat else completion_logprobs(entries, self.texts, offset)
            )
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        key = "delta" if stream else "message"
        content: dict[str, Any] = {"content": text} if stream else {"role": "assistant", "content": text}
        return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish_reason}

    def echo_choice(self, choice: Choice) -> dict[str, Any]:
        """A choice's echoed prompt as a completions choice, with its tokens' log-probabilities when asked for."""
        assert choice.echo is not None
        logprobs = None
        if self.logprobs is not None:
            assert choice.prompt_scored is not None, "a request with echo and logprobs scores its prompt"
            logprobs = echoed_logprobs(choice.echo.token_ids, choice.prompt_scored, self.texts, self.logprobs)
        return {"index": choice.index, "text": choice.echo.text, "logprobs": logprobs, "finish_reason": None}

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        """A finished choice's body (non-streamed), after its echoed prompt when asked for."""
        offset = 0 if choice.echo is None else len(choice.echo.text)
        body = self.choice("".join(choice.texts), choice.reason, False, choice.pending, offset, choice.index)
        if not self.chat and self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.scored_prompt(choice)
        if choice.echo is None:
            return body
        head = self.echo_choice(choice)
        body["text"] = head["text"] + body["text"]
        if body["logprobs"] is not None:
            body["logprobs"] = {key: head["logprobs"][key] + body["logprobs"][key] for key in body["logprobs"]}
        return body

    def scored_prompt(self, choice: Choice) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs`` of a choice's prompt (completions: in the choice; chat: the response's)."""
        assert choice.prompt_scored is not None and self.prompt_logprobs is not None
        return vllm_prompt_logprobs(choice.prompt_scored, self.texts, self.prompt_logprobs)

    def body(
        self, choices: list[dict[str, Any]], stream: bool, usage: Usage | None, include_usage: bool = False
    ) -> dict[str, Any]:
        """A response or stream chunk; chunks carry ``"usage": null`` when the client asked for usage."""
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                                "model": self.model, "choices": choices}  # fmt: skip
        if usage is not None or not stream or include_usage:
            body["usage"] = usage.body() if usage is not None else None
        return body


@dataclass
class Choice:
    """One of a request's answers (``n`` for each of its prompts): its job, its inbox, and what it has produced and
    not yet sent. ``index``: prompt_index * n + the answer's number, as OpenAI numbers them."""

    index: int
    prompt_index: int
    job: Job
    inbox: Inbox
    echo: Echo | None = None  # completions' ``echo``: the answer starts with its prompt
    texts: list[str] = field(default_factory=list)
    pending: list[TokenLogprob] = field(default_factory=list)  # log-probabilities not sent yet
    offset: int = 0  # the characters of the tokens sent so far (the legacy ``text_offset``)
    finished: Finished | None = None
    prompt_scored: tuple[TokenLogprob, ...] | None = None  # the prompt's log-probabilities (``echo``)

    @property
    def reason(self) -> str | None:
        return None if self.finished is None else self.finished.finish_reason

    def take(self, event: Event) -> None:
        """Keep a piece's text and log-probabilities, the prompt's, or the finish."""
        if isinstance(event, PromptScored):
            self.prompt_scored = event.logprobs
        elif isinstance(event, Piece):
            self.texts.append(event.text)
            self.pending.extend(event.logprobs)
        elif isinstance(event, Finished):
            self.finished = event


def cancel(choices: list[Choice]) -> None:
    """Stop every choice's job (those still queued are skipped, those running leave the batch)."""
    for choice in choices:
        choice.job.cancelled.set()
        choice.inbox.close()


def usage_of(choices: list[Choice]) -> Usage:
    """Each prompt counted once, every choice's tokens (as OpenAI counts ``n`` answers)."""
    done = [(choice.prompt_index, choice.finished) for choice in choices if choice.finished is not None]
    prompts = dict(reversed(done))  # each prompt's first finished answer
    return Usage(sum(finished.prompt_tokens for finished in prompts.values()),
                 sum(finished.completion_tokens for _, finished in done),
                 sum(finished.cached_tokens for finished in prompts.values()))  # fmt: skip


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_app(
    engine: Engine, max_queue: int = DEFAULT_MAX_QUEUE, model_name: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH, engine_thread: bool = True,
) -> FastAPI:  # fmt: skip
    """An app serving ``engine``, up to ``max_batch`` requests decoded together. With
    ``engine_thread`` its worker thread starts and stops with the app's lifespan; without, the
    caller runs the engine loop itself (``app.state.worker.run_while``), on the thread that loaded
    the model (``causaldraft serve`` does, see ``Worker.run_while``)."""
    metrics = Metrics()
    worker = Worker(engine, metrics, max_queue, max_batch)
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="causaldraft-tokenize")
    served_model = model_name or engine.model.model_dir.name
    token_texts = TokenTexts(engine.tokenizer)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            worker.start()
        try:
            yield
        finally:
            worker.stop()
            tokenizing.shutdown(wait=False, cancel_futures=True)

    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    def mailbox_of(loop: asyncio.AbstractEventLoop) -> Mailbox:
        return mailboxes.setdefault(loop, Mailbox(loop))

    app = FastAPI(title="causaldraft", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(StatusRecorder, metrics=metrics)  # type: ignore[arg-type]

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, error: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the metrics count the request as 499

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(error).__name__}: {error}")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        alive = worker.alive
        body = {"status": "ok" if alive else "worker stopped", "model": served_model,
                "queue_depth": worker.queue_depth, "running": worker.running}  # fmt: skip
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(worker.queue_depth, worker.max_queue, worker.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, Any]:
        return {"id": served_model, "object": "model", "created": created, "owned_by": "causaldraft",
                "context_length": worker.context_length, "dtype": engine.model.dtype,
                "compiled": engine.compiled}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != served_model:
            raise ApiError(404, f"model {model_id!r} is not served here; use {served_model!r}", "model",
                           "model_not_found")  # fmt: skip
        return model_card()

    # vLLM's tokenizer endpoints (lm-evaluation-harness finds them and needs no tokenizer of its own)
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(TokenizeRequest, await read_body(request))
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(tokenizing, token_ids_of, body)
        except CausalDraftError as error:
            param = message_param(str(error))
            if param in (None, "prompt"):
                param = "messages" if body.messages is not None else "prompt"
            raise ApiError(400, str(error), param) from None
        return {"count": len(ids), "max_model_len": worker.context_length, "tokens": ids}

    def token_ids_of(body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            messages = [{"role": item.role, "content": item.text()} for item in body.messages]
            return engine.encode_chat(messages, body.chat_template_kwargs)
        assert body.prompt is not None
        if body.add_special_tokens:
            return list(engine.tokenizer.encode(body.prompt, add_special_tokens=True))
        return engine.encode(body.prompt)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(DetokenizeRequest, await read_body(request))
        vocab = engine.model.backend.shape.vocab_size
        if any(token >= vocab for token in body.tokens):
            raise ApiError(400, f"token ids must be below the vocabulary's size, {vocab}", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tokenizer = engine.tokenizer
        return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
                "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
                "chat_template": tokenizer.chat_template, "model_max_length": worker.context_length}  # fmt: skip

    ignored: set[str] = set()  # fields already logged as ignored

    def note_ignored(body: GenerationParams) -> None:
        """Log each field the server does not read the first time a request sends it."""
        new = [name for name in body.ignored_fields() if name not in ignored]
        if new:
            ignored.update(new)
            log.warning("ignoring request fields this server does not use: %s", ", ".join(new))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_body(request))
        note_ignored(body)
        generations = [generation_request(body, prompt, None, body.max_tokens) for prompt in body.prompt_inputs()]
        if body.echo and body.logprobs is not None:  # the prompt's log-probabilities come with it
            scored = max(body.logprobs, body.prompt_logprobs or 0)
            generations = [replace(generation, prompt_logprobs=scored) for generation in generations]
        return await respond(request, body, generations, reply(False, "cmpl", body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_body(request))
        note_ignored(body)
        generation = generation_request(body, prompt=None, messages=body.chat_messages(),
                                        max_tokens=body.requested_max_tokens())  # fmt: skip
        generation = replace(generation, chat_template_kwargs=body.chat_template_kwargs)
        return await respond(request, body, [generation], reply(True, "chatcmpl", body))

    def reply(chat: bool, kind: str, body: GenerationParams) -> Reply:
        return Reply(chat, served_model, f"{kind}-{uuid.uuid4().hex}", int(time.time()), token_texts,
                     body.requested_logprobs(), body.prompt_logprobs)  # fmt: skip

    def generation_request(
        body: GenerationParams, prompt: str | list[int] | None, messages: list[dict[str, str]] | None,
        max_tokens: int | None,
    ) -> GenerationRequest:  # fmt: skip
        if body.model != served_model:
            raise ApiError(404, f"model {body.model!r} is not served here; use {served_model!r}", "model",
                           "model_not_found")  # fmt: skip
        if max_tokens is not None and max_tokens > worker.context_length:
            raise ApiError(400, f"max_tokens {max_tokens} exceeds the model's context of {worker.context_length} "
                           "tokens", "max_tokens")  # fmt: skip
        penalties = (body.presence_penalty, body.frequency_penalty, body.repetition_penalty)
        return GenerationRequest(prompt, messages, max_tokens, body.temperature, body.top_p, body.seed, body.stops(),
                                 body.sampling_top_k, body.requested_logprobs(), penalties, body.bias(),
                                 body.stop_token_ids or [], body.ignore_eos, body.min_tokens,
                                 body.prompt_logprobs)  # fmt: skip

    async def respond(
        request: Request, body: GenerationParams, generations: list[GenerationRequest], reply: Reply
    ) -> Response:
        """Run ``body.n`` answers to each prompt (``generations``: one per prompt) as jobs of the batch."""
        loop = asyncio.get_running_loop()
        capacity = worker.max_batch + worker.max_queue
        if body.n * len(generations) > capacity:
            param, asked = (
                ("n", f"n {body.n}")
                if len(generations) == 1
                else ("prompt", f"{len(generations)} prompts x n {body.n}")
            )
            raise ApiError(400, f"{asked} is more answers than this server runs and queues at once ({capacity}: its "
                           "--max-batch + --max-queue)", param)  # fmt: skip
        ready = []
        for generation in generations:
            try:
                ready.append(await loop.run_in_executor(tokenizing, worker.prepare, generation))
            except CausalDraftError as error:
                raise ApiError(400, str(error), param_of(str(error), generation)) from None
        choices: list[Choice] = []
        try:
            for prompt_index, (generation, prepared) in enumerate(zip(generations, ready, strict=True)):
                echo = echo_of(generation, prepared.prompt_ids) if body.echoes() else None
                for answer in range(body.n):  # answer i samples with seed + i (greedy: n equal answers)
                    seed = None if generation.seed is None else generation.seed + answer
                    inbox = Inbox(mailbox_of(loop))
                    job = Job(replace(prepared, request=replace(generation, seed=seed)), inbox.deliver)
                    worker.submit(job)
                    offset = 0 if echo is None else len(echo.text)
                    choices.append(
                        Choice(prompt_index * body.n + answer, prompt_index, job, inbox, echo, offset=offset)
                    )
        except QueueFull as error:
            cancel(choices)
            raise ApiError(429, str(error), None, "queue_full") from None
        try:
            # A stream starts once its first answer has: with more answers than the batch holds (n > --max-batch)
            # the later ones start only as earlier ones finish, and their start is an event of the stream.
            for choice in choices[:1] if body.stream else choices:
                first = await wait_event(request, choice.inbox, choice.job)
                if isinstance(first, Failed):
                    raise ApiError(first.status, first.message, first.param)
                assert isinstance(first, Started)
            if body.stream:
                return StreamingResponse(stream(choices, reply, body.include_usage), media_type="text/event-stream")
            return await collect(request, choices, reply)
        except ClientGone:
            cancel(choices)
            return Response(status_code=499)
        except BaseException:
            cancel(choices)
            raise

    def echo_of(generation: GenerationRequest, prompt_ids: list[int]) -> Echo:
        """A completion's prompt as its answer repeats it: the text as sent, or the token ids decoded."""
        prompt = generation.prompt
        return Echo(prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids), prompt_ids)

    async def wait_event(request: Request, inbox: Inbox, job: Job) -> Event:
        """The job's next event; every DISCONNECT_POLL_S, even while events flow, check the client is there."""
        while True:
            event = await inbox.next(DISCONNECT_POLL_S)
            if inbox.check_due() and await request.is_disconnected():
                job.cancelled.set()
                raise ClientGone
            if event is not None:
                return event

    async def collect(request: Request, choices: list[Choice], reply: Reply) -> JSONResponse:
        """Every choice's whole answer (the worker decodes them together; their events wait in their inboxes)."""
        for choice in choices:
            while choice.finished is None:
                event = await wait_event(request, choice.inbox, choice.job)
                if isinstance(event, Failed):
                    raise ApiError(event.status, event.message, event.param)
                choice.take(event)
        bodies = [reply.whole_choice(choice) for choice in choices]
        response = reply.body(bodies, False, usage_of(choices))
        if reply.chat and reply.prompt_logprobs is not None:
            response["prompt_logprobs"] = reply.scored_prompt(choices[0])  # vLLM's place for chat: the response's
        return JSONResponse(response)

    async def stream(choices: list[Choice], reply: Reply, include_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks, each choice's as its events come; if the client goes away, starlette cancels this generator
        and the jobs stop. Tokens whose text is held back (a stop string's start, part of a character) send their
        log-probabilities with the next text, or in a chunk of their own before the finishing one. An echoed prompt
        is each choice's first chunk (with its log-probabilities: once the prompt is read)."""

        def chunk(choice: Choice, text: str) -> bytes:
            body = reply.choice(text, None, True, choice.pending, choice.offset, choice.index)
            if body["logprobs"] is not None and not reply.chat:
                choice.offset += sum(len(token) for token in body["logprobs"]["tokens"])
            choice.pending.clear()
            return sse(reply.body([body], True, None, include_usage))

        waiting: dict[asyncio.Future[Event | None], Choice] = {}
        try:
            for choice in choices:
                if reply.chat:
                    first = reply.choice("", None, True, index=choice.index)
                    first["delta"]["role"] = "assistant"
                    first["logprobs"] = None
                    yield sse(reply.body([first], True, None, include_usage))
                if choice.echo is not None and reply.logprobs is None:
                    yield sse(reply.body([reply.echo_choice(choice)], True, None, include_usage))
                waiting[asyncio.ensure_future(choice.inbox.next(None))] = choice
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice, event = waiting.pop(task), task.result()
                    if isinstance(event, Failed):
                        error_type = ERROR_TYPES.get(event.status, "server_error")
                        yield sse({"error": {"message": event.message, "type": error_type, "param": event.param,
                                             "code": None}})  # fmt: skip
                        yield sse("[DONE]")
                        return
                    if isinstance(event, PromptScored) and choice.echo is not None:
                        choice.prompt_scored = event.logprobs
                        yield sse(reply.body([reply.echo_choice(choice)], True, None, include_usage))
                    if isinstance(event, Piece):
                        choice.pending.extend(event.logprobs)
                        if event.text:
                            yield chunk(choice, event.text)
                    if isinstance(event, Finished):
                        choice.finished = event
                        if choice.pending:
                            yield chunk(choice, "")
                        last = reply.choice("", event.finish_reason, True, index=choice.index)
                        last["logprobs"] = None
                        if reply.chat:
                            last["delta"] = {}  # OpenAI's last chunk: an empty delta with the finish reason
                        yield sse(reply.body([last], True, None, include_usage))
                    else:
                        waiting[asyncio.ensure_future(choice.inbox.next(None))] = choice
            if include_usage:
                yield sse(reply.body([], True, usage_of(choices)))
            yield sse("[DONE]")
        finally:
            for task in waiting:
                task.cancel()
            cancel(choices)

    return app


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def metrics_path(path: str) -> str:
    """The ``path`` label of a request: a known path, ``/v1/models/{id}``, or ``other``."""
    if path in KNOWN_PATHS:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


class StatusRecorder:
    """ASGI middleware counting responses by path and status (unknown paths count as ``other``)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = metrics_path(scope["path"])
        recorded = False

        async def recording_send(message: Message) -> None:
            nonlocal recorded
            if message["type"] == "http.response.start" and not recorded:
                recorded = True
                self.metrics.record_response(path, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except Exception:  # unhandled here: Starlette's outermost middleware answers it with a 500
            if not recorded:
                recorded = True
                self.metrics.record_response(path, 500)
            raise
        finally:
            if not recorded:  # the client left before any response started
                self.metrics.record_response(path, 499)
