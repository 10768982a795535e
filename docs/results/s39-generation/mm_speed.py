import time, torch
import torch.nn.functional as F
from causaldraft.models.loading import load_model
torch.set_num_threads(2)
loaded = load_model("default", "native", "bfloat16")
m = loaded.backend
layer = m.layers[0]
mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj}
for name, mod in layer.mlp.named_children(): mods[name] = mod
print({k: type(v).__name__ for k, v in mods.items()})
def bench(f, reps=20):
    f(); t = time.perf_counter()
    for _ in range(reps): f()
    return 1e3 * (time.perf_counter() - t) / reps
with torch.inference_mode():
    for rows in (1, 8, 48, 256, 1024):
        line = []
        for name, mod in mods.items():
            x = torch.randn(rows, mod.in_features, dtype=torch.bfloat16)
            w = mod.weight.contiguous()
            a = bench(lambda: mod(x)); b = bench(lambda: F.linear(x, w))
            line.append(f"{name} {a:.2f}/{b:.2f}")
        print(rows, " ".join(line), flush=True)
