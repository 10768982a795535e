# stop 49. The stop-48 TextTracker is read from git first: git show ec29e9c~1:causaldraft/api.py > /tmp/api_old.py
"""End to end: long outputs with a stop string, the whole-decode TextTracker (stop 48) against the windowed one,
alternating in one process (int4 default, compiled, lookup)."""
import importlib.util, sys, time
import causaldraft, causaldraft.api as api
spec = importlib.util.spec_from_file_location("api_old", "/tmp/api_old.py"); old = importlib.util.module_from_spec(spec)
sys.modules["api_old"] = old; spec.loader.exec_module(old)
new_cls = api.TextTracker
engine = causaldraft.load(model="default", drafter="lookup")
prompt = "Write a very long, detailed story about a lighthouse keeper, in many chapters."
totals = {"whole": [0, 0.0], "window": [0, 0.0]}
for round_ in range(3):
    for name, cls in (("whole", old.TextTracker), ("window", new_cls)) if round_ % 2 == 0 else (("window", new_cls), ("whole", old.TextTracker)):
        api.TextTracker = cls
        t = time.perf_counter()
        r = engine.generate(prompt, chat=True, max_new_tokens=2048, stop=["\n\n\n\n\n"])
        totals[name][0] += r.stats.new_tokens; totals[name][1] += time.perf_counter() - t
        print(name, r.stats.new_tokens, r.finish_reason, f"{r.stats.new_tokens / (time.perf_counter() - t):.1f} tok/s", flush=True)
print({k: round(n / s, 1) for k, (n, s) in totals.items()})
