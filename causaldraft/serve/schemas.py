"""Request bodies of the OpenAI-compatible endpoints, validated strictly (wrong types are 400s).

Unknown fields are ignored, as OpenAI-compatible servers commonly do (the app logs each one's name the first time
it is met, as vLLM warns of the fields it ignores: ``ignored_fields``); OpenAI parameters the server cannot honour
are rejected with a clear message when they ask for something (tools, a JSON response format: ``UNSUPPORTED``;
``echo`` in chat), never silently ignored. ``top_k`` and ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``
and ``min_tokens`` (vLLM's extensions; ``top_k`` 0 or -1: off) are honoured, and so are ``n`` (up to
``MAX_CHOICES``), several prompts in one completions request (each one's ``n`` answers, numbered as OpenAI numbers
them), ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and ``logprobs`` (completions: 0-20
alternatives per token; chat: ``logprobs: true`` with ``top_logprobs`` 0-20), vLLM's ``prompt_logprobs`` (0-20,
not streamed) and the legacy completions' ``echo`` (the prompt before the answer; with ``logprobs``, its tokens'
log-probabilities too, the first one null: what evaluation harnesses score).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from causaldraft.config import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS

MAX_PROMPT_CHARS = 1_000_000
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a whole request body; larger ones are refused before parsing (413)
MAX_STOPS = 4
MAX_CHOICES = 16  # n: answers per request (each one decoded as a request of the batch)

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI's presence and frequency penalties
RepetitionPenalty = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1)]
Stop = str | list[str] | None
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


def asks_nothing(value: object) -> bool:
    """An unsupported parameter left at what it means when absent: null, false, 0, "", [], {}."""
    return value is None or value is False or value == 0 or value in ("", [], {})


# OpenAI parameters this server cannot honour, and when a value asks for nothing it would have to do
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "best_of": lambda value: value is None or value == 1,
    "suffix": asks_nothing,
    "tools": asks_nothing,
    "tool_choice": lambda value: value in (None, "none", "auto"),
    "functions": asks_nothing,
    "function_call": lambda value: value in (None, "none", "auto"),
    "response_format": lambda value: value is None or (isinstance(value, dict) and value.get("type") == "text"),
}


def body_error(param: str, message: str) -> PydanticCustomError:
    """A whole-body validation error that still names its parameter (``ctx["param"]``, read by ``parse_body``)."""
    return PydanticCustomError("unsupported_parameter", "{message}", {"param": param, "message": message})


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: deprecated, accepted
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_parts_only(cls, content: object) -> object:
        """Named here, since the union's first member (str) would otherwise be the error reported."""
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, not {part.get('type')!r}")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class GenerationParams(BaseModel):
    """Parameters shared by both endpoints."""

    model_config = ConfigDict(strict=True, extra="allow")  # kept only to be named: ``ignored_fields``
    unsupported: ClassVar[dict[str, Callable[[object], bool]]] = UNSUPPORTED

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM's extension; 0 or -1: off
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # vLLM's extension; 1: off
    logit_bias: dict[str, Bias] | None = None  # token id (a JSON key, so a string) -> added to its logit
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's: more tokens that end the output
    ignore_eos: bool = False  # vLLM's: EOS does not end the output
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM's: no stop token before this many new tokens
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: each prompt token's, with this many alternatives
    stop: Stop = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def honoured_only(cls, body: Any) -> Any:
        """A parameter from ``unsupported`` that asks for something is refused, naming it."""
        if isinstance(body, dict):
            for name, unset in cls.unsupported.items():
                if name in body and not unset(body[name]):
                    raise body_error(name, f"{name} is not supported by this server (got {body[name]!r})")
            if body.get("stream_options") is not None and not body.get("stream"):
                raise body_error("stream_options", "stream_options is only allowed with stream: true")
            if body.get("prompt_logprobs") is not None and body.get("stream"):
                raise body_error("prompt_logprobs", "prompt_logprobs is not supported with stream: true")
        return body

    @field_validator("stop", mode="before")
    @classmethod
    def few_stops(cls, stop: object) -> object:
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings are supported, got {len(stop)}")
        return stop

    @field_validator("temperature", "top_p", "top_k", "n", "stream", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "ignore_eos", "min_tokens", mode="before")  # fmt: skip
    @classmethod
    def null_means_default(cls, value: object, info: ValidationInfo) -> object:
        """Clients often send ``null`` for parameters they leave unset."""
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("n")
    @classmethod
    def choices_in_range(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be from 1 to {MAX_CHOICES}, got {n}")
        return n

    def requested_logprobs(self) -> int | None:
        """Alternatives per token the response's ``logprobs`` carry; None: no ``logprobs``."""
        return None

    def ignored_fields(self) -> list[str]:
        """The body's fields this server does not read (OpenAI's ``user``, ``metadata``, other servers' own)."""
        return sorted(set(self.model_extra or {}) - set(self.unsupported))  # those are checked, not ignored

    def echoes(self) -> bool:
        """The answer starts with the prompt (completions' ``echo``)."""
        return False

    @field_validator("logit_bias")
    @classmethod
    def token_ids_as_keys(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in logit_bias or {}:
            if not (key.isascii() and key.isdigit()):  # str.isdigit takes other scripts' digits too
                raise ValueError(f"logit_bias keys are token ids (integers >= 0), got {key!r}")
        return logit_bias

    def bias(self) -> dict[int, float]:
        """``logit_bias`` as the engine takes it: {token id: bias}."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    @property
    def sampling_top_k(self) -> int:
        """``top_k`` as the engine takes it (0: off)."""
        return max(self.top_k, 0)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationParams):
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[str] | list[int] | list[list[int]]
    logprobs: TopLogprobs | None = None  # the legacy API's: alternatives per token (0: the chosen token's only)
    echo: bool = False  # the prompt before the answer (with logprobs: the prompt tokens' too)

    @field_validator("echo", mode="before")
    @classmethod
    def null_echo(cls, value: object) -> object:
        return False if value is None else value

    def echoes(self) -> bool:
        return self.echo

    @model_validator(mode="before")
    @classmethod
    def no_chat_logprobs(cls, body: Any) -> Any:
        """``top_logprobs`` is the chat API's; silently ignoring it would answer without what it asks."""
        if isinstance(body, dict) and body.get("top_logprobs") is not None:
            raise body_error("top_logprobs", "top_logprobs is a chat parameter; completions take logprobs=N")
        return body

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def prompts_not_empty(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> object:
        for one in prompts_of(prompt):
            if not one:
                raise ValueError("the prompt is empty")
            if isinstance(one, str) and len(one) > MAX_PROMPT_CHARS:
                raise ValueError(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        return prompt

    def prompt_inputs(self) -> list[str | list[int]]:
        """The request's prompts (OpenAI's ``prompt`` is one text or token list, or a list of them)."""
        return prompts_of(self.prompt)


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        return list(prompt)  # type: ignore[arg-type]
    return [prompt]  # type: ignore[list-item]


class ChatCompletionRequest(GenerationParams):
    unsupported: ClassVar[dict[str, Callable[[object], bool]]] = {**UNSUPPORTED, "echo": asks_nothing}

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more chat template variables
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    @model_validator(mode="after")
    def top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise body_error("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text (as ``/v1/completions`` reads it; ``add_special_tokens`` adds the tokenizer's
    own, as vLLM's default does not here) or chat messages (as ``/v1/chat/completions`` renders them)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as in a chat request
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise body_error("prompt", "give either prompt or messages")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise body_error("chat_template_kwargs", "chat_template_kwargs apply to messages (the chat template)")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize``: token ids -> text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    tokens: list[Annotated[int, Field(ge=0)]]
