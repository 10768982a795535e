"""Ranking a draft node's children, shared by the drafters that score a reduced vocabulary."""

from __future__ import annotations

import torch

from causaldraft.drafters.base import DraftContext
from causaldraft.sampling import gumbel_noise
from causaldraft.tree import Candidates


def noise_scores(perturbed: torch.Tensor, noise_score_temperature: float = 1.0) -> torch.Tensor:
    """Node scores under the Gumbel sampler: softmax(perturbed / tau) [..., V'] with perturbed =
    log q + g, the draft's log-probabilities plus the target's noise at the children's position.

    The target emits argmax(log p + g); were q equal to p, the draft's perturbed argmax would be that
    token for sure. q is not p, so the score of a child is the chance that it is the target's
    perturbed argmax, modelled as a softmax over the perturbed scores whose temperature tau is fit on
    held-out rows (``train/calibration.py``). q alone would be a poor score: a child chosen for
    its noise can be likely with a small q, and a large q loses to a larger noise elsewhere.
    Example: perturbed [-0.2, -1.6, -3.0] at tau 1 give [0.76, 0.19, 0.05]."""
    return torch.softmax(perturbed / noise_score_temperature, dim=-1)


def rank_children(
    logits: torch.Tensor,  # [m, V'] draft logits of m nodes
    vocab_ids: torch.Tensor,  # [V'] target id of each draft id
    vocab_size: int,  # the target's
    count: int,
    context: DraftContext,
    positions: list[int],  # absolute position of each node's children
    score_temperature: float = 1.0,
    sampling_temperature_scale: float = 1.0,
    noise_score_temperature: float = 1.0,
) -> list[Candidates]:
    """Each node's ``count`` best children as (target id, score).

    Greedy / rejection sampling: the most probable draft tokens, scored softmax(logits / t0).
    Gumbel sampling: the target emits argmax(log p + g) with g the noise of the child's position,
    so the draft ranks by log q + g with the same noise (q at the request's temperature times s)
    and guesses that very token; scores are ``noise_scores`` at tau. t0, s and tau are the
    drafter's calibration (``train/calibration.py``; 1, 1 and 1 when uncalibrated); none of them
    changes what the target emits."""
    if context.noise_seed is None:
        probs = torch.softmax(logits / score_temperature, dim=-1)  # [m, V']
        top = torch.topk(probs, count, dim=-1).indices  # [m, count]
        values = probs.gather(1, top)
    else:
        temperature = context.sampling.temperature * sampling_temperature_scale
        noise = torch.stack(
            [gumbel_noise(context.noise_seed, position, vocab_size)[vocab_ids] for position in positions]
        )
        perturbed = torch.log_softmax(logits / temperature, dim=-1) + noise  # [m, V']
        top = torch.topk(perturbed, count, dim=-1).indices
        values = noise_scores(perturbed, noise_score_temperature).gather(1, top)
    ids, scores = vocab_ids[top].tolist(), values.tolist()
    return [list(zip(ids[row], scores[row], strict=True)) for row in range(len(positions))]
