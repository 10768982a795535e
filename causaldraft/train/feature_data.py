"""Self-distillation data with target features, generated in one batched pass.

The target answers the training prompts (its own chat template; greedily, or sampled at ``temperature``,
seeded per prompt so a resumed run draws the same tokens) in a batch of ``batch_size``
rows, each row its own sequence: when a row finishes (EOS or ``max_new_tokens``) the next prompt is
prefilled into it (a few at a time), so the batch stays full. While generating, every fed token's
auxiliary features (the inputs of the ``aux_layers``, concatenated; the eagle3 layer's), with
``keep_hidden`` its final hidden state (the Markov and Medusa heads'), and every response token's
top-k target log-probabilities are kept: no second pass over the data.

One record per sequence of prompt length P and response length R (L = P + R tokens):
- ``tokens`` [L]: prompt + response (the response ends with EOS unless cut at max_new_tokens);
- ``features`` [L - 1, len(aux_layers) * hidden]: features of positions 0 .. L-2 (every token the
  target was fed; the last response token never is);
- ``topk_ids`` / ``topk_logprobs`` [R, k]: the target's distribution at positions P-1 .. L-2, the
  one each response token was chosen from;
- ``hidden`` [R, hidden] bfloat16 with ``keep_hidden`` (else [R, 0]): the final (normed) hidden states
  at the same positions, what the LM head read there (the prompt's other positions are not kept).
Example: prompt [a, b], response [c, EOS] -> tokens [a, b, c, EOS], features of a, b, c, top-k at
b (for c) and at c (for EOS).

Shards ``shard_XXXXX.pt`` hold whole sequences and the prompt indices they answered; a rerun skips
those prompts and stops once ``tokens`` response tokens exist (resumable after a kill).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from causaldraft.errors import CausalDraftError
from causaldraft.models.batched import BatchCache, batched_forward
from causaldraft.models.native import NativeLlama
from causaldraft.sampling import mix_seed
from causaldraft.threads import on_threads
from causaldraft.train.data import check_meta, encode_prompts, mix_prompts, prompts_digest, shard_paths


@dataclass(frozen=True)
class FeatureGenConfig:
    tokens: int = 500_000  # stop after this many response tokens
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256  # longer prompts are skipped
    batch_size: int = 48
    refill: int = 6  # prefill new prompts once this many rows are free (or every row, in a smaller batch)
    top_k: int = 16
    sequences_per_shard: int = 96
    seed: int = 0
    threads: int = 2
    temperature: float = 0.0  # 0: greedy responses; > 0: sampled (other contexts than greedy decoding's)

    def __post_init__(self) -> None:
        sizes = (self.tokens, self.max_new_tokens, self.max_prompt_tokens, self.batch_size, self.top_k)
        if min(sizes) < 1 or self.refill < 1 or self.sequences_per_shard < 1:
            raise CausalDraftError("feature generation sizes must be >= 1")
        if not 0.0 <= self.temperature <= 10.0:
            raise CausalDraftError(f"the data temperature must be in [0, 10], got {self.temperature}")

    def choose(self, logprobs: torch.Tensor, keys: list[tuple[int, int]]) -> list[int]:
        """Response tokens from the target's log-probs [m, vocab], one per (prompt index, position):
        the argmax, or a sample at ``temperature`` (the inverse of the distribution's CDF at a uniform
        keyed by the data seed, the prompt and the position: the same tokens whenever it runs)."""
        if self.temperature == 0.0:
            return logprobs.argmax(-1).tolist()
        # the unnormalised CDF, in place in one float64 buffer (a fresh 19 MB buffer per op cost
        # more than the arithmetic at 48 rows)
        cdf = logprobs.double()  # [m, vocab]
        cdf.sub_(cdf.amax(-1, keepdim=True)).div_(self.temperature).exp_()
        torch.cumsum(cdf, dim=-1, out=cdf)
        uniforms = [random.Random(mix_seed(mix_seed(self.seed, index), position)).random() for index, position in keys]
        points = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]  # [m, 1]
        ids = torch.searchsorted(cdf, points, right=True)[:, 0].clamp(max=cdf.shape[1] - 1)
        return ids.tolist()


@dataclass
class Row:
    """One batch row's sequence in progress."""

    prompt_index: int
    tokens: list[int]
    prompt_length: int
    features: list[torch.Tensor] = field(default_factory=list)  # [m, F] chunks
    hidden: list[torch.Tensor] = field(default_factory=list)  # [1, hidden] bf16 per response token ([1, 0]: not kept)
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # [k] per response token
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length


