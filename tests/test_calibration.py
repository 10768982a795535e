"""The drafter calibration's fits (train/calibration.py) on distributions whose answer is known."""

from __future__ import annotations

import torch

from causaldraft.drafters.ranking import noise_scores
from causaldraft.train.calibration import (
    NOISE_CHILDREN,
    NOISE_SCORE_TEMPERATURES,
    SAMPLING_SCALES,
    SCORE_TEMPERATURES,
    argmax_nll,
    best,
    coupled_agreement,
)


def target_rows(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random full distributions over ``vocab`` tokens: (ids [rows, vocab], log-probs [rows, vocab])."""
    generator = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(rows, vocab, generator=generator) * 2.0, dim=-1)
    return torch.arange(vocab).expand(rows, vocab).clone(), logprobs


def test_a_draft_equal_to_the_target_always_agrees_at_scale_one() -> None:
    """With q = p and the same noise on every token the two argmaxes are one token (the lump holds
    no mass); sharpening q breaks that."""
    ids, logprobs = target_rows(600, 48, 0)
    hits = coupled_agreement(logprobs, torch.arange(48), 48, ids, logprobs, (1.0, 0.4),
                             torch.Generator().manual_seed(1)).hits  # fmt: skip
    assert hits[0] == 600
    assert hits[1] < 540


def test_a_sample_outside_the_known_tokens_is_a_miss() -> None:
    """Known tokens holding 10 % of the mass: the target mostly samples the lump, which no draft guesses."""
    ids, logprobs = target_rows(400, 8, 2)
    hits = coupled_agreement(logprobs, torch.arange(8), 8, ids, logprobs + torch.log(torch.tensor(0.1)),
                             (1.0,), torch.Generator().manual_seed(3)).hits  # fmt: skip
    assert 10 < hits[0] < 80  # ~ 10 % of 400


def test_an_unsure_draft_agrees_more_when_sharpened() -> None:
    """A draft whose logits are the target's halved (too flat) agrees most near scale 0.5."""
    ids, logprobs = target_rows(2000, 32, 4)
    hits = coupled_agreement(logprobs / 2, torch.arange(32), 32, ids, logprobs, SAMPLING_SCALES,
                             torch.Generator().manual_seed(5)).hits  # fmt: skip
    agreement = dict(zip(SAMPLING_SCALES, hits.tolist(), strict=True))
    assert best(agreement, larger_is_better=True) == 0.5
    assert agreement[0.5] > agreement[1.0] + 100


def test_temperature_scaling_undoes_a_known_overconfidence() -> None:
    """Labels drawn from softmax(z), logits 1.5 z: the NLL is least at temperature 1.5."""
    generator = torch.Generator().manual_seed(6)
    z = torch.randn(6000, 20, generator=generator)
    labels = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator)[:, 0]
    nll = argmax_nll(z * 1.5, labels, SCORE_TEMPERATURES)
    fitted = best(dict(zip(SCORE_TEMPERATURES, nll.tolist(), strict=True)), larger_is_better=False)
    assert abs(fitted - 1.5) <= 0.1


def test_ties_go_to_the_plain_distribution() -> None:
    assert best({0.5: 3.0, 1.0: 3.0, 1.5: 3.0}, larger_is_better=True) == 1.0
    assert best({0.5: 1.0, 0.9: 2.0, 1.2: 2.0}, larger_is_better=False) == 0.5


def test_noise_scores_match_the_documented_example() -> None:
    scores = noise_scores(torch.tensor([-0.2, -1.6, -3.0]))
    assert torch.allclose(scores, torch.tensor([0.76, 0.19, 0.05]), atol=5e-3)


def noise_fit(draft_logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> dict[float, float]:
    vocab = ids.shape[1]
    coupled = coupled_agreement(draft_logits, torch.arange(vocab), vocab, ids, logprobs, (1.0,),
                                torch.Generator().manual_seed(7))  # fmt: skip
    rows = ids.shape[0] * NOISE_CHILDREN
    return {tau: float(v) / rows for tau, v in zip(NOISE_SCORE_TEMPERATURES, coupled.loss[0], strict=True)}


def test_a_draft_equal_to_the_target_is_sure_of_its_first_child() -> None:
    """q = p: the first child is always the sample and the others never are, so the sharpest scores
    (the smallest tau) predict best."""
    ids, logprobs = target_rows(800, 32, 8)
    loss = noise_fit(logprobs, ids, logprobs)
    assert best(loss, larger_is_better=False) == NOISE_SCORE_TEMPERATURES[0]
    assert loss[NOISE_SCORE_TEMPERATURES[0]] < loss[2.0] < loss[4.0]


def test_the_fitted_tau_scores_a_noisy_draft_as_often_as_it_is_right() -> None:
    """q is p with its log-probs jittered: its first child is the sample less often than its plain
    (tau 1) noise score claims; the fitted tau is larger and its mean score of the first child is
    within a few points of the measured agreement."""
    ids, logprobs = target_rows(3000, 32, 9)
    draft = logprobs + 3.0 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(10))
    loss = noise_fit(draft, ids, logprobs)
    tau = best(loss, larger_is_better=False)
    assert tau > 1.0 and loss[tau] < loss[1.0] - 0.01
    noise = -torch.log(-torch.log(torch.rand(ids.shape, generator=torch.Generator().manual_seed(11))))
    sampled = (logprobs + noise).argmax(-1)
    perturbed = torch.log_softmax(draft, dim=-1) + noise
    first = perturbed.argmax(-1)
    agreement = float((first == sampled).float().mean())
    claimed = float(noise_scores(perturbed, tau).max(-1).values.mean())
    plain = float(noise_scores(perturbed, 1.0).max(-1).values.mean())
    assert abs(claimed - agreement) < 0.05
    assert plain - agreement > 0.05
