"""The thread policy on and off, paired turn by turn in one process (int4 default, compiled): tokens/s per
engine over the same turns, order alternating, so the VM's slow stretches weigh on both alike."""
import json, sys, time
import causaldraft
from causaldraft.api import compile_backend
from causaldraft.models.loading import load_model

target = load_model("default", "native", "auto")
compile_backend(target, progress=False)
drafters = sys.argv[1].split(",") if len(sys.argv) > 1 else ["none", "lookup"]
engines = {(d, on): causaldraft.load(loaded=target, drafter=d, adapt_threads=on) for d in drafters for on in (True, False)}
questions = [json.loads(l) for l in open("/work/main/bench/prompts/mt-bench-8.jsonl")]
totals = {key: [0, 0.0] for key in engines}
for engine in engines.values():
    engine.generate(questions[0]["turns"][0], chat=True, max_new_tokens=32)
for i, q in enumerate(questions):
    keys = list(engines) if i % 2 == 0 else list(reversed(engines))
    for key in keys:
        engine = engines[key]
        messages = []
        for turn in q["turns"]:
            messages.append({"role": "user", "content": turn})
            t = time.perf_counter()
            r = engine.generate(messages, max_new_tokens=256)
            totals[key][0] += r.stats.new_tokens; totals[key][1] += time.perf_counter() - t
            messages.append({"role": "assistant", "content": r.text})
    print(i, {f"{d}:{'policy' if on else 'fixed'}": round(n / s, 1) for (d, on), (n, s) in totals.items()}, flush=True)
for (d, on), engine in engines.items():
    if on:
        p = engine.threads
        print(d, "switches", p.switches, "current", p.current, {k: round(v, 2) for k, v in p.slowdown.items()})
