"""Scratch: how tight can a rigorous bound from an int4 copy of the head be? Candidate counts."""
import json
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from causaldraft.models.quant import quantize_int4

torch.set_num_threads(1)
root = "/root/.cache/causaldraft/models/SmolLM2-135M-Instruct"
tok = AutoTokenizer.from_pretrained(root)
model = AutoModelForCausalLM.from_pretrained(root, torch_dtype=torch.float32)
W = model.lm_head.weight.detach().float()  # [V, D]
q = quantize_int4(W)
print(type(q), [f for f in vars(q)] if hasattr(q, "__dict__") else q)
G = q.group_size
approxW = ((q.values.float() - 8) * q.scales.repeat_interleave(G, 1) + q.zeros.repeat_interleave(G, 1))
R = W - approxW  # [V, D]
V, D = W.shape
nb = D // G
rb = R.view(V, nb, G).norm(dim=2)  # [V, nb]
rmax = R.abs().view(V, nb, G).amax(dim=2)
rnorm = R.norm(dim=1)
texts = [json.loads(line)["turns"][0] for line in open("bench/prompts/mt-bench-8.jsonl")][:4]
xs = []
for t in texts:
    ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = model.generate(ids, max_new_tokens=48, do_sample=False)
    with torch.no_grad():
        h = model.model(out).last_hidden_state[0]
    xs.append(h[ids.shape[1] - 1 :])
X = torch.cat(xs)
print("rows", X.shape, "|x| mean", X.norm(dim=1).mean().item())
stats = {k: [] for k in ("cs", "block", "elem", "actual", "n_cs", "n_block", "n_elem", "n_actual")}
for x in X:
    logit = W @ x
    ap = approxW @ x
    xb = x.view(nb, G)
    b_cs = x.norm() * rnorm
    b_block = rb @ xb.norm(dim=1)
    b_elem = rmax @ xb.abs().sum(dim=1)
    act = (logit - ap).abs()
    for name, b in (("cs", b_cs), ("block", b_block), ("elem", b_elem), ("actual", act)):
        lo = (ap - b).max()
        stats["n_" + name].append(int(((ap + b) >= lo).sum()))
        if name != "actual":
            stats[name].append(b.mean().item())
        else:
            stats[name].append(b.max().item())
    top = logit.max(); 
for k, v in stats.items():
    v = torch.tensor(v, dtype=torch.float64)
    print(k, "mean", round(v.mean().item(), 3), "median", round(v.median().item(), 3), "max", round(v.max().item(), 3))
xa = X.abs().mean(0)
print("top channels |x| mean:", torch.topk(xa, 8))
print("energy share of top 8 channels", (X[:, torch.topk(xa, 8).indices] ** 2).sum() / (X ** 2).sum())
