"""The decode loop: greedy equivalence of every drafter x tree kind, stop rules, bad input,
sampling law end to end on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

import causaldraft
from causaldraft.api import Engine
from causaldraft.config import SamplingConfig
from causaldraft.decode import PROMPT_CHUNK, PromptRead
from causaldraft.errors import CausalDraftError
from causaldraft.models.native import NativeLlama
from causaldraft.sampling import warp_probs
from tests.tiny import save_tiny_gpt2, save_tiny_llama

PROMPTS = ["hello world hello world", "the cat sat on the mat. the cat", "abcabcabc"]
DRAFTERS = ["lookup", "draft"]
TREES = ["chain", "static", "dynamic"]


def engine(directory: Path, drafter: str = "none", **options: object) -> Engine:
    settings: dict[str, object] = {
        "dtype": "float32",
        "drafter": drafter,
        "draft_layers": 2,
        "calibrate": False,
        "compile": False,
    }
    settings.update(options)
    return causaldraft.load(str(directory), **settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir: Path) -> dict[str, list[int]]:
    plain = engine(tiny_llama_dir)
    return {prompt: plain.generate(prompt, max_new_tokens=48).token_ids for prompt in PROMPTS}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("fallback", [False, True])
def test_greedy_speculative_output_is_token_identical_to_plain(
    tiny_llama_dir: Path, plain_outputs: dict[str, list[int]], drafter: str, tree: str, fallback: bool
) -> None:
    spec = engine(tiny_llama_dir, drafter, tree=tree, fallback=fallback, calibrate=fallback)
    for prompt in PROMPTS:
        result = spec.generate(prompt, max_new_tokens=48)
        assert result.token_ids == plain_outputs[prompt], (drafter, tree, prompt)
        if not fallback:
            assert sum(step.nodes for step in result.stats.steps) > result.stats.target_forwards


def test_lookup_paths_deeper_than_the_tree_keep_plain_output(
    tiny_llama_dir: Path, plain_outputs: dict[str, list[int]]
) -> None:
    """Lookup paths reach ``lookup_depth`` past the tree's ``depth``, and a match that reaches the
    present repeats its period; steps accept more than ``depth`` tokens, the output is plain decoding's."""
    spec = engine(tiny_llama_dir, "lookup", depth=3, lookup_depth=16, fallback=False)
    deepest = 0
    for prompt in PROMPTS:
        result = spec.generate(prompt, max_new_tokens=48)
        assert result.token_ids == plain_outputs[prompt], prompt
        deepest = max([deepest, *(step.accepted for step in result.stats.steps)])
    assert deepest > 3


def test_separate_draft_model_equal_to_target_accepts_every_token(
    tiny_llama_dir: Path, plain_outputs: dict[str, list[int]]
) -> None:
    spec = engine(tiny_llama_dir, "draft", draft_model=str(tiny_llama_dir), tree="chain", depth=5,
                  fallback=False, adapt=False)  # fmt: skip
    result = spec.generate(PROMPTS[0], max_new_tokens=48)
    assert result.token_ids == plain_outputs[PROMPTS[0]]
    assert all(step.accepted == 5 for step in result.stats.steps[:-1]), [s.accepted for s in result.stats.steps]
    for tree in ("static", "dynamic"):
        spec = engine(tiny_llama_dir, "draft", draft_model=str(tiny_llama_dir), tree=tree, fallback=False)
        result = spec.generate(PROMPTS[0], max_new_tokens=48)
        assert result.token_ids == plain_outputs[PROMPTS[0]]
        assert result.stats.mean_accepted > 3.0


def test_plain_greedy_matches_transformers_generate(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    plain = engine(tiny_llama_dir)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids) :]
        assert plain.generate(prompt, max_new_tokens=30).token_ids == expected.tolist()


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_prompt_read_in_chunks_caches_what_one_pass_over_it_gives(tiny_llama_dir: Path, backend: str) -> None:
    """A prompt longer than a chunk is read in two passes; the root's logits through that cache, and the
    hidden state that predicted it, are transformers' over the whole prompt at once."""
    plain = engine(tiny_llama_dir, backend=backend)
    ids = [3 + (index * 7919) % 256 for index in range(PROMPT_CHUNK + 100)]
    read = PromptRead(plain.decoder, ids, 1, None)
    passes = 0
    while not read.done:
        passes += int(read.advance() > 0)
    assert passes == 2 and read.state.cache.length == len(ids) - 1
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        whole = model(torch.tensor([ids]), output_hidden_states=True)
    root = plain.decoder.target.forward(torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]),
                                        torch.ones(1, len(ids), dtype=torch.bool), read.state.cache)  # fmt: skip
    torch.testing.assert_close(root.logits[0], whole.logits[0, -1], atol=1e-4, rtol=1e-4)
    assert read.state.hidden is not None
    torch.testing.assert_close(read.state.hidden, whole.hidden_states[-1][0, -2], atol=1e-4, rtol=1e-4)


