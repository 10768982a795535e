import json, time
import causaldraft
from causaldraft.models.loading import load_model
prompts = [json.loads(l)["turns"][0] for l in open("bench/prompts/mt-bench-8.jsonl")]
loaded = load_model("default", "native", "int4")
engines = {
    "plain": causaldraft.load(loaded=loaded, drafter="none", compile=True),
    "markov-adaptive": causaldraft.load(loaded=loaded, drafter="markov", tree="dynamic", compile=True),
    "markov-fixed": causaldraft.load(loaded=loaded, drafter="markov", tree="dynamic", compile=True, adapt=False, fallback=False),
    "markov-adapt-nofallback": causaldraft.load(loaded=loaded, drafter="markov", tree="dynamic", compile=True, fallback=False),
}
opts = {"repetition_penalty": 1.1}
totals = {k: [0, 0.0, 0] for k in engines}
for rnd in range(2):
    for p in prompts:
        for k, e in (list(engines.items()) if rnd == 0 else list(engines.items())[::-1]):
            r = e.generate(p, chat=True, max_new_tokens=128, **opts)
            t = totals[k]; t[0] += r.stats.new_tokens; t[1] += r.stats.wall_s; t[2] += r.stats.target_forwards
for k, (tok, wall, fw) in totals.items():
    print(f"{k}: {tok / wall:.1f} tok/s, {tok / fw:.2f} tokens per pass", flush=True)
