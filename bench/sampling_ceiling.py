"""How much can an eagle3 layer's children be accepted when the target samples (T = 1)? Offline.

On fresh responses of the target sampled at ``--data-temperature`` (the recipe's generator, features
kept), each row is a position where the layer drafts, given the true path so far (depth 1: from the
target's features; depth d: unrolled, as training-time test does). The target's distribution there is
known on its top-k tokens (the data's top-16 log-probs) plus one lump holding the rest of its mass.
Per depth it prints the target's mass on its known tokens (``known mass``) and the chance that a
drafted child is accepted:

- ``top1``: the layer's most probable token, a deterministic child (rejection sampling accepts it
  with the target's probability of it);
- ``gumbel c``: the target's Gumbel sample (its noise drawn here) is among the layer's first c
  children ranked by log q / s + g with the same noise (the ``gumbel`` sampler; s = the layer's
  ``sampling_temperature_scale``);
- ``sampled 1`` / ``sampled 2``: one or two children drawn from q at temperature s' (the best of
  ``--scales``), judged by recursive rejection sampling (min(1, p/q), then the residual): the best any
  one- or two-child rule can do with this q.

A sample in the lump always counts as a miss, so every figure is a lower bound on its rule. With the
acceptance a per depth, a tree that is c children wide at every depth accepts at most 1 / (1 - a)
tokens per pass however deep it grows.

    .venv/bin/python bench/sampling_ceiling.py --heads causaldraft/heads/default/eagle3 \\
        --prompts ../shared/data/train/*.json* --tokens 15000 --data-seed 9 --work /tmp/ceiling
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from causaldraft.drafters.eagle3_model import Eagle3Layer, load_layer
from causaldraft.errors import CausalDraftError
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.train.calibration import CHUNK_ROWS, gumbel, target_samples
from causaldraft.train.eagle3_train import Sequence, load_sequences, make_batch, ttt_outputs
from causaldraft.train.feature_data import FeatureGenConfig, generate_features
from causaldraft.train.trainer import draft_index

CHILDREN = 4  # Gumbel-ranked children counted
SEQUENCES_PER_BATCH = 8


def sampled_acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling's acceptance of one and of two children drawn from q, per row [m], where
    p and q [m, k] are the target's and the draft's probabilities of the target's top-k tokens (the
    rest of either counts as disjoint). One child: sum min(p, q). Second child, against the residual
    r = (p - q)+ / (1 - a1): (1 - a1) * sum min(r, q) = sum min((p - q)+, (1 - a1) q)."""
    first = torch.minimum(p, q).sum(-1)
    second = torch.minimum((p - q).clamp(min=0.0), q * (1.0 - first)[:, None]).sum(-1)
    return first, first + second


