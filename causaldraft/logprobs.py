"""Log-probabilities of the emitted tokens (OpenAI's ``logprobs``), read from the verify passes.

Every emitted token was chosen at one row of a verify pass: the accepted path's nodes predict, in order, the
accepted drafts and then the final (bonus or recovered) token. With ``acceptance.path = (0, 3, 4)`` and
``acceptance.tokens = (a, b, c)``: ``a`` is the token chosen at row 0 (the root), ``b`` at row 3 and ``c`` at
row 4. So the emitted tokens' rows are ``path[: len(emitted)]`` (EOS or max_new_tokens may cut the step short).

The values are the model's own log-probabilities, log_softmax of its logits, before temperature, top-k and top-p
(vLLM's default, ``raw_logprobs``), so they do not change with the sampling parameters. A verify pass computes
each row exactly as a one-row pass at its position (docs/exactness.md), and each row is reduced on its own, so a
speculative run reports the same bits as plain decoding in every dtype but float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log of the model's probability of the token at its position
    rank: int  # 1 + how many tokens are more likely there (1: the most likely; vLLM's ``rank``)
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there and theirs, most likely first


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` under row ``rows[i]`` of ``logits`` [n, vocab], with the ``top`` most
    likely tokens of that row. Each row is reduced alone, so its values do not depend on the pass's other rows."""
    entries = []
    for row, token in zip(rows, tokens, strict=True):
        row_logprobs = torch.log_softmax(logits[row].float(), dim=-1)  # [vocab]
        best: tuple[tuple[int, float], ...] = ()
        if top:
            values, ids = torch.topk(row_logprobs, top)
            best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        value = row_logprobs[token]
        entries.append(TokenLogprob(token, float(value), int((row_logprobs > value).sum()) + 1, best))
    return entries
