"""A bf16 model's LM head whose greedy answer (each row's first maximum) is found without computing every
logit: a cheaper Q8_0 copy of the head bounds each logit, and only the tokens whose bound reaches the
best one are computed exactly (docs/screened-head.md).

Why: the head is the widest product of a bf16 pass (49152 x 576 for the default model, 56.6 MB of bf16
weights read per pass: ~3.4 ms of a ~13.5 ms one-row pass on the AMD EPYC of stop 55), and greedy
verification reads only each row's argmax. The Q8_0 copy is 30 MB (``q8_0_head``'s kernel).

Exact by construction. For a row ``x`` and token ``v``, ``logit[v]`` is what the head's own product
(``bf16_mm``: exact bf16 products, fp32 sums, rounded once to bf16) gives, ``approx[v]`` the Q8_0 copy's,
``residual[v] = w[v] - q8_0(w)[v]``. Then

    |logit[v] - approx[v]| <= |x . residual[v]| + |fp32 sum errors| + |bf16 rounding of logit[v]|
                           <= |x| * margin + 2^-8 * |logit[v]|
                           <= |x| * margin * (1 + 2^-8) + 2^-8 * |approx[v]|  =: at most ``bound``

with ``margin`` the largest ``|residual[v]| + SUM_ERROR * |w[v]|`` over the vocabulary (Cauchy-Schwarz;
``SUM_ERROR`` covers both products' fp32 sums of a few hundred steps) and ``bound`` taken with the row's
largest ``|approx|``. A token ``v`` with ``approx[v] < max(approx) - 2 * bound`` has a logit below the logit
of the token with the largest ``approx``: it cannot be the row's maximum. The others, the candidates, get
their exact logits from the same product over their own weight rows (each output of ``bf16_mm`` depends
on its channel's weights and its row alone, so these are the dense product's bits), and the first
maximum among them, in token order, is the row's first maximum: every token tied at the maximum is a
candidate. A row whose approximations are not all finite is answered from the dense logits.

Gumbel-seeded sampling reads each row's first maximum of ``(logits - max) / T + noise`` (``gumbel_maxima``): the
same bound over T, widened by the scores' own float32 roundings, gives its candidates (docs/screened-head.md).

Measured on 1,100 rows of the default model's answers (stop 55): the bound is ~0.2 logits, 1.3
candidates per row on average, at most 7; a row with one candidate needs no exact product at all.

Worked example: approx = [1.0, 5.0, 4.9, -2.0], bound 0.1: max 5.0, threshold 5.0 - 0.2 = 4.8, so the
candidates are tokens 1 and 2; their exact logits [5.0, 5.0] (a tie) give token 1, the first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from causaldraft.config import SamplingConfig
from causaldraft.models import int4_kernel, q8_0_head
from causaldraft.sampling import MIN_TEMPERATURE
from causaldraft.verify import row_argmax

# "off": the LM head of before stop 55 (oneDNN's where it takes bf16 weights); "dense": this head's product, every
# logit computed (no screen), for comparisons
SWITCH = "CAUSALDRAFT_SCREENED_HEAD"
# Screen calls of up to this many rows: beyond, the Q8_0 copy's product costs about what the dense one does
# (cold caches, this CPU: 2.30 against 3.77 ms at 8 rows, 4.44 against 4.72 at 16)
MAX_ROWS = 8
SUM_ERROR = 2e-4  # > 2 x 1,000 x 2^-24: both products' fp32 sums, relative to sum |x_i w_i| <= |x| |w|
ROUNDING = 2.0**-8  # bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it
SCORE_ROUNDING = 1e-5  # > 6 x 2^-24: the centres' and a Gumbel score's float32 roundings, relative to their terms
NOISE_BOUND = 37.0  # |Gumbel noise| from float64 uniforms: at most -log(-log(1 - 2^-53)) = 36.7
SLACK = 1e-25  # absolute: products and sums of subnormal numbers, which the bf16 dot-product steps flush to zero
MAX_CANDIDATES = 1024  # more (a flat row, or a huge bound) and the dense logits are cheaper


class ScreenedHead(nn.Module):
    """``logits = x @ W.T`` through ``bf16_mm`` (fp32 out, from bf16 sums rounded once), row-invariant, and
    ``first_maxima`` through the Q8_0 screen (module docstring).

    ``weight``: the model's dense head parameter [vocab, hidden] bf16, kept where others read it (drafters
    take the target's output rows from ``lm_head.weight``) and gathered for the candidates' products;
    ``packed`` (``bf16_mm``'s records), ``screen`` (the Q8_0 copy's records) and ``largest_margin`` are derived,
    plain attributes."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        dense = weight.detach()
        self.packed = int4_kernel.pack_channels(padded_rows(dense, int4_kernel.BLOCK))
        copy = q8_0_head.quantize(padded_rows(dense, q8_0_head.CHANNELS))
        self.screen = q8_0_head.pack(copy)
        exact = dense.float()
        residual = exact - copy.dequantize()[: self.out_features]
        margins = residual.norm(dim=1) + SUM_ERROR * exact.norm(dim=1)  # [vocab]
        self.largest_margin = float(margins.max())
        self.screening = os.environ.get(SWITCH, "").lower() != "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [m, hidden]
        logits = int4_kernel.bf16_product(rows, self.packed)[:, : self.out_features].float()  # [m, vocab]
        return logits.reshape(*x.shape[:-1], self.out_features)

    def first_maxima(self, x: torch.Tensor) -> list[int] | None:
        """Each row's first maximum of ``forward(x)`` without computing it: x [m, hidden] -> m token ids;
        None where the screen does not answer (more than ``MAX_ROWS`` rows, approximations that are not
        all finite, too many candidates): the caller reads the dense logits."""
        approximation = self.approximate(x) if self.screening else None
        if approximation is None:
            return None
        candidates = approximation.maxima_candidates()
        if all(len(ids) == 1 for ids in candidates):
            return [int(ids[0]) for ids in candidates]
        ids, exact = self.exact_logits(approximation.rows, candidates)
        if exact is None:
            return None
        # the first maximum among each row's own candidates
        return [int(own[row_argmax(row_logits(exact, ids, row, own)[None])[0]]) for row, own in enumerate(candidates)]

    def gumbel_maxima(self, x: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig) -> list[int] | None:
        """Each row's first maximum of ``sampling.gumbel_scores(forward(x), noise, sampling)`` (its Gumbel sample)
        without computing every logit: x [m, hidden], noise [m, vocab] -> m token ids; None where the screen
        does not answer (as ``first_maxima``; top-k or top-p, whose scores need every logit).

        Each token's score lies within ``bound / T + slack`` of ``approx / T + noise`` less the row's largest logit
        over T (``slack`` covers the float32 roundings of both), so the candidates are the tokens within twice that
        of the best one; the greedy candidates join them (they hold the row's largest logit). Their scores are
        computed from their exact logits by ``gumbel_scores``' own operations (IEEE subtraction, division, addition
        of the same numbers: the dense scores' bits), and the first maximum among them, in token order, is the
        dense scores' first maximum."""
        if sampling.top_k > 0 or sampling.top_p < 1.0:
            return None
        approximation = self.approximate(x) if self.screening else None
        if approximation is None:
            return None
        temperature = max(sampling.temperature, MIN_TEMPERATURE)  # as scaled_logits divides
        centres = approximation.approx / np.float32(temperature)  # [m, vocab] float32
        centres += noise.numpy()
        reach = (np.abs(approximation.top) + np.abs(approximation.bottom) + 2 * approximation.bounds) / temperature
        slacks = SCORE_ROUNDING * (reach + NOISE_BOUND) + SLACK  # [m]: the centres' and the scores' roundings
        thresholds = centres.max(axis=1) - 2 * (approximation.bounds / temperature + slacks)  # [m]
        candidates = [
            np.union1d(np.flatnonzero(row >= threshold), maxima)
            for row, threshold, maxima in zip(centres, thresholds, approximation.maxima_candidates(), strict=True)
        ]  # fmt: skip
        ids, exact = self.exact_logits(approximation.rows, candidates)
        if exact is None:
            return None
        samples = []
        for row, own in enumerate(candidates):
            logits = row_logits(exact, ids, row, own)
            # gumbel_scores' operations on these elements: the dense scores' bits (IEEE sub, div, add)
            scores = (logits - logits.amax()).div_(temperature).add_(noise[row, torch.from_numpy(own)])
            samples.append(int(own[row_argmax(scores[None])[0]]))
        return samples

    def approximate(self, x: torch.Tensor) -> Approximation | None:
        """The Q8_0 copy's logits of x [m, hidden] and each row's bound (module docstring); None for more than
        ``MAX_ROWS`` rows or approximations that are not all finite."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [m, hidden]
        if rows.shape[0] > MAX_ROWS:
            return None
        approx = q8_0_head.product(rows, self.screen).numpy()[:, : self.out_features]  # [m, vocab] float32
        top, bottom = approx.max(axis=1), approx.min(axis=1)  # [m]: a NaN anywhere makes both NaN
        if not (np.isfinite(top).all() and np.isfinite(bottom).all()):
            return None
        norms = rows.float().norm(dim=1).numpy()  # [m]
        largest = np.maximum(np.abs(top), np.abs(bottom))  # [m] the largest |approx| of each row
        bounds = norms * self.largest_margin * (1 + ROUNDING) + ROUNDING * largest + SLACK  # [m]
        return Approximation(rows, approx, top, bottom, bounds)

    def exact_logits(self, rows: torch.Tensor, candidates: list[np.ndarray]) -> tuple[np.ndarray, torch.Tensor | None]:
        """rows [m, hidden] bf16, candidates[r] token ids of row r -> (ids [c], the union in increasing order, and
        every row's exact logits of them [m, c] float32: the dense product's bits); None for more than
        ``MAX_CANDIDATES`` ids."""
        ids = np.unique(np.concatenate(candidates))  # [c] increasing: every row's candidates
        if len(ids) > MAX_CANDIDATES:
            return ids, None
        weights = self.weight.detach().index_select(0, torch.from_numpy(ids))  # [c, hidden]
        packed = int4_kernel.pack_channels(padded_rows(weights, int4_kernel.BLOCK))
        return ids, int4_kernel.bf16_product(rows, packed)[:, : len(ids)].float()


@dataclass(frozen=True)
class Approximation:
    """The Q8_0 copy's logits of some rows: every exact logit lies within its row's bound of them."""

    rows: torch.Tensor  # [m, hidden] bf16
    approx: np.ndarray  # [m, vocab] float32
    top: np.ndarray  # [m] each row's largest approximation
    bottom: np.ndarray  # [m] and smallest
    bounds: np.ndarray  # [m] |logit - approx| <= bound for every token of the row

    def maxima_candidates(self) -> list[np.ndarray]:
        """Each row's tokens that may hold its largest logit (increasing ids): within twice the bound of the top."""
        thresholds = self.top - 2 * self.bounds  # [m]
        return [np.flatnonzero(row >= threshold) for row, threshold in zip(self.approx, thresholds, strict=True)]


