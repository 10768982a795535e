"""The OpenAI-compatible server: a real uvicorn on loopback, driven by the official openai client."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from causaldraft.api import Engine, load
from causaldraft.cli import build_parser
from causaldraft.serve.app import StatusRecorder, create_app
from causaldraft.serve.logprob_bodies import TokenTexts
from causaldraft.serve.metrics import Metrics, parse_metrics
from causaldraft.serve.schemas import MAX_REQUEST_BYTES
from causaldraft.serve.server import BackgroundServer
from causaldraft.serve.worker import (
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    PreparedRequest,
    QueueFull,
    Started,
    Worker,
)
from tests.test_prompt_logprobs import whole_pass_logprobs
from tests.tiny import save_tiny_llama

MODEL = "tiny"
CONTEXT = 4096  # long enough that a "slow" request takes many steps even on a fast machine
LONG_PROMPT = "Hello there"  # greedy on the tiny model does not stop early (the cancel tests would fail)
LONG_TOKENS = 4000


def tiny_engine(model_dir: Path) -> Engine:
    return load(model=str(model_dir), dtype="float32", drafter="lookup", calibrate=False, compile=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Engine:
    """A second engine on the same model, for the expected outputs (the server's is the worker's alone)."""
    return tiny_engine(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[BackgroundServer]:
    """One request decoded at a time, one waiting (the batched server has its own tests)."""
    app = create_app(tiny_engine(model_dir), max_queue=1, model_name=MODEL, max_batch=1)
    with BackgroundServer(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server: BackgroundServer) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{server.url}/metrics").text)


def idle(server: BackgroundServer) -> bool:
    now = metrics(server)
    return now["causaldraft_requests_running"] == now["causaldraft_queue_depth"] == 0


def wait_until(condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_models_and_health(server: BackgroundServer, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.head(f"{server.url}/health").status_code == 200  # load balancers probe with HEAD


def test_completion_greedy_equals_engine(client: openai.OpenAI, reference: Engine) -> None:
    expected = reference.generate(LONG_PROMPT, max_new_tokens=24)
    result = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=24, temperature=0)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason == "length"
    assert result.usage is not None
    assert result.usage.completion_tokens == len(expected.token_ids) == 24
    assert result.usage.prompt_tokens == len(reference.encode(LONG_PROMPT))


def test_completion_stream_equals_engine(client: openai.OpenAI, reference: Engine) -> None:
    expected = reference.generate("abc", max_new_tokens=20, stop=["zz"])
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stop=["zz"],
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == expected.text
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finish == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_greedy_equals_engine(client: openai.OpenAI, reference: Engine) -> None:
    expected = reference.generate("Tell me a story", max_new_tokens=16, chat=True)
    messages: Any = [{"role": "user", "content": "Tell me a story"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage is not None and result.usage.completion_tokens == len(expected.token_ids)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                              stream=True)  # fmt: skip
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    thinking_off = {"enable_thinking": False}  # vLLM's chat_template_kwargs, as its clients send them
    switched = reference.generate(messages, max_new_tokens=16, chat_template_kwargs=thinking_off)
    assert switched.token_ids != expected.token_ids  # the variable changes the prompt, and so the answer
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            extra_body={"chat_template_kwargs": thinking_off})  # fmt: skip
    assert result.choices[0].message.content == switched.text
    assert result.usage is not None and result.usage.prompt_tokens == len(reference.encode(messages)) + 15


def test_null_parameters_mean_defaults(server: BackgroundServer, reference: Engine) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0, "top_p": None, "n": None,
            "stream": None, "stop": None, "seed": None, "user": "someone"}  # fmt: skip
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference.generate("abc", max_new_tokens=5).text


@pytest.mark.parametrize(
    "extra",
    [
        {"seed": 2**64, "temperature": 0.8},
        {"seed": 2**70 + 3, "temperature": 1.0},
        {"temperature": 1e-37},
        {"temperature": 5e-324},
        {"top_p": 1e-300, "temperature": 1},
    ],
)
def test_extreme_valid_sampling_values_are_served(server: BackgroundServer, extra: dict[str, float]) -> None:
    """Found by a probe: these got 500s (seed overflow, NaN probabilities); each is valid input."""
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": stream, **extra}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert "error" not in response.text


def test_stream_ends_with_done(server: BackgroundServer) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"


def completion(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, **changes}


def chat(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **changes}


MALFORMED: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", b"", None),
    ("completions", completion(prompt=None), "prompt"),
    ("completions", {"model": MODEL, "max_tokens": 4}, "prompt"),
    ("completions", completion(prompt=""), "prompt"),
    ("completions", completion(prompt=["a", "b", "c"]), "prompt"),  # more answers than run and queue at once (2)
    ("completions", completion(prompt=["a", ""]), "prompt"),
    ("completions", completion(prompt=[[1, 2], []]), "prompt"),
    ("completions", completion(prompt=[999999]), "prompt"),
    ("completions", completion(prompt="x" * (CONTEXT + 100)), "prompt"),
    ("completions", completion(prompt="x" * (CONTEXT + 100), stream=True), "prompt"),
    ("completions", completion(prompt="x" * (CONTEXT - 100), max_tokens=300), "max_tokens"),
    ("completions", completion(max_tokens="ten"), "max_tokens"),
    ("completions", completion(max_tokens=2.5), "max_tokens"),
    ("completions", completion(max_tokens=True), "max_tokens"),
    ("completions", completion(max_tokens=-1), "max_tokens"),
    ("completions", completion(max_tokens=0), "max_tokens"),
    ("completions", completion(max_tokens=10**12), "max_tokens"),
    ("completions", completion(temperature=-0.5), "temperature"),
    ("completions", completion(temperature=7), "temperature"),
    ("completions", completion(temperature="hot"), "temperature"),
    ("completions", completion(top_p=0), "top_p"),
    ("completions", completion(top_p=1.5), "top_p"),
    ("completions", completion(seed="seven"), "seed"),
    ("completions", completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("completions", completion(stream="yes"), "stream"),
    ("completions", completion(n=0), "n"),
    ("completions", completion(n=3), "n"),  # more than the server runs and queues at once (2)
    ("chat/completions", chat(messages=[]), "messages"),
    ("chat/completions", chat(messages="hi"), "messages"),
    ("chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    ("chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages"),
    ("chat/completions", chat(messages=[{"role": "user", "content": "x" * (CONTEXT + 100)}]), "messages"),
    ("chat/completions", chat(max_tokens=-3), "max_tokens"),
    ("chat/completions", chat(n=17), "n"),
    ("chat/completions", chat(echo=True), "echo"),
    ("completions", completion(echo="yes"), "echo"),
    ("completions", completion(prompt_logprobs=21), "prompt_logprobs"),
    ("completions", completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("completions", completion(logprobs=21), "logprobs"),
    ("completions", completion(logprobs=-1), "logprobs"),
    ("completions", completion(logprobs=True), "logprobs"),
    ("completions", completion(top_logprobs=2), "top_logprobs"),
    ("completions", completion(best_of=3), "best_of"),
    ("completions", completion(suffix="end"), "suffix"),
    ("completions", completion(logit_bias={"5": 1000}), "logit_bias"),
    ("completions", completion(logit_bias={"x": 1}), "logit_bias"),
    ("completions", completion(logit_bias={"999999": 1}), "logit_bias"),
    ("completions", completion(stop_token_ids="x"), "stop_token_ids"),
    ("completions", completion(stop_token_ids=[999999]), "stop_token_ids"),
    ("completions", completion(min_tokens=-1), "min_tokens"),
    ("completions", completion(min_tokens=10), "min_tokens"),  # more than max_tokens (4)
    ("chat/completions", chat(ignore_eos="yes"), "ignore_eos"),
    ("completions", completion(presence_penalty=3), "presence_penalty"),
    ("completions", completion(frequency_penalty="x"), "frequency_penalty"),
    ("completions", completion(repetition_penalty=0), "repetition_penalty"),
    ("completions", completion(stream_options={"include_usage": True}), "stream_options"),
    ("completions", completion(top_k=-2), "top_k"),
    ("chat/completions", chat(logprobs=3), "logprobs"),
    ("chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat/completions", chat(frequency_penalty=-2.5), "frequency_penalty"),
    ("chat/completions", chat(response_format={"type": "json_object"}), "response_format"),
    ("chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("chat/completions", chat(chat_template_kwargs="enable_thinking"), "chat_template_kwargs"),
    ("chat/completions", chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
    ("chat/completions", chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("completions", completion(logit_bias={"\u0663": 1}), "logit_bias"),  # an Arabic-Indic digit three
]


@pytest.mark.parametrize(("endpoint", "body", "param"), MALFORMED)
def test_malformed_request_gets_openai_error(
    server: BackgroundServer, endpoint: str, body: bytes | dict[str, Any], param: str | None
) -> None:
    url = f"{server.url}/v1/{endpoint}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize(
    ("endpoint", "body"), [("completions", completion(model="gpt-4")), ("chat/completions", chat(model="other"))]
)
def test_a_model_not_served_is_404(server: BackgroundServer, endpoint: str, body: dict[str, Any]) -> None:
    """As OpenAI and vLLM answer it (the openai client raises NotFoundError), naming the model served."""
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=60)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found") and repr(MODEL) in error["message"]


def test_a_server_error_is_counted_as_500() -> None:
    """An unexpected exception is answered with a 500 and counted as one (not as a client that left, 499)."""
    metrics = Metrics()
    app = FastAPI()
    app.add_middleware(StatusRecorder, metrics=metrics)  # type: ignore[arg-type]

    @app.get("/health")
    async def broken() -> None:
        raise RuntimeError("broken")

    with TestClient(app, raise_server_exceptions=False) as test_client:
        assert test_client.get("/health").status_code == 500
    assert metrics.responses == {("/health", 500): 1}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (completion(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4 stop strings"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages",
         "only text content parts"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages", ""),
        (chat(echo=True), "echo", "echo is not supported"),
        (completion(prompt_logprobs=2, stream=True), "prompt_logprobs", "not supported with stream"),
    ],
)  # fmt: skip
def test_errors_name_the_parameter_not_pydantic_internals(
    server: BackgroundServer, body: dict[str, Any], param: str, says: str
) -> None:
    endpoint = "chat/completions" if "messages" in body else "completions"
    error = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=60).json()["error"]
    assert error["param"] == param and says in error["message"], error
    for internal in ("constrained", "list[", ".str", "TextPart", "literal"):
        assert internal not in error["message"], error["message"]


def test_an_oversized_body_is_refused_before_parsing(server: BackgroundServer, client: openai.OpenAI) -> None:
    content = "x" * 900_000  # each message is under the per-message limit; together far over the body limit
    body = chat(messages=[{"role": "user", "content": content}] * (MAX_REQUEST_BYTES // len(content) + 2))
    started = time.perf_counter()
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert time.perf_counter() - started < 30
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2).usage is not None


def test_models_retrieve_and_the_function_role(server: BackgroundServer, client: openai.OpenAI) -> None:
    before = metrics(server)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump()["dtype"] == "float32"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    after = metrics(server)
    for status in (200, 404):  # counted under their own path, not "other"
        key = f'causaldraft_requests_total{{path="/v1/models/{{id}}",status="{status}"}}'
        assert after[key] == before.get(key, 0) + 1
    messages = [{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "42"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert result.choices[0].message.content is not None


def test_stream_chunks_carry_null_usage_when_usage_is_asked(server: BackgroundServer) -> None:
    body = chat(stream=True, stream_options={"include_usage": True}, max_tokens=3)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"]
    assert all("usage" in chunk for chunk in chunks)
    assert all(chunk["usage"] is None for chunk in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] >= 1
    last = chunks[-2]["choices"][0]  # the finishing chunk, as OpenAI sends it: an empty delta
    assert last["delta"] == {} and last["finish_reason"] in ("stop", "length")
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat(stream=True), timeout=120) as response:
        plain = [json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"]
    assert not any("usage" in chunk for chunk in plain)


def sse_chunks(server: BackgroundServer, endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json=body, timeout=120) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"]


def test_chat_logprobs_are_the_engine_s_in_openai_s_shape(
    server: BackgroundServer, client: openai.OpenAI, reference: Engine
) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                            logprobs=True, top_logprobs=2)  # fmt: skip
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None and result.usage is not None
    content = choice.logprobs.content
    expected = reference.generate(messages, max_new_tokens=12, logprobs=2)
    assert expected.logprobs is not None and len(content) == result.usage.completion_tokens == len(expected.logprobs)
    assert [entry.logprob for entry in content] == pytest.approx([item.logprob for item in expected.logprobs], abs=1e-5)
    texts = TokenTexts(reference.tokenizer)
    for entry, item in zip(content, expected.logprobs, strict=True):
        assert entry.token == texts.text(item.token_id) and entry.bytes == texts.bytes(item.token_id)
        assert [best.token for best in entry.top_logprobs] == [texts.text(token) for token, _ in item.top]
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the most likely token
    streamed = sse_chunks(server, "chat/completions", chat(messages=messages, max_tokens=12, temperature=0,
                                                           logprobs=True, top_logprobs=2, stream=True))  # fmt: skip
    pieces = [entry for chunk in streamed if chunk["choices"] and (body := chunk["choices"][0]["logprobs"])
              for entry in body["content"]]  # fmt: skip
    assert [entry["token"] for entry in pieces] == [entry.token for entry in content]
    assert [entry["logprob"] for entry in pieces] == pytest.approx([entry.logprob for entry in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


def test_penalties_are_the_engine_s(client: openai.OpenAI, reference: Engine) -> None:
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.0}
    result = client.completions.create(model=MODEL, prompt="abcabc", max_tokens=12, temperature=0,
                                       extra_body={"repetition_penalty": 1.3}, **penalties)  # fmt: skip
    expected = reference.generate("abcabc", max_new_tokens=12, repetition_penalty=1.3, **penalties)
    assert result.choices[0].text == expected.text
    assert expected.text != reference.generate("abcabc", max_new_tokens=12).text  # the penalties changed it
    first = reference.generate("abcabc", max_new_tokens=1).token_ids[0]
    biased = client.completions.create(model=MODEL, prompt="abcabc", max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100, "100": 3})  # fmt: skip
    assert (
        biased.choices[0].text == reference.generate("abcabc", max_new_tokens=6, logit_bias={first: -100, 100: 3}).text
    )
    assert reference.encode(biased.choices[0].text)[:1] != [first]


def test_n_choices_are_each_one_request_s_answer(
    server: BackgroundServer, client: openai.OpenAI, reference: Engine
) -> None:
    """Greedy: n equal answers. Sampled with a seed: choice i is the answer to the same request with seed + i.
    Streamed: each choice's chunks carry its index; usage counts the prompt once and every choice's tokens."""
    greedy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, n=2)
    expected = reference.generate("Hello", max_new_tokens=6)
    assert [choice.index for choice in greedy.choices] == [0, 1]
    assert [choice.text for choice in greedy.choices] == [expected.text] * 2
    assert greedy.usage is not None and greedy.usage.completion_tokens == 2 * len(expected.token_ids)
    messages = [{"role": "user", "content": "Say something"}]
    sampled = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0,  # type: ignore[arg-type]
                                             seed=11, n=2)  # fmt: skip
    texts = {choice.index: choice.message.content for choice in sampled.choices}
    for index, text in texts.items():
        alone = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0,  # type: ignore[arg-type]
                                               seed=11 + index)  # fmt: skip
        assert text == alone.choices[0].message.content
    assert texts[0] != texts[1]
    body = chat(messages=messages, max_tokens=8, temperature=1.0, seed=11, n=2, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    chunks = sse_chunks(server, "chat/completions", body)
    streamed, reasons = {0: "", 1: ""}, {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert streamed == texts and set(reasons) == {0, 1}
    assert sampled.usage is not None and chunks[-1]["usage"]["completion_tokens"] == sampled.usage.completion_tokens


def test_a_stream_of_more_answers_than_the_batch_starts_at_once(server: BackgroundServer) -> None:
    """The server runs one request at a time (``max_batch=1``): a streamed n=2 request's second answer starts when
    the first finishes, and the stream does not wait for it: the first answer's text arrives while it runs."""
    completed = 'causaldraft_generations_total{outcome="completed"}'
    before = metrics(server)[completed]
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        first = json.loads(next(lines)[len("data: ") :])
        assert first["choices"][0]["index"] == 0 and first["choices"][0]["text"]
        assert metrics(server)[completed] == before  # neither answer has finished
    wait_until(lambda: httpx.get(f"{server.url}/health").json()["status"] == "ok")


