"""Ranking children (drafters/ranking.py): what the drafters that score a reduced vocabulary propose."""

from __future__ import annotations

import torch

from causaldraft.config import SamplingConfig
from causaldraft.drafters.base import DraftContext
from causaldraft.drafters.ranking import noise_scores, rank_children
from causaldraft.sampling import gumbel_noise

VOCAB = 40  # the target's
VOCAB_IDS = torch.arange(0, VOCAB, 2)  # a 20-token draft vocabulary: the even ids


def context(temperature: float, noise_seed: int | None) -> DraftContext:
    return DraftContext((1, 2, 3), None, "dynamic", 3, 3, 8, SamplingConfig(temperature=temperature), None, noise_seed)


def test_greedy_children_are_the_most_probable_scored_at_the_score_temperature() -> None:
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
    ranked = rank_children(logits, VOCAB_IDS, VOCAB, 3, context(0.0, None), [5, 6], score_temperature=0.7)
    for row in range(2):
        probs = torch.softmax(logits[row] / 0.7, dim=-1)
        top = probs.topk(3)
        assert ranked[row] == [(int(VOCAB_IDS[i]), float(p)) for p, i in zip(top.values, top.indices, strict=True)]


def test_gumbel_children_are_the_perturbed_best_scored_by_their_chance_to_be_the_sample() -> None:
    """Ranked by log q/(T s) + g with the noise of each row's own position; the scores are the noise
    scores at tau, not q: a child picked for its noise keeps the chance the calibration gives it."""
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(1)) * 3
    positions = [7, 9]
    ranked = rank_children(logits, VOCAB_IDS, VOCAB, 3, context(0.8, 123), positions,
                           sampling_temperature_scale=0.5, noise_score_temperature=1.5)  # fmt: skip
    for row, position in enumerate(positions):
        perturbed = torch.log_softmax(logits[row] / 0.4, dim=-1) + gumbel_noise(123, position, VOCAB)[VOCAB_IDS]
        top = perturbed.topk(3).indices
        scores = noise_scores(perturbed, 1.5)[top]
        assert [token for token, _ in ranked[row]] == VOCAB_IDS[top].tolist()
        assert [score for _, score in ranked[row]] == scores.tolist()
        assert scores[0] >= scores[1] >= scores[2] and float(scores.sum()) <= 1.0 + 1e-6
    sharper = rank_children(logits, VOCAB_IDS, VOCAB, 3, context(0.8, 123), positions,
                            sampling_temperature_scale=0.5, noise_score_temperature=0.5)  # fmt: skip
    assert [c[0] for c in sharper[0]] == [c[0] for c in ranked[0]]  # tau scores; it never reorders
    assert sharper[0][0][1] > ranked[0][0][1]
