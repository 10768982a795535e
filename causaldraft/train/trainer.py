"""Distillation of draft heads: soft cross-entropy against the target's distribution k steps ahead,
teacher-forced on the target's own tokens.

A training sample is a row i of the features (h_i predicted the root tokens[i + 1]). Head k
(0-based) takes tokens[i + k + 1] as its path token (markov) and is trained against the target's
top-k distribution at row i + k + 1, i.e. the distribution of tokens[i + k + 2]. It is valid while
i + k + 2 <= ends[i] (still inside the segment). Example: segment [b, c, d, e] at rows 0..3, i = 0:
head 0 sees root c and learns the target's distribution at row 1 (for d); head 1 sees d and learns
row 2's (for e); head 2 would need row 3's distribution of a token after e: out of range.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from causaldraft.drafters.heads import DraftHeads
from causaldraft.errors import CausalDraftError
from causaldraft.train.features import Features


def run_digest(settings: object, vocab_ids: torch.Tensor, tokens: torch.Tensor) -> str:
    """What a training checkpoint's name must carry besides its readable settings, so that a resumed run
    only ever picks up a run of the same training: the settings' repr (learning rate and all), the draft
    vocabulary and the training data's tokens. Without it a rerun on more data or at another learning
    rate reloaded the finished checkpoint and reported the new data as trained on."""
    digest = hashlib.sha256(repr(settings).encode())
    digest.update(vocab_ids.to(torch.int64).numpy().tobytes())
    digest.update(tokens.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:10]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 1024
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 30
    seed: int = 0
    checkpoint_every: int = 100
    autocast: bool = True  # bf16 autocast on CPU

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise CausalDraftError("steps, batch size and learning rate must be positive")


@dataclass(frozen=True)
class Batch:
    hidden: torch.Tensor  # [b, hidden] float32
    path_embeds: torch.Tensor  # [b, heads, hidden] embeddings of tokens[i + k + 1]
    target_ids: torch.Tensor  # [b, heads, top_k] draft-vocabulary ids (0 where outside V')
    target_probs: torch.Tensor  # [b, heads, top_k] target probabilities (0 outside V' or invalid)
    valid: torch.Tensor  # [b, heads] bool


def draft_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab] long: each full id's index in the draft vocabulary, -1 if absent."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(vocab_ids.shape[0])
    return index


def make_batch(
    features: Features, rows: torch.Tensor, embed: torch.Tensor, to_draft: torch.Tensor, heads: int
) -> Batch:
    """rows: [b] sample rows; embed: [vocab, hidden] the target's token embeddings."""
    offsets = torch.arange(heads)  # [heads]
    last = features.tokens.shape[0] - 1
    valid = rows[:, None] + offsets[None, :] + 2 <= features.ends[rows][:, None]  # [b, heads]
    path_rows = (rows[:, None] + offsets[None, :] + 1).clamp(max=last)  # [b, heads]
    ids = features.topk_ids[path_rows]  # [b, heads, top_k]
    probs = torch.softmax(features.topk_logprobs[path_rows], dim=-1)  # [b, heads, top_k]
    draft_ids = to_draft[ids]  # [b, heads, top_k]
    probs = probs * (draft_ids >= 0) * valid[..., None]
    return Batch(
        hidden=features.hidden[rows].float(),
        path_embeds=embed[features.tokens[path_rows]].float(),
        target_ids=draft_ids.clamp(min=0),
        target_probs=probs,
        valid=valid,
    )


def head_logits(heads: DraftHeads, batch: Batch) -> list[torch.Tensor]:
    """Teacher-forced logits of every head: K tensors [b, V']."""
    outputs = []
    state = batch.hidden
    for head in range(heads.config.num_heads):
        if heads.config.kind == "markov":
            state = heads.step(head, state, batch.path_embeds[:, head])
            outputs.append(heads.logits(head, state))
        else:
            outputs.append(heads.logits(head, heads.medusa_state(head, batch.hidden)))
    return outputs


def distillation_loss(heads: DraftHeads, batch: Batch) -> tuple[torch.Tensor, list[float]]:
    """Mean over heads of the soft cross-entropy; also each head's value."""
    losses = []
    for head, logits in enumerate(head_logits(heads, batch)):
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [b, V']
        picked = logprobs.gather(1, batch.target_ids[:, head])  # [b, top_k]
        weight = batch.valid[:, head].sum().clamp(min=1)
        losses.append(-(batch.target_probs[:, head] * picked).sum() / weight)
    total = torch.stack(losses).mean()
    return total, [float(loss.detach()) for loss in losses]


def sample_rows(features: Features, count: int, generator: torch.Generator) -> torch.Tensor:
    """Rows with at least one valid head (two more rows in their segment)."""
    usable = torch.nonzero(torch.arange(features.tokens.shape[0]) + 2 <= features.ends).squeeze(1)
    if usable.numel() == 0:
        raise CausalDraftError("the training data has no sequences long enough")
    return usable[torch.randint(usable.numel(), (count,), generator=generator)]


def learning_rate(config: TrainConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(
    heads: DraftHeads,
    features: Features,
    embed: torch.Tensor,  # [vocab, hidden] frozen target embeddings
    config: TrainConfig,
    checkpoint: Path | None = None,
) -> list[float]:
    """Train in place; resume from ``checkpoint`` if it exists. Returns the loss of every step."""
    to_draft = draft_index(heads.vocab_ids, embed.shape[0])
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    history: list[float] = []
    start = 0
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        heads.load_state_dict(saved["heads"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        start, history = saved["step"], saved["history"]
    heads.train()
    progress = tqdm(range(start, config.steps), initial=start, total=config.steps, desc=f"train {heads.config.kind}")
    began = time.perf_counter()
    for step in progress:
        batch = make_batch(features, sample_rows(features, config.batch_size, generator), embed, to_draft,
                           heads.config.num_heads)  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast):
            loss, per_head = distillation_loss(heads, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        history.append(float(loss.detach()))
        progress.set_postfix(loss=round(history[-1], 3), first=round(per_head[0], 3))
        done = step + 1
        if checkpoint is not None and (done % config.checkpoint_every == 0 or done == config.steps):
            state = {"heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                     "generator": generator.get_state(), "step": done, "history": history,
                     "seconds": time.perf_counter() - began}  # fmt: skip
            torch.save(state, checkpoint.with_suffix(".tmp"))
            checkpoint.with_suffix(".tmp").rename(checkpoint)
    heads.eval()
    return history
