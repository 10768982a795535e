"""The screened LM head of bf16 models: its first maxima equal the dense logits' first maxima (ties, near-ties
inside the Q8_0 copy's error, padding, refusals), the logits a pass returns are computed only when read, and
greedy decoding through the screen writes what the dense head's argmax writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from causaldraft.api import load
from causaldraft.config import SamplingConfig
from causaldraft.models import int4_kernel, q8_0_head, screened_head
from causaldraft.models.base import Scores
from causaldraft.models.loading import load_model
from causaldraft.models.screened_head import MAX_ROWS, ScreenedHead, use_screened_head
from causaldraft.sampling import gumbel_noise_rows, gumbel_scores
from causaldraft.verify import row_argmax

needs_kernels = pytest.mark.skipif(
    not (q8_0_head.available() and int4_kernel.bf16_available()),
    reason="the screen needs the Q8_0 kernel (AVX-512 with bf16) and causaldraft's bf16 product",
)


def head_of(weight: torch.Tensor) -> ScreenedHead:
    return ScreenedHead(nn.Parameter(weight.to(torch.bfloat16), requires_grad=False))


def dense_first_maxima(head: ScreenedHead, x: torch.Tensor) -> list[int]:
    return row_argmax(head(x))


def dense_gumbel_maxima(
    head: ScreenedHead, x: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig
) -> list[int]:
    return row_argmax(gumbel_scores(head(x), noise, sampling))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_first_maxima_are_the_dense_logits_first_maxima(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    head = head_of(torch.randn(1000, 96, generator=generator) * 0.05)  # 1000: not a multiple of 16 (padding)
    for trial in range(20):
        x = torch.randn(rows, 96, generator=generator) * (1 + trial)
        assert head.first_maxima(x) == dense_first_maxima(head, x)


@needs_kernels
@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 3.0])
def test_gumbel_maxima_are_the_dense_scores_first_maxima(temperature: float) -> None:
    generator = torch.Generator().manual_seed(7)
    head = head_of(torch.randn(1000, 96, generator=generator) * 0.05)
    sampling = SamplingConfig(temperature=temperature)
    for trial in range(12):
        rows = 1 + trial % 8
        x = torch.randn(rows, 96, generator=generator) * (1 + trial)
        noise = gumbel_noise_rows(trial, list(range(100, 100 + rows)), 1000)
        assert head.gumbel_maxima(x, noise, sampling) == dense_gumbel_maxima(head, x, noise, sampling)
    assert head.gumbel_maxima(x, noise, SamplingConfig(temperature=1.0, top_k=5)) is None  # top-k: every logit


def near_tie(step_rows: tuple[float, float]) -> tuple[torch.Tensor, float, float]:
    """Two weight rows [2, 32] bf16, zero but at input 0 (their Q8_0 block's largest magnitude, so its step) and
    input 5, where row 1's weight is larger than row 0's while the Q8_0 copy holds it smaller: found on the
    bf16 grid. Returns the rows and the two weights at input 5."""
    rows = torch.zeros(2, 32)
    rows[0, 0], rows[1, 0] = step_rows[0] * 127, step_rows[1] * 127
    value = torch.tensor(0.5, dtype=torch.bfloat16)
    while value < 0.7:
        for ulps in (2, 3):
            larger = (value.view(torch.int16) + ulps).view(torch.bfloat16)
            rows[0, 5], rows[1, 5] = float(value), float(larger)
            copy = q8_0_head.quantize(rows.to(torch.bfloat16).float()).dequantize()  # as the head quantizes
            if copy[1, 5] < copy[0, 5]:
                return rows.to(torch.bfloat16), float(value), float(larger)
        value = (value.view(torch.int16) + 1).view(torch.bfloat16)
    raise AssertionError("no near tie on the grid")


@needs_kernels
def test_a_token_the_q8_0_copy_ranks_below_another_is_still_found() -> None:
    """Token 600's weight at input 5 is larger than token 500's, its Q8_0 copy's smaller (their blocks have other
    steps): for x = 40 at input 5, token 600 has the largest logit, the copy ranks token 500 first. A screen
    that trusted the copy's argmax (no bound) would answer 500."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 32, generator=generator) * 0.002
    pair, smaller, larger = near_tie((0.01, 0.0153))
    weight[500], weight[600] = pair[0].float(), pair[1].float()
    head = head_of(weight)
    x = torch.zeros(1, 32)
    x[0, 5] = 40.0
    dense = head(x)
    approx = q8_0_head.product(x.to(torch.bfloat16), head.screen)
    assert float(dense[0, 600]) > float(dense[0, 500]) and float(approx[0, 500]) > float(approx[0, 600])
    assert row_argmax(approx[:, :1000]) == [500]
    assert head.first_maxima(x) == dense_first_maxima(head, x) == [600]
    assert smaller < larger
    # sampled at T = 1: token 700 has by far the largest logit but the least noise, 500 and 600 the same noise,
    # far more than the rest: the sample is 600 (the copy's scores rank 500 first, and 700 is the greedy answer)
    weight[700] = 0.0
    weight[700, 5] = 0.9
    head = head_of(weight)
    noise = torch.full((1, 1000), -20.0)
    noise[0, 500] = noise[0, 600] = 0.5
    sampling = SamplingConfig(temperature=1.0)
    assert head.first_maxima(x) == [700]
    assert head.gumbel_maxima(x, noise, sampling) == dense_gumbel_maxima(head, x, noise, sampling) == [600]


