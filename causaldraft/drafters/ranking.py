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
    if context.noise_seed is None:
        probs = torch.softmax(logits / score_temperature, dim=-1)  # [m, V']
        top = torch.topk(probs, count, dim=-1).indices  # [m, count]
        values = probs.gather(1, top)
    else:
        temperature = context.sampling.temperature * sampling_temperature_scale
        scaled = torch.log_softmax(logits / temperature, dim=-1)  # [m, V']
        noise = torch.stack(
            [gumbel_noise(context.noise_seed, position, vocab_size)[vocab_ids] for position in positions]
        )
        top = torch.topk(scaled + noise, count, dim=-1).indices
        values = scaled.gather(1, top).exp()  # q of the chosen children only
    ids, scores = vocab_ids[top].tolist(), values.tolist()
    return [list(zip(ids[row], scores[row], strict=True)) for row in range(len(positions))]