def test_eos_accepted_mid_block_ends_the_output_there(
    tiny_llama_dir: Path, plain_outputs: dict[str, list[int]]
) -> None:
    reference = plain_outputs[PROMPTS[0]]
    eos = reference[7]
    cut = reference.index(eos) + 1
    spec = engine(
        tiny_llama_dir, "draft", draft_model=str(tiny_llama_dir), tree="chain", depth=6, fallback=False, adapt=False
    )
    spec.decoder = dataclasses.replace(spec.decoder, eos_token_ids=frozenset({eos}))
    result = spec.generate(PROMPTS[0], max_new_tokens=48)
    assert result.token_ids == reference[:cut]
    assert result.finish_reason == "stop"
    assert sum(min(s.accepted + 1, 48) for s in result.stats.steps) > cut  # the last block went past EOS


def test_every_end_token_of_generation_config_ends_the_output_as_transformers_does(
    tiny_llama_dir: Path, plain_outputs: dict[str, list[int]], tmp_path: Path
) -> None:
    """Instruct checkpoints list several ``eos_token_id`` in generation_config.json (Llama 3.1, Qwen3); transformers'
    ``generate`` stops at each, and so does every drafter here. A generation_config.json that cannot be read, or
    whose ids are not ids, is refused at load."""
    directory = tmp_path / "ends"
    shutil.copytree(tiny_llama_dir, directory)
    reference = plain_outputs[PROMPTS[1]]
    end = reference[9]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end, 10**6]}))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(directory)).encode(PROMPTS[1], add_special_tokens=False)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :].tolist()
    assert expected == reference[: reference.index(end) + 1]
    for drafter in ("none", *DRAFTERS):
        spec = engine(directory, drafter, draft_model=str(directory), fallback=False)
        result = spec.generate(PROMPTS[1], max_new_tokens=48)
        assert (result.token_ids, result.finish_reason) == (expected, "stop"), drafter
        assert spec.generate(PROMPTS[1], max_new_tokens=48, ignore_eos=True).token_ids == reference
    for text, message in [("{not json", "cannot read"), ('{"eos_token_id": "2"}', "must be a token id")]:
        (directory / "generation_config.json").write_text(text)
        with pytest.raises(CausalDraftError, match=message):
            engine(directory)


@pytest.mark.parametrize("drafter", ["none", "lookup", "draft"])
def test_max_new_tokens_is_exact(tiny_llama_dir: Path, plain_outputs: dict[str, list[int]], drafter: str) -> None:
    spec = engine(tiny_llama_dir, drafter, fallback=False)
    for limit in (1, 2, 7, 13):
        result = spec.generate(PROMPTS[0], max_new_tokens=limit)
        assert result.token_ids == plain_outputs[PROMPTS[0]][:limit]
        assert result.stats.new_tokens == limit and result.finish_reason == "length"


def test_stop_strings_end_output_exactly_like_plain_decoding(tiny_llama_dir: Path) -> None:
    plain = engine(tiny_llama_dir)
    full = plain.generate(PROMPTS[1], max_new_tokens=48)
    stop = full.text[10:13]
    expected = plain.generate(PROMPTS[1], max_new_tokens=48, stop=[stop])
    assert expected.text == full.text[: full.text.index(stop)]
    assert expected.finish_reason == "stop"
    for drafter in DRAFTERS:
        spec = engine(tiny_llama_dir, drafter, fallback=False)
        result = spec.generate(PROMPTS[1], max_new_tokens=48, stop=[stop])
        assert (result.text, result.token_ids) == (expected.text, expected.token_ids)
        streamed = "".join(spec.stream(PROMPTS[1], max_new_tokens=48, stop=stop))
        assert streamed == expected.text


def test_stream_yields_the_generated_text(tiny_llama_dir: Path) -> None:
    spec = engine(tiny_llama_dir, "lookup")
    pieces = list(spec.stream(PROMPTS[0], max_new_tokens=20))
    assert len(pieces) > 1
    assert "".join(pieces) == spec.generate(PROMPTS[0], max_new_tokens=20).text


