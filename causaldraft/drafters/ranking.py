"""Ranking a draft node's children, shared by the drafters that score a reduced vocabulary."""

from __future__ import annotations

import torch

from causaldraft.drafters.base import DraftContext
from causaldraft.sampling import gumbel_noise
from causaldraft.tree import Candidates


def rank_children(
    logits: torch.Tensor,  # [m, V'] draft logits of m nodes
    vocab_ids: torch.Tensor,  # [V'] target id of each draft id
    vocab_size: int,  # the target's
    count: int,
    context: DraftContext,
    positions: list[int],  # absolute position of each node's children
    score_temperature: float = 1.0,
    sampling_temperature_scale: float = 1.0,
) -> list[Candidates]:
    """Each node's ``count`` best children as (target id, draft probability).

    Greedy / rejection sampling: the most probable draft tokens, scored softmax(logits / t0).
    Gumbel sampling: the target emits argmax(log p + g) with g the noise of the child's position,
    so the draft ranks by log q + g with the same noise (q at the request's temperature times s)
    and guesses that very token. t0 and s are the drafter's calibration (``train/calibration.py``;
    1 and 1: the drafter's plain distribution); neither changes what the target emits."""
    probs = torch.softmax(logits / score_temperature, dim=-1)  # [m, V']
    ranking = probs
    if context.noise_seed is not None:
        temperature = context.sampling.temperature * sampling_temperature_scale
        scaled = torch.log_softmax(logits / temperature, dim=-1)
        noise = torch.stack(
            [gumbel_noise(context.noise_seed, position, vocab_size)[vocab_ids] for position in positions]
        )
        ranking = scaled + noise
        probs = scaled.exp()
    top = torch.topk(ranking, count, dim=-1).indices  # [m, count]
    ids = vocab_ids[top].tolist()
    values = probs.gather(1, top).tolist()
    return [list(zip(ids[row], values[row], strict=True)) for row in range(len(positions))]
