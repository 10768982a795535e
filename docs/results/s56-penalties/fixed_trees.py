import json, os, sys
import causaldraft
from causaldraft.models.loading import load_model
prompts = [json.loads(l)["turns"][0] for l in open("bench/prompts/mt-bench-8.jsonl")]
loaded = load_model("default", "native", "int4")
plain = causaldraft.load(loaded=loaded, drafter="none", compile=True)
engines = {d: causaldraft.load(loaded=loaded, drafter=d, tree="dynamic", compile=True, adapt=False, fallback=False)
           for d in ("markov", "eagle3")}
for setting, opts in (("none", {}), ("rep1.1", {"repetition_penalty": 1.1}), ("rep1.2", {"repetition_penalty": 1.2})):
    expected = [plain.generate(p, chat=True, max_new_tokens=128, **opts).token_ids for p in prompts]
    for proto in (("", "12", "23", "35") if setting != "none" else ("",)):
        os.environ["PROTO_PEN"] = proto
        line = [f"{setting} proto={proto or 'off'}"]
        for d, e in engines.items():
            tok = fw = 0; same = True
            for p, exp in zip(prompts, expected):
                r = e.generate(p, chat=True, max_new_tokens=128, **opts)
                tok += r.stats.new_tokens; fw += r.stats.target_forwards; same &= r.token_ids == exp
            line.append(f"{d} acc {tok/fw:.3f} same={same}")
        print(" | ".join(line), flush=True)