def test_vocabulary_mismatch_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_llama_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(str(other))
    tokenizer.add_tokens(["<extra-token>"])
    tokenizer.save_pretrained(str(other))
    with pytest.raises(CausalDraftError, match="vocabulary"):
        engine(tiny_llama_dir, "draft", draft_model=str(other))
    # found by an audit: the same tokenizer over fewer embedding rows crashed at the first id past them
    fewer = tmp_path / "fewer-rows"
    save_tiny_llama(fewer, vocab_size=200)
    AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(str(fewer))
    with pytest.raises(CausalDraftError, match="embeds 200 token ids, fewer than the target's 259"):
        engine(tiny_llama_dir, "draft", draft_model=str(fewer))
    with pytest.raises(CausalDraftError, match="draft models run on the native backend"):
        engine(tiny_llama_dir, "draft", draft_model=str(save_tiny_gpt2(tmp_path / "gpt2")))
    with pytest.raises(CausalDraftError, match=r"--draft-layers .* \[1, 3\] for this 4-layer model, got 4"):
        engine(tiny_llama_dir, "draft", draft_layers=4)


def test_context_overflow_is_a_clear_error(tiny_llama_dir: Path) -> None:
    plain = engine(tiny_llama_dir)
    with pytest.raises(CausalDraftError, match="context"):
        plain.generate("x" * 500, max_new_tokens=20)


@pytest.mark.parametrize(
    "options",
    [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"max_new_tokens": 0},
     {"max_new_tokens": "ten"}, {"temperature": float("nan")}, {"temperature": True}, {"top_k": True},
     {"top_p": True}, {"seed": True}, {"chat": "no"}, {"max_tokens": 5}],
)  # fmt: skip
def test_invalid_sampling_parameters_are_clear_errors(tiny_llama_dir: Path, options: dict[str, object]) -> None:
    """Bad request options (a bool for a number, a misspelt name) are CausalDraftErrors, raised by ``stream`` at
    the call, before any text; the engine goes on as before."""
    plain = engine(tiny_llama_dir)
    with pytest.raises(CausalDraftError):
        plain.generate(PROMPTS[0], **options)
    with pytest.raises(CausalDraftError):
        plain.stream(PROMPTS[0], **options)
    with pytest.raises(CausalDraftError):
        plain.generate_batch([PROMPTS[0]], **options)
    assert plain.generate(PROMPTS[0], max_new_tokens=3).stats.new_tokens == 3  # nothing lost


def test_invalid_engine_options_are_clear_errors(tiny_llama_dir: Path) -> None:
    for options in ({"tree": "forest"}, {"drafter": "oracle"}, {"acceptance": "optimistic"}, {"depth": 0}):
        with pytest.raises(CausalDraftError):
            engine(tiny_llama_dir, **options)  # type: ignore[arg-type]
    for options, message in (({"depth": "3"}, "depth must be int or None, got '3'"),
                             ({"compile": 1}, "compile must be bool or None"),
                             ({"width": True}, "width must be")):  # fmt: skip
        with pytest.raises(CausalDraftError, match=message):
            engine(tiny_llama_dir, **options)  # type: ignore[arg-type]
    for model in (None, 3):
        with pytest.raises(CausalDraftError, match="model must be str"):
            causaldraft.load(model=model)  # type: ignore[arg-type]
    with pytest.raises(CausalDraftError, match="compiling needs the native backend"):  # before any model loads
        causaldraft.load(model=str(tiny_llama_dir / "nowhere"), backend="hf", compile=True)
    assert engine(Path(tiny_llama_dir)).generate("ab", max_new_tokens=2).token_ids  # a Path names a model too


