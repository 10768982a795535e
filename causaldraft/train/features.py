"""One target pass over the generated answers: last hidden states and top-k next-token log-probs.

The answers come from ``feature_data.generate_features`` without auxiliary layers (the batched
generator of the eagle3 recipe and of build-store); the heads then need each position's final hidden
state, which this pass computes, one sequence at a time.

For a sequence of prompt length P and response length R, the stored *segment* covers positions
P-1 .. P+R-1 (R + 1 rows): tokens[j] is the token at position P-1+j, hidden[j] the target's final
hidden state there (it predicts tokens[j + 1]), topk_ids[j] / topk_logprobs[j] the target's top-k
next-token distribution there. Example: prompt [a, b], response [c, d] -> segment tokens [b, c, d],
hidden[0] is h(b) which predicted c.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from causaldraft.errors import CausalDraftError
from causaldraft.models.base import Backend
from causaldraft.train.data import check_meta, read_meta, shard_paths
from causaldraft.train.feature_data import shard_answers


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


def compute_features(backend: Backend, data_dir: Path, feat_dir: Path, top_k: int = 16) -> Features:
    """One shard of features per shard of answers in ``data_dir`` (``feature_data.generate_features``'s
    folders); existing shards are reused (resumable) when they were computed from this data by this model in
    this dtype (``check_meta``)."""
    check_meta(feat_dir, {"data": read_meta(data_dir), "dtype": str(backend.dtype), "top_k": top_k})
    data_shards = shard_paths(data_dir)
    if not data_shards:
        raise CausalDraftError(f"no generated data in {data_dir}")
    todo = [path for path in data_shards if not (feat_dir / path.name).is_file()]
    with torch.inference_mode():
        for path in tqdm(todo, desc="hidden pass", unit="shard"):
            items = [
                sequence_features(backend, prompt, response, top_k)
                for prompt, response in shard_answers(path)
                if response
            ]
            merged = {
                name: [item[name] for item in items] for name in ("tokens", "hidden", "topk_ids", "topk_logprobs")
            }
            merged["lengths"] = [torch.tensor([len(item["tokens"]) for item in items])]
            target = feat_dir / path.name
            torch.save({name: torch.cat(values) for name, values in merged.items()}, target.with_suffix(".tmp"))
            target.with_suffix(".tmp").rename(target)
    return load_features(feat_dir)


def load_features(feat_dir: Path) -> Features:
    parts = []
    for path in shard_paths(feat_dir):
        try:
            parts.append(torch.load(path, weights_only=True))
        except (OSError, RuntimeError, EOFError) as error:
            raise CausalDraftError(f"corrupt feature shard {path}: {error}; delete it to recompute") from error
    if not parts:
        raise CausalDraftError(f"no feature shards in {feat_dir}")
    lengths = torch.cat([part["lengths"] for part in parts]).long()
    return Features(
        tokens=torch.cat([part["tokens"] for part in parts]).long(),
        hidden=torch.cat([part["hidden"] for part in parts]),
        topk_ids=torch.cat([part["topk_ids"] for part in parts]).long(),
        topk_logprobs=torch.cat([part["topk_logprobs"] for part in parts]).float(),
        ends=torch.repeat_interleave(lengths.cumsum(0) - 1, lengths),
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
