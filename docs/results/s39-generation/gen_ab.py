"""Feature generation speed, kernel vs oneDNN products: python gen_ab.py kernel|onednn TOKENS"""
import json, shutil, sys, time, torch
from pathlib import Path
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.models.native import default_aux_layers
from causaldraft.train.feature_data import FeatureGenConfig, generate_features
P = Path("../shared/data/train")
files = [P / "sharegpt_first_prompts_10k_sorted.json", P / "sharegpt_v3_filtered_1000.json", P / "gsm8k_train.jsonl"]
mode, tokens = sys.argv[1], int(sys.argv[2])
loaded = load_model("default", "native", "bfloat16")
m = loaded.backend
if mode == "onednn":
    assert use_batch_products(m)
aux = default_aux_layers(m.llama_shape.num_layers)
out = Path(f"runs/s39/gen-{mode}"); shutil.rmtree(out, ignore_errors=True)
t0 = time.perf_counter()
n, s = generate_features(m, loaded.tokenizer, files, out, aux, FeatureGenConfig(tokens=tokens, seed=9), loaded.fingerprint)
wall = time.perf_counter() - t0
print(json.dumps({"mode": mode, "tokens": n, "wall_s": round(wall, 1), "tok_per_s": round(n / wall, 1)}))
