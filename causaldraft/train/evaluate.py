"""Held-out evaluation of draft heads: per-head top-1 / top-5 accuracy conditional on the earlier
heads' top-1 being right (what a chain of drafts needs), and the chain's mean accepted length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from causaldraft.drafters.heads import DraftHeads
from causaldraft.train.features import Features
from causaldraft.train.trainer import draft_index, head_logits, make_batch


@dataclass(frozen=True)
class Evaluation:
    top1: tuple[float, ...]  # per head, given heads before it were right
    top5: tuple[float, ...]
    chain_accepted: float  # 1 + mean run of correct top-1 heads from the first
    rows: int

    def summary(self) -> dict[str, object]:
        return {
            "top1": [round(value, 4) for value in self.top1],
            "top5": [round(value, 4) for value in self.top5],
            "chain_accepted": round(self.chain_accepted, 4),
            "rows": self.rows,
        }


def evaluate(heads: DraftHeads, features: Features, embed: torch.Tensor, chunk: int = 2048) -> Evaluation:
    """embed: [vocab, hidden] the target's token embeddings."""
    count = heads.config.num_heads
    to_draft = draft_index(heads.vocab_ids, embed.shape[0])
    rows_all = torch.nonzero(torch.arange(features.tokens.shape[0]) + 2 <= features.ends).squeeze(1)
    hits1 = torch.zeros(count)
    hits5 = torch.zeros(count)
    tries = torch.zeros(count)
    run_total = 0.0
    with torch.inference_mode():
        for start in range(0, rows_all.numel(), chunk):
            rows = rows_all[start : start + chunk]
            batch = make_batch(features, rows, embed, to_draft, count)
            last = features.tokens.shape[0] - 1
            alive = torch.ones(rows.numel(), dtype=torch.bool)  # earlier heads all right
            run = torch.zeros(rows.numel())
            for head, logits in enumerate(head_logits(heads, batch)):
                target = features.topk_ids[(rows + head + 1).clamp(max=last), 0]  # [b] target argmax
                top5 = heads.vocab_ids[torch.topk(logits, 5, dim=-1).indices]  # [b, 5]
                right1 = top5[:, 0] == target
                counted = alive & batch.valid[:, head]
                tries[head] += counted.sum()
                hits1[head] += (counted & right1).sum()
                hits5[head] += (counted & (top5 == target[:, None]).any(-1)).sum()
                alive = counted & right1
                run += alive.float()
            run_total += float(run.sum())
    top1_rate = (hits1 / tries.clamp(min=1)).tolist()
    top5_rate = (hits5 / tries.clamp(min=1)).tolist()
    return Evaluation(tuple(top1_rate), tuple(top5_rate), 1.0 + run_total / max(1, rows_all.numel()), rows_all.numel())
