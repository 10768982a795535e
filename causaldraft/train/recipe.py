"""The whole train-heads recipe: generate (with hidden states) -> train -> evaluate -> save.

The target answers the prompts greedily with the batched generator of the eagle3 recipe and build-store
(``feature_data.generate_features``: 48 sequences at a time on the native backend, resumable), into
``heads-data``, keeping each position's final hidden state and top-k as it goes (``features``).
Generated data and features live in a work directory, so markov and medusa heads trained with the
same ``work`` share exactly the same data; each data folder records the model, prompts and settings
it was made with, and another model's or other prompts' data is refused (``data.check_meta``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from causaldraft.drafters.heads import HEAD_KINDS, HeadsConfig, new_heads, save_heads
from causaldraft.errors import CausalDraftError
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import load_model
from causaldraft.models.native import NativeLlama
from causaldraft.paths import causaldraft_home
from causaldraft.threads import on_threads
from causaldraft.train.data import check_enough_prompts, order_suffix
from causaldraft.train.evaluate import evaluate
from causaldraft.train.feature_data import FeatureGenConfig, generate_features
from causaldraft.train.features import answer_features, draft_vocabulary, split_features
from causaldraft.train.trainer import TrainConfig, run_digest, train

HEADS_DATA = FeatureGenConfig(tokens=80_000, max_new_tokens=160)  # the heads' data by default: small and quick


@dataclass(frozen=True)
class Recipe:
    model: str
    prompts: tuple[Path, ...]
    kind: str
    out: Path
    num_heads: int = 5
    draft_vocab: int = 8192
    work: Path | None = None
    dtype: str = "bfloat16"  # of the target that answers the prompts
    eval_every: int = 20
    generation: FeatureGenConfig = HEADS_DATA
    training: TrainConfig = field(default_factory=TrainConfig)
    command: str = ""

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise CausalDraftError(f"--heads must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if not 1 <= self.num_heads <= 16:
            raise CausalDraftError(f"--num-heads must be in [1, 16], got {self.num_heads}")
        if self.draft_vocab < 16:
            raise CausalDraftError(f"--draft-vocab must be >= 16, got {self.draft_vocab}")


def run_recipe(recipe: Recipe) -> dict[str, object]:
    """The recipe on ``recipe.generation.threads`` threads; the caller's torch thread count is restored after it
    (a test or a program that trains and then decodes keeps its own)."""
    with on_threads(recipe.generation.threads):
        return heads_recipe_phases(recipe)


def heads_recipe_phases(recipe: Recipe) -> dict[str, object]:
    timings: dict[str, float] = {}
    check_enough_prompts(recipe.prompts, recipe.eval_every)
    loaded = load_model(recipe.model, "native", recipe.dtype)
    backend = loaded.backend
    if not isinstance(backend, NativeLlama):
        raise CausalDraftError("train-heads needs the native backend")
    use_batch_products(backend)  # answers are generated 48 rows at a time
    work = recipe.work or causaldraft_home() / "train" / loaded.fingerprint
    suffix = order_suffix(recipe.generation.seed)  # each prompt order resumes in folders of its own
    data_dir = work / f"heads-data{suffix}"
    started = time.perf_counter()
    response_tokens, _ = generate_features(backend, loaded.tokenizer, recipe.prompts, data_dir, (), recipe.generation,
                                           loaded.fingerprint, keep_hidden=True,
                                           ends=loaded.end_token_ids())  # fmt: skip
    timings["generate_s"] = time.perf_counter() - started
    features = answer_features(data_dir)
    train_set, eval_set = split_features(features, recipe.eval_every)
    if not eval_set.segments:  # prompts longer than --max-prompt-tokens were left out
        raise CausalDraftError(f"{features.segments} answers: evaluation holds out every {recipe.eval_every}th, so "
                               f"at least {recipe.eval_every} are needed (more or shorter prompts)")  # fmt: skip
    vocab_size = backend.shape.vocab_size
    vocab_ids = draft_vocabulary(train_set, vocab_size, recipe.draft_vocab)
    config = HeadsConfig(recipe.kind, recipe.num_heads, backend.shape.hidden_size, vocab_size,
                         int(vocab_ids.numel()), loaded.base_fingerprint)  # fmt: skip
    heads = new_heads(config, vocab_ids, backend.lm_head_weight(), recipe.training.seed)
    with torch.inference_mode():
        embed = backend.embed(torch.arange(vocab_size)).float()  # [vocab, hidden]
    digest = run_digest((config, recipe.training), vocab_ids, train_set.tokens)
    checkpoint = work / (
        f"ckpt-{recipe.kind}-h{recipe.num_heads}-v{config.draft_vocab}-s{recipe.training.seed}"
        f"-n{recipe.training.steps}-b{recipe.training.batch_size}-d{digest}.pt"
    )
    started = time.perf_counter()
    history = train(heads, train_set, embed, recipe.training, checkpoint)
    timings["train_s"] = time.perf_counter() - started
    evaluation = evaluate(heads, eval_set, embed)
    coverage = float(torch.isin(eval_set.tokens, vocab_ids).float().mean())
    summary: dict[str, object] = {
        "command": recipe.command,
        "response_tokens": response_tokens,
        "sequences": features.segments,
        "train_rows": int(train_set.tokens.numel()),
        "eval_rows": int(eval_set.tokens.numel()),
        "steps": recipe.training.steps,
        "batch_size": recipe.training.batch_size,
        "first_loss": round(history[0], 4),
        "last_loss": round(sum(history[-20:]) / len(history[-20:]), 4),
        "eval_vocab_coverage": round(coverage, 4),
        "evaluation": evaluation.summary(),
        "seconds_this_run": {name: round(value, 1) for name, value in timings.items()},
    }
    save_heads(heads, recipe.out, {"training": summary})
    return summary
