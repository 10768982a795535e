"""The engine worker: one thread runs the active requests together (continuous batching).

The engine is not thread-safe, so only this thread touches it. Prompts are tokenized and checked
against the context before a job is queued (``prepare``, on another thread), so a huge or invalid
request never stalls the engine. The thread keeps up to ``max_batch`` jobs in a ``batch.Batch``:
each loop admits waiting jobs while there is room, runs one step of the batch (a chunk of the
joining jobs' prompts, then one decoding step of every job whose prompt is read, in one target
pass), and delivers what each produced. A job reports events
through a thread-safe ``deliver`` callback: ``Started`` (prompt accepted), ``PromptScored`` (the prompt's
log-probabilities, once it is read, when the request asked for them), ``Piece`` (text delta), then exactly one
of ``Finished`` or ``Failed``. A job whose ``cancelled`` flag is set (the client
went away) leaves the batch at the next step, or is skipped if it has not started yet.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from causaldraft.api import Completion, Engine
from causaldraft.batch import Batch, Stream
from causaldraft.config import PENALTIES
from causaldraft.errors import CausalDraftError
from causaldraft.logprobs import TokenLogprob
from causaldraft.serve.metrics import Metrics

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 512  # chat has no OpenAI default: capped by the context left
DEFAULT_MAX_BATCH = 8  # requests decoded together
DEFAULT_MAX_QUEUE = 16  # requests waiting beyond those (more get 429)


class QueueFull(Exception):
    """The bounded queue has no room: the server answers 429."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict[str, str]] | None  # chat: rendered with the model's chat template
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    top_k: int = 0  # 0: off
    logprobs: int | None = None  # alternatives per token in the pieces' log-probabilities; None: none
    penalties: tuple[float, float, float] = (0.0, 0.0, 1.0)  # presence, frequency, repetition (penalties.py)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: more tokens that end the output
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # alternatives per prompt token (completions' echo with logprobs); None: none
    chat_template_kwargs: dict[str, Any] | None = None  # chat: more variables for the template

    @property
    def default_max_tokens(self) -> int:
        return DEFAULT_CHAT_TOKENS if self.messages is not None else DEFAULT_COMPLETION_TOKENS


@dataclass(frozen=True)
class PreparedRequest:
    """A request tokenized and checked against the context: what the engine thread runs."""

    request: GenerationRequest
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class PromptScored:
    logprobs: tuple[TokenLogprob, ...]  # prompt tokens 1.. (``PromptRead.scored``)


@dataclass(frozen=True)
class Piece:
    text: str
    token_count: int
    logprobs: tuple[TokenLogprob, ...] = ()  # the piece's tokens', when the request asked for them


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens copied from a kept prefix (prefix.py), not read again


@dataclass(frozen=True)
class Failed:
    status: int  # 400 for a user error, 500 for a server fault
    message: str
    param: str | None = None


Event = Started | PromptScored | Piece | Finished | Failed


