"""Continuous batching: every stream of a batch gets exactly the output it would get alone
(``NativeLlama.forward_batch``, ``batch.Batch``, ``generate_batch`` and the batched server)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch

from causaldraft.adapt import VerifyCost
from causaldraft.api import Engine, load
from causaldraft.batch import PROMPT_ROWS_PER_STEP, Batch, generate_batch
from causaldraft.errors import CausalDraftError
from causaldraft.models import bf16_choice, int4_kernel
from causaldraft.models.blocked import KEY_BLOCK, pass_room
from causaldraft.models.compiled import GraphKey, GraphStore, compile_batch, compile_model, use_chosen_bf16_products
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama, SequencePass, default_aux_layers
from causaldraft.models.products import native_bf16_products
from causaldraft.serve.app import create_app
from causaldraft.serve.metrics import parse_metrics
from causaldraft.serve.server import BackgroundServer
from tests.test_eagle3 import layer_dir
from tests.test_exact import LOW_PRECISION, backend_of, decoy_tree
from tests.test_heads import random_heads_dir

# prefixes whose heads differ (none, one block, two blocks), so a batch pass pads heads
PREFIXES = [30, KEY_BLOCK + 5, 2 * KEY_BLOCK + 2]
# prompts of different lengths (the tiny tokenizer is bytes: a token per character)
PROMPTS = ["hello hello hello world", "the cat sat on the mat and the cat " * 3, "abcabcabc", "xyz " * 40, "q"]


def prefill(backend: NativeLlama, prompt: list[int], cache: object) -> None:
    n = len(prompt)
    backend.forward(torch.tensor(prompt), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)  # type: ignore[arg-type]


def assert_batch_rows_match_own_passes(backend: NativeLlama, pool_size: int) -> None:
    """Sequences with different heads, each a chain among decoys (different row counts), in one
    batch pass: every row's features, hidden state and logits equal its sequence's own pass."""
    layers = backend.graph_aux_layers or default_aux_layers(backend.llama_shape.num_layers)
    generator = torch.Generator().manual_seed(0)
    pool = backend.new_pool(pool_size, 256)
    passes, expected = [], []
    for index, prefix in enumerate(PREFIXES):
        prompt = torch.randint(3, 259, (prefix,), generator=generator).tolist()
        depth = min(1 + index, pass_room(prefix), backend.batch_rows // 2)
        chain = torch.randint(3, 259, (depth,), generator=generator).tolist()
        tokens, positions, mask = decoy_tree(chain, prefix)
        own = backend.new_cache(256)
        prefill(backend, prompt, own)
        expected.append(backend.forward(tokens, positions, mask, own, aux_layers=layers))
        slot = pool.take()
        prefill(backend, prompt, pool.caches[slot])
        passes.append(SequencePass(slot, tokens, positions, mask))
    outputs = backend.forward_batch(pool, passes, layers)
    for index, (out, own_out, one) in enumerate(zip(outputs, expected, passes, strict=True)):
        assert out.aux is not None and own_out.aux is not None
        assert torch.equal(out.aux, own_out.aux), index
        assert torch.equal(out.hidden, own_out.hidden), index
        assert torch.equal(out.logits, own_out.logits), index
        assert pool.caches[one.slot].length == PREFIXES[index] + one.tokens.shape[0]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_eager_batch_rows_equal_each_sequences_own_pass(models: dict[str, LoadedModel], dtype: str) -> None:
    assert_batch_rows_match_own_passes(backend_of(models[dtype]), pool_size=4)


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16-chosen", pytest.param("int4", marks=pytest.mark.slow)])
def test_compiled_batch_rows_equal_each_sequences_own_pass(
    tiny_llama_dir: Path, graph_root: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch graph (4 sequences) against the one-sequence graphs; "bfloat16-chosen": both through oneDNN's
    frozen products where chosen over the kernel (models/bf16_choice.py)."""
    if dtype == "bfloat16-chosen":
        if not (native_bf16_products() and int4_kernel.bf16_available()):
            pytest.skip("needs oneDNN's bf16 products and causaldraft's bf16 kernel")
        monkeypatch.setenv(bf16_choice.SWITCH, bf16_choice.ONEDNN)
    backend = backend_of(load_model(str(tiny_llama_dir), "native", dtype.partition("-")[0]))
    layers = default_aux_layers(backend.llama_shape.num_layers)
    buckets = (1, 16) if backend.quantized else (2, 16)  # test_exact's, so the session builds them once
    use_chosen_bf16_products(backend)
    store = GraphStore(GraphKey.of(backend, layers), graph_root)
    compile_model(backend, buckets=buckets, store=store, progress=False)
    compile_batch(backend, 4, progress=False, buckets=(2,) if backend.quantized else (4,))
    assert backend.batch_graphs and backend.batch_sequences == 4
    assert_batch_rows_match_own_passes(backend, pool_size=4)