@needs_kernels
def test_tied_tokens_give_the_first() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1000, 64, generator=generator) * 0.01
    direction = torch.randn(64, generator=generator).abs() + 0.5
    weight[300] = weight[700] = direction * 0.3
    head = head_of(weight)
    x = torch.stack((direction, direction * 2)).to(torch.bfloat16)
    assert head.first_maxima(x) == [300, 300] == dense_first_maxima(head, x)


@needs_kernels
def test_rows_the_screen_does_not_answer() -> None:
    head = head_of(torch.randn(64, 32) * 0.1)
    assert head.first_maxima(torch.randn(MAX_ROWS + 1, 32)) is None  # dense logits are cheaper there
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    assert head.first_maxima(x) is None
    x[1, 3] = float("inf")
    assert head.first_maxima(x) is None
    scores = Scores(x, head, head)  # the pass's answer: from the logits, a NaN as the maximum
    assert scores.first_maxima() == row_argmax(head(x))


class FixedScreen:
    """A screen answering every call with ``maxima``."""

    def __init__(self, maxima: list[int] | None) -> None:
        self.maxima = maxima

    def first_maxima(self, x: torch.Tensor) -> list[int] | None:
        return self.maxima

    def gumbel_maxima(self, x: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig) -> list[int] | None:
        return self.maxima


def test_logits_are_computed_once_and_only_when_read() -> None:
    calls: list[int] = []

    def head(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return torch.tensor([[0.0, 2.0, 2.0], [3.0, 1.0, 0.0]])

    screened = Scores(torch.zeros(2, 4), head, FixedScreen([2, 0]))
    assert screened.first_maxima() == [2, 0] and calls == []  # the screen answered: no logits
    assert screened.logits()[0, 1] == 2.0 and screened.logits()[1, 0] == 3.0 and calls == [2]
    assert screened.first_maxima() == [1, 0]  # once read, the logits answer (the same, for an exact screen)
    unanswered = Scores(torch.zeros(2, 4), head, FixedScreen(None))
    assert unanswered.first_maxima() == [1, 0] and calls == [2, 2]
    assert Scores.of(torch.tensor([[0.0, 5.0]])).first_maxima() == [1]


@needs_kernels
def test_bf16_models_get_the_screen_and_others_do_not(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = load_model(str(tiny_llama_dir), "native", "bfloat16").backend
    assert isinstance(backend.lm_head, ScreenedHead)
    assert not isinstance(load_model(str(tiny_llama_dir), "native", "float32").backend.lm_head, ScreenedHead)
    assert not isinstance(load_model(str(tiny_llama_dir), "native", "int4").backend.lm_head, ScreenedHead)
    monkeypatch.setenv(screened_head.SWITCH, "off")
    assert not isinstance(load_model(str(tiny_llama_dir), "native", "bfloat16").backend.lm_head, ScreenedHead)
    assert not use_screened_head(nn.Module())


@needs_kernels
@pytest.mark.parametrize("drafter", ["none", "lookup", "draft"])
def test_greedy_decoding_through_the_screen_writes_the_dense_argmax(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, drafter: str
) -> None:
    """The same engine, its screen turned off by hand (every pass reads its logits' argmax): the same tokens,
    and the screen answered most passes (it is not skipped)."""
    engine = load(
        str(tiny_llama_dir), dtype="bfloat16", drafter=drafter, draft_layers=2, compile=False
    )  # draft: the first layers
    answered: list[bool] = []
    first_maxima = ScreenedHead.first_maxima

    def counted(self: ScreenedHead, x: torch.Tensor) -> list[int] | None:
        maxima = first_maxima(self, x)
        answered.append(maxima is not None)
        return maxima

    monkeypatch.setattr(ScreenedHead, "first_maxima", counted)
    prompts = [[5, 9, 12, 40, 7], [100, 3, 3, 3, 8, 200]]
    screened = [engine.generate(prompt, max_new_tokens=60).token_ids for prompt in prompts]
    assert sum(answered) > 20 and sum(answered) >= 0.5 * len(answered)  # trees of more than MAX_ROWS: dense
    monkeypatch.setattr(ScreenedHead, "first_maxima", lambda self, x: None)
    dense = [engine.generate(prompt, max_new_tokens=60).token_ids for prompt in prompts]
    assert screened == dense


@needs_kernels
@pytest.mark.parametrize("drafter", ["none", "lookup"])
def test_seeded_sampling_through_the_screen_draws_the_dense_scores_samples(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, drafter: str
) -> None:
    """Gumbel-seeded sampling (T = 1): the same tokens with the screen turned off by hand, which answered most
    passes."""
    engine = load(str(tiny_llama_dir), dtype="bfloat16", drafter=drafter, compile=False)
    answered: list[bool] = []
    gumbel_maxima = ScreenedHead.gumbel_maxima

    def counted(self: ScreenedHead, x: torch.Tensor, noise: torch.Tensor, sampling: SamplingConfig) -> list[int] | None:
        maxima = gumbel_maxima(self, x, noise, sampling)
        answered.append(maxima is not None)
        return maxima

    monkeypatch.setattr(ScreenedHead, "gumbel_maxima", counted)
    prompts = [[5, 9, 12, 40, 7], [100, 3, 3, 3, 8, 200]]
    options = {"max_new_tokens": 60, "temperature": 1.0, "seed": 3}
    screened = [engine.generate(prompt, **options).token_ids for prompt in prompts]
    assert sum(answered) > 20 and sum(answered) >= 0.5 * len(answered)
    monkeypatch.setattr(ScreenedHead, "gumbel_maxima", lambda self, x, noise, sampling: None)
    dense = [engine.generate(prompt, **options).token_ids for prompt in prompts]
    assert screened == dense
