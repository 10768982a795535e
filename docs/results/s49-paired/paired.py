"""Engines compared paired in one process, turn by turn, the order alternating per question (mt-bench-8, both
turns, 256 tokens; int4 default, compiled), so the VM's slow stretches weigh on all of them alike.

Each argument names an engine: a drafter, then settings, e.g. ``none``, ``lookup:fixed`` (``adapt_threads=False``:
torch's thread count throughout), ``markov:nodes=4`` (a node budget ceiling of 4). Prints cumulative tokens/s and
mean accepted after each question, and the thread policy's state of every engine that has one."""
import json
import sys
import time

import causaldraft
from causaldraft.api import compile_backend
from causaldraft.models.loading import load_model


def settings(spec: str) -> tuple[str, dict[str, object]]:
    drafter, *rest = spec.split(":")
    options: dict[str, object] = {}
    for item in rest:
        if item == "fixed":
            options["adapt_threads"] = False
        elif item.startswith("nodes="):
            options["max_nodes"] = int(item.removeprefix("nodes="))
    return drafter, options


target = load_model("default", "native", "auto")
compile_backend(target, progress=False)
engines = {}
for spec in sys.argv[1:]:
    drafter, options = settings(spec)
    engines[spec] = causaldraft.load(loaded=target, drafter=drafter, **options)
questions = [json.loads(line) for line in open("/work/main/bench/prompts/mt-bench-8.jsonl")]
totals = {spec: [0, 0.0, 0] for spec in engines}
for engine in engines.values():
    engine.generate(questions[0]["turns"][0], chat=True, max_new_tokens=32)
for index, question in enumerate(questions):
    for spec in engines if index % 2 == 0 else reversed(engines):
        engine, messages = engines[spec], []
        for turn in question["turns"]:
            messages.append({"role": "user", "content": turn})
            started = time.perf_counter()
            result = engine.generate(messages, max_new_tokens=256)
            totals[spec][0] += result.stats.new_tokens
            totals[spec][1] += time.perf_counter() - started
            totals[spec][2] += result.stats.target_forwards
            messages.append({"role": "assistant", "content": result.text})
    print(index, {spec: (round(n / s, 1), round(n / f, 2)) for spec, (n, s, f) in totals.items()}, flush=True)
for spec, engine in engines.items():
    policy = engine.threads
    if policy.enabled:
        print(spec, "switches", policy.switches, "current", policy.current,
              {count: round(value, 2) for count, value in policy.slowdown.items()})
