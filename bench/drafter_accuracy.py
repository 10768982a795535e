"""Held-out top-1 / top-5 accuracy per draft depth of eagle3, markov and medusa on the same split.

The split is eagle3's (every ``--eval-every``-th sequence of the feature data in ``--work``). The
heads read the target's final hidden state, which that data does not keep: it is recomputed for
the held-out sequences with one native pass each. Accuracy at depth k counts rows where depths
1..k-1 were right (a chain's view); "chain accepted" is the simulated mean accepted length.

    python bench/drafter_accuracy.py --work runs/work/eagle3-data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from causaldraft.drafters.eagle3 import default_eagle3_dir
from causaldraft.drafters.eagle3_model import load_layer
from causaldraft.drafters.heads import default_heads_dir, load_heads
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.train.eagle3_train import evaluate_layer, load_sequences, split_sequences
from causaldraft.train.evaluate import evaluate
from causaldraft.train.features import Features, sequence_features


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True, help="eagle3 feature data directory")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eagle3", type=Path, default=default_eagle3_dir())
    parser.add_argument("--heads-root", type=Path, default=default_heads_dir("markov").parent)
    parser.add_argument("--depths", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("default", "native", "bfloat16")
    backend = target.backend
    use_batch_products(backend)  # the held-out answers' hidden states, one whole sequence per pass
    shape = backend.shape
    _, held = split_sequences(load_sequences(args.work), args.eval_every)
    embed = backend.embed(torch.arange(shape.vocab_size)).float()
    layer = load_layer(args.eagle3, target.base_fingerprint, shape.vocab_size, shape.hidden_size)
    results = {"eagle3": evaluate_layer(layer, held, embed, args.depths, 48).summary()}
    items = []
    with torch.inference_mode():
        for seq in held:
            prompt = seq.tokens[: seq.prompt_length].tolist()
            items.append(sequence_features(backend, prompt, seq.tokens[seq.prompt_length :].tolist(), 16))
    lengths = torch.tensor([item["tokens"].shape[0] for item in items])
    features = Features(
        tokens=torch.cat([item["tokens"] for item in items]).long(),
        hidden=torch.cat([item["hidden"] for item in items]),
        topk_ids=torch.cat([item["topk_ids"] for item in items]).long(),
        topk_logprobs=torch.cat([item["topk_logprobs"] for item in items]).float(),
        ends=torch.repeat_interleave(lengths.cumsum(0) - 1, lengths),
        segments=len(items),
    )
    for kind in ("markov", "medusa"):
        heads = load_heads(args.heads_root / kind, target, kind)
        results[kind] = evaluate(heads, features, embed).summary()
    print(json.dumps({"held_out_sequences": len(held), **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
