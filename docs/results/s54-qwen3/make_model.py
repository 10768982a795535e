"""A randomly initialised model of Qwen3-0.6B's shape (config values from its published config.json), for timing
the native backend on a real Qwen3 geometry without downloading weights: heads of 128, 16 query heads over a
hidden size of 1024 (q_proj 1024 -> 2048), query/key norms, tied embeddings. Random weights: its text is noise
and drafting accepts little, so only plain decoding's speed per backend and dtype is meaningful.

    .venv/bin/python docs/results/s54-qwen3/make_model.py /tmp/qwen3-0.6b-random
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.tiny import byte_tokenizer

out = Path(sys.argv[1])
config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1,
                     eos_token_id=2)  # fmt: skip
torch.manual_seed(0)
model = Qwen3ForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(str(out))
byte_tokenizer().save_pretrained(str(out))
print(out, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