def ceiling(layer: Eagle3Layer, sequences: list[Sequence], embed: torch.Tensor, depths: int,
            scales: tuple[float, ...], seed: int) -> dict[str, list[float]]:  # fmt: skip
    """Per depth: the acceptances of the module docstring, averaged over rows."""
    vocab_size = embed.shape[0]
    to_draft = draft_index(layer.vocab_ids, vocab_size)
    generator = torch.Generator().manual_seed(seed)
    scale = layer.config.sampling_temperature_scale
    sums: dict[str, torch.Tensor] = {name: torch.zeros(depths) for name in ("rows", "known mass", "top1")}
    sums.update({f"gumbel {c}": torch.zeros(depths) for c in range(1, CHILDREN + 1)})
    sums.update({f"sampled {n} @ {s}": torch.zeros(depths) for n in (1, 2) for s in scales})
    with torch.inference_mode():
        for start in range(0, len(sequences), SEQUENCES_PER_BATCH):
            batch = make_batch(sequences[start : start + SEQUENCES_PER_BATCH], depths, 48, to_draft)
            for depth, out in enumerate(ttt_outputs(layer, embed, batch, depths)):
                valid = batch.valid[:, :, depth]
                all_logits = layer.logits(out[valid]).float()  # [M, V']
                all_ids = batch.topk_ids[:, :, depth][valid]  # [M, k]
                all_logprobs = batch.topk_logprobs[:, :, depth][valid].float()
                for row in range(0, all_logits.shape[0], CHUNK_ROWS):
                    logits = all_logits[row : row + CHUNK_ROWS]
                    ids, logprobs = all_ids[row : row + CHUNK_ROWS], all_logprobs[row : row + CHUNK_ROWS]
                    p = logprobs.exp()
                    sums["rows"][depth] += logits.shape[0]
                    sums["known mass"][depth] += float(p.sum())
                    best = layer.vocab_ids[logits.argmax(-1)]
                    sums["top1"][depth] += float((p * (ids == best[:, None])).sum())
                    noise = gumbel((logits.shape[0], vocab_size), generator)
                    sample = target_samples(ids, logprobs, noise, generator)
                    perturbed = torch.log_softmax(logits / scale, dim=-1) + noise[:, layer.vocab_ids]
                    top = perturbed.topk(CHILDREN, dim=-1).indices
                    found = (layer.vocab_ids[top] == sample[:, None]).float().cumsum(1).clamp(max=1.0).sum(0)
                    for c in range(1, CHILDREN + 1):
                        sums[f"gumbel {c}"][depth] += float(found[c - 1])
                    draft_ids = to_draft[ids]  # [m, k], -1 outside the draft vocabulary
                    for s in scales:
                        q_all = torch.softmax(logits / s, dim=-1)
                        q = torch.where(draft_ids >= 0, q_all.gather(1, draft_ids.clamp(min=0)), torch.zeros_like(p))
                        one, two = sampled_acceptance(p, q)
                        sums[f"sampled 1 @ {s}"][depth] += float(one.sum())
                        sums[f"sampled 2 @ {s}"][depth] += float(two.sum())
    rows = sums.pop("rows")
    table = {name: (values / rows.clamp(min=1)).tolist() for name, values in sums.items()}
    return {"rows": rows.tolist(), **table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--heads", type=Path, required=True, help="the eagle3 layer's directory")
    parser.add_argument("--prompts", type=Path, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=15000)
    parser.add_argument("--data-seed", type=int, default=9)
    parser.add_argument("--data-temperature", type=float, default=1.0)
    parser.add_argument("--depths", type=int, default=3)
    parser.add_argument("--scales", default="0.6,0.8,1.0", help="temperatures of q for the sampled children")
    parser.add_argument("--seed", type=int, default=0, help="of the noise drawn here")
    parser.add_argument("--work", type=Path, required=True, help="where the generated data goes (resumable)")
    args = parser.parse_args()
    loaded = load_model(args.model, "native", "bfloat16")
    backend = loaded.backend
    use_batch_products(backend)  # the data passes run 48 rows and whole prompts at a time
    layer = load_layer(args.heads, loaded.base_fingerprint, backend.shape.vocab_size, backend.shape.hidden_size)
    generation = FeatureGenConfig(tokens=args.tokens, seed=args.data_seed, temperature=args.data_temperature)
    generate_features(backend, loaded.tokenizer, tuple(args.prompts), args.work,
                      layer.config.aux_layers, generation, loaded.fingerprint)  # fmt: skip
    torch.set_num_threads(generation.threads)
    sequences = load_sequences(args.work)
    with torch.inference_mode():
        embed = backend.embed(torch.arange(backend.shape.vocab_size)).float()
    scales = tuple(float(value) for value in args.scales.split(","))
    table = ceiling(layer, sequences, embed, args.depths, scales, args.seed)
    print(json.dumps({"sequences": len(sequences), "data_temperature": args.data_temperature}))
    for name, values in table.items():
        print(f"{name:18s}", " ".join(f"{value:8.3f}" if name != "rows" else f"{value:8.0f}" for value in values))


if __name__ == "__main__":
    try:
        main()
    except CausalDraftError as error:
        sys.exit(f"sampling_ceiling: {error}")