def test_empty_prompt_and_bad_token_ids_are_clear_errors(tiny_llama_dir: Path) -> None:
    plain = engine(tiny_llama_dir)
    with pytest.raises(CausalDraftError):
        plain.generate("", max_new_tokens=3)
    with pytest.raises(CausalDraftError):
        plain.generate([1, 2, 9999], max_new_tokens=3)
    for prompt in (b"hello", [1.5, 2.7], [True, 5], None, 5):
        with pytest.raises(CausalDraftError, match="a prompt is|token ids are integers"):
            plain.generate(prompt, max_new_tokens=3)  # type: ignore[arg-type]
    for prompt in (["ab", "cd"], [{"role": "user", "content": "hi"}, 5]):
        with pytest.raises(CausalDraftError, match="chat messages .* or token ids .*, not both and not text: got"):
            plain.generate(prompt, max_new_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(CausalDraftError, match="chat=True applies to a text prompt"):
        plain.generate([5, 6], chat=True, max_new_tokens=3)
    for stop in (5, [5], [None], {"a": 1}):
        with pytest.raises(CausalDraftError, match="stop must be"):
            plain.generate("ab", max_new_tokens=3, stop=stop)
    with pytest.raises(CausalDraftError, match="a list of prompts"):
        plain.generate_batch("hi", max_new_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(CausalDraftError, match="chat message"):
        plain.generate([{"role": "user"}], max_new_tokens=3)
    assert (
        plain.generate(torch.tensor([5, 6]), max_new_tokens=3).token_ids
        == plain.generate([5, 6], max_new_tokens=3).token_ids
    )


def test_chat_messages_are_a_prompt(tiny_llama_dir: Path) -> None:
    """A list of messages (a system one too) goes through the chat template; one user message is ``chat=True``."""
    plain = engine(tiny_llama_dir)
    user = {"role": "user", "content": "hello"}
    assert (plain.generate([user], max_new_tokens=8).token_ids
            == plain.generate("hello", chat=True, max_new_tokens=8).token_ids)  # fmt: skip
    messages = [{"role": "system", "content": "be brief"}, user]
    ids = plain.encode(messages)
    assert ids == plain.encode_chat(messages) and len(ids) > len(plain.encode([user]))
    assert plain.generate(messages, max_new_tokens=8).token_ids == plain.generate(ids, max_new_tokens=8).token_ids


def test_seeded_sampling_is_reproducible(tiny_llama_dir: Path) -> None:
    spec = engine(tiny_llama_dir, "draft", tree="static", fallback=False)
    first = spec.generate(PROMPTS[0], max_new_tokens=24, temperature=1.0, seed=7)
    second = spec.generate(PROMPTS[0], max_new_tokens=24, temperature=1.0, seed=7)
    third = spec.generate(PROMPTS[0], max_new_tokens=24, temperature=1.0, seed=8)
    assert first.token_ids == second.token_ids
    assert first.token_ids != third.token_ids


# ---- end-to-end sampling law ------------------------------------------------------------------

SAMPLES = 1000
SAMPLING = SamplingConfig(temperature=1.0, top_k=4)


def exact_law(directory: Path, prompt_ids: list[int], sampling: SamplingConfig) -> dict[tuple[int, int], float]:
    """Enumerate the target's law of the first two generated tokens (fp32 full forwards)."""
    model = NativeLlama.from_pretrained(directory, torch.float32)

    def next_probs(tokens: list[int]) -> torch.Tensor:
        cache = model.new_cache(len(tokens))
        n = len(tokens)
        logits = model.forward(
            torch.tensor(tokens), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache
        ).logits
        return warp_probs(logits[-1], sampling)

    first = next_probs(prompt_ids)
    law = {}
    for a in first.nonzero().flatten().tolist():
        second = next_probs([*prompt_ids, a])
        for b in second.nonzero().flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    return law


@pytest.mark.parametrize("sampler", ["gumbel", "rejection"])
@pytest.mark.parametrize(("drafter", "tree", "options"), [
    ("draft", "chain", {}), ("draft", "static", {}), ("lookup", "dynamic", {}),
    ("draft", "chain", {"top_p": 0.8}),
])  # fmt: skip
def test_sampled_output_follows_the_exact_target_law(
    tiny_llama_dir: Path, drafter: str, tree: str, options: dict[str, float], sampler: str
) -> None:
    spec = engine(tiny_llama_dir, drafter, tree=tree, depth=2, fallback=False, adapt=False, sampler=sampler)
    pvalue, drafted = law_test(spec, tiny_llama_dir, options)
    assert drafted > SAMPLES  # the verifier really judged drafts
    assert pvalue > 1e-4


def law_test(spec: Engine, directory: Path, options: dict[str, float]) -> tuple[float, int]:
    """Sample the first two tokens of PROMPTS[0] SAMPLES times (T=1, top-k 4 and ``options``): the
    chi-square p-value against the exact target law, and the draft nodes the verifier judged."""
    prompt_ids = spec.encode(PROMPTS[0])
    law = exact_law(directory, prompt_ids, dataclasses.replace(SAMPLING, **options))
    counts: Counter[tuple[int, int]] = Counter()
    drafted = 0
    for seed in range(SAMPLES):
        result = spec.generate(prompt_ids, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed, **options)
        counts[(result.token_ids[0], result.token_ids[1])] += 1
        drafted += result.stats.steps[0].nodes - 1
    assert set(counts) <= set(law)
    keys = sorted(law)
    observed = [counts[key] for key in keys]
    total = sum(law.values())
    expected = [law[key] / total * sum(observed) for key in keys]
    return float(chisquare(observed, expected).pvalue), drafted


def first_token_law(directory: Path, prompt_ids: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """The target's law of the first generated token [vocab] (an fp32 full forward)."""
    model = NativeLlama.from_pretrained(directory, torch.float32)
    n = len(prompt_ids)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    logits = model.forward(torch.tensor(prompt_ids), torch.arange(n), mask, model.new_cache(n)).logits
    return warp_probs(logits[-1], sampling)


def pooled_pvalue(counts: Counter[int], law: torch.Tensor) -> float:
    """Chi-square p-value of token counts against ``law`` [vocab], the tokens expected fewer than 5 times pooled."""
    samples = sum(counts.values())
    expected = law.double() * samples
    kept = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts[token] for token in kept]
    pooled = [samples - sum(observed), samples - float(expected[kept].sum())]
    return float(chisquare([*observed, pooled[0]], [*expected[kept].tolist(), pooled[1]]).pvalue)


def test_gumbel_sampling_without_top_k_or_top_p_follows_the_target_law(tiny_llama_dir: Path) -> None:
    """Without top-k or top-p the Gumbel sampler scores (logits - max) / T + noise, with no softmax
    (``sampling.gumbel_scores``; the law tests above all cut at top-k 4). The first token of a chain
    drafter's verify passes follows the target's law at T = 0.5; the law at T = 1 is rejected."""
    spec = engine(tiny_llama_dir, "draft", tree="chain", depth=2, fallback=False, adapt=False)
    prompt_ids = spec.encode(PROMPTS[0])
    samples = 2000
    first = Counter(
        spec.generate(prompt_ids, max_new_tokens=1, temperature=0.5, seed=seed).token_ids[0] for seed in range(samples)
    )
    assert pooled_pvalue(first, first_token_law(tiny_llama_dir, prompt_ids, SamplingConfig(temperature=0.5))) > 1e-4
    assert pooled_pvalue(first, first_token_law(tiny_llama_dir, prompt_ids, SamplingConfig(temperature=1.0))) < 1e-4


def test_naive_acceptance_fails_the_same_law_test(tiny_llama_dir: Path) -> None:
    spec = engine(tiny_llama_dir, "draft", tree="static", depth=2, width=3, fallback=False, adapt=False,
                  acceptance="naive")  # fmt: skip
    prompt_ids = spec.encode(PROMPTS[0])
    sampling = dataclasses.replace(SAMPLING, top_k=0)
    law = exact_law(tiny_llama_dir, prompt_ids, dataclasses.replace(SAMPLING))
    counts: Counter[tuple[int, int]] = Counter()
    for seed in range(SAMPLES):
        result = spec.generate(prompt_ids, max_new_tokens=2, temperature=1.0, top_k=4, seed=seed)
        counts[(result.token_ids[0], result.token_ids[1])] += 1
    keys = sorted(law)
    observed = [counts[key] for key in keys]
    total = sum(law.values())
    expected = [law[key] / total * sum(observed) for key in keys]
    assert sampling.top_k == 0
    assert chisquare(observed, expected).pvalue < 1e-4


def test_gumbel_sampling_gives_the_same_tokens_for_a_seed_whatever_the_drafter_and_tree(tiny_llama_dir: Path) -> None:
    """Gumbel-max with noise keyed by (seed, position): each seeded request's output is a function
    of the seed and the model alone, so plain decoding and every drafter x tree agree, with the
    measured cost model choosing trees freely."""
    prompt = PROMPTS[1]
    plain = engine(tiny_llama_dir)
    for seed in (0, 1, 2**64 + 5):
        expected = plain.generate(prompt, max_new_tokens=32, temperature=0.9, top_p=0.95, seed=seed).token_ids
        for drafter in ("lookup", "draft"):
            for tree in TREES:
                spec = engine(tiny_llama_dir, drafter, tree=tree, calibrate=True)
                result = spec.generate(prompt, max_new_tokens=32, temperature=0.9, top_p=0.95, seed=seed)
                assert result.token_ids == expected, (seed, drafter, tree)
    assert plain.generate(prompt, max_new_tokens=32, temperature=0.9, seed=3).token_ids != expected


def test_gumbel_draft_equal_to_target_accepts_every_token_when_sampling(tiny_llama_dir: Path) -> None:
    """Ranked with the target's own noise, a draft equal to the target guesses every sampled token
    (as rejection sampling accepts every draw of a draft equal to the target)."""
    spec = engine(tiny_llama_dir, "draft", draft_model=str(tiny_llama_dir), tree="chain", depth=5,
                  fallback=False, adapt=False)  # fmt: skip
    result = spec.generate(PROMPTS[0], max_new_tokens=48, temperature=1.0, seed=11)
    assert all(step.accepted == 5 for step in result.stats.steps[:-1]), [s.accepted for s in result.stats.steps]
    rejection = engine(tiny_llama_dir, "draft", draft_model=str(tiny_llama_dir), tree="chain", depth=5,
                       fallback=False, adapt=False, sampler="rejection")  # fmt: skip
    steps = rejection.generate(PROMPTS[0], max_new_tokens=48, temperature=1.0, seed=11).stats.steps
    assert all(step.accepted == 5 for step in steps[:-1])


def test_a_draft_model_padded_to_a_larger_vocabulary_drafts_the_targets(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The target's weights with embeddings padded from 259 to 518 rows (same tokenizer, as model families
    pad), each padding row outscoring a real token's: the padding rows are cut from its logits, so it is the
    target again and every draft is accepted, greedy, Gumbel-ranked or drawn for rejection sampling (where
    its 518-wide distribution once crashed)."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    model.resize_token_embeddings(518, mean_resizing=False)
    with torch.no_grad():
        model.lm_head.weight[259:] = 1.01 * model.lm_head.weight[:259]
    model.save_pretrained(str(tmp_path / "padded"))
    AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(str(tmp_path / "padded"))
    plain = engine(tiny_llama_dir)
    for sampler, options in (("gumbel", {}), ("gumbel", {"temperature": 1.0, "seed": 4}),
                             ("rejection", {"temperature": 1.0, "seed": 4})):  # fmt: skip
        spec = engine(tiny_llama_dir, "draft", draft_model=str(tmp_path / "padded"), tree="chain", depth=5,
                      fallback=False, adapt=False, sampler=sampler)  # fmt: skip
        result = spec.generate(PROMPTS[0], max_new_tokens=32, **options)  # type: ignore[arg-type]
        assert all(step.accepted == 5 for step in result.stats.steps[:-1]), (sampler, options)
        if sampler == "gumbel":
            assert result.token_ids == plain.generate(PROMPTS[0], max_new_tokens=32, **options).token_ids  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{"seed": 2**64}, {"seed": -(2**70)}, {"temperature": 1e-37},
                                     {"temperature": 5e-324}, {"top_p": 1e-300}])  # fmt: skip
