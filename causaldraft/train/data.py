"""Self-distillation data: the target answers training prompts with its own chat template.

Prompts come from ShareGPT files (JSON arrays; first human turn), JSONL files with a ``question``
(GSM8K) or ``turns`` (MT-bench / Spec-Bench) field, or plain text files (one prompt per line).
Generation is batched greedy decoding with transformers (left padding); each response is cut at
its first EOS (the pad token of SmolLM2 is the end-of-turn token, so padding and EOS coincide).
Shards of a few batches are written to ``<work>/gen/shard_XXXXX.pt``; a rerun resumes after the
last shard and stops once ``tokens`` response tokens exist. A data folder's ``meta.json`` says what
its sequences depend on (``check_meta``), so a rerun never resumes from another model's or other
prompts' data.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from causaldraft.errors import CausalDraftError


@dataclass(frozen=True)
class GenerationConfig:
    tokens: int = 80_000  # stop after this many response tokens
    max_new_tokens: int = 160
    max_prompt_tokens: int = 256  # longer prompts are skipped
    batch_size: int = 32
    batches_per_shard: int = 1
    seed: int = 0
    threads: int = 1  # torch threads; one avoids OpenMP spin-wait collapse on a shared CPU

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.max_new_tokens < 1 or self.batch_size < 1 or self.batches_per_shard < 1:
            raise CausalDraftError("generation sizes must be >= 1")


@dataclass(frozen=True)
class Sequences:
    """Prompt and response token ids of the generated data, one entry per prompt."""

    prompts: list[list[int]]
    responses: list[list[int]]

    @property
    def response_tokens(self) -> int:
        return sum(len(response) for response in self.responses)


def read_prompts(path: Path) -> list[str]:
    """The user prompts of one file (see the module docstring for the formats)."""
    if not path.is_file():
        raise CausalDraftError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    prompts: list[str] = []
    try:
        if path.suffix == ".json":
            for record in json.loads(text):
                turns = [turn["value"] for turn in record.get("conversations", []) if turn.get("from") == "human"]
                if turns:
                    prompts.append(turns[0])
        elif path.suffix == ".jsonl":
            for line in text.splitlines():
                if line.strip():
                    record = json.loads(line)
                    prompts.append(record["question"] if "question" in record else record["turns"][0])
        else:
            prompts = [line for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise CausalDraftError(f"cannot read prompts from {path}: {error}") from error
    return [prompt.strip() for prompt in prompts if prompt.strip()]


def mix_prompts(files: Sequence[Path], seed: int) -> list[str]:
    """Shuffle each file's prompts, then interleave the files round-robin (a balanced mix)."""
    rng = random.Random(seed)
    pools = []
    for path in files:
        prompts = read_prompts(path)
        rng.shuffle(prompts)
        pools.append(prompts)
    mixed: list[str] = []
    for index in range(max((len(pool) for pool in pools), default=0)):
        mixed.extend(pool[index] for pool in pools if index < len(pool))
    if not mixed:
        raise CausalDraftError("no prompts found in the prompt files")
    return mixed


META_FILE = "meta.json"


def check_meta(directory: Path, meta: dict[str, object], added: tuple[str, ...] = ()) -> None:
    """A data folder holds data made with ``meta`` (model fingerprint, prompts, settings), or none yet:
    another model's or other prompts' data is refused, never resumed. ``added``: keys a folder made before
    they were recorded lacks; such a folder whose other keys agree is taken, and its record completed. A
    folder with shards but no record at all (made before records) is taken the same way."""
    path = directory / META_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise CausalDraftError(
                f"{path} is unreadable ({error}); delete {directory} to make its data again"
            ) from error
        older = {key: value for key, value in meta.items() if key not in added or key in saved}
        if saved != meta and saved != older:
            changed = sorted(key for key in {*saved, *meta} if saved.get(key) != meta.get(key))
            raise CausalDraftError(
                f"{directory} holds data made differently ({', '.join(changed)}: {[saved.get(k) for k in changed]} "
                f"vs {[meta.get(k) for k in changed]}); use another --work, or delete it"
            )
        if saved == meta:
            return
    directory.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(meta, indent=2) + "\n")
    path.with_suffix(".tmp").rename(path)


