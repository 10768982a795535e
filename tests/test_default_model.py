"""End-to-end checks on the real default model (SmolLM2-135M-Instruct), fp32 for exactness.

Run alone with: pytest -m slow
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import causaldraft
from causaldraft.models.loading import LoadedModel, load_model

pytestmark = pytest.mark.slow

# MT-bench questions kept in the repository (not those of bench/prompts/mt-bench-8.jsonl, which the benches use)
BENCH = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "mt-bench-other16.jsonl"


def mt_bench_prompts(count: int) -> list[str]:
    rows = [json.loads(line) for line in BENCH.read_text().splitlines() if line.strip()]
    step = len(rows) // count
    return [row["turns"][0] for row in rows[::step][:count]]


@pytest.fixture(scope="module")
def default_fp32() -> LoadedModel:
    return load_model("default", "native", "float32")


@pytest.fixture(scope="module")
def plain_outputs(default_fp32: LoadedModel) -> dict[str, list[int]]:
    engine = causaldraft.load(loaded=default_fp32, drafter="none", calibrate=False)
    return {text: engine.generate(text, chat=True, max_new_tokens=48).token_ids for text in mt_bench_prompts(5)}


def test_plain_greedy_matches_transformers_generate(
    default_fp32: LoadedModel, plain_outputs: dict[str, list[int]]
) -> None:
    engine = causaldraft.load(loaded=default_fp32, drafter="none", calibrate=False)
    model = AutoModelForCausalLM.from_pretrained(str(default_fp32.model_dir), dtype=torch.float32).eval()
    for text, ours in plain_outputs.items():
        ids = engine.encode(text, chat=True)
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :]
        assert ours == expected.tolist()


@pytest.mark.parametrize("drafter", ["lookup", "draft", "eagle3", "markov"])
@pytest.mark.parametrize("tree", ["chain", "static", "dynamic"])
def test_speculative_greedy_is_token_identical_on_the_default_model(
    default_fp32: LoadedModel, plain_outputs: dict[str, list[int]], drafter: str, tree: str
) -> None:
    engine = causaldraft.load(loaded=default_fp32, drafter=drafter, tree=tree, fallback=False, calibrate=False)
    for text in list(plain_outputs)[:2]:
        assert engine.generate(text, chat=True, max_new_tokens=48).token_ids == plain_outputs[text]


def test_default_model_loads_from_the_converted_cache_quickly_enough_to_reuse() -> None:
    loaded = load_model("default", "native", "bfloat16")
    assert (loaded.model_dir / "config.json").is_file()
    assert loaded.backend.shape.vocab_size == 49152
    assert loaded.tokenizer.eos_token_id == 2
