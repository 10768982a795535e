"""The ``logprobs`` of a response, in the two OpenAI shapes: the legacy completions object (parallel lists) and the
chat object (one entry per token, with its UTF-8 bytes and its alternatives)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from causaldraft.logprobs import TokenLogprob


class TokenTexts:
    """Each token's text (the token decoded alone) and bytes, as the API reports them.

    A byte-level BPE tokenizer (GPT-2's scheme, the default model's) spells each byte as one character, so a
    token's own bytes are exact even where it holds part of a UTF-8 character (its text then ends in U+FFFD);
    other tokenizers report the UTF-8 encoding of the token's text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()} if byte_level else None
        self.known: dict[int, str] = {}  # token id -> text, as tokens are met (at most the vocabulary)

    def text(self, token_id: int) -> str:
        if token_id not in self.known:
            self.known[token_id] = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
        return self.known[token_id]

    def bytes(self, token_id: int) -> list[int]:
        spelled = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_of is not None and isinstance(spelled, str) and all(char in self.byte_of for char in spelled):
            return [self.byte_of[char] for char in spelled]
        return list(self.text(token_id).encode("utf-8"))


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int) -> dict[str, Any]:
    """The legacy object: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per token) and ``text_offset``
    (each token's first character in the completion's text, counted from ``offset``: earlier stream chunks')."""
    tokens = [texts.text(entry.token_id) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{texts.text(token_id): logprob for token_id, logprob in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def echoed_logprobs(
    prompt_ids: Sequence[int], scored: Sequence[TokenLogprob], texts: TokenTexts, top: int
) -> dict[str, Any]:
    """The legacy object for an echoed prompt: its first token, which nothing predicts (null, as OpenAI reports it),
    then ``scored``, the log-probabilities of the others (``PromptRead.scored``), with ``top`` alternatives."""
    first = texts.text(prompt_ids[0])
    rest = completion_logprobs([replace(entry, top=entry.top[:top]) for entry in scored], texts, len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def vllm_prompt_logprobs(
    scored: Sequence[TokenLogprob], texts: TokenTexts, top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then for each other one a dict by token id (a
    string, as JSON keys are) of the token itself and its ``top`` likeliest alternatives, each
    ``{"logprob", "rank", "decoded_token"}``."""

    def item(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": texts.text(token_id)}

    positions: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in scored:
        position = {str(entry.token_id): item(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top[:top], start=1):
            position.setdefault(str(token_id), item(token_id, logprob, rank))
        positions.append(position)
    return positions


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """The chat object: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}

    content = [{**item(entry.token_id, entry.logprob), "top_logprobs": [item(*best) for best in entry.top]}
               for entry in entries]  # fmt: skip
    return {"content": content, "refusal": None}
