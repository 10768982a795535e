# fp32 logits of the native backend against transformers on make_model.py's model: PYTHONPATH=. .venv/bin/python docs/results/s54-qwen3/parity.py
import torch
from causaldraft.models.native import NativeLlama
from causaldraft.models.hf import HFBackend
from tests.test_backends import run_prefix_and_tree, TREES
d = '/tmp/qwen3-0.6b-random'
from pathlib import Path
native = NativeLlama.from_pretrained(Path(d), torch.float32)
ref = HFBackend.from_pretrained(Path(d), torch.float32)
for name, t in TREES.items():
    a, b = run_prefix_and_tree(native, t); c, e = run_prefix_and_tree(ref, t)
    print(name, 'max |diff| prefix', (a-c).abs().max().item(), 'tree', (b-e).abs().max().item(), 'logit std', c.std().item(),
          'argmax equal', bool((a.argmax(-1) == c.argmax(-1)).all()), bool((b.argmax(-1) == e.argmax(-1)).all()))
