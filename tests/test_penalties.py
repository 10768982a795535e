"""Repetition, frequency and presence penalties: each verify node penalized along its own path, so speculative
output is the penalized plain decoding's (token for token greedy and Gumbel-sampled, in law rejection-sampled),
and plain decoding is what a naive loop over whole forwards gives."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

import causaldraft
from causaldraft.api import Engine
from causaldraft.config import SamplingConfig
from causaldraft.errors import CausalDraftError
from causaldraft.models.loading import LoadedModel
from causaldraft.models.native import NativeLlama
from causaldraft.penalties import penalized_logits
from causaldraft.sampling import warp_probs
from causaldraft.tree import Tree
from tests.test_eagle3 import AUX, layer_dir
from tests.test_exact import LOW_PRECISION, PROMPTS

PENALTIES: list[dict[str, Any]] = [
    {"repetition_penalty": 1.4},
    {"frequency_penalty": 0.8},
    {"presence_penalty": 1.2},
    {"repetition_penalty": 0.8, "frequency_penalty": -0.5, "presence_penalty": 0.4},
    {"logit_bias": {100: 2.5, 120: -3.0, 250: 1.0}, "repetition_penalty": 1.2},
]


def test_each_node_is_penalized_for_its_own_path() -> None:
    """The docstring's worked example: output (a, b, a) = (1, 2, 1) after prompt (5, 6); root r = a (node 0),
    x = 3 (node 1) and y = 4 (node 2) under it, z = 7 (node 3) under x."""
    tree = Tree(parents=(-1, 0, 0, 1), tokens=(1, 3, 4, 7))
    logits = torch.ones(4, 8)
    logits[:, 6] = -1.0
    sampling = SamplingConfig(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    scores = penalized_logits(logits, tree, [5, 6, 1, 2, 1], 2, sampling)
    assert scores[3, 1] == 1 / 2 - 0.5 * 2 - 0.25  # a: seen, twice in the output
    assert scores[3, 3] == 1 / 2 - 0.5 * 1 - 0.25  # x: on node 3's path
    assert scores[3, 7] == 1 / 2 - 0.5 * 1 - 0.25  # z: node 3 itself (its row chooses the token after z)
    assert scores[2, 3] == 1.0 and scores[2, 4] == 1 / 2 - 0.5 - 0.25  # x is not on node 2's path; y is
    assert scores[0, 5] == 1 / 2 and scores[0, 6] == -2.0  # prompt tokens: repetition only, negative times r
    assert scores[0, 0] == 1.0 and scores[1, 2] == 1 / 2 - 0.5 - 0.25  # unseen; b, once in the output
    assert torch.equal(penalized_logits(logits, tree, [5, 6, 1, 2, 1], 2, SamplingConfig()), logits)
    biased = SamplingConfig(repetition_penalty=2.0, logit_bias=((0, -1.0), (5, 1.0)))
    scores = penalized_logits(logits, tree, [5, 6, 1, 2, 1], 2, biased)
    assert scores[:, 0].tolist() == [0.0] * 4  # every node alike; unseen, so no repetition penalty
    assert scores[:, 5].tolist() == [(1.0 + 1.0) / 2] * 4  # the bias first, then the repetition penalty (vLLM's order)


def naive_penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], options: dict[str, Any]
) -> torch.Tensor:
    """The logit bias and the penalties written out token by token, as vLLM's documentation states them."""
    scores = logits.clone()
    for token, bias in options.get("logit_bias", {}).items():
        scores[token] += bias
    repetition = options.get("repetition_penalty", 1.0)
    for token in set(prompt + output):
        scores[token] = scores[token] / repetition if scores[token] > 0 else scores[token] * repetition
    for token, count in Counter(output).items():
        scores[token] -= options.get("frequency_penalty", 0.0) * count + options.get("presence_penalty", 0.0)
    return scores


def naive_decoding(directory: Path, prompt: list[int], tokens: int, options: dict[str, Any]) -> list[int]:
    """Greedy decoding with penalties by one whole fp32 forward per token."""
    model = NativeLlama.from_pretrained(directory, torch.float32)
    output: list[int] = []
    for _ in range(tokens):
        context = prompt + output
        n = len(context)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        logits = model.forward(torch.tensor(context), torch.arange(n), mask, model.new_cache(n)).logits[-1]
        output.append(int(naive_penalized(logits, prompt, output, options).argmax()))
    return output


