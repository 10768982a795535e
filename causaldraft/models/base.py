"""The backend protocol: one forward over any set of new tokens against a KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from causaldraft.config import SamplingConfig
from causaldraft.sampling import gumbel_scores
from causaldraft.verify import row_argmax


@dataclass(frozen=True)
class ModelShape:
    """What callers need to know about a model, whatever its backend."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_positions: int


Head = Callable[[torch.Tensor], torch.Tensor]  # [rows, hidden] -> [rows, vocab] logits


class ScreeningHead(Protocol):
    """A head that finds rows' first maxima without computing every logit (``models/screened_head.py``); each
    returns None where it does not answer, and the caller reads the logits."""

    def first_maxima(self, x: torch.Tensor) -> list[int] | None: ...

    def gumbel_maxima(self, x: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig) -> list[int] | None: ...


class Scores:
    """A pass's logits over its scored rows, [rows, vocab] float32 (rows = all new tokens, or the requested
    rows), computed when first read. Greedy and Gumbel-seeded acceptance read only each row's first maximum of
    the logits or of their Gumbel scores (``first_maxima``, ``gumbel_maxima``), which a ``screen`` may answer
    without computing every logit.

    ``Scores.of(logits)``: logits already computed; ``Scores(rows, head, screen)``: ``head(rows)`` when read."""

    def __init__(self, rows: torch.Tensor, head: Head, screen: ScreeningHead | None = None) -> None:
        self.rows = rows  # [rows, hidden] the head's inputs
        self.head = head
        self.screen = screen
        self.computed: torch.Tensor | None = None

    @classmethod
    def of(cls, logits: torch.Tensor) -> Scores:
        """Logits [rows, vocab] already computed."""
        scores = cls(logits.new_empty(logits.shape[0], 0), lambda rows: logits)
        scores.computed = logits
        return scores

    def logits(self) -> torch.Tensor:
        """[rows, vocab] float32, computed once."""
        if self.computed is None:
            self.computed = self.head(self.rows).float()
        return self.computed

    def first_maxima(self) -> list[int]:
        """Each row's first maximum (a NaN counts as the maximum): through the screen where there is one and
        the logits were not read, else from the logits."""
        if self.computed is None and self.screen is not None:
            maxima = self.screen.first_maxima(self.rows)
            if maxima is not None:
                return maxima
        return row_argmax(self.logits())

    def gumbel_maxima(self, noise: torch.Tensor, sampling: SamplingConfig) -> list[int]:
        """Each row's Gumbel sample: the first maximum of ``gumbel_scores(logits, noise, sampling)``, noise
        [rows, vocab]; through the screen where there is one and the logits were not read."""
        if self.computed is None and self.screen is not None:
            maxima = self.screen.gumbel_maxima(self.rows, noise, sampling)
            if maxima is not None:
                return maxima
        return row_argmax(gumbel_scores(self.logits(), noise, sampling))


@dataclass(frozen=True)
class ForwardOutput:
    scores: Scores  # the logits of the scored rows, computed when read
    hidden: torch.Tensor  # [n, hidden] last-layer hidden states (after the final norm)
    aux: torch.Tensor | None = None  # [n, len(aux_layers) * hidden] inputs of the requested layers

    @property
    def logits(self) -> torch.Tensor:
        """[rows, vocab] float32 (rows = all new tokens, or the requested rows)."""
        return self.scores.logits()


class Cache(Protocol):
    length: int
    max_len: int

    def append(self, new_tokens: int) -> None: ...

    def commit(self, slots: list[int], start: int) -> None: ...

    def rollback(self, length: int) -> None: ...

    def check_room(self, new_tokens: int) -> None: ...


class CalibrationStore(Protocol):
    """Where measured verify costs are kept between processes (beside compiled graphs)."""

    def read_calibration(self, name: str) -> dict[int, float] | None: ...

    def write_calibration(self, name: str, seconds: dict[int, float]) -> None: ...


class Backend(Protocol):
    """A target model. What it can do is declared, not probed: ``buckets`` (row counts its
    compiled passes are padded to; empty when it runs eagerly), ``quantized`` (int8/int4 weights)
    and ``calibration`` (a store for measured verify costs, when it has compiled graphs)."""

    buckets: tuple[int, ...]
    quantized: bool
    shape: ModelShape  # max_positions may be capped below the config's (loading.capped_to_window)

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def calibration(self) -> CalibrationStore | None: ...

    def new_cache(self, max_len: int) -> Cache: ...

    def pass_room(self, length: int) -> int:
        """How many positions (length, length + 1, ...) one pass over a cache of ``length``
        committed entries may reach while every row computes exactly what a one-row pass at its
        position would (the decode loop keeps draft trees within it)."""
        ...

    def pass_rows(self) -> int:
        """The most new tokens one pass may hold while every row computes exactly what a one-row
        pass computes (the decode loop keeps draft trees within it)."""
        ...

    def forward(
        self,
        tokens: torch.Tensor,  # [n] long
        positions: torch.Tensor,  # [n] long
        mask: torch.Tensor,  # [n, cache.length + n] bool, True = may attend
        cache: Cache,
        logits_rows: torch.Tensor | None = None,  # [m] long rows of the new tokens to score; None = all
        aux_layers: tuple[int, ...] = (),  # layers whose inputs to return as ``aux`` (num_layers: the last
        # layer's output before the final norm); feature drafters ask for them
    ) -> ForwardOutput: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        ...

    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        ...
