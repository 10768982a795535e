"""Bounded load test for ``causaldraft serve``: concurrent chat requests on loopback only.

Sends a fixed number of requests (``--requests``) with at most ``--concurrency`` in flight, and
stops at ``--duration`` seconds whatever happens. Reports p50/p99 latency, generated tokens/s and
errors. Either targets a running server (``--url http://127.0.0.1:PORT``) or starts its own in this
process from the usual model/drafter flags.

    python bench/load_server.py --model default --dtype bfloat16 --drafter lookup \
        --requests 16 --concurrency 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from urllib.parse import urlparse

import httpx

from causaldraft.errors import CausalDraftError
from causaldraft.flags import add_drafter_flags, add_model_flags, engine_config
from causaldraft.serve.cli import SERVE_DEFAULT_DRAFTER
from causaldraft.serve.metrics import parse_metrics

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse.",
    "List three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Little Red Riding Hood.",
    "Give me a recipe for a simple tomato soup.",
    "How does a bicycle stay upright?",
    "Describe the water cycle to a ten-year-old.",
)


@dataclass(frozen=True)
class Outcome:
    ok: bool
    error: str  # "" when ok, else the HTTP status or exception name
    latency_s: float
    first_token_s: float | None  # streamed requests only
    completion_tokens: int
    text: str = ""


@dataclass(frozen=True)
class Report:
    requests: int
    completed: int
    errors: dict[str, int]
    not_sent: int
    wall_s: float
    latency_p50_s: float
    latency_p99_s: float
    latency_mean_s: float
    first_token_p50_s: float | None
    completion_tokens: int
    tokens_per_s: float
    requests_per_s: float
    server_mean_accepted_length: float | None
    server_acceptance_rate: float | None
    server_tokens_per_s: float | None  # while generating: the engine's own speed, without queueing
    server_batch_size_mean: float | None  # requests per decoding step
    outputs_checked: int  # --check-outputs: completed requests compared with the same request sent alone
    outputs_differing: int
    bad_sent: int  # --bad-every: malformed requests mixed into the load
    bad_answered_4xx: int


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile (with 16 samples p99 is the slowest request)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


async def one_request(client: httpx.AsyncClient, body: dict[str, object], stream: bool) -> Outcome:
    started = time.perf_counter()
    try:
        if not stream:
            response = await client.post("/v1/chat/completions", json=body)
            latency = time.perf_counter() - started
            if response.status_code != 200:
                return Outcome(False, str(response.status_code), latency, None, 0)
            reply = response.json()
            text = reply["choices"][0]["message"]["content"] or ""
            return Outcome(True, "", latency, None, int(reply["usage"]["completion_tokens"]), text)
        first_token: float | None = None
        tokens = 0
        pieces: list[str] = []
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(False, str(response.status_code), time.perf_counter() - started, None, 0)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return Outcome(False, "stream-error", time.perf_counter() - started, first_token, tokens)
                content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if content:
                    pieces.append(content)
                    first_token = first_token if first_token is not None else time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        return Outcome(True, "", time.perf_counter() - started, first_token, tokens, "".join(pieces))
    except httpx.HTTPError as error:
        return Outcome(False, type(error).__name__, time.perf_counter() - started, None, 0)


# malformed requests mixed into the load (--bad-every): each must get a 4xx and disturb nothing
BAD_BODIES: tuple[dict[str, object], ...] = (
    {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_p": 7},
)


def request_body(model: str, index: int, args: argparse.Namespace) -> dict[str, object]:
    prompt = PROMPTS[index % len(PROMPTS)]
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": index}  # fmt: skip


def reference_key(body: dict[str, object]) -> str:
    """Requests that must get the same answer: same prompt, and same seed when sampling."""
    same = {key: value for key, value in body.items() if key != "seed" or body.get("temperature")}
    return json.dumps(same, sort_keys=True)


async def bad_request(client: httpx.AsyncClient, model: str, index: int) -> bool:
    """Send one malformed request; True when it got a 4xx."""
    body = {"model": model, **BAD_BODIES[index % len(BAD_BODIES)]}
    try:
        response = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError:
        return False
    return 400 <= response.status_code < 500


async def run_load(url: str, args: argparse.Namespace) -> Report:
    timeout = httpx.Timeout(args.duration)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        alone: dict[str, str] = {}  # --check-outputs: each distinct request's answer when sent alone
        if args.check_outputs:
            for index in range(args.requests):
                body = request_body(model, index, args)
                if reference_key(body) not in alone:
                    alone[reference_key(body)] = (await one_request(client, body, False)).text
        gate = asyncio.Semaphore(args.concurrency)
        outcomes: list[tuple[str, Outcome]] = []
        bad: list[bool] = []
        started = time.perf_counter()
        deadline = started + args.duration

        async def worker(index: int) -> None:
            async with gate:
                if time.perf_counter() >= deadline:
                    return
                body = request_body(model, index, args)
                outcomes.append((reference_key(body), await one_request(client, body, args.stream)))

        async def bad_worker(index: int) -> None:
            await asyncio.sleep(0.5 * index)  # spread over the run, while the good requests are served
            bad.append(await bad_request(client, model, index))

        bad_count = args.requests // args.bad_every if args.bad_every else 0
        tasks = [asyncio.create_task(worker(index)) for index in range(args.requests)]
        tasks += [asyncio.create_task(bad_worker(index)) for index in range(bad_count)]
        _, pending = await asyncio.wait(tasks, timeout=args.duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - started
        metrics = await client.get("/metrics")
        try:  # a server other than causaldraft's (e.g. llama-server) may lack its Prometheus /metrics
            server = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
        except ValueError:
            server = {}
    checked = [alone[key] == outcome.text for key, outcome in outcomes if outcome.ok and key in alone]
    report = summarise([outcome for _, outcome in outcomes], args.requests, wall, len(pending), server)
    return replace(report, outputs_checked=len(checked), outputs_differing=checked.count(False),
                   bad_sent=len(bad), bad_answered_4xx=sum(bad))  # fmt: skip


def summarise(outcomes: list[Outcome], requests: int, wall: float, cut: int, server: dict[str, float]) -> Report:
    done = [outcome for outcome in outcomes if outcome.ok]
    errors = Counter(outcome.error for outcome in outcomes if not outcome.ok)
    if cut:
        errors["duration-cap"] += cut
    latencies = [outcome.latency_s for outcome in done]
    first_tokens = [outcome.first_token_s for outcome in done if outcome.first_token_s is not None]
    tokens = sum(outcome.completion_tokens for outcome in done)
    return Report(
        requests=requests,
        completed=len(done),
        errors=dict(errors),
        not_sent=requests - len(outcomes) - cut,
        wall_s=round(wall, 3),
        latency_p50_s=round(percentile(latencies, 0.5), 3),
        latency_p99_s=round(percentile(latencies, 0.99), 3),
        latency_mean_s=round(sum(latencies) / len(latencies), 3) if latencies else math.nan,
        first_token_p50_s=round(percentile(first_tokens, 0.5), 3) if first_tokens else None,
        completion_tokens=tokens,
        tokens_per_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        requests_per_s=round(len(done) / wall, 3) if wall > 0 else 0.0,
        server_mean_accepted_length=server.get("causaldraft_mean_accepted_length"),
        server_acceptance_rate=server.get("causaldraft_acceptance_rate"),
        server_tokens_per_s=server.get("causaldraft_tokens_per_second"),
        server_batch_size_mean=server.get("causaldraft_batch_size_mean"),
        outputs_checked=0,
        outputs_differing=0,
        bad_sent=0,
        bad_answered_4xx=0,
    )


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise CausalDraftError(f"the load script only targets loopback servers, got host {host!r}")
    return url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="a running server on loopback; else start one in-process")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--duration", type=float, default=300.0, help="hard cap on the whole run, seconds")
    parser.add_argument("--stream", action="store_true", help="stream responses and measure time to first token")
    parser.add_argument("--max-queue", type=int, default=64, help="in-process server's queue size")
    parser.add_argument("--max-batch", type=int, default=8, help="in-process server's batch size")
    parser.add_argument("--check-outputs", action="store_true",
                        help="first send each distinct request alone; count load answers that differ")  # fmt: skip
    parser.add_argument("--bad-every", type=int, default=0,
                        help="mix one malformed request per this many good ones (each must get a 4xx)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the report to this file")
    add_model_flags(parser)
    add_drafter_flags(parser, default_drafter=SERVE_DEFAULT_DRAFTER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.duration <= 0:
        raise CausalDraftError("--requests and --concurrency must be >= 1 and --duration > 0")
    if args.url:
        report = asyncio.run(run_load(check_loopback(args.url), args))
    else:
        from causaldraft.api import load
        from causaldraft.serve.app import create_app
        from causaldraft.serve.server import BackgroundServer

        engine = load(engine_config(args))
        app = create_app(engine, max_queue=args.max_queue, max_batch=args.max_batch, engine_thread=False)
        with BackgroundServer(app) as server:
            # the engine loop runs here, on the thread that loaded the model (as `causaldraft serve`
            # does); the load runs on another
            reports: list[Report] = []
            client = threading.Thread(target=lambda: reports.append(asyncio.run(run_load(server.url, args))))
            client.start()
            app.state.worker.run_while(client.is_alive)
            client.join()
            if not reports:
                raise CausalDraftError("the load run failed (see above)")
            report = reports[0]
    payload = asdict(report)
    print(json.dumps(payload, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    failed = report.errors or report.outputs_differing or report.bad_answered_4xx < report.bad_sent
    return 0 if not failed else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CausalDraftError as error:
        print(f"load_server: error: {error}", file=sys.stderr)
        sys.exit(2)