@pytest.mark.parametrize("options", [*PENALTIES[:4], {"logit_bias": "the first token's, -100"}])
def test_plain_decoding_with_penalties_is_the_naive_loop_s(tiny_llama_dir: Path, options: dict[str, Any]) -> None:
    plain = causaldraft.load(str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    prompt = plain.encode(PROMPTS[2])
    if "logit_bias" in options:  # the first greedy token made impossible, another one likelier
        options = {"logit_bias": {plain.generate(prompt, max_new_tokens=1).token_ids[0]: -100.0, 100: 2.5}}
    result = plain.generate(prompt, max_new_tokens=24, **options)
    assert result.token_ids == naive_decoding(tiny_llama_dir, prompt, 24, options)
    assert result.token_ids != plain.generate(prompt, max_new_tokens=24).token_ids  # the penalties changed it


def speculative(loaded: LoadedModel, directory: Path, tmp_path: Path, drafter: str) -> Engine:
    options: dict[str, object] = {"tree": "dynamic"}
    if drafter == "draft":  # the target as its own draft model: it accepts wherever penalties leave the argmax
        options.update(draft_model=str(directory), tree="chain", depth=4)
    if drafter == "eagle3":
        options["heads"] = str(layer_dir(loaded, tmp_path / drafter, aux_layers=AUX))
    return causaldraft.load(loaded=loaded, drafter=drafter, calibrate=False, fallback=False, compile=False, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("drafter", ["draft", "lookup", "eagle3"])
def test_speculative_output_with_penalties_is_plain_decoding_s(
    models: dict[str, LoadedModel], tiny_llama_dir: Path, tmp_path: Path, dtype: str, drafter: str
) -> None:
    loaded = models[dtype]
    plain = causaldraft.load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    spec = speculative(loaded, tiny_llama_dir, tmp_path, drafter)
    accepted = 0
    for options in PENALTIES:
        for prompt in PROMPTS[:2]:
            for sampling in ({}, {"temperature": 0.8, "seed": 5}):  # greedy, and Gumbel-sampled with a seed
                expected = plain.generate(prompt, max_new_tokens=40, logprobs=0, **options, **sampling)
                result = spec.generate(prompt, max_new_tokens=40, logprobs=0, **options, **sampling)
                assert result.token_ids == expected.token_ids, (options, prompt, sampling)
                assert result.logprobs == expected.logprobs  # raw: before penalties, as plain decoding reports
                accepted += sum(step.accepted for step in result.stats.steps)
    assert accepted > 0


def test_batched_penalties_are_each_request_s_alone(models: dict[str, LoadedModel]) -> None:
    engine = causaldraft.load(loaded=models["int4"], drafter="lookup", calibrate=False, compile=False)
    options = {"repetition_penalty": 1.3, "frequency_penalty": 0.2}
    alone = [engine.generate(prompt, max_new_tokens=30, **options).token_ids for prompt in PROMPTS]
    batched = engine.generate_batch(PROMPTS, size=3, max_new_tokens=30, **options)
    assert [result.token_ids for result in batched] == alone


def exact_penalized_law(directory: Path, prompt: list[int], options: dict[str, Any]) -> dict[tuple[int, int], float]:
    """The law of the first two tokens at T = 1, top-k 4, with penalties (whole fp32 forwards)."""
    model = NativeLlama.from_pretrained(directory, torch.float32)
    sampling = SamplingConfig(temperature=1.0, top_k=4)

    def next_probs(output: list[int]) -> torch.Tensor:
        context = prompt + output
        n = len(context)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        logits = model.forward(torch.tensor(context), torch.arange(n), mask, model.new_cache(n)).logits[-1]
        return warp_probs(naive_penalized(logits, prompt, output, options), sampling)

    first = next_probs([])
    law = {}
    for a in first.nonzero().flatten().tolist():
        second = next_probs([a])
        for b in second.nonzero().flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    return law


@pytest.mark.parametrize("sampler", ["rejection", "gumbel"])
def test_sampled_output_with_penalties_follows_the_penalized_law(tiny_llama_dir: Path, sampler: str) -> None:
    """The second token's node is judged against its penalized distribution given the first: 1,000 samples of
    the first two tokens against the exact law with the penalties, and against the law without them. The target
    drafts for itself (its first token is then always accepted), so the second node's row decides most pairs."""
    spec = causaldraft.load(str(tiny_llama_dir), dtype="float32", drafter="draft", draft_model=str(tiny_llama_dir),
                            tree="chain", depth=2, fallback=False, adapt=False, sampler=sampler, calibrate=False,
                            compile=False)  # fmt: skip
    options = {"frequency_penalty": -1.0, "presence_penalty": -0.5, "repetition_penalty": 1.2,  # repeats favoured
               "logit_bias": {100: 1.0, 200: -1.0}}  # fmt: skip
    prompt = spec.encode(PROMPTS[0])
    counts: Counter[tuple[int, int]] = Counter()
    accepted = 0
    for seed in range(1000):
        result = spec.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed, **options)
        counts[(result.token_ids[0], result.token_ids[1])] += 1
        accepted += result.stats.steps[0].accepted
    assert accepted > 500  # the second token came from the first step's second row that often

    def pvalue(law: dict[tuple[int, int], float]) -> float:
        keys = sorted(set(law) | set(counts))
        observed = [counts[key] for key in keys]
        total = sum(law.values())
        expected = [max(law.get(key, 0.0) / total * sum(observed), 1e-9) for key in keys]
        return float(chisquare(observed, expected).pvalue)

    assert pvalue(exact_penalized_law(tiny_llama_dir, prompt, options)) > 1e-4
    assert pvalue(exact_penalized_law(tiny_llama_dir, prompt, {})) < 1e-4  # the test can tell the penalties apart


@pytest.mark.parametrize(
    "options",
    [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"frequency_penalty": float("nan")},
     {"repetition_penalty": 0}, {"repetition_penalty": -1.0}, {"repetition_penalty": float("inf")},
     {"presence_penalty": True}, {"repetition_penalty": "1.2"}, {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}},
     {"logit_bias": {"7": 1}}, {"logit_bias": {1: float("nan")}}, {"logit_bias": [3, 4]}],
)  # fmt: skip
def test_bad_penalties_are_refused_at_the_call(models: dict[str, LoadedModel], options: dict[str, object]) -> None:
    engine = causaldraft.load(loaded=models["int4"], drafter="none", calibrate=False, compile=False)
    name = next(iter(options))
    with pytest.raises(CausalDraftError, match=name):
        engine.events("hi", **options)
    with pytest.raises(CausalDraftError, match="vocabulary"):
        engine.generate("hi", max_new_tokens=2, logit_bias={engine.model.backend.shape.vocab_size: 1.0})
    assert engine.generate("hi", max_new_tokens=2).token_ids  # the engine is still usable
