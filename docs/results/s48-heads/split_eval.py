"""The shipped Markov/Medusa heads (85.6k tokens) and the stop-48 ones (500k) on the same held-out rows: every
20th answer of the 500k-token data (the split train-heads held out), and the part of it whose prompts the shipped
heads' 672 training prompts (the first of the same prompt order) cannot include (prompt index >= 1000).
Run with the code that made the features (a3b99ff): PYTHONPATH=/tmp/wt-a3b."""
import json
from pathlib import Path

import torch

from causaldraft.drafters.heads import default_heads_dir, load_heads
from causaldraft.models.loading import load_model
from causaldraft.train.evaluate import evaluate
from causaldraft.train.features import load_features, split_features

work = Path("/work/runs48/markov-work")
target = load_model("default", "native", "bfloat16")
features = load_features(work / "heads-features")
prompt_index = []
for path in sorted((work / "heads-data").glob("shard_*.pt")):
    shard = torch.load(path, weights_only=True)
    responses = (shard["lengths"] - shard["prompt_lengths"]).tolist()
    prompt_index += [index for index, length in zip(shard["prompt_index"].tolist(), responses) if length > 0]
assert len(prompt_index) == features.segments, (len(prompt_index), features.segments)
segment_ids = torch.arange(features.segments)
held = segment_ids[segment_ids % 20 == 19]
unseen = torch.tensor([int(s) for s in held if prompt_index[int(s)] >= 1000])
embed = target.backend.embed(torch.arange(target.backend.shape.vocab_size)).float()
out = {"held_out_answers": len(held), "unseen_prompt_answers": len(unseen)}
for name, ids in (("held_out", held), ("held_out_prompt_index_ge_1000", unseen)):
    part = features.select(ids)
    for kind in ("markov", "medusa"):
        for which, directory in (("shipped", default_heads_dir(kind)), ("stop48", Path("/work/runs48/new-heads") / kind)):
            if directory.is_dir():
                heads = load_heads(directory, target, kind)
                out[f"{name}/{kind}/{which}"] = evaluate(heads, part, embed).summary()
print(json.dumps(out, indent=1))
