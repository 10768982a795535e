"""Training the EAGLE-3 draft layer by self-distillation, with training-time test (TTT).

Data: sequences from ``feature_data`` (tokens, target features, top-k target log-probs). Each
training example is one sequence cropped to its response plus ``context`` prompt rows before it.
Rows are draft rows p (token x_{p+1}, features a_p); see ``drafters/eagle3_model``.

TTT unrolls ``steps`` passes the way drafting uses the layer. Step 0 reads fc(a_p) and predicts
x_{p+2}. Step j >= 1 at row p reads the token x_{p+1+j} and the layer's own step j-1 output at row
p (rope position p + j), attends to the step-0 keys of rows 0..p (the accepted prefix, made from
target features) and to its own earlier steps' keys at row p (its drafted ancestors), and is
trained against the target's distribution for x_{p+2+j}. That is exactly a depth-(j+1) node of a
draft tree: the prefix up to the root row p, then its ancestors on the path.

Worked example (steps = 3, row p = 4): step 0 sees keys k0[0..4]; step 1 sees k0[0..4], k1[4];
step 2 sees k0[0..4], k1[4], k2[4] and learns the target's distribution at position 7 (for x_8).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from causaldraft.drafters.eagle3_model import Eagle3Layer
from causaldraft.errors import CausalDraftError
from causaldraft.models.native import apply_rope
from causaldraft.train.data import shard_paths
from causaldraft.train.evaluate import Evaluation
from causaldraft.train.feature_data import read_shard
from causaldraft.train.trainer import draft_index


@dataclass(frozen=True)
class Eagle3TrainConfig:
    # the shipped default layer's recipe: 2 epochs of ~512-row steps at 1e-3 (1 epoch of 1,536-row steps at
    # 5e-4 left it at 33% held-out top-1 at depth 1 instead of 43%)
    epochs: float = 2.0
    rows_per_batch: int = 512
    steps: int = 5  # TTT unroll = draft depths trained
    context: int = 48  # prompt rows kept before the response
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 40
    step_decay: float = 0.8  # loss weight of TTT step j: decay ** j
    seed: int = 0
    checkpoint_every: int = 50
    autocast: bool = True

    def __post_init__(self) -> None:
        if self.epochs <= 0 or self.rows_per_batch < 16 or self.steps < 1 or self.lr <= 0 or self.context < 0:
            raise CausalDraftError("eagle3 training sizes and learning rate must be positive")


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [L] long
    prompt_length: int
    features: torch.Tensor  # [L - 1, F] bfloat16
    topk_ids: torch.Tensor  # [R, k] long
    topk_logprobs: torch.Tensor  # [R, k] float32

    @property
    def response_length(self) -> int:
        return self.tokens.shape[0] - self.prompt_length


def load_sequences(directory: Path) -> list[Sequence]:
    paths = shard_paths(directory)
    if not paths:
        raise CausalDraftError(f"no generated feature data in {directory}")
    sequences = []
    for path in paths:
        shard = read_shard(path)
        lengths, prompts = shard["lengths"].tolist(), shard["prompt_lengths"].tolist()
        tokens = shard["tokens"].long().split(lengths)
        features = shard["features"].split([length - 1 for length in lengths])
        responses = [length - prompt for length, prompt in zip(lengths, prompts, strict=True)]
        ids = shard["topk_ids"].long().split(responses)
        logprobs = shard["topk_logprobs"].float().split(responses)
        for index in range(len(lengths)):
            sequences.append(Sequence(tokens[index], prompts[index], features[index], ids[index], logprobs[index]))
    return sequences


def split_sequences(sequences: list[Sequence], eval_every: int) -> tuple[list[Sequence], list[Sequence]]:
    """Every ``eval_every``-th sequence is held out."""
    held = [seq for index, seq in enumerate(sequences) if index % eval_every == eval_every - 1]
    kept = [seq for index, seq in enumerate(sequences) if index % eval_every != eval_every - 1]
    return kept, held


def token_counts(sequences: list[Sequence], vocab_size: int) -> torch.Tensor:
    """[vocab] how often each target id occurs in the responses: emitted tokens count 1, top-k candidates
    their probability."""
    counts = torch.zeros(vocab_size)
    for seq in sequences:
        counts += torch.bincount(seq.tokens[seq.prompt_length :], minlength=vocab_size).float()
        counts += torch.bincount(seq.topk_ids.flatten(), weights=seq.topk_logprobs.exp().flatten(),
                                 minlength=vocab_size)  # fmt: skip
    return counts


def draft_vocabulary(sequences: list[Sequence], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` target ids most frequent in the responses (``token_counts``), sorted ascending (draft id
    order = target id order)."""
    return torch.topk(token_counts(sequences, vocab_size), min(size, vocab_size)).indices.sort().values