def read_meta(directory: Path) -> dict[str, object] | None:
    """A data folder's record (``check_meta``), None without one."""
    path = directory / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short digest of the encoded training prompts, in order (files, order seed, tokenizer and
    length limit all show in it)."""
    return hashlib.sha256(json.dumps([list(prompt) for prompt in prompts]).encode()).hexdigest()[:16]


def order_suffix(seed: int) -> str:
    """The name suffix of a prompt order's data folders: none for order 0 (the original names), so
    work caches made before orders existed still resume, ``-seedN`` otherwise."""
    return "" if seed == 0 else f"-seed{seed}"


def encode_prompts(tokenizer, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Chat-template each prompt (as the engine does with ``chat``); drop those longer than ``max_tokens``.
    A tokenizer without a chat template (a base model) reads each prompt as plain text, as the engine reads
    a prompt without ``chat``: the drafter learns the continuations that model is asked for."""
    templated = bool(tokenizer.chat_template)
    if not templated:
        print("causaldraft: this model's tokenizer has no chat template: the prompts are read as plain text",
              file=sys.stderr)  # fmt: skip
    encoded = []
    for prompt in prompts:
        text = prompt
        if templated:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) <= max_tokens:
            encoded.append(ids)
    return encoded


def cut_at_eos(response: Sequence[int], eos_id: int) -> list[int]:
    """Keep the response through its first EOS (inclusive): everything after it is padding."""
    ids = list(response)
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


def generate_batch(model, batch: list[list[int]], pad_id: int, eos_id: int, max_new_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Greedy responses of one left-padded batch."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [b, width]
    attention = torch.zeros(len(batch), width, dtype=torch.long)  # [b, width]
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )  # [b, width + new]
    return [cut_at_eos(row[width:].tolist(), eos_id) for row in out]


def shard_paths(gen_dir: Path) -> list[Path]:
    return sorted(gen_dir.glob("shard_*.pt"))


def load_sequences(gen_dir: Path) -> Sequences:
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    for path in shard_paths(gen_dir):
        try:
            shard = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError) as error:
            raise CausalDraftError(f"corrupt generation shard {path}: {error}; delete it to regenerate") from error
        prompts.extend(shard["prompts"])
        responses.extend(shard["responses"])
    return Sequences(prompts, responses)


def generate_data(
    model_dir: Path, prompt_files: Sequence[Path], gen_dir: Path, config: GenerationConfig, fingerprint: str
) -> Sequences:
    """Generate (or resume generating) self-distillation data until ``config.tokens`` tokens exist.
    ``fingerprint``: the model's (``heads.base_fingerprint``), recorded with the prompts and response length."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = encode_prompts(tokenizer, mix_prompts(prompt_files, config.seed), config.max_prompt_tokens)
    meta = {"fingerprint": fingerprint, "prompts": prompts_digest(prompts), "max_new_tokens": config.max_new_tokens}
    check_meta(gen_dir, meta)
    done = load_sequences(gen_dir)
    if done.response_tokens >= config.tokens:
        return done
    torch.set_num_threads(config.threads)
    eos_id = int(tokenizer.eos_token_id)
    pad_id = int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else eos_id
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    model.eval()
    per_shard = config.batch_size * config.batches_per_shard
    total = done.response_tokens
    shard_index = len(shard_paths(gen_dir))
    start = len(done.prompts)
    progress = tqdm(total=config.tokens, initial=total, unit="tok", desc="generate")
    while total < config.tokens and start < len(prompts):
        chunk = sorted(prompts[start : start + per_shard], key=len)  # similar lengths share a batch
        responses: list[list[int]] = []
        began = time.perf_counter()
        for offset in range(0, len(chunk), config.batch_size):
            batch = chunk[offset : offset + config.batch_size]
            responses.extend(generate_batch(model, batch, pad_id, eos_id, config.max_new_tokens))
        count = sum(len(response) for response in responses)
        path = gen_dir / f"shard_{shard_index:05d}.pt"
        torch.save({"prompts": chunk, "responses": responses}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        total += count
        progress.update(count)
        progress.set_postfix(tok_s=round(count / (time.perf_counter() - began), 1))
        shard_index += 1
        start += len(chunk)
    progress.close()
    return load_sequences(gen_dir)
