"""MT-bench first-turn answers of the default model (bf16, greedy, 256 tokens) with eagle3's features, for
bench/drafter_accuracy.py (--eval-every 1: every sequence held out; no drafter trained on MT-bench)."""
from pathlib import Path

import torch

from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.drafters.eagle3 import default_eagle3_dir
from causaldraft.drafters.eagle3_model import load_layer
from causaldraft.train.feature_data import FeatureGenConfig, generate_features

target = load_model("default", "native", "bfloat16")
use_batch_products(target.backend)
shape = target.backend.shape
layer = load_layer(default_eagle3_dir(), target.base_fingerprint, shape.vocab_size, shape.hidden_size)
aux = tuple(layer.config.aux_layers) if hasattr(layer.config, "aux_layers") else (2, 15, 27)
print("aux layers", aux)
config = FeatureGenConfig(tokens=10**7, max_new_tokens=256, threads=2)
print(generate_features(target.backend, target.tokenizer, [Path("/work/shared/data/bench/mt_bench_question.jsonl")],
                        Path("/work/runs48/mt-data"), aux, config, target.fingerprint))