def grown_vocabulary(vocab_ids: torch.Tensor, sequences: list[Sequence], vocab_size: int, size: int) -> torch.Tensor:
    """The target ids to add to a draft vocabulary ``vocab_ids`` [V'] to grow it to ``size``: the most frequent
    ones (``token_counts``) it lacks, sorted ascending. Example: counts [5, 0, 9, 2], vocab_ids [2], size 3
    give [0, 3]."""
    counts = token_counts(sequences, vocab_size)
    counts[vocab_ids] = -1.0  # below every count
    extra = max(0, min(size, vocab_size) - vocab_ids.numel())
    return torch.topk(counts, extra).indices.sort().values


@dataclass(frozen=True)
class Batch:
    features: torch.Tensor  # [B, N, F] float32
    tokens: torch.Tensor  # [B, N + steps] long: tokens[b, p + j] is step j's input token at row p
    positions: torch.Tensor  # [B, N] long
    target_ids: torch.Tensor  # [B, N, steps, k] draft ids (0 where outside the draft vocabulary)
    target_probs: torch.Tensor  # [B, N, steps, k] (0 outside V' or where invalid)
    greedy: torch.Tensor  # [B, N, steps] target argmax (full-vocabulary id)
    valid: torch.Tensor  # [B, N, steps] bool
    topk_ids: torch.Tensor  # [B, N, steps, k] the target's top-k (full-vocabulary ids)
    topk_logprobs: torch.Tensor  # [B, N, steps, k] their log-probs (of the full distribution)


def make_batch(sequences: list[Sequence], steps: int, context: int, to_draft: torch.Tensor) -> Batch:
    """Crop each sequence to rows s .. L-2 (s = max(0, P-1-context)) and pad to one length."""
    crops = [max(0, seq.prompt_length - 1 - context) for seq in sequences]
    rows = [seq.tokens.shape[0] - 1 - start for seq, start in zip(sequences, crops, strict=True)]
    batch, width = len(sequences), max(rows)
    top_k = sequences[0].topk_ids.shape[1]
    features = torch.zeros(batch, width, sequences[0].features.shape[1])
    tokens = torch.zeros(batch, width + steps, dtype=torch.long)
    positions = torch.zeros(batch, width, dtype=torch.long)
    target_ids = torch.zeros(batch, width, steps, top_k, dtype=torch.long)
    target_probs = torch.zeros(batch, width, steps, top_k)
    greedy = torch.zeros(batch, width, steps, dtype=torch.long)
    valid = torch.zeros(batch, width, steps, dtype=torch.bool)
    topk_ids = torch.zeros(batch, width, steps, top_k, dtype=torch.long)
    topk_logprobs = torch.zeros(batch, width, steps, top_k)
    for b, (seq, start, count) in enumerate(zip(sequences, crops, rows, strict=True)):
        length = seq.tokens.shape[0]
        features[b, :count] = seq.features[start:].float()
        tokens[b, : length - start - 1] = seq.tokens[start + 1 :]
        positions[b, :count] = torch.arange(start, length - 1)
        probs = torch.softmax(seq.topk_logprobs, dim=-1)  # [R, k]
        draft_ids = to_draft[seq.topk_ids]  # [R, k]
        for step in range(steps):
            # row p (local r = p - start) at step j learns the distribution at position p + 1 + j,
            # which is response index p + 1 + j - (P - 1)
            first = max(0, seq.prompt_length - 2 - step - start)
            last = min(count, length - 2 - step - start)  # exclusive: index R - 1 at most
            if last <= first:
                continue
            index = torch.arange(first, last) + start + 2 + step - seq.prompt_length
            target_ids[b, first:last, step] = draft_ids[index].clamp(min=0)
            target_probs[b, first:last, step] = probs[index] * (draft_ids[index] >= 0)
            greedy[b, first:last, step] = seq.topk_ids[index, 0]
            valid[b, first:last, step] = True
            topk_ids[b, first:last, step] = seq.topk_ids[index]
            topk_logprobs[b, first:last, step] = seq.topk_logprobs[index]
    return Batch(features, tokens, positions, target_ids, target_probs, greedy, valid, topk_ids, topk_logprobs)


