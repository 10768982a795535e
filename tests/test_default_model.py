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
from causaldraft.models.loading import (
    LoadedModel,
    default_gguf_path,
    file_sha256,
    load_model,
    read_source_record,
    resolve_dtype,
    resolve_model_dir,
    write_source_record,
)

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
    engine = causaldraft.load(loaded=default_fp32, drafter="none", calibrate=False, compile=False)
    return {text: engine.generate(text, chat=True, max_new_tokens=48).token_ids for text in mt_bench_prompts(5)}


def test_plain_greedy_matches_transformers_generate(
    default_fp32: LoadedModel, plain_outputs: dict[str, list[int]]
) -> None:
    engine = causaldraft.load(loaded=default_fp32, drafter="none", calibrate=False, compile=False)
    model = AutoModelForCausalLM.from_pretrained(str(default_fp32.model_dir), dtype=torch.float32).eval()
    for text, ours in plain_outputs.items():
        ids = engine.encode(text, chat=True)
        with torch.inference_mode():
            expected = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids) :]
        assert ours == expected.tolist()


# every drafter with the dynamic tree (every default's), chains and static trees with lookup and eagle3: the tiny
# Llama's tests cover every drafter x tree x verifier; the draft model and the Markov heads cost ~15 s a case here
@pytest.mark.parametrize(("drafter", "tree"), [
    *((drafter, "dynamic") for drafter in ("lookup", "draft", "eagle3", "markov")),
    *((drafter, tree) for drafter in ("lookup", "eagle3") for tree in ("chain", "static")),
])  # fmt: skip
def test_speculative_greedy_is_token_identical_on_the_default_model(
    default_fp32: LoadedModel, plain_outputs: dict[str, list[int]], drafter: str, tree: str
) -> None:
    engine = causaldraft.load(
        loaded=default_fp32, drafter=drafter, tree=tree, fallback=False, calibrate=False, compile=False
    )
    # the draft model drafts in fp32 with a model as large as the target: one prompt keeps the suite's time (the
    # tiny Llama's tests cover every drafter x tree x verifier in depth)
    for text in list(plain_outputs)[: 1 if drafter == "draft" else 2]:
        assert engine.generate(text, chat=True, max_new_tokens=48).token_ids == plain_outputs[text]


def test_the_default_conversion_follows_its_gguf_file_to_a_new_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion whose record names a GGUF path that is gone (the environment it was made in was
    deleted) is still the default model's, in int4 with ``auto``, once the installed file has the same bytes.
    Before the record carried a digest, that folder was reused as it was: with no GGUF file, ``auto``
    chose bfloat16 and int4 quantized the checkpoint instead of reading the file's blocks."""
    installed = resolve_model_dir("default")
    home = tmp_path / "home"
    copy = home / "models" / installed.name
    copy.mkdir(parents=True)
    for item in installed.iterdir():
        if item.is_file() and not item.name.startswith(("quant-", ".")):  # the checkpoint, not its caches
            (copy / item.name).symlink_to(item)
    (copy / "causaldraft_source.json").unlink()
    gguf = default_gguf_path()
    stale = {"gguf": str(tmp_path / "deleted-env" / gguf.name), "size": 1, "mtime_ns": 1}
    write_source_record(copy, {**stale, "sha256": file_sha256(gguf), "four_bit": True})
    monkeypatch.setenv("CAUSALDRAFT_HOME", str(home))
    assert resolve_model_dir("default") == copy  # not converted again: the same bytes
    assert Path(str(read_source_record(copy)["gguf"])) == gguf.resolve()
    assert resolve_dtype(copy, "auto") == "int4"


def test_default_model_loads_from_the_converted_cache_quickly_enough_to_reuse() -> None:
    loaded = load_model("default", "native", "bfloat16")
    assert (loaded.model_dir / "config.json").is_file()
    assert loaded.backend.shape.vocab_size == 49152
    assert loaded.tokenizer.eos_token_id == 2
