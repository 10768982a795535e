"""The public surface: ``load()`` returns an ``Engine`` with ``generate`` and ``stream``."""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import random
import sys
import time
import typing
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from causaldraft.adapt import (
    AdaptState,
    BudgetPolicy,
    VerifyCost,
    calibration_holds,
    calibration_name,
    flat_cost_tree,
    initial_adapt_state,
    measure_verify_cost,
    plausible_calibration,
)
from causaldraft.config import (
    PENALTIES,
    EngineConfig,
    SamplingConfig,
    bias_pairs,
    validate_max_new_tokens,
    validate_top_logprobs,
)
from causaldraft.decode import PROMPT_CHUNK, Decoder, DecodeState, GenerationStats, PromptRead, decode_steps
from causaldraft.drafters.registry import DrafterOptions, build_drafter
from causaldraft.errors import CausalDraftError
from causaldraft.logprobs import TokenLogprob
from causaldraft.models.base import Backend, Cache
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama
from causaldraft.prefix import PrefixStore
from causaldraft.sampling import make_generator
from causaldraft.threads import ThreadPolicy, prompt_on, thread_invariant

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]  # text, token ids or chat messages (``Engine.encode``)


def token_id(item: object) -> int:
    """A token id given as an int (or numpy / 0-d torch integer); a bool, float or str is a CausalDraftError."""
    if isinstance(item, bool):
        raise CausalDraftError(f"token ids are integers, got {item!r}")
    try:
        return operator.index(item)  # type: ignore[arg-type]
    except TypeError:
        raise CausalDraftError(f"token ids are integers, got {item!r}") from None


SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "seed", *PENALTIES, "logit_bias")  # SamplingConfig's fields
DEFAULT_MAX_NEW_TOKENS = 256  # a request's, when it names none
STOP_OPTIONS = ("stop", "stop_token_ids", "ignore_eos", "min_tokens")  # when the output ends
REQUEST_OPTIONS = ("max_new_tokens", *SAMPLING_OPTIONS, *STOP_OPTIONS, "chat", "chat_template_kwargs", "logprobs",
                   "prompt_logprobs")  # fmt: skip
UNTEMPLATED = (
    "chat_template_kwargs apply to a prompt rendered by the chat template: chat messages, or text with chat=True"
)
# Not template variables: the arguments of apply_chat_template and of the function it renders through (one of
# them would change how the call renders), and the variables that render call sets itself (the conversation goes
# to the template as ``messages``): passing one again is a TypeError inside transformers.
TEMPLATE_CALL_ARGUMENTS = frozenset(
    name for call in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template)
    for name in inspect.signature(call).parameters if name not in ("self", "kwargs")
) | {"messages", "tools", "documents", "add_generation_prompt"}  # fmt: skip