def row_logits(exact: torch.Tensor, ids: np.ndarray, row: int, own: np.ndarray) -> torch.Tensor:
    """Row ``row``'s exact logits of its own candidates ``own`` (increasing ids, a subset of ``ids``), from
    ``exact`` [m, len(ids)]: [len(own)] float32. Example: ids [3, 7, 9], own [7, 9] -> exact[row, [1, 2]]."""
    return exact[row, torch.from_numpy(np.searchsorted(ids, own))]


def padded_rows(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    """weight [out, in] with zero rows appended up to a multiple of ``multiple`` rows."""
    padding = -weight.shape[0] % multiple
    return torch.cat((weight, weight.new_zeros(padding, weight.shape[1]))) if padding else weight


def wanted() -> bool:
    return os.environ.get(SWITCH, "").lower() != "off"


def use_screened_head(model: nn.Module) -> bool:
    """Replace ``model.lm_head`` (bf16, no bias) by a ScreenedHead where both products run here (``bf16_mm``
    and the Q8_0 kernel) and the hidden size fits Q8_0 blocks; False (nothing changed) otherwise."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if not wanted() or not isinstance(weight, nn.Parameter) or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    if getattr(head, "bias", None) is not None or weight.shape[1] % q8_0_head.GROUP:
        return False
    if not int4_kernel.bf16_available() or not q8_0_head.available():
        return False
    model.lm_head = ScreenedHead(weight)
    return True