@dataclass
class ShardWriter:
    directory: Path
    per_shard: int
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, row: Row) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        index = len(shard_paths(self.directory))
        record = {
            "prompt_index": torch.tensor([row.prompt_index for row in self.rows]),
            "lengths": torch.tensor([len(row.tokens) for row in self.rows]),
            "prompt_lengths": torch.tensor([row.prompt_length for row in self.rows]),
            "tokens": torch.tensor([token for row in self.rows for token in row.tokens], dtype=torch.int32),
            "features": torch.cat([chunk for row in self.rows for chunk in row.features]),
            "hidden": torch.cat([chunk for row in self.rows for chunk in row.hidden]),
            "topk_ids": torch.stack([ids for row in self.rows for ids in row.topk_ids]).to(torch.int32),
            "topk_logprobs": torch.stack([lp for row in self.rows for lp in row.topk_logprobs]).half(),
            "seconds": torch.tensor(self.seconds),
        }
        path = self.directory / f"shard_{index:05d}.pt"
        torch.save(record, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        self.rows, self.seconds = [], 0.0


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """One shard's record (``ShardWriter.flush``); a corrupt one is refused with what to do about it."""
    try:
        return torch.load(path, weights_only=True)  # type: ignore[no-any-return]
    except (OSError, RuntimeError, EOFError) as error:
        raise CausalDraftError(f"corrupt feature shard {path}: {error}; delete it to regenerate") from error


def shard_answers(path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) token ids of each sequence in one shard, in order."""
    shard = read_shard(path)
    lengths, prompt_lengths = shard["lengths"].tolist(), shard["prompt_lengths"].tolist()
    sequences = [tokens.tolist() for tokens in shard["tokens"].split(lengths)]
    return [(tokens[:prompt], tokens[prompt:]) for tokens, prompt in zip(sequences, prompt_lengths, strict=True)]


def done_prompts(directory: Path) -> tuple[set[int], int, float]:
    """Prompt indices already answered, their response tokens, and the seconds spent on them."""
    done: set[int] = set()
    tokens, seconds = 0, 0.0
    for path in shard_paths(directory):
        shard = read_shard(path)
        done.update(shard["prompt_index"].tolist())
        tokens += int((shard["lengths"] - shard["prompt_lengths"]).sum())
        seconds += float(shard["seconds"])
    return done, tokens, seconds


def top_candidates(
    model: NativeLlama, hidden: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [m, h] -> top-k ids and log-probs [m, k] of the target's next-token distribution, and
    the whole distribution's log-probs [m, vocab]."""
    logprobs = torch.log_softmax(model.lm_head(hidden), dim=-1, dtype=torch.float32)  # [m, vocab]
    top = torch.topk(logprobs, top_k, dim=-1)
    return top.indices, top.values, logprobs


def data_meta(
    fingerprint: str, aux_layers: tuple[int, ...], config: FeatureGenConfig, prompts: str, keep_hidden: bool = False
) -> dict[str, object]:
    """What a data folder's sequences depend on (the temperature only when sampled and ``hidden`` only when
    kept, so folders made before either existed still resume). ``prompts``: ``prompts_digest`` of the encoded
    prompts."""
    meta: dict[str, object] = {"fingerprint": fingerprint, "aux_layers": list(aux_layers), "top_k": config.top_k,
                               "max_new_tokens": config.max_new_tokens, "seed": config.seed}  # fmt: skip
    meta["prompts"] = prompts
    if config.temperature > 0:
        meta["temperature"] = config.temperature
    if keep_hidden:
        meta["hidden"] = True
    return meta


def generate_features(
    model: NativeLlama,
    tokenizer,  # type: ignore[no-untyped-def]
    prompt_files: Sequence[Path],
    directory: Path,
    aux_layers: tuple[int, ...],
    config: FeatureGenConfig,
    fingerprint: str,
    keep_hidden: bool = False,
    ends: frozenset[int] | None = None,
) -> tuple[int, float]:
    """Generate (or resume) until ``config.tokens`` response tokens exist; returns (tokens, seconds).
    ``keep_hidden``: also keep every fed token's final hidden state (the heads' input). ``ends``: the tokens that
    end an answer (``LoadedModel.end_token_ids``; None: the tokenizer's EOS alone)."""
    prompts = encode_prompts(tokenizer, mix_prompts(prompt_files, config.seed), config.max_prompt_tokens)
    meta = data_meta(fingerprint, aux_layers, config, prompts_digest(prompts), keep_hidden)
    check_meta(directory, meta, added=("prompts",))
    done, total, seconds = done_prompts(directory)
    if total >= config.tokens:
        return total, seconds
    queue = [index for index in range(len(prompts)) if index not in done]
    ends = frozenset({int(tokenizer.eos_token_id)}) if ends is None else ends
    batch = config.batch_size
    cache = BatchCache.empty(model, batch, config.max_prompt_tokens + config.max_new_tokens + 1)
    rows: list[Row | None] = [None] * batch
    writer = ShardWriter(directory, config.sequences_per_shard)
    progress = tqdm(total=config.tokens, initial=total, unit="tok", desc="generate + features")
    with torch.inference_mode(), on_threads(config.threads):  # the caller's count restored afterwards
        while total < config.tokens:
            free = [slot for slot, row in enumerate(rows) if row is None]
            if queue and len(free) >= min(config.refill, batch):  # found by an audit: batches under 6 were refused
                began = time.perf_counter()
                taken, queue = queue[: len(free)], queue[len(free) :]
                prefill_rows(model, cache, rows, free[: len(taken)], taken, prompts, config, aux_layers, keep_hidden)
                writer.seconds += time.perf_counter() - began
            if all(row is None for row in rows):
                break
            began = time.perf_counter()
            finished = decode_step(model, cache, rows, config, aux_layers, ends, keep_hidden)
            writer.seconds += time.perf_counter() - began
            for row in finished:
                writer.add(row)
                total += row.response_length
                progress.update(row.response_length)
    writer.flush()
    progress.close()
    if total < config.tokens:  # found by an audit: only the progress bar told
        print(f"causaldraft: the prompts ran out at {total} response tokens of the {config.tokens} asked (each prompt "
              "is answered once): more prompts, or a larger --max-new-tokens, give more", file=sys.stderr)  # fmt: skip
    return done_prompts(directory)[1:]


def prefill_rows(
    model: NativeLlama,
    cache: BatchCache,
    rows: list[Row | None],
    slots: list[int],
    prompt_indices: list[int],
    prompts: list[list[int]],
    config: FeatureGenConfig,
    aux_layers: tuple[int, ...],
    keep_hidden: bool,
) -> None:
    """Prefill prompts (right-padded together) into free batch rows; pick each first response token."""
    width = max(len(prompts[index]) for index in prompt_indices)
    tokens = torch.zeros(len(prompt_indices), width, dtype=torch.long)  # [r, width]
    for row, index in enumerate(prompt_indices):
        tokens[row, : len(prompts[index])] = torch.tensor(prompts[index])
    small = BatchCache.empty(model, len(prompt_indices), width)
    positions = torch.arange(width)[None].expand(len(prompt_indices), width)
    hidden, features = batched_forward(model, tokens, positions, small, aux_layers)  # [r, width, h]
    features = hidden[..., :0] if features is None else features  # no aux layers: [r, width, 0]
    cache.copy_rows(small, torch.tensor(slots), width)
    lengths = torch.tensor([len(prompts[index]) for index in prompt_indices])
    last = hidden[torch.arange(len(prompt_indices)), lengths - 1]  # [r, h]
    kept = last.to(torch.bfloat16) if keep_hidden else last[:, :0]  # [r, hidden or 0]
    ids, logprobs, full = top_candidates(model, last, config.top_k)
    chosen = config.choose(full, [(index, len(prompts[index])) for index in prompt_indices])
    for row, (slot, index) in enumerate(zip(slots, prompt_indices, strict=True)):
        length = len(prompts[index])
        state = Row(index, [*prompts[index], chosen[row]], length)
        state.features.append(features[row, :length].clone())
        state.hidden.append(kept[row : row + 1].clone())
        state.topk_ids.append(ids[row].clone())
        state.topk_logprobs.append(logprobs[row].clone())
        rows[slot] = state


def decode_step(
    model: NativeLlama,
    cache: BatchCache,
    rows: list[Row | None],
    config: FeatureGenConfig,
    aux_layers: tuple[int, ...],
    ends: frozenset[int],
    keep_hidden: bool,
) -> list[Row]:
    """Feed every row's newest token; rows that end (an end token, max_new_tokens) are returned and freed.
    Free rows compute a throwaway token at slot 0 (refilled before they are read)."""
    finished: list[Row] = []
    for slot, row in enumerate(rows):  # a row whose first token already ends it is not fed
        if row is not None and (row.tokens[-1] in ends or row.response_length >= config.max_new_tokens):
            finished.append(row)
            rows[slot] = None
    live = [(slot, row) for slot, row in enumerate(rows) if row is not None]
    if not live:
        return finished
    tokens = torch.zeros(len(rows), 1, dtype=torch.long)
    positions = torch.zeros(len(rows), 1, dtype=torch.long)
    for slot, row in live:
        tokens[slot, 0] = row.tokens[-1]
        positions[slot, 0] = len(row.tokens) - 1
    hidden, features = batched_forward(model, tokens, positions, cache, aux_layers)
    features = hidden[..., :0] if features is None else features  # no aux layers: [B, 1, 0]
    kept = hidden.to(torch.bfloat16) if keep_hidden else hidden[..., :0]  # [B, 1, hidden or 0]
    ids, logprobs, full = top_candidates(model, hidden[:, 0], config.top_k)
    slots = [slot for slot, _ in live]
    live_logprobs = full if len(slots) == len(rows) else full[slots]
    chosen = config.choose(live_logprobs, [(row.prompt_index, len(row.tokens)) for _, row in live])
    for (slot, row), token in zip(live, chosen, strict=True):
        row.features.append(features[slot, :1].clone())
        row.hidden.append(kept[slot, :1].clone())
        row.topk_ids.append(ids[slot].clone())
        row.topk_logprobs.append(logprobs[slot].clone())
        row.tokens.append(token)
        if row.tokens[-1] in ends or row.response_length >= config.max_new_tokens:
            finished.append(row)
            rows[slot] = None
    return finished
