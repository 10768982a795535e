"""Fit a trained eagle3 layer's calibration again, on fresh responses of its target.

``train-heads --heads eagle3`` fits the layer's three temperatures after training
(``train/calibration.py``). A layer trained before a temperature existed carries 1 for it (the
plain distribution); this script generates ``--tokens`` response tokens with features (the recipe's
generator, another prompt order: ``--data-seed``, sampled at ``--data-temperature``), fits all three
on them and prints the fit. ``--write`` stores them in the layer's ``eagle3_config.json``, with the fit
under ``training.recalibration``; the weights are untouched.

    .venv/bin/python bench/calibrate_eagle3.py --model default --heads causaldraft/heads/default/eagle3 \\
        --prompts ../shared/data/train/*.json* --tokens 30000 --data-seed 4 --data-temperature 0.8 \\
        --work /tmp/calib --write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from causaldraft.drafters.eagle3_model import CALIBRATION_FIELDS, CONFIG_FILE, load_layer, read_config
from causaldraft.errors import CausalDraftError
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.train.calibration import calibrate_layer
from causaldraft.train.eagle3_train import load_sequences
from causaldraft.train.feature_data import FeatureGenConfig, generate_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", help="of the target while generating")
    parser.add_argument("--heads", type=Path, required=True, help="the eagle3 layer's directory")
    parser.add_argument("--prompts", type=Path, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--data-seed", type=int, default=4)
    parser.add_argument("--data-temperature", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=5, help="unrolled depths of the score fit")
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--work", type=Path, required=True, help="where the generated data goes (resumable)")
    parser.add_argument("--write", action="store_true", help="store the fit in the layer's config")
    args = parser.parse_args()
    loaded = load_model(args.model, "native", args.dtype)
    backend = loaded.backend
    use_batch_products(backend)  # the data passes run 48 rows and whole prompts at a time
    layer = load_layer(args.heads, loaded.base_fingerprint, backend.shape.vocab_size, backend.shape.hidden_size)
    started = time.perf_counter()
    generation = FeatureGenConfig(tokens=args.tokens, seed=args.data_seed, temperature=args.data_temperature)
    generate_features(backend, loaded.tokenizer, tuple(args.prompts), args.work,
                      layer.config.aux_layers, generation, loaded.fingerprint)  # fmt: skip
    generated = time.perf_counter() - started
    torch.set_num_threads(generation.threads)
    sequences = load_sequences(args.work)
    with torch.inference_mode():
        embed = backend.embed(torch.arange(backend.shape.vocab_size)).float()
    started = time.perf_counter()
    calibration = calibrate_layer(layer, sequences, embed, args.steps, args.context)
    summary = {
        "sequences": len(sequences),
        "response_tokens": sum(seq.response_length for seq in sequences),
        "data_seed": args.data_seed,
        "data_temperature": args.data_temperature,
        "seconds": {"generate": round(generated, 1), "calibrate": round(time.perf_counter() - started, 1)},
        **calibration.summary(),
    }
    print(json.dumps(summary, indent=1))
    if args.write:
        config, record = read_config(args.heads)
        fitted = calibration.fitted(config)
        record.update({name: getattr(fitted, name) for name in CALIBRATION_FIELDS})
        training = record.get("training")
        record["training"] = {**(training if isinstance(training, dict) else {}), "recalibration": summary}
        (args.heads / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.heads / CONFIG_FILE}")


if __name__ == "__main__":
    try:
        main()
    except CausalDraftError as error:  # a missing, corrupt or foreign layer, a bad model path
        sys.exit(f"calibrate_eagle3: {error}")