def ttt_outputs(layer: Eagle3Layer, embed: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Unrolled drafting over a batch: per step, the layer outputs [B, N, h] (module docstring).
    ``embed`` [vocab, h] is the target's frozen token embedding."""
    c = layer.config
    size, width = batch.positions.shape
    group = c.num_heads // c.kv_heads
    scale = c.head_dim**-0.5
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [N, N]
    hidden = layer.fc(batch.features)  # [B, N, h]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs = []
    for step in range(steps):
        embeds = embed[batch.tokens[:, step : step + width]]  # [B, N, h]
        q, k, v = layer.project(embeds, hidden)
        cos, sin = layer.rope(batch.positions + step)  # [B, N, hd]
        cos, sin = cos[:, None], sin[:, None]
        q = apply_rope(q.view(size, width, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)  # [B, nh, N, hd]
        k = apply_rope(k.view(size, width, c.kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(size, width, c.kv_heads, c.head_dim).transpose(1, 2)  # [B, kvh, N, hd]
        keys.append(k.repeat_interleave(group, dim=1))  # [B, nh, N, hd]
        values.append(v.repeat_interleave(group, dim=1))
        prefix = torch.matmul(q, keys[0].transpose(-1, -2)).float() * scale  # [B, nh, N, N]
        prefix = prefix.masked_fill(~causal, float("-inf"))
        own = [(q * key).sum(-1, keepdim=True).float() * scale for key in keys[1:]]  # [B, nh, N, 1] each
        weights = torch.softmax(torch.cat([prefix, *own], dim=-1), dim=-1)  # [B, nh, N, N + step]
        attended = torch.matmul(weights[..., :width].to(values[0].dtype), values[0])  # [B, nh, N, hd]
        for index, value in enumerate(values[1:]):
            attended = attended + weights[..., width + index : width + index + 1].to(value.dtype) * value
        out = layer.finish(hidden, attended.transpose(1, 2).reshape(size, width, c.num_heads * c.head_dim))
        outputs.append(out)
        hidden = out
    return outputs


def ttt_loss(
    layer: Eagle3Layer, embed: torch.Tensor, batch: Batch, config: Eagle3TrainConfig
) -> tuple[torch.Tensor, list[float]]:
    """Weighted mean over steps of the soft cross-entropy against the target's top-k."""
    total = torch.zeros(())
    weights = 0.0
    per_step = []
    for step, out in enumerate(ttt_outputs(layer, embed, batch, config.steps)):
        valid = batch.valid[:, :, step]  # [B, N]
        logprobs = torch.log_softmax(layer.logits(out[valid]).float(), dim=-1)  # [M, V']
        picked = logprobs.gather(1, batch.target_ids[:, :, step][valid])  # [M, k]
        loss = -(batch.target_probs[:, :, step][valid] * picked).sum() / valid.sum().clamp(min=1)
        total = total + config.step_decay**step * loss
        weights += config.step_decay**step
        per_step.append(float(loss.detach()))
    return total / weights, per_step


def batches(sequences: list[Sequence], config: Eagle3TrainConfig, rng: random.Random) -> list[list[int]]:
    """Sequences grouped by similar length into batches of about ``rows_per_batch`` rows."""
    order = sorted(range(len(sequences)), key=lambda i: (sequences[i].tokens.shape[0], rng.random()))
    groups: list[list[int]] = []
    current: list[int] = []
    for index in order:
        rows = sequences[index].response_length + config.context
        if current and (len(current) + 1) * max(rows, 1) > config.rows_per_batch:
            groups.append(current)
            current = []
        current.append(index)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    return groups


def learning_rate(config: Eagle3TrainConfig, step: int, total: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, total - config.warmup)
    return config.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_layer(
    layer: Eagle3Layer,
    sequences: list[Sequence],
    embed: torch.Tensor,  # [vocab, hidden] frozen
    config: Eagle3TrainConfig,
    checkpoint: Path | None = None,
) -> list[float]:
    """Train in place; resumes from ``checkpoint`` (same batch order). Returns the step losses."""
    rng = random.Random(config.seed)
    epochs = math.ceil(config.epochs)
    plan = [group for _ in range(epochs) for group in batches(sequences, config, rng)]
    plan = plan[: max(1, round(len(plan) * config.epochs / epochs))]
    to_draft = draft_index(layer.vocab_ids, embed.shape[0])
    trainable = [param for param in layer.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    history: list[float] = []
    start = 0
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        layer.load_state_dict(saved["layer"])
        optimizer.load_state_dict(saved["optimizer"])
        start, history = saved["step"], saved["history"]
    layer.train()
    progress = tqdm(range(start, len(plan)), initial=start, total=len(plan), desc="train eagle3")
    began = time.perf_counter()
    for step in progress:
        batch = make_batch([sequences[i] for i in plan[step]], config.steps, config.context, to_draft)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, len(plan))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast):
            loss, per_step = ttt_loss(layer, embed, batch, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        history.append(float(loss.detach()))
        progress.set_postfix(loss=round(history[-1], 3), first=round(per_step[0], 3), last=round(per_step[-1], 3))
        done = step + 1
        if checkpoint is not None and (done % config.checkpoint_every == 0 or done == len(plan)):
            state = {"layer": layer.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                     "history": history, "seconds": time.perf_counter() - began}  # fmt: skip
            torch.save(state, checkpoint.with_suffix(".tmp"))
            checkpoint.with_suffix(".tmp").rename(checkpoint)
    layer.eval()
    return history


def evaluate_layer(
    layer: Eagle3Layer, sequences: list[Sequence], embed: torch.Tensor, steps: int, context: int, chunk: int = 8
) -> Evaluation:
    """Held-out accuracy per draft depth, counted at the rows where every depth has a target.
    Rows are the response rows p >= P-1 (the root after the prompt and after each response token)."""
    to_draft = draft_index(layer.vocab_ids, embed.shape[0])
    hits1, hits5, tries = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    run_total, rows_total = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(sequences), chunk):
            batch = make_batch(sequences[start : start + chunk], steps, context, to_draft)
            first = batch.valid[:, :, 0]  # [B, N] rows with a depth-1 target
            alive = first.clone()
            run = torch.zeros_like(first, dtype=torch.float32)
            for step, out in enumerate(ttt_outputs(layer, embed, batch, steps)):
                counted = alive & batch.valid[:, :, step]  # [B, N]
                top5 = torch.full((*counted.shape, 5), -1, dtype=torch.long)  # [B, N, 5]
                top5[counted] = layer.vocab_ids[torch.topk(layer.logits(out[counted]).float(), 5, dim=-1).indices]
                target = batch.greedy[:, :, step]
                right1 = top5[..., 0] == target
                tries[step] += counted.sum()
                hits1[step] += (counted & right1).sum()
                hits5[step] += (counted & (top5 == target[..., None]).any(-1)).sum()
                alive = counted & right1
                run += alive.float()
            run_total += float(run[first].sum())
            rows_total += int(first.sum())
    return Evaluation(
        tuple((hits1 / tries.clamp(min=1)).tolist()),
        tuple((hits5 / tries.clamp(min=1)).tolist()),
        1.0 + run_total / max(1, rows_total),
        rows_total,
    )
