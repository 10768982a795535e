# stop 49. The stop-48 TextTracker is read from git first: git show ec29e9c~1:causaldraft/api.py > /tmp/api_old.py
"""Detokenisation cost per emitted token, the whole-decode TextTracker (stop 48) against the windowed one."""
import importlib.util, sys, time
sys.path.insert(0, "/work/main")
from causaldraft.api import TextTracker as New
from causaldraft.models.loading import load_tokenizer, resolve_model_dir
spec = importlib.util.spec_from_file_location("api_old", "/tmp/api_old.py"); old = importlib.util.module_from_spec(spec)
sys.modules["api_old"] = old; spec.loader.exec_module(old)
tok = load_tokenizer(resolve_model_dir("default"))
ids = tok.encode(open("/work/main/README.md").read() * 2, add_special_tokens=False)
for n in (256, 1024, 4096):
    for stops in ([], ["\n\n\n\n"]):
        row = []
        for cls in (old.TextTracker, New):
            tracker = cls(tok, stops)
            t = time.perf_counter()
            for at in range(0, n, 2):
                tracker.add(ids[at:at + 2])
            tracker.flush()
            row.append((time.perf_counter() - t) / n * 1e3)
        print(f"{n} tokens, stops={stops!r}: whole decodes {row[0]:.3f} ms/token, window {row[1]:.4f} ms/token")
