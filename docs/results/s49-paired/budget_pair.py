"""Default node budget against capped ones, paired turn by turn in one process (int4 default, compiled)."""
import json, sys, time
import causaldraft
from causaldraft.api import compile_backend
from causaldraft.models.loading import load_model

target = load_model("default", "native", "auto")
compile_backend(target, progress=False)
specs = [s.split(":") for s in sys.argv[1].split(",")]  # drafter:max_nodes (0: default)
engines = {f"{d}:{n}": causaldraft.load(loaded=target, drafter=d, **({"max_nodes": int(n)} if int(n) else {}))
           for d, n in specs}
questions = [json.loads(l) for l in open("/work/main/bench/prompts/mt-bench-8.jsonl")]
totals = {key: [0, 0.0, 0] for key in engines}
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
            totals[key][2] += r.stats.target_forwards
            messages.append({"role": "assistant", "content": r.text})
    print(i, {k: (round(n / s, 1), round(n / f, 2)) for k, (n, s, f) in totals.items()}, flush=True)
