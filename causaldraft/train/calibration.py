"""Calibrating a trained drafter's probabilities: three temperatures, fit on held-out rows.

A drafter's probabilities q serve three times, and a drafter trained on soft labels is unsure where the
target is sure (on the shipped eagle3 layer, rows the layer gave 0.25-0.35 to its first guess were
right 34-49 % of the time), so each use is fit on data rather than taken at 1 (docs/eagle3.md,
"Calibration"):

- ``score_temperature`` t0: node scores are softmax(logits / t0). The tree builder grows the most
  probable paths and the cost model predicts a tree's accepted tokens from their scores, so the
  scores should be the chances that the target agrees. Fit: the t0 of ``SCORE_TEMPERATURES``
  with the least negative log-likelihood of the target's argmax (classic temperature scaling),
  over depths 1 .. steps of the unrolled layer.
- ``sampling_temperature_scale`` s: with the ``gumbel`` sampler the target emits
  argmax_x (log p(x) / T + g_x), the noise g keyed by the request's seed and the position, and a
  drafter ranks a node's children by log q(x) / (T s) + g_x with the same noise
  (``drafters/ranking.py``). Any s keeps the output exact (the target's noise alone decides it); s
  only changes how often the first child is the target's sample. Fit: the s of ``SAMPLING_SCALES``
  with the most such agreements at depth 1, simulated at T = 1: the target's sample is the argmax
  over its k known tokens (the data's top-k log-probs) and one lump holding the rest of its mass
  (a sample in the lump counts as a miss: the drafter cannot know which token it was); the draft
  ranks its whole vocabulary, its noise equal to the target's on the k known tokens. The noise
  comes from a seeded generator, so a fit is reproducible.
- ``noise_score_temperature`` tau: under the ``gumbel`` sampler a child's score is
  softmax((log q + g) / tau) at that child (``drafters/ranking.noise_scores``): the drafter's chance
  that the child is the target's sample. q alone predicts that badly (on 1,420 rows of sampled
  MT-bench answers, first children the shipped eagle3 layer gave q < 0.1 were the sample 27 % of the
  time, those above 0.9 56 %). Fit: in the same simulation, at the chosen s, the tau of
  ``NOISE_SCORE_TEMPERATURES`` with the least binary log-loss of "this child is the target's
  sample" over each row's first ``NOISE_CHILDREN`` children.

Worked example, one row, k = 2: the target's probabilities are 0.8 and 0.1 for tokens a and b (lump:
0.1). Noise g_a = 0, g_b = 0.5, lump 0 gives scores log 0.8 = -0.22, log 0.1 + 0.5 = -1.80 and -2.30:
the target samples a. An unsure draft, q(a) = 0.4, q(b) = 0.3, at s = 1 scores a at -0.92 and b at
log 0.3 + 0.5 = -0.70: it guesses b, a miss. At s = 0.5: a -1.83, b -2.41 + 0.5 = -1.91: it guesses a.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from causaldraft.drafters.eagle3_model import Eagle3Config, Eagle3Layer
from causaldraft.drafters.ranking import noise_scores
from causaldraft.train.eagle3_train import Sequence, make_batch, ttt_outputs
from causaldraft.train.trainer import draft_index

SCORE_TEMPERATURES = tuple(round(0.5 + 0.05 * index, 2) for index in range(31))  # 0.5 .. 2.0
SAMPLING_SCALES = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
NOISE_SCORE_TEMPERATURES = tuple(round(0.5 + 0.25 * index, 2) for index in range(15))  # 0.5 .. 4.0
NOISE_CHILDREN = 3  # children per row whose noise scores the tau fit scores
CHUNK_ROWS = 256  # rows whose noise is drawn at once ([rows, vocab] floats)
MAX_ROWS = 8192  # held-out rows used per depth (the first ones)


@dataclass(frozen=True)
class Calibration:
    score_temperature: float
    sampling_temperature_scale: float
    noise_score_temperature: float
    score_nll: dict[float, float]  # mean NLL of the target's argmax per candidate t0 (depths pooled)
    sampling_agreement: dict[float, float]  # share of rows whose first child is the target's sample, per s
    noise_score_loss: dict[float, float]  # mean binary log-loss per child at the chosen s, per tau
    rows: int  # depth-1 rows

    def fitted(self, config: Eagle3Config) -> Eagle3Config:
        """``config`` with the three fitted temperatures."""
        return replace(config, score_temperature=self.score_temperature,
                       sampling_temperature_scale=self.sampling_temperature_scale,
                       noise_score_temperature=self.noise_score_temperature)  # fmt: skip

    def summary(self) -> dict[str, object]:
        return {
            "score_temperature": self.score_temperature,
            "sampling_temperature_scale": self.sampling_temperature_scale,
            "noise_score_temperature": self.noise_score_temperature,
            "score_nll": {str(t): round(v, 4) for t, v in self.score_nll.items()},
            "sampling_agreement": {str(s): round(v, 4) for s, v in self.sampling_agreement.items()},
            "noise_score_loss": {str(t): round(v, 4) for t, v in self.noise_score_loss.items()},
            "rows": self.rows,
        }


@dataclass(frozen=True)
class Coupled:
    """Sums over rows of the Gumbel simulation (``coupled_agreement``)."""

    hits: torch.Tensor  # [S] rows whose first child is the target's sample, per scale
    loss: torch.Tensor  # [S, Tau] binary log-loss of the first NOISE_CHILDREN children's scores, per scale and tau


def gumbel(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    uniform = torch.rand(shape, generator=generator).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def argmax_nll(logits: torch.Tensor, targets: torch.Tensor, temperatures: tuple[float, ...]) -> torch.Tensor:
    """Summed NLL of ``targets`` (draft ids) under softmax(logits / t) per t: [len(temperatures)]."""
    logits = logits.float()
    return torch.stack([
        -torch.log_softmax(logits / t, dim=-1).gather(1, targets[:, None]).sum() for t in temperatures
    ])  # fmt: skip


def target_samples(
    ids: torch.Tensor,  # [m, k] the target's top-k ids
    logprobs: torch.Tensor,  # [m, k] their log-probs (float32)
    noise: torch.Tensor,  # [m, vocab] Gumbel noise of every token
    generator: torch.Generator,  # draws the lump's noise
) -> torch.Tensor:
    """The target's Gumbel sample per row [m]: the argmax of log p + g over its k known tokens and one
    lump holding the rest of its mass; the full-vocabulary id, -1 when the lump wins (the drafter
    cannot know which token that was)."""
    width = ids.shape[1]
    rest = (1.0 - logprobs.exp().sum(-1)).clamp(min=1e-6).log()  # [m] the lump's log-mass
    scores = torch.cat([logprobs + noise.gather(1, ids), (rest + gumbel((ids.shape[0],), generator))[:, None]], dim=1)
    choice = scores.argmax(-1)  # [m] in 0 .. k (k: the lump)
    picked = ids.gather(1, choice.clamp(max=width - 1)[:, None])[:, 0]
    return torch.where(choice < width, picked, torch.full_like(picked, -1))


def coupled_agreement(
    draft_logits: torch.Tensor,  # [M, V'] draft logits, one row per held-out position
    vocab_ids: torch.Tensor,  # [V'] target id of each draft id
    vocab_size: int,
    target_ids: torch.Tensor,  # [M, k] the target's top-k ids at the children's position
    target_logprobs: torch.Tensor,  # [M, k] their log-probs (of the full distribution, T = 1)
    scales: tuple[float, ...],
    generator: torch.Generator,
    noise_temperatures: tuple[float, ...] = NOISE_SCORE_TEMPERATURES,
) -> Coupled:
    """For how many of the M rows the draft's first child (ranked with the target's noise at each
    scale) is the target's Gumbel sample, and how well the noise scores at each tau predict which of
    the first ``NOISE_CHILDREN`` children is (summed binary log-loss)."""
    hits = torch.zeros(len(scales))
    loss = torch.zeros(len(scales), len(noise_temperatures))
    children = min(NOISE_CHILDREN, vocab_ids.shape[0])
    for start in range(0, draft_logits.shape[0], CHUNK_ROWS):
        logits = draft_logits[start : start + CHUNK_ROWS].float()
        ids, logprobs = target_ids[start : start + CHUNK_ROWS], target_logprobs[start : start + CHUNK_ROWS].float()
        noise = gumbel((logits.shape[0], vocab_size), generator)  # [m, vocab]
        sampled = target_samples(ids, logprobs, noise, generator)  # [m] target id, -1: the lump
        draft_noise = noise[:, vocab_ids]  # [m, V']
        for index, scale in enumerate(scales):
            perturbed = torch.log_softmax(logits / scale, dim=-1) + draft_noise  # [m, V']
            top = perturbed.topk(children, dim=-1).indices  # [m, c]
            taken = (vocab_ids[top] == sampled[:, None]).float()  # [m, c] 1: that child is the sample
            hits[index] += float(taken[:, 0].sum())
            for column, tau in enumerate(noise_temperatures):
                predicted = noise_scores(perturbed, tau).gather(1, top).clamp(1e-6, 1.0 - 1e-6)  # [m, c]
                loss[index, column] += float(nn.functional.binary_cross_entropy(predicted, taken, reduction="sum"))
    return Coupled(hits, loss)


def best(values: dict[float, float], larger_is_better: bool) -> float:
    """The best candidate; on a tie the one closest to 1 (the plain distribution)."""
    sign = 1.0 if larger_is_better else -1.0
    return max(values, key=lambda key: (sign * values[key], -abs(key - 1.0)))


def calibrate_layer(
    layer: Eagle3Layer, sequences: list[Sequence], embed: torch.Tensor, steps: int, context: int, seed: int = 0,
    chunk: int = 8,
) -> Calibration:  # fmt: skip
    """Fit the three temperatures of an eagle3 layer on held-out sequences (module docstring)."""
    to_draft = draft_index(layer.vocab_ids, embed.shape[0])
    generator = torch.Generator().manual_seed(seed)
    nll, nll_rows = torch.zeros(len(SCORE_TEMPERATURES)), 0
    hits, rows = torch.zeros(len(SAMPLING_SCALES)), 0
    loss = torch.zeros(len(SAMPLING_SCALES), len(NOISE_SCORE_TEMPERATURES))
    with torch.inference_mode():
        for start in range(0, len(sequences), chunk):
            if rows >= MAX_ROWS:
                break
            batch = make_batch(sequences[start : start + chunk], steps, context, to_draft)
            for step, out in enumerate(ttt_outputs(layer, embed, batch, steps)):
                valid = batch.valid[:, :, step]  # [B, N]
                logits = layer.logits(out[valid]).float()  # [M, V']
                greedy = to_draft[batch.greedy[:, :, step][valid]]  # [M] draft id, -1 outside V'
                inside = greedy >= 0
                nll += argmax_nll(logits[inside], greedy[inside], SCORE_TEMPERATURES)
                nll_rows += int(inside.sum())
                if step == 0:
                    coupled = coupled_agreement(
                        logits, layer.vocab_ids, embed.shape[0], batch.topk_ids[:, :, 0][valid],
                        batch.topk_logprobs[:, :, 0][valid], SAMPLING_SCALES, generator,
                    )  # fmt: skip
                    hits += coupled.hits
                    loss += coupled.loss
                    rows += int(valid.sum())
    score_nll = {t: float(v) / max(1, nll_rows) for t, v in zip(SCORE_TEMPERATURES, nll, strict=True)}
    agreement = {s: float(v) / max(1, rows) for s, v in zip(SAMPLING_SCALES, hits, strict=True)}
    scale = best(agreement, True)
    per_child = max(1, rows * min(NOISE_CHILDREN, int(layer.vocab_ids.numel())))
    noise_loss = {
        tau: float(v) / per_child
        for tau, v in zip(NOISE_SCORE_TEMPERATURES, loss[SAMPLING_SCALES.index(scale)], strict=True)
    }
    return Calibration(best(score_nll, False), scale, best(noise_loss, False), score_nll, agreement, noise_loss, rows)