def test_stop_token_ids_and_min_tokens_are_the_engine_s(client: openai.OpenAI, reference: Engine) -> None:
    whole = reference.generate("abcabc", max_new_tokens=12).token_ids
    stop = whole[4]
    options = {"stop_token_ids": [stop], "min_tokens": 6, "ignore_eos": True}
    result = client.completions.create(model=MODEL, prompt="abcabc", max_tokens=12, temperature=0, extra_body=options)
    expected = reference.generate("abcabc", max_new_tokens=12, **options)
    assert result.choices[0].text == expected.text and result.choices[0].finish_reason == expected.finish_reason
    assert result.usage is not None and result.usage.completion_tokens == len(expected.token_ids)
    assert expected.token_ids != reference.generate("abcabc", max_new_tokens=12, stop_token_ids=[stop]).token_ids


def test_completion_logprobs_count_each_token_s_offset(
    server: BackgroundServer, client: openai.OpenAI, reference: Engine
) -> None:
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and result.usage is not None
    expected = reference.generate("Hello", max_new_tokens=10, logprobs=2)
    assert expected.logprobs is not None and len(logprobs.tokens) == result.usage.completion_tokens
    assert logprobs.token_logprobs == pytest.approx([item.logprob for item in expected.logprobs], abs=1e-5)
    texts = TokenTexts(reference.tokenizer)
    assert logprobs.tokens == [texts.text(item.token_id) for item in expected.logprobs]
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:index])) for index in range(len(logprobs.tokens))]
    assert logprobs.top_logprobs is not None and all(1 <= len(best) <= 2 for best in logprobs.top_logprobs)
    streamed = sse_chunks(server, "completions", completion(prompt="Hello", max_tokens=10, logprobs=2, stream=True))
    bodies = [chunk["choices"][0]["logprobs"] for chunk in streamed if chunk["choices"]]
    assert [token for body in bodies if body for token in body["tokens"]] == logprobs.tokens
    assert [offset for body in bodies if body for offset in body["text_offset"]] == logprobs.text_offset