def engine_for(loaded: LoadedModel, drafter: str, tmp_path: Path) -> Engine:
    options: dict[str, object] = {"draft_layers": 2}
    if drafter in ("markov", "medusa"):
        options["heads"] = str(random_heads_dir(loaded, drafter, tmp_path / drafter))
    if drafter == "eagle3":
        options["heads"] = str(layer_dir(loaded, tmp_path / drafter))
    return load(loaded=loaded, drafter=drafter, calibrate=False, fallback=False, compile=False, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("drafter", ["none", "lookup", "draft", "markov", "medusa", "eagle3"])
def test_generate_batch_equals_each_prompts_own_generation(
    models: dict[str, LoadedModel], tmp_path: Path, dtype: str, drafter: str
) -> None:
    """Five prompts through a batch of three (streams join as others finish): token-identical to
    generating each alone, and the batch really shared passes."""
    engine = engine_for(models[dtype], drafter, tmp_path)
    expected = [engine.generate(prompt, max_new_tokens=60).token_ids for prompt in PROMPTS]
    batch = Batch(engine, 3, context=512, cost=VerifyCost({1: 1.0, 4: 1.0}))
    results = generate_batch(engine, PROMPTS, size=3, max_new_tokens=60, batch=batch)
    assert [result.token_ids for result in results] == expected
    assert batch.largest_step == 3


def test_seeded_sampling_in_a_batch_is_the_streams_own(models: dict[str, LoadedModel]) -> None:
    """Gumbel-sampled streams draw each position's noise from their own seed: the same tokens."""
    engine = load(loaded=models["bfloat16"], drafter="lookup", calibrate=False, compile=False)
    options = {"max_new_tokens": 40, "temperature": 0.9, "top_p": 0.95}
    expected = [engine.generate(prompt, seed=seed, **options).token_ids for seed, prompt in enumerate(PROMPTS)]
    batch = Batch(engine, 4, context=512)
    streams = [batch.add(prompt, seed=seed, **options) for seed, prompt in enumerate(PROMPTS[:4])]
    while any(not stream.done for stream in streams):
        batch.step()
    got = [[token for event in stream.events for token in getattr(event, "token_ids", [])] for stream in streams]
    assert got == expected[:4]


def test_a_long_prompt_joins_a_chunk_per_step_while_the_others_decode(models: dict[str, LoadedModel]) -> None:
    """A prompt of two chunks is read over two steps, and the stream already running emits tokens in
    each of them; both outputs are what each gets alone. (No kept prefixes: the long prompt, read alone
    first, would be copied but for its last chunk.)"""
    engine = load(loaded=models["bfloat16"], drafter="lookup", calibrate=False, compile=False, prefix_cache_mb=0)
    short, long = PROMPTS[1], "the quick brown fox jumps over the lazy dog. " * 11  # 495 bytes
    expected = [engine.generate(prompt, max_new_tokens=12).token_ids for prompt in (short, long)]
    batch = Batch(engine, 2, context=512)
    running = batch.add(short, max_new_tokens=12)
    batch.step()
    joining = batch.add(long, max_new_tokens=12)
    assert joining.run.prompt_read.rows_left > PROMPT_ROWS_PER_STEP
    for _ in range(2):
        emitted = len(running.events)
        assert joining.run.reading
        batch.step()
        assert len(running.events) > emitted or running.done
    assert not joining.run.reading
    while not (running.done and joining.done):
        batch.step()
    got = [[token for event in stream.events for token in getattr(event, "token_ids", [])]
           for stream in (running, joining)]  # fmt: skip
    assert got == expected


def test_bad_input_and_a_full_batch_leave_the_batch_as_it_was(models: dict[str, LoadedModel]) -> None:
    engine = load(loaded=models["bfloat16"], drafter="lookup", calibrate=False, compile=False)
    batch = Batch(engine, 2, context=128)
    assert batch.pool is not None
    with pytest.raises(CausalDraftError, match="temperature"):
        batch.add("abc", temperature=-1.0)
    with pytest.raises(CausalDraftError, match="context"):
        batch.add("a" * 120, max_new_tokens=64)
    assert batch.free == 2 and len(batch.pool.free) == 2
    first, second = batch.add("abc", max_new_tokens=4), batch.add("abd", max_new_tokens=4)
    with pytest.raises(CausalDraftError, match="full"):
        batch.add("abe")
    batch.remove(first)
    assert batch.free == 1 and batch.pool.free == [first.slot]
    batch.step()
    assert second.events


def test_an_expensive_batch_pass_makes_streams_decode_plainly(models: dict[str, LoadedModel]) -> None:
    """The cost model decides per batch: when every extra row per stream costs ten one-row passes,
    the streams stop speculating (and stay token-identical)."""
    engine = load(loaded=models["bfloat16"], drafter="lookup", calibrate=False, compile=False)
    prompt = PROMPTS[2] * 3
    expected = engine.generate(prompt, max_new_tokens=80).token_ids
    costly = VerifyCost({1: 0.01, 2: 0.1, 4: 0.2, 8: 0.4, 16: 0.8})
    batch = Batch(engine, 2, context=512, cost=costly)
    streams = [batch.add(prompt, max_new_tokens=80) for _ in range(2)]
    while any(not stream.done for stream in streams):
        batch.step()
    for stream in streams:
        assert [token for event in stream.events for token in getattr(event, "token_ids", [])] == expected
        steps = stream.run.state.stats.steps
        assert sum(step.nodes == 1 for step in steps) > len(steps) // 2


def test_batched_server_answers_concurrent_requests_as_alone(tiny_llama_dir: Path) -> None:
    """Four concurrent requests to a server batching four: each answer is the request's own, and
    /metrics shows steps that served several requests."""
    engine = load(model=str(tiny_llama_dir), dtype="bfloat16", drafter="lookup", calibrate=False, compile=False)
    reference = load(model=str(tiny_llama_dir), dtype="bfloat16", drafter="none", calibrate=False, compile=False)
    prompts = PROMPTS[:4]
    expected = [reference.generate(prompt, max_new_tokens=48).text for prompt in prompts]
    answers: dict[int, str] = {}
    with BackgroundServer(create_app(engine, max_queue=4, model_name="tiny", max_batch=4)) as server:

        def ask(index: int) -> None:
            body = {"model": "tiny", "prompt": prompts[index], "max_tokens": 48, "temperature": 0}
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            answers[index] = reply.json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        metrics = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    assert [answers.get(index) for index in range(len(prompts))] == expected
    assert metrics["causaldraft_batch_size_mean"] > 1.0
    assert metrics["causaldraft_request_tokens_per_second_count"] == len(prompts)


def test_several_prompts_in_one_request_are_each_answered_as_alone(tiny_llama_dir: Path) -> None:
    """A completions request with three prompts (token ids, as evaluation harnesses send them) and n=2, echoed
    with logprobs, to a server batching four: choice i answers prompt i // 2 as the prompt alone does; usage counts
    each prompt once; more answers than the server runs and queues is a 400 naming the prompt."""
    engine = load(model=str(tiny_llama_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)
    reference = load(model=str(tiny_llama_dir), dtype="float32", drafter="none", calibrate=False, compile=False)
    prompts = [reference.encode(prompt) for prompt in PROMPTS[:3]]
    expected = [reference.generate(prompt, max_new_tokens=12, logprobs=1, prompt_logprobs=1) for prompt in prompts]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0, "n": 2, "echo": True,
            "logprobs": 1}  # fmt: skip
    with BackgroundServer(create_app(engine, max_queue=4, model_name="tiny", max_batch=4)) as server:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120).text
        too_many = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 3}, timeout=120)
    assert [choice["index"] for choice in answer["choices"]] == list(range(6))
    texts = {}
    for choice in answer["choices"]:
        prompt, result = prompts[choice["index"] // 2], expected[choice["index"] // 2]
        assert choice["text"] == reference.tokenizer.decode(prompt) + result.text
        assert result.prompt_logprobs is not None and result.logprobs is not None
        scored = [entry.logprob for entry in [*result.prompt_logprobs, *result.logprobs]]
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(scored, abs=1e-5)
        texts[choice["index"]] = choice["text"]
    assert answer["usage"]["prompt_tokens"] == sum(len(prompt) for prompt in prompts)
    assert answer["usage"]["completion_tokens"] == 2 * sum(len(result.token_ids) for result in expected)
    pieces = {index: "" for index in range(6)}
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                pieces[choice["index"]] += choice["text"]
    assert pieces == texts
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


def test_load_script_checks_outputs_and_bad_requests(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """bench/load_server.py against a batching server: every answer equals the same request sent
    alone, and each malformed request mixed into the load gets a 4xx."""
    import json
    import subprocess
    import sys

    report_path = tmp_path / "load.json"
    command = [sys.executable, "bench/load_server.py", "--model", str(tiny_llama_dir), "--dtype", "bfloat16",
               "--no-compile", "--drafter", "lookup", "--requests", "6", "--concurrency", "3", "--max-tokens", "16",
               "--max-batch", "3", "--check-outputs", "--bad-every", "2", "--json", str(report_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report["completed"] == 6 and report["errors"] == {}
    assert report["outputs_checked"] == 6 and report["outputs_differing"] == 0
    assert report["bad_sent"] == 3 and report["bad_answered_4xx"] == 3
    assert report["server_batch_size_mean"] > 1.0
