"""The heads' training rows: final hidden states and top-k next-token log-probs along each answer.

The answers come from ``feature_data.generate_features`` with ``keep_hidden`` (the batched generator of
the eagle3 recipe and of build-store), which keeps every fed token's final hidden state and every
response token's top-k while generating: no second pass over the data (``answer_features``).

For a sequence of prompt length P and response length R, the *segment* covers positions
P-1 .. P+R-1 (R + 1 rows): tokens[j] is the token at position P-1+j, hidden[j] the target's final
hidden state there (it predicts tokens[j + 1]), topk_ids[j] / topk_logprobs[j] the target's top-k
next-token distribution there. Example: prompt [a, b], response [c, d] -> segment tokens [b, c, d],
hidden[0] is h(b) which predicted c. The last row's token was never fed to the target, so it has no
hidden state or distribution: it holds zeros and a flat placeholder (``LAST_ROW_LOGPROB``), which
nothing reads (a training row needs two more rows in its segment, and a label comes from the row
before its token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend
from causaldraft.train.data import read_meta, shard_paths
from causaldraft.train.feature_data import read_shard


@dataclass(frozen=True)
class Features:
    """Concatenated segments. ``ends[i]`` is the global index of the last row of row i's segment."""

    tokens: torch.Tensor  # [T] long
    hidden: torch.Tensor  # [T, hidden] bfloat16
    topk_ids: torch.Tensor  # [T, k] long
    topk_logprobs: torch.Tensor  # [T, k] float32
    ends: torch.Tensor  # [T] long
    segments: int

    def select(self, segment_ids: torch.Tensor) -> Features:
        """The rows of some segments (by segment number), with ``ends`` re-indexed."""
        starts = torch.cat((torch.zeros(1, dtype=torch.long), self.ends.unique_consecutive()[:-1] + 1))
        lengths = self.ends.unique_consecutive() - starts + 1
        rows = torch.cat([torch.arange(int(starts[s]), int(starts[s] + lengths[s])) for s in segment_ids.tolist()])
        new_lengths = lengths[segment_ids]
        new_ends = torch.repeat_interleave(new_lengths.cumsum(0) - 1, new_lengths)
        return Features(
            self.tokens[rows], self.hidden[rows], self.topk_ids[rows], self.topk_logprobs[rows],
            new_ends, len(segment_ids),
        )  # fmt: skip


def sequence_features(backend: Backend, prompt: list[int], response: list[int], top_k: int) -> dict[str, torch.Tensor]:
    tokens = torch.tensor(prompt + response, dtype=torch.long)
    n = tokens.shape[0]
    cache = backend.new_cache(n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    rows = torch.arange(len(prompt) - 1, n)
    out = backend.forward(tokens, torch.arange(n), mask, cache, rows)
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [R + 1, vocab]
    top = torch.topk(logprobs, top_k, dim=-1)
    return {
        "tokens": tokens[rows].to(torch.int32),
        "hidden": out.hidden[rows].to(torch.bfloat16),
        "topk_ids": top.indices.to(torch.int32),
        "topk_logprobs": top.values.to(torch.float16),
    }


LAST_ROW_LOGPROB = -1e4  # a segment's last row's top-k log-probs: finite (a softmax of them is flat), weight ~0


def answer_features(data_dir: Path) -> Features:
    """The segments of every answer in ``data_dir``, a ``generate_features(..., keep_hidden=True)`` folder."""
    if not (read_meta(data_dir) or {}).get("hidden"):
        raise CausalDraftError(f"{data_dir} keeps no hidden states (made without keep_hidden); use another --work")
    paths = shard_paths(data_dir)
    if not paths:
        raise CausalDraftError(f"no generated data in {data_dir}")
    parts: dict[str, list[torch.Tensor]] = {"tokens": [], "hidden": [], "topk_ids": [], "topk_logprobs": []}
    lengths: list[int] = []
    for path in paths:
        shard = read_shard(path)
        full, prompt_lengths = shard["lengths"].tolist(), shard["prompt_lengths"].tolist()
        responses = [length - prompt for length, prompt in zip(full, prompt_lengths, strict=True)]
        tokens = shard["tokens"].long().split(full)
        hidden = shard["hidden"].split(responses)  # [R, hidden] each
        ids = shard["topk_ids"].long().split(responses)  # [R, k] each
        logprobs = shard["topk_logprobs"].float().split(responses)
        for index, (prompt, response) in enumerate(zip(prompt_lengths, responses, strict=True)):
            if not response:
                continue
            parts["tokens"].append(tokens[index][prompt - 1 :])  # [R + 1]
            last_hidden = hidden[index].new_zeros(1, hidden[index].shape[1])
            parts["hidden"].append(torch.cat((hidden[index], last_hidden)))
            parts["topk_ids"].append(torch.cat((ids[index], ids[index].new_zeros(1, ids[index].shape[1]))))
            last_logprobs = logprobs[index].new_full((1, logprobs[index].shape[1]), LAST_ROW_LOGPROB)
            parts["topk_logprobs"].append(torch.cat((logprobs[index], last_logprobs)))
            lengths.append(response + 1)
    if not lengths:
        raise CausalDraftError(f"no answers in {data_dir}")
    counts = torch.tensor(lengths)
    return Features(
        tokens=torch.cat(parts["tokens"]),
        hidden=torch.cat(parts["hidden"]),
        topk_ids=torch.cat(parts["topk_ids"]),
        topk_logprobs=torch.cat(parts["topk_logprobs"]),
        ends=torch.repeat_interleave(counts.cumsum(0) - 1, counts),
        segments=len(lengths),
    )


def split_features(features: Features, eval_every: int) -> tuple[Features, Features]:
    """Every ``eval_every``-th segment is held out for evaluation."""
    segment_ids = torch.arange(features.segments)
    held_out = segment_ids % eval_every == eval_every - 1
    return features.select(segment_ids[~held_out]), features.select(segment_ids[held_out])


def draft_vocabulary(features: Features, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` ids most frequent in the target's outputs: emitted tokens count 1 each, plus
    each top-k candidate's probability (so near-misses rank above never-seen ids). Sorted ids."""
    counts = torch.bincount(features.tokens, minlength=vocab_size).float()
    counts += torch.bincount(
        features.topk_ids.flatten(), weights=features.topk_logprobs.exp().flatten(), minlength=vocab_size
    )
    return torch.topk(counts, min(size, vocab_size)).indices.sort().values