def test_echo_scores_the_prompt_as_an_evaluation_harness_asks(
    server: BackgroundServer, client: openai.OpenAI, reference: Engine
) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``): the
    prompt's tokens with the engine's prompt log-probabilities (the first null), then the answer's token; summed
    over a continuation and checked for greediness as the harness does."""
    context, continuation = reference.encode("The cat sat"), reference.encode(" on the mat")
    ids = context + continuation
    result = client.completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = result.choices[0]
    expected = reference.generate(ids, max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    assert expected.prompt_logprobs is not None and expected.logprobs is not None
    assert choice.text == reference.tokenizer.decode(ids) + expected.text
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    texts = TokenTexts(reference.tokenizer)
    assert logprobs.tokens == [texts.text(token) for token in ids + expected.token_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scored = [*expected.prompt_logprobs, *expected.logprobs]
    assert logprobs.token_logprobs[1:] == pytest.approx([entry.logprob for entry in scored], abs=1e-5)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:index])) for index in range(len(logprobs.tokens))]
    # the harness's reading: the continuation's log-likelihood, and whether greedy decoding would have written it
    ctxlen = len(context)
    total = sum(logprobs.token_logprobs[ctxlen:-1])  # type: ignore[arg-type]
    greedy = all(value == max(best.values()) for value, best in
                 zip(logprobs.token_logprobs[ctxlen:-1], logprobs.top_logprobs[ctxlen:-1], strict=True))  # fmt: skip
    rows = whole_pass_logprobs(reference, ids)
    expected_total = sum(float(rows[index - 1, ids[index]]) for index in range(ctxlen, len(ids)))
    assert total == pytest.approx(expected_total, abs=1e-4)
    assert greedy == all(int(rows[index - 1].argmax()) == ids[index] for index in range(ctxlen, len(ids)))
    streamed = sse_chunks(server, "completions", completion(prompt=[ids], max_tokens=1, logprobs=1, echo=True,
                                                            stream=True))  # fmt: skip
    bodies = [chunk["choices"][0]["logprobs"] for chunk in streamed if chunk["choices"]]
    assert [token for body in bodies if body for token in body["tokens"]] == logprobs.tokens
    assert [offset for body in bodies if body for offset in body["text_offset"]] == logprobs.text_offset
    assert "".join(chunk["choices"][0]["text"] for chunk in streamed if chunk["choices"]) == choice.text


def test_vllm_prompt_logprobs_are_the_engine_s(client: openai.OpenAI, reference: Engine) -> None:
    """vLLM's ``prompt_logprobs``: null, then per prompt token a dict by token id of the token (its rank) and the N
    likeliest (ranks 1..N); in the choice for completions, in the response for chat."""
    expected = reference.generate("The cat sat on", max_new_tokens=3, prompt_logprobs=2)
    assert expected.prompt_logprobs is not None
    answer = client.completions.create(model=MODEL, prompt="The cat sat on", max_tokens=3, temperature=0,
                                       extra_body={"prompt_logprobs": 2})  # fmt: skip
    scored = answer.choices[0].model_dump()["prompt_logprobs"]
    assert answer.choices[0].text == expected.text and scored[0] is None
    assert len(scored) == len(expected.prompt_logprobs) + 1
    texts = TokenTexts(reference.tokenizer)
    for position, entry in zip(scored[1:], expected.prompt_logprobs, strict=True):
        own = position[str(entry.token_id)]
        assert own["logprob"] == pytest.approx(entry.logprob, abs=1e-5) and own["rank"] == entry.rank >= 1
        assert own["decoded_token"] == texts.text(entry.token_id)
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            assert position[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-5)
            assert position[str(token_id)]["rank"] == (entry.rank if token_id == entry.token_id else rank)
        assert len(position) == len({entry.token_id, *(token_id for token_id, _ in entry.top)})
    assert any(entry.rank > 2 for entry in expected.prompt_logprobs)  # some prompt token outside the top two
    messages = [{"role": "user", "content": "Hi"}]
    chat_answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                                 extra_body={"prompt_logprobs": 0})  # fmt: skip
    chat_scored = chat_answer.model_dump()["prompt_logprobs"]
    chat_expected = reference.generate(messages, max_new_tokens=2, prompt_logprobs=0).prompt_logprobs
    assert chat_expected is not None and len(chat_scored) == len(chat_expected) + 1
    assert [next(iter(position)) for position in chat_scored[1:]] == [str(e.token_id) for e in chat_expected]


def test_echo_without_logprobs_starts_each_answer_with_the_prompt(
    server: BackgroundServer, client: openai.OpenAI
) -> None:
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    wait_until(
        lambda: metrics(server)["causaldraft_requests_running"] == metrics(server)["causaldraft_queue_depth"] == 0
    )
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, echo=True, n=2)
    assert [choice.text for choice in echoed.choices] == ["Hello" + plain.choices[0].text] * 2
    assert echoed.choices[0].logprobs is None
    assert echoed.usage is not None and plain.usage is not None
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    streamed = sse_chunks(server, "completions", completion(prompt="Hello", max_tokens=5, echo=True, stream=True))
    texts = [chunk["choices"][0]["text"] for chunk in streamed if chunk["choices"]]
    assert texts[0] == "Hello" and "".join(texts) == echoed.choices[0].text


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_burst_is_admitted_as_the_batch_plus_the_queue(model_dir: Path, max_batch: int) -> None:
    """Counted from submit: with max_queue 2, max_batch + 2 simultaneous requests are admitted
    (max_batch to run, two waiting) and one more is refused."""
    worker = Worker(tiny_engine(model_dir), Metrics(), max_queue=2, max_batch=max_batch)
    request = PreparedRequest(GenerationRequest("hi", None, 1, 0.0, 1.0, None, []), [1, 2, 3], 1)
    for _ in range(max_batch + 2):
        worker.submit(Job(request, lambda event: None))
    with pytest.raises(QueueFull):
        worker.submit(Job(request, lambda event: None))


def test_prompts_are_tokenized_off_the_engine_thread(model_dir: Path) -> None:
    engine = tiny_engine(model_dir)
    threads: list[str] = []
    encode = engine.encode

    def recording_encode(
        prompt: str | list[int], chat: bool = False, chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        if isinstance(prompt, str):  # text is tokenized here; the engine thread only gets ids
            threads.append(threading.current_thread().name)
        return encode(prompt, chat, chat_template_kwargs)

    engine.encode = recording_encode  # type: ignore[method-assign]
    with BackgroundServer(create_app(engine, model_name=MODEL)) as running:
        response = httpx.post(f"{running.url}/v1/completions", json=completion(), timeout=60)
    assert response.status_code == 200 and threads
    assert not any(name.startswith("causaldraft-engine") for name in threads)


def test_ignored_fields_are_answered_and_logged_once(
    client: openai.OpenAI, reference: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    extra = {"unread_option_a": "x", "unread_option_b": 3}  # names no other test sends
    with caplog.at_level(logging.WARNING, logger="causaldraft.serve.app"):
        first = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, extra_body=extra)
        client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, extra_body=extra)
    assert first.choices[0].text == reference.generate("abc", max_new_tokens=3).text
    warnings = [record.getMessage() for record in caplog.records if "ignoring request fields" in record.getMessage()]
    assert len(warnings) == 1 and "unread_option_a, unread_option_b" in warnings[0], warnings


def test_tokenizer_endpoints_are_vllm_s(server: BackgroundServer, reference: Engine) -> None:
    """``/tokenize`` gives the ids ``/v1/completions`` (text) and ``/v1/chat/completions`` (messages) read,
    ``/detokenize`` the text back, ``/tokenizer_info`` what lm-evaluation-harness's remote tokenizer reads; bad
    bodies are 400s naming the field."""
    text = "Hello there, <|im_start|> friend"
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=60).json()
    assert tokenized["tokens"] == reference.encode(text) and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == CONTEXT
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    assert chat_ids == reference.encode(messages)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=60).json()
    assert back == {"prompt": reference.tokenizer.decode(tokenized["tokens"])}
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == reference.tokenizer.eos_token and info["model_max_length"] == CONTEXT
    assert info["chat_template"] == reference.tokenizer.chat_template
    thinking_off = {"enable_thinking": False}  # a template variable (tests/tiny.py), as vLLM takes it
    switched = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "chat_template_kwargs": thinking_off},
                          timeout=60).json()["tokens"]  # fmt: skip
    assert switched == reference.encode(messages, chat_template_kwargs=thinking_off) != chat_ids
    for path, body, param in [("tokenize", {}, "prompt"), ("tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("tokenize", {"messages": messages, "chat_template_kwargs": {"tokenize": 1}},
                               "chat_template_kwargs"),
                              ("tokenize", {"prompt": "a", "chat_template_kwargs": thinking_off},
                               "chat_template_kwargs"),
                              ("tokenize", {"prompt": 5}, "prompt"), ("detokenize", {"tokens": [10**9]}, "tokens"),
                              ("detokenize", {"tokens": "abc"}, "tokens")]:  # fmt: skip
        response = httpx.post(f"{server.url}/{path}", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, body)


def test_unknown_route_and_method_get_error_bodies(server: BackgroundServer) -> None:
    missing = httpx.get(f"{server.url}/v1/engines")
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    wrong_method = httpx.get(f"{server.url}/v1/completions")
    assert wrong_method.status_code == 405 and "message" in wrong_method.json()["error"]


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="abc", max_tokens=4, n=17)
    assert "n must be from 1 to 16" in str(caught.value)
    with pytest.raises(openai.NotFoundError):  # as OpenAI and vLLM answer a model not served
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_disconnect_mid_stream_frees_the_worker(
    server: BackgroundServer, client: openai.OpenAI, reference: Engine
) -> None:
    before = metrics(server)
    stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=LONG_TOKENS, temperature=0,
                                       stream=True)  # fmt: skip
    next(iter(stream))
    stream.close()
    expected = reference.generate("abc", max_new_tokens=6)
    result = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0)
    assert result.choices[0].text == expected.text
    after = metrics(server)
    cancelled = 'causaldraft_generations_total{outcome="cancelled"}'
    assert after[cancelled] == before[cancelled] + 1  # the worker broke off the stream, it did not finish it
    generated = after["causaldraft_generated_tokens_total"] - before["causaldraft_generated_tokens_total"]
    assert generated < LONG_TOKENS  # the long request stopped early: it did not run to its length


def test_a_client_gone_mid_body_is_a_quiet_499(server: BackgroundServer, caplog: pytest.LogCaptureFixture) -> None:
    """A client that closes its connection while sending the body: counted as 499, with no traceback logged."""
    before = metrics(server)
    with socket.create_connection((server.host, server.port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n{\"model\":")  # fmt: skip
    key = 'causaldraft_requests_total{path="/v1/completions",status="499"}'
    wait_until(lambda: metrics(server).get(key, 0) == before.get(key, 0) + 1)
    assert not [record for record in caplog.records if record.exc_info], caplog.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_disconnect_while_waiting_non_streamed(server: BackgroundServer, client: openai.OpenAI) -> None:
    before = metrics(server)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    cancelled = 'causaldraft_generations_total{outcome="cancelled"}'
    wait_until(lambda: metrics(server)[cancelled] == before[cancelled] + 1)
    assert client.completions.create(model=MODEL, prompt="abc", max_tokens=3).usage is not None


def test_queue_full_gets_429(server: BackgroundServer, client: openai.OpenAI, reference: Engine) -> None:
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as slow:
        assert slow.status_code == 200
        lines = slow.iter_lines()  # keep the iterator: dropping it would close the connection
        next(lines)  # the slow request is being generated: the worker is busy
        assert metrics(server)["causaldraft_requests_running"] == 1
        queued: dict[str, str | None] = {}

        def send_queued() -> None:
            queued["text"] = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0
                                                       ).choices[0].text  # fmt: skip

        waiter = threading.Thread(target=send_queued)
        waiter.start()
        wait_until(lambda: metrics(server)["causaldraft_queue_depth"] == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="abc", max_tokens=5)
        assert caught.value.status_code == 429
        assert caught.value.body["code"] == "queue_full"  # type: ignore[index]
        assert int(caught.value.response.headers["retry-after"]) >= 1
    waiter.join(timeout=120)  # leaving the block disconnected the slow stream: the queued request runs
    assert queued["text"] == reference.generate("abc", max_new_tokens=5).text
    assert metrics(server)['causaldraft_requests_total{path="/v1/completions",status="429"}'] >= 1


def test_metrics_change_after_requests(server: BackgroundServer, client: openai.OpenAI) -> None:
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    after = metrics(server)
    for path in ("/v1/completions", "/v1/chat/completions"):
        key = f'causaldraft_requests_total{{path="{path}",status="200"}}'
        assert after[key] == before.get(key, 0) + 1
    assert after["causaldraft_generated_tokens_total"] > before["causaldraft_generated_tokens_total"]
    assert after["causaldraft_target_forwards_total"] > before["causaldraft_target_forwards_total"]
    assert after["causaldraft_mean_accepted_length"] >= 1.0
    assert 0.0 <= after["causaldraft_acceptance_rate"] <= 1.0
    assert after["causaldraft_tokens_per_second"] > 0
    assert after["causaldraft_queue_depth"] == 0
    assert after["causaldraft_queue_capacity"] == 1


def test_worker_survives_an_unexpected_exception(model_dir: Path) -> None:
    """A fault while starting one request fails that request with a 500; the next one is served."""
    engine = tiny_engine(model_dir)
    start = engine.start
    calls: list[int] = []

    def faulty_start(prompt: list[int], **options: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("boom")
        return start(prompt, **options)

    engine.start = faulty_start  # type: ignore[method-assign]
    worker = Worker(engine, Metrics(), max_queue=2)
    events: list[list[Event]] = [[], []]
    request = PreparedRequest(GenerationRequest("hi", None, 1, 0.0, 1.0, None, []), [1, 2, 3], 1)
    worker.start()
    try:
        for inbox in events:
            worker.submit(Job(request, inbox.append))
        wait_until(lambda: bool(events[1]) and isinstance(events[1][-1], Finished), timeout_s=30)
    finally:
        worker.stop()
    assert isinstance(events[0][-1], Failed) and events[0][-1].status == 500
    assert "ZeroDivisionError" in events[0][-1].message
    assert isinstance(events[1][0], Started) and events[1][-1] == Finished("length", 3, 1)
    assert worker.metrics.outcomes == {"failed": 1, "completed": 1}


def test_serve_cli_flags() -> None:
    args = build_parser().parse_args(["serve", "--port", "0", "--max-queue", "3", "--tree", "chain"])
    assert (args.drafter, args.host, args.port, args.max_queue, args.tree) == ("auto", "127.0.0.1", 0, 3, "chain")
    assert args.func.__module__ == "causaldraft.serve.cli"


@pytest.mark.slow
def test_default_model_chat_matches_engine() -> None:
    engine = load(model="default", dtype="float32", drafter="lookup", compile=False)
    expected = engine.generate("Name three colours.", max_new_tokens=24, chat=True)
    app = create_app(load(model="default", dtype="float32", drafter="lookup", compile=False), model_name="default")
    with BackgroundServer(app) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=300)
        messages: Any = [{"role": "user", "content": "Name three colours."}]
        result = client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0)
    assert result.choices[0].message.content == expected.text