def check_request_options(options: Mapping[str, object]) -> None:
    """A request's options are ``REQUEST_OPTIONS`` (a misspelt one is a CausalDraftError, not a TypeError), with
    valid values (``Engine.start`` checks them again as it starts the request)."""
    unknown = sorted(set(options) - set(REQUEST_OPTIONS))
    if unknown:
        raise CausalDraftError(f"unknown request option {unknown[0]!r}; the options are {', '.join(REQUEST_OPTIONS)}")
    if "max_new_tokens" in options:
        validate_max_new_tokens(options["max_new_tokens"])
    sampling = {name: options[name] for name in SAMPLING_OPTIONS if name in options}
    if "logit_bias" in sampling:
        sampling["logit_bias"] = bias_pairs(sampling["logit_bias"] or ())
    SamplingConfig(**sampling)  # type: ignore[arg-type]
    stop_strings(options.get("stop"))
    stop_token_set(options.get("stop_token_ids"))
    ignore_eos, min_tokens = options.get("ignore_eos", False), options.get("min_tokens", 0)
    check_stop_options(ignore_eos, min_tokens, options.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    validate_top_logprobs(options.get("logprobs"))
    validate_top_logprobs(options.get("prompt_logprobs"), "prompt_logprobs")
    if not isinstance(options.get("chat", False), bool):
        raise CausalDraftError(f"chat must be True or False, got {options['chat']!r}")
    template_variables(options.get("chat_template_kwargs"))


def template_variables(value: object) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM's name): more variables for the chat template, such as Qwen3's
    ``{"enable_thinking": False}``; None or a dict by variable name."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(name, str) and name.isidentifier() for name in value):
        raise CausalDraftError(f"chat_template_kwargs must be a dict of template variables by name, got {value!r}")
    reserved = sorted(set(value) & TEMPLATE_CALL_ARGUMENTS)
    if reserved:
        raise CausalDraftError(f"chat_template_kwargs cannot set {reserved[0]!r}: it is an argument of the template's "
                               "call, not a variable of the template")  # fmt: skip
    return dict(value)


def stop_strings(stop: object) -> list[str]:
    """``stop`` as a list of non-empty strings: one string, a sequence of them, or None."""
    items = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else None
    if stop is not None and (items is None or not all(isinstance(item, str) for item in items)):
        raise CausalDraftError(f"stop must be a string or a list of strings, got {stop!r}")
    return [item for item in items or [] if item]


def stop_token_set(value: object) -> frozenset[int]:
    """``stop_token_ids`` (vLLM's): None or a list of token ids (checked against the vocabulary at the request)."""
    if value is None:
        return frozenset()
    if not isinstance(value, (list, tuple)):
        raise CausalDraftError(f"stop_token_ids must be a list of token ids, got {value!r}")
    return frozenset(token_id(item) for item in value)


def check_stop_options(ignore_eos: object, min_tokens: object, max_new_tokens: object) -> None:
    """``ignore_eos`` is a bool; ``min_tokens`` an integer from 0 to max_new_tokens (CausalDraftError otherwise)."""
    if not isinstance(ignore_eos, bool):
        raise CausalDraftError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise CausalDraftError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    if isinstance(max_new_tokens, int) and min_tokens > max_new_tokens:
        raise CausalDraftError(f"min_tokens {min_tokens} is more than max_new_tokens {max_new_tokens}")


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]  # new tokens only
    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    logprobs: list[TokenLogprob] | None = None  # one per token id, with ``logprobs=`` (logprobs.py)
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token but the first, with ``prompt_logprobs=``


@dataclass(frozen=True)
class StreamPiece:
    text: str
    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, with ``logprobs=``


@dataclass(frozen=True)
class Completion:
    """The last item of ``Engine.events``: the request's own stats (tokens up to a stop string
    counted, the rest not) and why it ended. Absent when the consumer stops early."""

    stats: GenerationStats
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    prompt_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.. (``prompt_logprobs=``)


