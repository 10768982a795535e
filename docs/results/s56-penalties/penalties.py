"""Scratch: what penalties do to speculative decoding's gain (int4 default model, compiled). One process,
engines sharing one loaded model, methods interleaved per prompt; greedy."""
import json
import sys
import statistics

import causaldraft
from causaldraft.models.loading import load_model

dtype = sys.argv[1] if len(sys.argv) > 1 else "int4"
drafters = sys.argv[2].split(",") if len(sys.argv) > 2 else ["none", "lookup", "markov"]
prompts = [json.loads(line)["turns"][0] for line in open("bench/prompts/mt-bench-8.jsonl")]
loaded = load_model("default", "native", dtype)
settings = {
    "none": {},
    "rep1.1": {"repetition_penalty": 1.1},
    "freq0.5": {"frequency_penalty": 0.5},
    "pres0.6": {"presence_penalty": 0.6},
}
engines = {d: causaldraft.load(loaded=loaded, drafter=d, tree="dynamic", compile=True) for d in drafters}
for name, options in settings.items():
    rows = {d: [] for d in drafters}
    for prompt in prompts:
        for d in drafters:
            result = engines[d].generate(prompt, chat=True, max_new_tokens=128, **options)
            rows[d].append((result.stats.new_tokens, result.stats.wall_s, result.stats.mean_accepted, result.token_ids))
    base = rows["none"]
    line = [name]
    for d in drafters:
        tokens = sum(r[0] for r in rows[d]); wall = sum(r[1] for r in rows[d])
        same = all(r[3] == b[3] for r, b in zip(rows[d], base))
        acc = statistics.mean(r[2] for r in rows[d])
        line.append(f"{d} {tokens / wall:.1f} tok/s acc {acc:.2f} same={same}")
    print(" | ".join(line), flush=True)
