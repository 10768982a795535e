"""Temperature / top-k / top-p warping and seeded sampling, shared by target and drafts."""

from __future__ import annotations

import functools

import torch

from causaldraft.config import SamplingConfig

MIN_TEMPERATURE = 1e-30
MASK64 = (1 << 64) - 1


def warp_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Logits [..., vocab] -> probabilities [..., vocab] (float32) after temperature, top-k, top-p.

    Greedy (temperature 0) gives the one-hot distribution of the argmax.
    """
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = scaled_logits(logits, sampling.temperature)
    if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        keep_sorted = before < sampling.top_p
        keep_sorted[..., 0] = True  # the most probable token, even for a top_p below float32's range
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - max) / T in float32 [..., vocab], a new tensor. Shifted so the best logit is 0: no overflow
    however small the temperature (float32 cannot divide by one below ~1e-38, where sampling is greedy in
    effect anyway; ``MIN_TEMPERATURE``)."""
    logits = logits.float()
    return (logits - logits.amax(-1, keepdim=True)).div_(max(temperature, MIN_TEMPERATURE))  # amax: ~4x faster than max


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed & MASK64)  # any integer seed (e.g. 2**64) folds into 64 bits
    return generator


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for (seed, position): splitmix64 of seed * golden + position, so
    neighbouring positions and seeds get unrelated streams. Any Python int seed is accepted."""
    z = (seed * 0x9E3779B97F4A7C15 + position) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=256)
def gumbel_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [size] for absolute ``position`` of a request seeded ``seed``.

    Counter-based: the noise depends on (seed, position) only, never on how many values were drawn
    before, so whatever computes a position's token (a plain step, any node of any tree, or a
    drafter guessing it) sees the same noise. Read-only (cached)."""
    generator = torch.Generator().manual_seed(mix_seed(seed, position))
    uniform = torch.rand(size, generator=generator, dtype=torch.float64)
    return (-torch.log(-torch.log(uniform))).float()


def gumbel_noise_rows(seed: int, positions: list[int], vocab_size: int) -> torch.Tensor:
    """[n, vocab] float32: row i the Gumbel noise of the token sampled at ``positions[i]`` (``gumbel_noise``)."""
    return torch.stack([gumbel_noise(seed, position, vocab_size) for position in positions])


def gumbel_scores(logits: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Scores whose argmax per row is the row's Gumbel sample: [n, vocab] (float32). ``noise`` [n, vocab]:
    ``gumbel_noise_rows`` of the seed and the absolute positions of the tokens the rows sample (each row's own
    position + 1), the key drafters use too.

    Gumbel-max: argmax over a row of log(warped probabilities) + Gumbel noise is an exact sample of that
    row's warped distribution, and with noise keyed by (seed, position) it is the very token plain seeded
    sampling draws there. Without top-k or top-p, the log-probabilities are (logits - max) / T less the
    row's log-sum-exp, one constant per row that no argmax sees, so the scores leave it out (and the
    softmax and log over the vocabulary, ~1.5 ms for an 8-row pass). With them, the tokens they drop
    score -inf. Example: logits [2, 1.5, 1, -9] at T = 1 and noise [0.1, 0.9, -0.2, 2.0] give
    [0.1, 0.4, -1.2, -9.0]: token 1."""
    if sampling.top_k == 0 and sampling.top_p >= 1.0:
        scores = scaled_logits(logits, sampling.temperature)
    else:
        scores = torch.log(warp_probs(logits, sampling))  # [n, vocab], -inf outside top-k/top-p
    return scores.add_(noise)