@dataclass
class Job:
    request: PreparedRequest
    deliver: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Owns the engine, the batch and the queue; ``submit`` is safe from any thread."""

    def __init__(self, engine: Engine, metrics: Metrics, max_queue: int, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_queue < 1:
            raise CausalDraftError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise CausalDraftError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.batch = Batch(engine, max_batch, self.context_length)
        self.jobs: queue.Queue[Job] = queue.Queue()
        # admitted jobs: those running plus at most max_queue waiting (a job counts from submit, so
        # a burst that arrives before the worker picks its first jobs is counted right)
        self.admitted = threading.BoundedSemaphore(max_queue + max_batch)
        self.active: dict[int, Active] = {}  # stream ident -> its job
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="causaldraft-engine", daemon=True)
        self.looping = False  # the loop runs (on its own thread or the caller's: run_while)

    @property
    def context_length(self) -> int:
        return self.engine.model.backend.shape.max_positions

    @property
    def queue_depth(self) -> int:
        return self.jobs.qsize()

    @property
    def running(self) -> int:
        """Requests being generated now."""
        return len(self.active)

    @property
    def alive(self) -> bool:
        return self.looping or self.thread.is_alive()

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def submit(self, job: Job) -> None:
        if not self.admitted.acquire(blocking=False):
            raise QueueFull(f"the server is busy: {self.max_queue} requests are already waiting")
        self.jobs.put_nowait(job)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Tokenize and check the prompt and max_tokens against the context (any thread; the
        tokenizer is only read). Raises CausalDraftError for a user error."""
        engine = self.engine
        if request.messages is not None:
            prompt_ids = engine.encode_chat(request.messages, request.chat_template_kwargs)
        else:
            assert request.prompt is not None
            prompt_ids = engine.encode(request.prompt)
        if not prompt_ids:
            raise CausalDraftError("the prompt is empty")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise CausalDraftError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.context_length} tokens"
            )
        max_tokens = request.max_tokens if request.max_tokens is not None else min(request.default_max_tokens, room)
        if max_tokens > room:
            raise CausalDraftError(
                f"max_tokens {max_tokens} + prompt of {len(prompt_ids)} tokens exceeds the model's context "
                f"of {self.context_length} tokens"
            )
        return PreparedRequest(request, prompt_ids, max_tokens)

    def run_while(self, condition: Callable[[], bool]) -> None:
        """Run the engine loop on the calling thread while ``condition()`` holds (or until
        ``stop``). Run it on the thread that loaded the model: torch's OpenMP threads belong to the
        thread that starts a parallel region, and a second thread's pool makes both throttle their
        spinning (measured, int4 batch of 8: 29 ms per pass on the loading thread, 41 ms on another)."""
        self.loop(condition)

    def loop(self, condition: Callable[[], bool] = lambda: True) -> None:
        self.looping = True
        try:
            while not self.stopping.is_set() and condition():
                self.tick()
        finally:
            self.looping = False

    def tick(self) -> None:
        """Admit waiting jobs, run one step of the active ones and deliver what they produced."""
        self.admit()
        if not self.active:
            return
        try:
            self.batch.step()
        except Exception as error:  # the worker must survive any fault; the step's jobs fail
            log.exception("a decoding step failed")
            for ident in list(self.active):
                self.leave(ident, "failed", Failed(500, f"internal error: {type(error).__name__}: {error}"))
            return
        if self.batch.last_step is not None:
            self.metrics.record_step(self.batch.last_step.streams)
        self.flush()

    def admit(self) -> None:
        """Start waiting jobs while the batch has room (blocking briefly when it is idle)."""
        while self.batch.free and not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.2) if not self.active else self.jobs.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self.metrics.record_outcome("cancelled")
                self.admitted.release()
                continue
            self.begin(job)

    def begin(self, job: Job) -> None:
        """Check and prefill one job into the batch; a failure is reported and never kills the worker."""
        request, prompt_ids, max_tokens = job.request.request, job.request.prompt_ids, job.request.max_tokens
        self.deliver(job, Started(len(prompt_ids), max_tokens))
        try:
            stream = self.batch.add(prompt_ids, max_new_tokens=max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, top_k=request.top_k, seed=request.seed,
                                    stop=request.stop, logprobs=request.logprobs, logit_bias=request.logit_bias,
                                    stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
                                    min_tokens=request.min_tokens, prompt_logprobs=request.prompt_logprobs,
                                    **dict(zip(PENALTIES, request.penalties, strict=True)))  # fmt: skip
        except CausalDraftError as error:
            self.end(job, "rejected", Failed(400, str(error), param_of(str(error), request)))
            return
        except Exception as error:
            log.exception("starting a generation failed")
            self.end(job, "failed", Failed(500, f"internal error: {type(error).__name__}: {error}"))
            return
        self.active[stream.ident] = Active(job, stream, time.perf_counter())

    def flush(self) -> None:
        """Deliver what each job's stream produced; finished and cancelled jobs leave the batch."""
        for ident, active in list(self.active.items()):
            if active.job.cancelled.is_set():
                self.leave(ident, "cancelled", None)
                continue
            scored = active.stream.run.prompt_read.scored
            if scored is not None and not active.scored_sent and not active.stream.run.reading:
                active.scored_sent = True
                self.deliver(active.job, PromptScored(tuple(scored)))
            for item in active.stream.events:
                if isinstance(item, Completion):
                    seconds = time.perf_counter() - active.started
                    self.metrics.record_generation(item.stats, item.prompt_tokens, seconds)
                    done = Finished(item.finish_reason, item.prompt_tokens, active.completion_tokens,
                                    item.stats.cached_prompt_tokens)  # fmt: skip
                    self.leave(ident, "completed", done)
                    break
                active.completion_tokens += len(item.token_ids)
                self.deliver(active.job, Piece(item.text, len(item.token_ids), item.logprobs))
            active.stream.events.clear()

    def leave(self, ident: int, outcome: str, event: Event | None) -> None:
        active = self.active.pop(ident)
        self.batch.remove(active.stream)
        self.end(active.job, outcome, event)

    def end(self, job: Job, outcome: str, event: Event | None) -> None:
        if event is not None:
            self.deliver(job, event)
        self.metrics.record_outcome(outcome)
        self.admitted.release()

    def deliver(self, job: Job, event: Event) -> None:
        try:
            job.deliver(event)
        except RuntimeError:  # the server's event loop is gone (shutdown): nobody is listening
            job.cancelled.set()


@dataclass
class Active:
    """A job in the batch: its stream, when it started and the tokens delivered so far."""

    job: Job
    stream: Stream
    started: float
    completion_tokens: int = 0
    scored_sent: bool = False  # its PromptScored was delivered


def param_of(message: str, request: GenerationRequest) -> str | None:
    """The request field a user error is about, for the OpenAI error body."""
    param = message_param(message)
    return "messages" if param == "prompt" and request.messages is not None else param


def message_param(message: str) -> str | None:
    for name, param in (("chat_template_kwargs", "chat_template_kwargs"),
                        ("logit_bias", "logit_bias"), ("stop_token_ids", "stop_token_ids"),
                        ("min_tokens", "min_tokens"), ("max_new_tokens", "max_tokens"), ("max_tokens", "max_tokens"),
                        ("prompt", "prompt"),
                        ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
                        ("logprobs", "logprobs"), ("presence_penalty", "presence_penalty"),
                        ("frequency_penalty", "frequency_penalty"), ("repetition_penalty", "repetition_penalty"),
                        ("token ids", "prompt"), ("chat template", "messages")):  # fmt: skip
        if name in message:
            return param
    return None
