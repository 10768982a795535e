"""Log-probabilities of the prompt's tokens (``prompt_logprobs=``, what the server's ``echo`` reports and
evaluation harnesses score): row i of the prompt's passes predicts prompt token i + 1; the output does not change;
kept prefixes are read again rather than copied; bad values refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from causaldraft.api import Engine, load
from causaldraft.decode import PROMPT_CHUNK
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel
from tests.test_exact import LOW_PRECISION, PROMPTS

TOP = 3
LONG_PROMPT = "".join(f"{index} bottles of water on the wall, " for index in range(12))  # > PROMPT_CHUNK tokens


def whole_pass_logprobs(engine: Engine, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax of one whole causal fp32 pass over the prompt: row i predicts token i + 1."""
    backend = engine.model.backend
    cache = backend.new_cache(len(prompt_ids))
    causal = torch.ones(len(prompt_ids), len(prompt_ids), dtype=torch.bool).tril()
    logits = backend.forward(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), causal, cache).logits
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("prompt", [PROMPTS[1], LONG_PROMPT])
def test_prompt_logprobs_are_a_whole_causal_pass_s(tiny_llama_dir: Path, prompt: str) -> None:
    """In fp32: each prompt token but the first, with its log-probability and the ``TOP`` likeliest tokens there,
    as one whole causal pass gives them, across the chunks the prompt is read in."""
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    prompt_ids = engine.encode(prompt)
    result = engine.generate(prompt, max_new_tokens=8, prompt_logprobs=TOP)
    assert result.prompt_logprobs is not None and result.logprobs is None
    assert [entry.token_id for entry in result.prompt_logprobs] == prompt_ids[1:]
    reference = whole_pass_logprobs(engine, prompt_ids)
    for row, entry in enumerate(result.prompt_logprobs):
        value = float(reference[row, entry.token_id])
        assert entry.logprob == pytest.approx(value, abs=1e-4), row
        assert int((reference[row] > value + 1e-4).sum()) < entry.rank <= int((reference[row] > value - 1e-4).sum()) + 1
        values, ids = torch.topk(reference[row], TOP)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    if prompt == LONG_PROMPT:
        assert len(prompt_ids) > PROMPT_CHUNK + 1  # the rows of a second chunk were scored too


def test_a_one_token_prompt_has_none_and_zero_alternatives_keep_the_token_s_own(tiny_llama_dir: Path) -> None:
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    first = engine.encode(PROMPTS[0])[:1]
    assert engine.generate(first, max_new_tokens=4, prompt_logprobs=2).prompt_logprobs == []
    result = engine.generate(PROMPTS[0], max_new_tokens=4, prompt_logprobs=0)
    assert result.prompt_logprobs and all(entry.top == () for entry in result.prompt_logprobs)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_output_is_unchanged_and_kept_prefixes_are_scored_again(models: dict[str, LoadedModel], dtype: str) -> None:
    """Scoring the prompt changes nothing the request writes; with the prefix store on, a prompt whose first chunk
    was kept gets the same prompt log-probabilities and output as the first time (the chunk is read, not copied,
    so its rows have logits)."""
    engine = load(loaded=models[dtype], drafter="lookup", calibrate=False, compile=False, prefix_cache_mb=64)
    engine.generate(LONG_PROMPT, max_new_tokens=24)  # keeps the first chunk
    plain = engine.generate(LONG_PROMPT, max_new_tokens=24)
    first = engine.generate(LONG_PROMPT, max_new_tokens=24, prompt_logprobs=TOP, logprobs=1)
    again = engine.generate(LONG_PROMPT, max_new_tokens=24, prompt_logprobs=TOP, logprobs=1)
    assert plain.stats.cached_prompt_tokens > 0  # the store is on: a plain request copies the kept chunk
    assert first.token_ids == again.token_ids == plain.token_ids
    assert first.stats.cached_prompt_tokens == again.stats.cached_prompt_tokens == 0
    assert first.prompt_logprobs == again.prompt_logprobs
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(engine.encode(LONG_PROMPT)) - 1


def test_batched_requests_score_their_own_prompts(tiny_llama_dir: Path) -> None:
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    prompts = [PROMPTS[0], LONG_PROMPT, PROMPTS[2]]
    batched = engine.generate_batch(prompts, size=3, max_new_tokens=12, prompt_logprobs=1)
    for prompt, result in zip(prompts, batched, strict=True):
        alone = engine.generate(prompt, max_new_tokens=12, prompt_logprobs=1)
        assert result.token_ids == alone.token_ids
        assert result.prompt_logprobs is not None and alone.prompt_logprobs is not None
        assert [entry.token_id for entry in result.prompt_logprobs] == engine.encode(prompt)[1:]
        for mine, own in zip(result.prompt_logprobs, alone.prompt_logprobs, strict=True):
            assert mine.logprob == pytest.approx(own.logprob, abs=1e-4)


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_bad_prompt_logprobs_are_refused_at_the_call(tiny_llama_dir: Path, value: object) -> None:
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    with pytest.raises(CausalDraftError, match="prompt_logprobs must be"):
        engine.generate(PROMPTS[0], max_new_tokens=4, prompt_logprobs=value)
    with pytest.raises(CausalDraftError, match="prompt_logprobs must be"):
        engine.events(PROMPTS[0], prompt_logprobs=value)
    assert engine.generate(PROMPTS[0], max_new_tokens=4).token_ids  # still usable
