"""Request bodies of the OpenAI-compatible endpoints, validated strictly (wrong types are 400s).

Unknown fields are ignored, as OpenAI-compatible servers commonly do; parameters the server cannot
honour (``n`` other than 1, several prompts) are rejected with a clear message instead.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_PROMPT_CHARS = 1_000_000
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a whole request body; larger ones are refused before parsing (413)
MAX_STOPS = 4

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None


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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class GenerationParams(BaseModel):
    """Parameters shared by both endpoints."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: Stop = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("temperature", "top_p", "n", "stream", mode="before")
    @classmethod
    def null_means_default(cls, value: object, info: ValidationInfo) -> object:
        """Clients often send ``null`` for parameters they leave unset."""
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].default
        return value

    @field_validator("n")
    @classmethod
    def single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationParams):
    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def single_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[str] | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt per request is supported")
            prompt = prompt[0]  # type: ignore[assignment]
        if not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt is longer than {MAX_PROMPT_CHARS} characters")
        return prompt  # type: ignore[return-value]

    def prompt_input(self) -> str | list[int]:
        return self.prompt  # type: ignore[return-value]


class ChatCompletionRequest(GenerationParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
