"""Self-distillation data: the training prompts, encoded with the target's own chat template, and the
records of the folders the data is generated into (``feature_data.generate_features`` generates it).

Prompts come from ShareGPT files (JSON arrays; first human turn), JSONL files with a ``question``
(GSM8K) or ``turns`` (MT-bench / Spec-Bench) field, or plain text files (one prompt per line).
A data folder's ``meta.json`` says what its sequences depend on (``check_meta``), so a rerun never
resumes from another model's or other prompts' data.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from causaldraft.errors import CausalDraftError


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
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    prompts.append(jsonl_prompt(json.loads(line), path, number))
        else:
            prompts = [line for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise CausalDraftError(f"cannot read prompts from {path}: {error}") from error
    return [prompt.strip() for prompt in prompts if prompt.strip()]


def jsonl_prompt(record: object, path: Path, number: int) -> str:
    """A .jsonl line's prompt: its ``question``, or the first of its ``turns`` (MT-bench's layout)."""
    if isinstance(record, dict):
        if isinstance(record.get("question"), str):
            return record["question"]
        turns = record.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
    raise CausalDraftError(f"cannot read prompts from {path}: line {number} is not an object with a \"question\" "
                           f"(text) or \"turns\" (a list of texts): {str(record)[:80]}")  # fmt: skip


def check_enough_prompts(files: Sequence[Path], eval_every: int) -> None:
    """Training holds out every ``eval_every``-th answer for its evaluation, and answers each prompt once: fewer
    prompts than that would leave nothing to evaluate on (found by an audit: it failed after generating)."""
    count = sum(len(read_prompts(path)) for path in files)
    if count < eval_every:
        raise CausalDraftError(f"{count} prompts in the prompt files: training answers each prompt once and "
                               f"holds out every {eval_every}th answer for evaluation, so it needs at least "
                               f"{eval_every}")  # fmt: skip


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


def shard_paths(gen_dir: Path) -> list[Path]:
    return sorted(gen_dir.glob("shard_*.pt"))