@dataclass
class Engine:
    model: LoadedModel
    decoder: Decoder
    drafter_name: str
    adapt: AdaptState
    threads: ThreadPolicy  # each step's thread count (carries over between requests, as ``adapt``)
    prefixes: PrefixStore | None = None  # prompt prefixes kept between requests (prefix.py); None: off

    @property
    def compiled(self) -> bool:
        backend = self.model.backend
        return isinstance(backend, NativeLlama) and backend.compiled

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.model.tokenizer

    def encode(
        self, prompt: Prompt, chat: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """A prompt's token ids. ``prompt``: text (with ``chat``, the user's message in the chat template),
        chat messages (``[{"role": "system", "content": ...}, {"role": "user", ...}]``, always through the
        template), or token ids, taken as they are. ``chat_template_kwargs``: more template variables
        (``encode_chat``), for a prompt that goes through the template. Anything else is a CausalDraftError."""
        if isinstance(prompt, str):
            if chat_template_kwargs is not None and not chat:
                raise CausalDraftError(UNTEMPLATED)
            if chat:
                return self.encode_chat([{"role": "user", "content": prompt}], chat_template_kwargs)
            return self.embeddable(list(self.tokenizer.encode(prompt, add_special_tokens=False)))
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            raise CausalDraftError(
                f"a prompt is text, chat messages or token ids, got {type(prompt).__name__} (decode bytes first)"
            )
        items = list(prompt)
        if items and all(isinstance(item, Mapping) for item in items):
            return self.encode_chat(typing.cast(list[Mapping[str, str]], items), chat_template_kwargs)
        if chat_template_kwargs is not None:
            raise CausalDraftError(UNTEMPLATED)
        odd = next((item for item in items if isinstance(item, (str, Mapping))), None)
        if odd is not None:
            raise CausalDraftError(f"a prompt list holds chat messages (dicts with a role and a content) or token ids "
                                   f"(ints), not both and not text: got {odd!r}")  # fmt: skip
        if chat:
            raise CausalDraftError("chat=True applies to a text prompt; token ids are taken as they are")
        ids = [token_id(item) for item in items]
        vocab = self.model.backend.shape.vocab_size
        if any(token < 0 or token >= vocab for token in ids):
            raise CausalDraftError(f"token ids must be in [0, {vocab})")
        return ids

    def embeddable(self, ids: list[int]) -> list[int]:
        """Text's token ids, checked against the model's embedding rows: a tokenizer can hold more tokens than
        its model's ``vocab_size`` (found by an audit: such an id crashed the first pass)."""
        vocab = self.model.backend.shape.vocab_size
        beyond = next((token for token in ids if token >= vocab), None)
        if beyond is not None:
            raise CausalDraftError(f"the prompt's text holds token id {beyond} ({self.tokenizer.decode([beyond])!r}), "
                                   f"past this model's {vocab} embedding rows: its tokenizer has more tokens than "
                                   "the model's vocab_size")  # fmt: skip
        return ids

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Chat messages through the model's chat template, with the assistant's turn opened;
        ``chat_template_kwargs``: more variables for the template (``template_variables``). A template that
        refuses the messages (some have no system role) is a CausalDraftError."""
        variables = template_variables(chat_template_kwargs)
        for message in messages:
            if (
                not isinstance(message, Mapping)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise CausalDraftError(f"a chat message is a dict with a str role and a str content, got {message!r}")
        if not self.tokenizer.chat_template:
            raise CausalDraftError("this model's tokenizer has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
        except jinja2.TemplateError as error:
            raise CausalDraftError(f"the chat template refused these messages: {error}") from None
        return self.embeddable(list(self.tokenizer.encode(text, add_special_tokens=False)))

    def start(
        self,
        prompt: Prompt,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        chat: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        decoder: Decoder | None = None,
        cache: Cache | None = None,
        read_prompt: bool = True,
    ) -> RequestRun:
        """Check a request, prefill its prompt and return its run, ready for decoding steps
        (``events`` drives one; a ``batch.Batch`` drives several together). ``decoder`` and
        ``cache``: a batched stream's own drafter and pool slot (default: the engine's, a new cache).
        ``read_prompt=False`` leaves the prompt to ``RequestRun.read_prompt`` (a batch reads it a
        chunk per step). ``logprobs``: each new token's log-probability with that many alternatives
        (0-20; None: none), in the stream's pieces (``logprobs.py``); ``prompt_logprobs``: the same for every
        prompt token but the first, in the ``Completion`` (read from the prompt's passes, ``PromptRead``). The
        penalties and ``logit_bias`` ({token id: bias in [-100, 100]}): ``penalties.py``. vLLM's ``stop_token_ids``
        (more tokens that end the output, kept in it like EOS), ``ignore_eos`` (EOS does not end it) and
        ``min_tokens`` (no stop token before this many new tokens). Raises CausalDraftError for bad input."""
        decoder = decoder or self.decoder
        if not isinstance(chat, bool):
            raise CausalDraftError(f"chat must be True or False, got {chat!r}")
        max_new_tokens = validate_max_new_tokens(max_new_tokens)
        sampling = SamplingConfig(temperature, top_p, top_k, seed, presence_penalty, frequency_penalty,
                                  repetition_penalty, bias_pairs(logit_bias or ()))  # fmt: skip
        vocab = self.model.backend.shape.vocab_size
        if any(token >= vocab for token, _ in sampling.logit_bias):
            raise CausalDraftError(f"logit_bias keys are token ids below the vocabulary's size, {vocab}")
        check_stop_options(ignore_eos, min_tokens, max_new_tokens)
        extra_stops = stop_token_set(stop_token_ids)
        if any(token < 0 or token >= vocab for token in extra_stops):
            raise CausalDraftError(f"stop_token_ids must be token ids in [0, {vocab})")
        stops = stop_strings(stop)
        top_logprobs = validate_top_logprobs(logprobs)
        top_prompt_logprobs = validate_top_logprobs(prompt_logprobs, "prompt_logprobs")
        prompt_ids = self.encode(prompt, chat, chat_template_kwargs)
        generator = None if sampling.greedy else make_generator(seed)
        gumbel = not sampling.greedy and decoder.decode.sampler == "gumbel" and decoder.decode.acceptance == "lossless"
        # Greedy and Gumbel-sampled output does not depend on the tree, so those requests use the
        # engine's measured cost model. A seeded request under rejection sampling adapts from a
        # fresh state without timing-based decisions, so the same seed gives the same tokens (tree
        # shapes, and so random draws, never depend on the clock; nor its drafter's numbers on the
        # thread count).
        seeded = seed is not None and not sampling.greedy and not gumbel
        threads = None if seeded else self.threads
        started = time.perf_counter()
        prompt_read = PromptRead(decoder, prompt_ids, max_new_tokens, generator, cache, self.prefixes,
                                 top_prompt_logprobs)  # fmt: skip
        state = prompt_read.state
        if gumbel:
            state.noise_seed = seed if seed is not None else random.getrandbits(63)
        if top_logprobs is not None:
            state.logprobs, state.top_logprobs = [], top_logprobs
        state.stop_token_ids = (frozenset() if ignore_eos else decoder.eos_token_ids) | extra_stops
        state.min_tokens = min_tokens
        adapt = initial_adapt_state(decoder.tree, timed=False) if seeded else self.adapt
        if decoder is not self.decoder:
            adapt = copy.deepcopy(adapt)  # a batched stream adapts on its own
        policy = BudgetPolicy(decoder.tree, decoder.decode, decoder.cost, adapt)
        run = RequestRun(decoder, state, policy, sampling, max_new_tokens, TextTracker(self.tokenizer, stops),
                         len(prompt_ids), started, threads, prompt_read)  # fmt: skip
        if read_prompt:
            run.read_prompt()
        return run

    def events(self, prompt: Prompt, **options: Any) -> Iterator[StreamPiece | Completion]:
        """The streaming core: text deltas with their tokens, then one ``Completion``. Nothing about
        the request is left on the engine (its adaptation state carries over, by design). Options:
        those of ``start`` (``REQUEST_OPTIONS``), checked at once; the request starts at the first ``next``."""
        check_request_options(options)
        return self.run_events(prompt, options)

    def run_events(self, prompt: Prompt, options: dict[str, Any]) -> Iterator[StreamPiece | Completion]:
        run = self.start(prompt, **options)
        steps = decode_steps(run.decoder, run.state, run.policy, run.sampling, run.max_new_tokens, run.threads)
        for emitted in steps:
            yield from run.absorb(emitted)
            if run.text.stopped:
                break
        yield from run.finish()

    def stream(self, prompt: Prompt, **options: object) -> Iterator[str]:
        """The text as it is decoded (options as ``generate``; bad ones are refused here, at the call)."""
        events = self.events(prompt, **options)
        return (item.text for item in events if isinstance(item, StreamPiece) and item.text)

    def generate(self, prompt: Prompt, **options: object) -> Generation:
        return as_generation(list(self.events(prompt, **options)), options.get("logprobs") is not None)

    def generate_batch(self, prompts: Sequence[Prompt], size: int = 8, **options: Any) -> list[Generation]:
        """Generate for every prompt, ``size`` decoded together (continuous batching: each step's
        trees share one target pass; a finished prompt's place goes to the next). Each result is
        what ``generate`` gives for that prompt alone. Options: as ``generate``."""
        from causaldraft.batch import generate_batch  # batch builds on this module

        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise CausalDraftError(f"generate_batch takes a list of prompts, got {type(prompts).__name__}")
        check_request_options(options)
        return generate_batch(self, prompts, size, **options)


@dataclass
class RequestRun:
    """One request in progress: its decoder, decode state, budget policy and text (stop strings)."""

    decoder: Decoder
    state: DecodeState
    policy: BudgetPolicy
    sampling: SamplingConfig
    max_new_tokens: int
    text: TextTracker
    prompt_tokens: int
    started: float
    threads: ThreadPolicy | None  # the engine's, or None: torch's count (a seeded request, whose drafter's
    # numbers, and so its random draws, must not depend on the machine's load)
    prompt_read: PromptRead  # the prompt's prefill, read before the first step
    kept_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.state.finished or self.text.stopped

    @property
    def reading(self) -> bool:
        """The prompt is not all cached yet: no decoding step may run."""
        return not self.prompt_read.done

    def read_prompt(self, rows: int | None = None) -> int:
        """Cache the prompt's next chunks, on all threads (``ThreadPolicy.prompt``), until at least ``rows``
        rows are read (None: the whole prompt); returns the rows read."""
        read = 0
        with prompt_on(self.threads):
            while not self.prompt_read.done and (rows is None or read < rows):
                read += self.prompt_read.advance()
        return read

    def absorb(self, emitted: list[int]) -> list[StreamPiece]:
        """A step's emitted tokens -> the text that may be shown (a stop string ends it there), with the
        kept tokens' log-probabilities when asked for (the state's last ``len(emitted)``)."""
        kept, delta = self.text.add(emitted)
        self.kept_tokens += kept
        logprobs = self.state.logprobs
        step_logprobs = () if logprobs is None else tuple(logprobs[len(logprobs) - len(emitted) :][:kept])
        return [StreamPiece(delta, emitted[:kept], step_logprobs)] if kept or delta else []

    def finish(self) -> list[StreamPiece | Completion]:
        """The held-back text, then the ``Completion``."""
        tail = self.text.flush()
        pieces: list[StreamPiece | Completion] = [StreamPiece(tail, [])] if tail else []
        # a stop string ends the output there: the tokens after it are not this request's output
        reason = "stop" if self.text.stopped else (self.state.finish_reason or "stop")
        stats = replace(self.state.stats, new_tokens=self.kept_tokens, wall_s=time.perf_counter() - self.started)
        scored = self.prompt_read.scored
        return [*pieces, Completion(stats, reason, self.prompt_tokens, None if scored is None else tuple(scored))]


def as_generation(events: list[StreamPiece | Completion], logprobs: bool) -> Generation:
    """A request's events (ending with its ``Completion``) as one ``Generation``; ``logprobs``: they were asked for."""
    completion = events[-1]
    if not isinstance(completion, Completion):
        raise AssertionError("a request's events end with a Completion")
    pieces = [event for event in events if isinstance(event, StreamPiece)]
    text = "".join(piece.text for piece in pieces)
    ids = [token for piece in pieces for token in piece.token_ids]
    entries = [entry for piece in pieces for entry in piece.logprobs] if logprobs else None
    scored = None if completion.prompt_logprobs is None else list(completion.prompt_logprobs)
    return Generation(text, ids, completion.stats, completion.finish_reason, entries, scored)


class TextTracker:
    """Incremental detokenisation with exact stop strings.

    ``add`` returns how many of the new tokens are kept (a stop string ends the output at the
    token that completes it) and the text that is safe to show: text that could still grow into a
    stop string, or an incomplete UTF-8 character, is held back.

    ``text`` is what decoding the whole output gives, kept up to date by decoding only a window: the tokens
    since the last character completed, after the ones before them (the window's first tokens are decoded
    again and their text subtracted, so a decoder's rules at the start of a decode, such as dropping a leading
    space, do not reach the new text). This is the offset scheme of text-generation-inference and vLLM
    (``tokenizers.decoders.DecodeStream`` runs it too, but shows nothing of a character still incomplete, and
    a stop string may end on its first bytes: " and" then half an emoji). A token then costs the same at the
    10th and the 4,000th; decoding the whole output at every step (once per token with stop strings) made long
    outputs quadratic: 0.5 ms a decode at 2,048 tokens, 1.0 ms at 4,096 (the default model's tokenizer). A
    tokenizer whose decode cleans up spaces (a rule over the whole text) is decoded whole, as is an output
    whose window ever disagrees with the text before it."""

    def __init__(self, tokenizer, stops: list[str]) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest_stop = max(map(len, stops), default=0)
        self.ids: list[int] = []
        self.shown = 0
        self.text = ""
        self.stopped = False
        self.windowed = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.window = 0  # the window's first token
        self.settled = 0  # tokens whose characters are complete (the window's new tokens start here)
        self.settled_text = ""  # their text
        self.known = ""  # the text of ids[window:settled] decoded alone

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def extend(self, token: int) -> None:
        """One more token: ``text`` becomes the whole output's text."""
        self.ids.append(token)
        if self.windowed:
            decoded = self.decode(self.ids[self.window :])
            if decoded.startswith(self.known):
                tail = decoded[len(self.known) :]
                self.text = self.settled_text + tail
                if tail and not tail.endswith("\ufffd"):  # its characters are complete: the window moves on
                    self.settled_text = self.text
                    self.window, self.settled = self.settled, len(self.ids)
                    self.known = self.decode(self.ids[self.window :])
                return
            self.windowed = False
        self.text = self.decode(self.ids)

    def add(self, tokens: list[int]) -> tuple[int, str]:
        for count, token in enumerate(tokens, 1):
            settled = len(self.settled_text)
            self.extend(token)
            if self.stops:
                # every earlier text was searched, and the settled text begins every later one: a new stop
                # string ends past it (the rest, a held-back U+FFFD, may have become another character); a whole
                # decode is searched whole
                start = max(0, settled - self.longest_stop + 1) if self.windowed else 0
                found = [at for stop in self.stops if (at := self.text.find(stop, start)) >= 0]
                if found:
                    self.text = self.text[: min(found)]
                    self.stopped = True
                    return count, self.take(final=True)
        return len(tokens), self.take(final=False)

    def take(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            for stop in self.stops:
                for size in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[:end].endswith(stop[:size]):
                        end -= size
                        break
        end = max(end, self.shown)
        delta = self.text[self.shown : end]
        self.shown = end
        return delta

    def flush(self) -> str:
        return self.take(final=True)


@contextlib.contextmanager
def quiet_graph_builds() -> Iterator[None]:
    """Building a compiled graph of an int4 model makes torch 2.13 deep-copy an FX graph, and with it a
    pytree ``LeafSpec``, a class torch itself deprecated: one FutureWarning per graph that says nothing a
    user can act on. It is hidden here; any other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        yield


def compile_backend(target: LoadedModel, progress: bool = True) -> bool:
    """Run the target's passes through compiled graphs (built once, then loaded from disk).
    Returns False, after one line saying why, where no compiler is available."""
    from causaldraft.models.compiled import compile_model, compiler_available

    backend = target.backend
    if not isinstance(backend, NativeLlama):
        raise CausalDraftError("compiling needs the native backend (--backend native)")
    if backend.compiled:
        return True
    reason = compiler_available()
    if reason is not None:
        print(f"causaldraft: running eagerly: {reason}", file=sys.stderr)
        return False
    with quiet_graph_builds():
        compile_model(backend, progress=progress)
    return True


def check_graph_features(backend: Backend, drafter: str, feature_layers: tuple[int, ...]) -> None:
    """Refuse a drafter reading the features of layers the compiled graphs do not return: its verify passes
    would run eagerly while plain decoding runs the graphs, and the two may round a row differently
    (docs/exactness.md), which would break token-identity with plain decoding."""
    if not isinstance(backend, NativeLlama) or not backend.compiled:
        return
    missing = sorted(set(feature_layers) - set(backend.graph_aux_layers))
    if missing:
        raise CausalDraftError(
            f"drafter {drafter} reads the features of layers {tuple(feature_layers)}, but the compiled graphs return"
            f" those of layers {backend.graph_aux_layers} only (missing {tuple(missing)}); run it without compiled"
            " graphs (--no-compile, or compile=False)"
        )


def verify_cost(backend: Backend, max_nodes: int, aux_layers: tuple[int, ...], remeasure: bool = False) -> VerifyCost:
    """The measured cost of verify passes. With compiled graphs it is measured once and kept
    beside them (``remeasure`` times it again, as does a kept one whose smallest or largest pass no longer
    takes what it kept, ``calibration_holds``); the decode loop refines it from every step."""
    store = backend.calibration
    name = calibration_name(f"max_nodes={max_nodes}", aux_layers, backend)
    if store is not None and not remeasure:
        seconds = store.read_calibration(name)
        if seconds and plausible_calibration(seconds):
            ends = (min(seconds), max(seconds))
            now = measure_verify_cost(backend, max(ends), repeats=3, aux_layers=aux_layers, sizes=ends)
            if calibration_holds(seconds, now):
                return VerifyCost(seconds, buckets=backend.buckets)
    cost = measure_verify_cost(backend, max_nodes, aux_layers=aux_layers)
    if store is not None:
        store.write_calibration(name, cost.seconds)
    return cost


def load(
    config: EngineConfig | str | None = None, dtype: str | None = None, *, loaded: LoadedModel | None = None,
    **options: Any,
) -> Engine:  # fmt: skip
    """Load a target model and a drafter into an engine.

    ``config`` holds every setting; a model name or path there, ``dtype`` and keyword arguments
    (the fields of ``EngineConfig``) are a convenience that builds one:
    ``load("default", drafter="lookup")``. ``loaded`` reuses an already loaded target (the bench
    shares one across methods).
    """
    if isinstance(config, str):
        config, options = None, {"model": config, **options}
    if dtype is not None:
        options["dtype"] = dtype
    if config is None:
        try:
            config = EngineConfig(**options)
        except TypeError as error:  # an unknown keyword
            raise CausalDraftError(f"unknown engine setting: {error}") from None
    elif options:
        raise CausalDraftError("pass either an EngineConfig or keyword settings, not both")
    target = loaded or load_model(config.model, config.backend, config.dtype)
    if config.compiled:
        compile_backend(target)
    drafter_options = DrafterOptions(draft_model=config.draft_model, draft_layers=config.draft_layers,
                                     heads=config.heads, lookup_merge=config.lookup_merge, store=config.store,
                                     use_store=config.use_store)  # fmt: skip
    chosen = build_drafter(config.drafter, target, drafter_options, target.dtype)
    check_graph_features(target.backend, chosen.name, chosen.feature_layers)
    tree_config = config.tree_config
    if config.calibrate:
        cost = verify_cost(target.backend, tree_config.max_nodes, chosen.feature_layers)
        tree_config = flat_cost_tree(tree_config, cost, config.depth is not None, config.lookup_depth is not None)
    else:
        cost = VerifyCost({1: 1.0, 64: 1.0})
    ends = target.end_token_ids()  # the tokenizer's EOS and generation_config.json's
    decoder = Decoder(target.backend, chosen, tree_config, config.decode_config, cost, ends, target.prefill)
    full = torch.get_num_threads()
    adapt_threads = config.adapt_threads and thread_invariant(target.backend, full, target.prefill)
    threads = ThreadPolicy(full, VerifyCost(dict(cost.seconds), buckets=cost.buckets), enabled=adapt_threads)
    prefixes = PrefixStore(config.prefix_cache_mb << 20, PROMPT_CHUNK) if config.prefix_cache_mb else None
    return Engine(target, decoder, chosen.name, initial_adapt_state(tree_config), threads, prefixes)
