"""Prompt prefixes kept between requests (prefix.py): the store's bookkeeping on literal caches, and
on the tiny Llama that a prompt starting with a kept prefix is cached bit for bit as if read whole,
decodes the same tokens, and hands a drafter the same features."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch

from causaldraft.api import Engine, load
from causaldraft.batch import Batch
from causaldraft.bench.harness import BenchConfig
from causaldraft.cache import KVCache
from causaldraft.config import EngineConfig
from causaldraft.decode import PROMPT_CHUNK, PromptRead
from causaldraft.drafters.base import NoDrafter
from causaldraft.errors import CausalDraftError
from causaldraft.flags import engine_config
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.prefix import PrefixStore, chunk_digests, copy_chunks
from causaldraft.serve.app import create_app
from causaldraft.serve.metrics import parse_metrics
from causaldraft.serve.server import BackgroundServer
from tests.test_eagle3 import layer_dir

SENTENCE = "the quick brown fox jumps over the lazy dog. "
SHARED = (SENTENCE * 7)[:300]  # 300 byte tokens: one whole chunk of 256 and 44 more
PROMPT_A = SHARED + "what does the fox do next?"
PROMPT_B = SHARED + "name three colours, then count to five"


def numbered_cache(rows: int, layers: int = 2) -> KVCache:
    """A cache whose entry at position p holds p (keys) and -p (values) everywhere."""
    cache = KVCache(layers, 1, 2, 64, torch.float32)
    column = torch.arange(rows, dtype=torch.float32)[None, :, None].expand(1, rows, 2)  # [1, rows, 2]
    for layer in range(layers):
        cache.write_layer(layer, column, -column)
    cache.append(rows)
    return cache


def test_digests_chain_over_whole_chunks_and_the_conditions() -> None:
    tokens = [5, 6, 7, 8, 9]
    digests = chunk_digests(tokens, 2, 2, (1,))
    assert len(digests) == 2 and digests[0] != digests[1]
    assert chunk_digests([5, 6, 7, 8, 0], 2, 2, (1,)) == digests  # the partial chunk is not part of it
    assert chunk_digests([5, 6, 7, 0], 2, 2, (1,))[0] == digests[0]
    assert chunk_digests([5, 6, 7, 0], 2, 2, (1,))[1] != digests[1]
    assert chunk_digests(tokens, 2, 2, (2,))[0] != digests[0]  # another thread count or feature layers


def keep_all(store: PrefixStore, prompt: list[int], conditions: tuple[int, ...] = ()) -> None:
    """Keep every whole chunk of ``prompt`` from a numbered cache, as a prompt read keeps them."""
    rows = len(prompt) - 1
    cache = numbered_cache(rows)
    for index in range(rows // store.chunk):
        store.keep(prompt, index, cache, None, conditions)


def test_the_kept_chunks_that_continue_a_prefix_are_found_and_a_row_is_always_left_to_read() -> None:
    store = PrefixStore(1 << 20, chunk=2)
    keep_all(store, [1, 2, 3, 4, 5, 6, 7], (1,))  # 6 rows cached: 3 whole chunks
    assert len(store.chunks) == 3
    assert sum(kept.rows for kept in store.find([1, 2, 3, 4, 5, 6, 9, 9], 0, (1,))) == 6
    assert sum(kept.rows for kept in store.find([1, 2, 3, 4, 5, 6, 7], 0, (1,))) == 4  # its last row is read again
    assert sum(kept.rows for kept in store.find([1, 2, 3, 4, 5, 6, 9, 9], 1, (1,))) == 4  # from chunk 1 on
    assert sum(kept.rows for kept in store.find([1, 2, 3, 0, 5, 6, 7], 0, (1,))) == 2
    assert store.find([1, 2, 3, 4, 5, 6, 7], 0, (2,)) == []
    assert store.find([0, 2, 3, 4, 5, 6, 7], 0, (1,)) == []
    assert store.find([1, 2, 3], 0, (1,)) == []  # 2 rows to cache: nothing may be copied
    cache = KVCache(2, 1, 2, 64, torch.float32)
    copy_chunks(store.find([1, 2, 3, 4, 5, 0, 0], 0, (1,)), cache)
    assert cache.length == 4
    assert cache.keys[1][0, :4, 0].tolist() == [0, 1, 2, 3] and cache.values[0][0, :4, 1].tolist() == [0, -1, -2, -3]
    copy_chunks(store.find([1, 2, 3, 4, 5, 6, 0, 0], 2, (1,)), cache)  # appended after what is cached
    assert cache.length == 6 and cache.keys[0][0, :6, 1].tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="not cached yet"):
        store.keep([8, 8, 8, 8], 0, numbered_cache(1), None, ())


def test_prompts_that_part_after_a_shared_chunk_share_it_and_the_oldest_leaf_goes_first() -> None:
    chunk_bytes = 2 * 2 * 2 * 2 * 4  # two rows: 2 layers x (keys + values) x [1, 2, 2] float32
    store = PrefixStore(4 * chunk_bytes, chunk=2)
    keep_all(store, [1, 2, 3, 4, 5, 6, 0])  # chunks [1, 2] [3, 4] [5, 6]
    keep_all(store, [1, 2, 7, 8, 0])  # parts after [1, 2]: one more chunk, [1, 2] held once
    assert len(store.chunks) == 4 and store.nbytes == 4 * chunk_bytes
    assert sum(kept.rows for kept in store.find([1, 2, 3, 4, 5, 6, 9, 9], 0, ())) == 6
    assert sum(kept.rows for kept in store.find([1, 2, 7, 8, 9, 9], 0, ())) == 4  # now the newest
    keep_all(store, [9, 9, 0])  # full: the oldest chunk no other continues goes, [5, 6]
    assert sum(kept.rows for kept in store.find([1, 2, 3, 4, 5, 6, 9, 9], 0, ())) == 4
    assert sum(kept.rows for kept in store.find([9, 9, 0, 0], 0, ())) == 2
    keep_all(store, [1, 2, 3, 4, 5, 6, 0])  # [5, 6] again: [7, 8], the oldest leaf, goes
    assert sum(kept.rows for kept in store.find([1, 2, 7, 8, 9, 9], 0, ())) == 2
    assert store.nbytes == 4 * chunk_bytes and sum(kept.children for kept in store.chunks.values()) == 2
    store.keep([4, 4, 4, 4, 0], 1, numbered_cache(4), None, ())  # its parent [4, 4] is not kept: nor is it
    assert store.find([4, 4, 4, 4, 0, 0], 0, ()) == []
    larger = PrefixStore(chunk_bytes - 1, chunk=2)
    keep_all(larger, [1, 2, 3])  # larger than the store: not kept
    assert not larger.chunks and PrefixStore(0, 2).find([1, 2, 3, 4], 0, ()) == []
    store.clear()
    assert store.find([1, 2, 3, 4, 5, 6, 0], 0, ()) == [] and not store.chunks and store.nbytes == 0


class FeatureRecorder(NoDrafter):
    """Plain decoding that asks for the features of three layers and keeps what ``start`` is given."""

    feature_layers = (1, 2, 3)

    def __init__(self) -> None:
        self.started: list[torch.Tensor | None] = []

    def start(self, prompt: tuple[int, ...], features: torch.Tensor | None) -> None:
        self.started.append(features)


def read(engine: Engine, prompt: list[int], prefixes: PrefixStore | None) -> tuple[PromptRead, torch.Tensor | None]:
    """The prompt cached by a decoder whose drafter records its features; returns them too."""
    recorder = FeatureRecorder()
    prompt_read = PromptRead(replace(engine.decoder, drafter=recorder), prompt, 8, None, prefixes=prefixes)
    while not prompt_read.done:
        prompt_read.advance()
    return prompt_read, recorder.started[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_a_copied_prefix_is_the_cache_a_whole_read_writes(tiny_llama_dir: Path, dtype: str) -> None:
    loaded = load_model(str(tiny_llama_dir), "native", dtype)
    engine = load(loaded=loaded, drafter="none", calibrate=False, compile=False)
    first, second = engine.encode(PROMPT_A), engine.encode(PROMPT_B)
    store = PrefixStore(1 << 26, PROMPT_CHUNK)
    read(engine, first, store)
    assert len(store.chunks) == 1
    (copied, copied_features), (whole, whole_features) = read(engine, second, store), read(engine, second, None)
    assert copied.state.stats.cached_prompt_tokens == PROMPT_CHUNK and not whole.state.stats.cached_prompt_tokens
    rows = len(second) - 1
    for layer in range(len(whole.state.cache.keys)):
        assert torch.equal(copied.state.cache.keys[layer][:, :rows], whole.state.cache.keys[layer][:, :rows])
        assert torch.equal(copied.state.cache.values[layer][:, :rows], whole.state.cache.values[layer][:, :rows])
    assert copied.state.hidden is not None and torch.equal(copied.state.hidden, whole.state.hidden)
    assert copied_features is not None and whole_features is not None
    assert copied_features.shape == (rows, 3 * loaded.backend.shape.hidden_size)
    assert torch.equal(copied_features, whole_features)


@pytest.fixture(scope="module")
def models_by_dtype(tiny_llama_dir: Path) -> dict[str, LoadedModel]:
    return {dtype: load_model(str(tiny_llama_dir), "native", dtype) for dtype in ("float32", "int4")}


@pytest.mark.parametrize("dtype", ["float32", "int4"])
@pytest.mark.parametrize("drafter", ["none", "lookup", "eagle3"])
def test_generation_after_a_kept_prefix_is_the_same(
    models_by_dtype: dict[str, LoadedModel], tmp_path: Path, dtype: str, drafter: str
) -> None:
    """The same tokens, steps and drafts (eagle3 reads the prompt's features: the copied ones) as an engine
    that reads every prompt whole; the second prompt and the first again copy a chunk."""
    loaded = models_by_dtype[dtype]
    heads = str(layer_dir(loaded, tmp_path / "eagle3")) if drafter == "eagle3" else None
    options = {"drafter": drafter, "heads": heads, "calibrate": False, "compile": False, "fallback": False}
    keeping = load(loaded=loaded, **options)  # type: ignore[arg-type]
    reading = load(loaded=loaded, prefix_cache_mb=0, **options)  # type: ignore[arg-type]
    assert keeping.prefixes is not None and reading.prefixes is None
    cached = []
    for prompt in (PROMPT_A, PROMPT_B, PROMPT_A):
        expected = reading.generate(prompt, max_new_tokens=24)
        result = keeping.generate(prompt, max_new_tokens=24)
        assert result.token_ids == expected.token_ids
        assert [(step.nodes, step.accepted) for step in result.stats.steps] == [
            (step.nodes, step.accepted) for step in expected.stats.steps
        ]
        cached.append(result.stats.cached_prompt_tokens)
        assert result.stats.summary()["cached_prompt_tokens"] == cached[-1]
    assert cached == [0, PROMPT_CHUNK, PROMPT_CHUNK]
    if drafter != "none":
        assert any(step.nodes > 1 for step in result.stats.steps)  # it really drafted


def test_a_batch_copies_kept_prefixes_into_its_slots(models_by_dtype: dict[str, LoadedModel]) -> None:
    engine = load(loaded=models_by_dtype["int4"], drafter="lookup", calibrate=False, compile=False)
    reading = load(loaded=models_by_dtype["int4"], drafter="lookup", calibrate=False, compile=False, prefix_cache_mb=0)
    expected = [reading.generate(prompt, max_new_tokens=12).token_ids for prompt in (PROMPT_A, PROMPT_B)]
    engine.generate(PROMPT_A, max_new_tokens=2)
    batch = Batch(engine, 2, context=512)
    streams = [batch.add(prompt, max_new_tokens=12) for prompt in (PROMPT_A, PROMPT_B)]
    while not all(stream.done for stream in streams):
        batch.step()
    assert [stream.run.state.stats.cached_prompt_tokens for stream in streams] == [PROMPT_CHUNK, PROMPT_CHUNK]
    got = [[token for event in stream.events for token in getattr(event, "token_ids", [])] for stream in streams]
    assert got == expected


def test_a_prompt_joining_a_batch_copies_what_another_has_read_so_far(models_by_dtype: dict[str, LoadedModel]) -> None:
    """Chunks are kept as they are read: B joins one step after A started reading the same first chunk."""
    engine = load(loaded=models_by_dtype["int4"], drafter="lookup", calibrate=False, compile=False)
    reading = load(loaded=models_by_dtype["int4"], drafter="lookup", calibrate=False, compile=False, prefix_cache_mb=0)
    expected = [reading.generate(prompt, max_new_tokens=12).token_ids for prompt in (PROMPT_A, PROMPT_B)]
    batch = Batch(engine, 2, context=512)
    first = batch.add(PROMPT_A, max_new_tokens=12)
    batch.step()
    assert first.run.reading and len(engine.prefixes.chunks) == 1  # type: ignore[union-attr]
    second = batch.add(PROMPT_B, max_new_tokens=12)
    while not (first.done and second.done):
        batch.step()
    assert first.run.state.stats.cached_prompt_tokens == 0
    assert second.run.state.stats.cached_prompt_tokens == PROMPT_CHUNK
    streams = (first, second)
    got = [[token for event in stream.events for token in getattr(event, "token_ids", [])] for stream in streams]
    assert got == expected


def test_the_size_is_checked_and_the_bench_reads_every_prompt_whole(tiny_llama_dir: Path) -> None:
    with pytest.raises(CausalDraftError, match="prefix cache"):
        EngineConfig(prefix_cache_mb=-1)
    assert EngineConfig().prefix_cache_mb > 0
    assert "--prefix-cache-mb" in EngineConfig(prefix_cache_mb=0).flags()
    assert BenchConfig("p.jsonl", ("ar",)).engine.prefix_cache_mb == 0
    from causaldraft.bench.cli import config_from_args
    from causaldraft.cli import build_parser

    bench = build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--methods", "ar"])
    assert config_from_args(bench).engine.prefix_cache_mb == 0
    kept = build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--methods", "ar", "--prefix-cache-mb", "64"])
    assert config_from_args(kept).engine.prefix_cache_mb == 64
    generate = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert engine_config(generate).prefix_cache_mb == EngineConfig().prefix_cache_mb
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False,
                  backend="hf")  # fmt: skip
    result = engine.generate(PROMPT_A, max_new_tokens=2)
    assert engine.generate(PROMPT_B, max_new_tokens=2).stats.cached_prompt_tokens == 0  # hf caches: read whole
    assert result.stats.cached_prompt_tokens == 0


def test_the_server_reports_cached_prompt_tokens(tiny_llama_dir: Path) -> None:
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    with BackgroundServer(create_app(engine, model_name="tiny")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.completions.create(model="tiny", prompt=PROMPT_A, max_tokens=4, temperature=0)
        second = client.completions.create(model="tiny", prompt=PROMPT_B, max_tokens=4, temperature=0)
        assert first.usage is not None and second.usage is not None
        assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == PROMPT_CHUNK
        metrics = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        assert metrics["causaldraft_cached_prompt_tokens_total"] == PROMPT_CHUNK