def test_extreme_but_valid_sampling_values_sample_correctly(tiny_llama_dir: Path, options: dict[str, float]) -> None:
    settings: dict[str, float] = {"temperature": 1.0, "seed": 1, **options}
    for sampler in ("gumbel", "rejection"):
        spec = engine(tiny_llama_dir, "lookup", sampler=sampler, fallback=False)
        result = spec.generate(PROMPTS[0], max_new_tokens=8, **settings)  # type: ignore[arg-type]
        assert len(result.token_ids) == 8
        if settings["temperature"] < 1e-30 or settings.get("top_p", 1.0) < 1e-30:
            greedy = engine(tiny_llama_dir).generate(PROMPTS[0], max_new_tokens=8).token_ids
            assert result.token_ids == greedy  # effectively greedy, never NaN


def test_text_past_the_model_s_embedding_rows_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Found by an audit: a tokenizer with more tokens than its model's ``vocab_size`` encoded text to an id the
    model cannot embed, and the first pass crashed; token-id prompts were already checked."""
    small = save_tiny_llama(tmp_path / "small-vocab", vocab_size=200)  # the 259-token byte tokenizer
    plain = engine(small)
    assert plain.generate("ab", max_new_tokens=2).token_ids  # bytes a, b: ids under 200
    for prompt, chat in (("€", False), ("hi", True)):  # a byte of € and the template's spaces: ids past 200
        with pytest.raises(CausalDraftError, match="past this model's 200 embedding rows"):
            plain.generate(prompt, chat=chat, max_new_tokens=2)
    with pytest.raises(CausalDraftError, match=r"token ids must be in \[0, 200\)"):
        plain.generate([5, 230], max_new_tokens=2)
