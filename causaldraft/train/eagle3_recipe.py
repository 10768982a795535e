"""``train-heads --heads eagle3``: generate (with features) -> train with TTT -> evaluate -> calibrate -> save.

The work directory holds the generated sequences and features (``eagle3-data``, resumable shard by
shard) and the training checkpoint (resumable every ``checkpoint_every`` steps), so a killed run
picks up where it stopped. Timings are reported per phase, including the generation time spent by
earlier runs on the same data.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from causaldraft.drafters.eagle3_model import (
    WEIGHTS_FILE,
    Eagle3Config,
    check_rope_type,
    load_layer,
    new_layer,
    read_config,
    save_layer,
    widen_vocabulary,
)
from causaldraft.errors import CausalDraftError
from causaldraft.models.batched import use_batch_products
from causaldraft.models.loading import LoadedModel, load_model
from causaldraft.models.native import NativeLlama, default_aux_layers
from causaldraft.paths import causaldraft_home
from causaldraft.threads import on_threads
from causaldraft.train.calibration import calibrate_layer
from causaldraft.train.data import check_enough_prompts, order_suffix
from causaldraft.train.eagle3_train import (
    Eagle3TrainConfig,
    draft_vocabulary,
    evaluate_layer,
    grown_vocabulary,
    load_sequences,
    split_sequences,
    train_layer,
)
from causaldraft.train.feature_data import FeatureGenConfig, generate_features
from causaldraft.train.trainer import run_digest

DEFAULT_DRAFT_VOCAB = 8192


@dataclass(frozen=True)
class Eagle3Recipe:
    model: str
    prompts: tuple[Path, ...]
    out: Path
    # from scratch: the draft vocabulary's size (None: DEFAULT_DRAFT_VOCAB); from ``init``: None keeps the starting
    # layer's, a larger size grows it (``widen_vocabulary``), a smaller one is refused
    draft_vocab: int | None = None
    work: Path | None = None
    dtype: str = "bfloat16"  # of the target while generating
    eval_every: int = 20
    generation: FeatureGenConfig = field(default_factory=FeatureGenConfig)
    training: Eagle3TrainConfig = field(default_factory=Eagle3TrainConfig)
    command: str = ""
    init: Path | None = None  # a trained layer to start from (same target): more epochs or more data

    def __post_init__(self) -> None:
        if self.draft_vocab is not None and self.draft_vocab < 16:
            raise CausalDraftError(f"--draft-vocab must be >= 16, got {self.draft_vocab}")


def target_rope(model_dir: Path) -> tuple[float, dict[str, object] | None]:
    """The target's rope base and, where it scales its rope, its rope parameters: the draft layer runs the
    same rope. A rope the layer cannot take (its frequencies change with the sequence length) is refused."""
    config = AutoConfig.from_pretrained(str(model_dir))
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    check_rope_type(rope_type)
    if rope_type == "default":
        return theta, None
    return theta, {**params, "rope_type": rope_type, "rope_theta": theta}


def eagle3_config(loaded: LoadedModel, draft_vocab: int, aux_layers: tuple[int, ...] | None = None) -> Eagle3Config:
    """The draft layer's shape for a native Llama-family target: its attention and MLP sizes."""
    backend = loaded.backend
    if not isinstance(backend, NativeLlama):
        raise CausalDraftError("eagle3 training needs the native backend")
    s = backend.llama_shape
    theta, rope = target_rope(loaded.model_dir)
    return Eagle3Config(
        hidden_size=s.hidden_size, num_heads=s.num_heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
        intermediate_size=s.intermediate_size, rms_eps=s.rms_eps, vocab_size=s.vocab_size,
        draft_vocab=min(draft_vocab, s.vocab_size), aux_layers=aux_layers or default_aux_layers(s.num_layers),
        target_layers=s.num_layers, rope_theta=theta, max_positions=s.max_positions,
        fingerprint=loaded.base_fingerprint, rope_parameters=rope,
    )  # fmt: skip


def temperature_suffix(temperature: float) -> str:
    """The data folder's name part for sampled responses ('' for greedy ones)."""
    return "" if temperature == 0 else f"-t{temperature:g}"


def init_tag(init: Path | None) -> str:
    """A checkpoint-name part naming the starting layer by its weights' digest ('' from scratch)."""
    if init is None:
        return ""
    digest = hashlib.sha256((init / WEIGHTS_FILE).read_bytes()).hexdigest()[:10]
    return f"-init{digest}"


def run_eagle3_recipe(recipe: Eagle3Recipe) -> dict[str, object]:
    """The recipe on ``recipe.generation.threads`` threads; the caller's torch thread count is restored after it
    (a test or a program that trains and then decodes keeps its own)."""
    with on_threads(recipe.generation.threads):
        return eagle3_recipe_phases(recipe)


def eagle3_recipe_phases(recipe: Eagle3Recipe) -> dict[str, object]:
    timings: dict[str, float] = {}
    check_enough_prompts(recipe.prompts, recipe.eval_every)
    loaded = load_model(recipe.model, "native", recipe.dtype)
    backend = loaded.backend
    assert isinstance(backend, NativeLlama)
    target_rope(loaded.model_dir)  # a rope the layer cannot take is refused before any data is made
    use_batch_products(backend)  # the data passes run 48 rows and whole prompts at a time
    work = recipe.work or causaldraft_home() / "train" / loaded.fingerprint
    shape = backend.shape
    aux_layers = default_aux_layers(shape.num_layers)
    order = order_suffix(recipe.generation.seed) + temperature_suffix(recipe.generation.temperature)
    data_dir = work / f"eagle3-data{order}"  # one folder per prompt order and response temperature
    started = time.perf_counter()
    tokens, generation_seconds = generate_features(
        backend, loaded.tokenizer, recipe.prompts, data_dir, aux_layers, recipe.generation,
        loaded.fingerprint, ends=loaded.end_token_ids(),
    )  # fmt: skip
    timings["generate_s_this_run"] = time.perf_counter() - started
    timings["generate_s_all_runs"] = generation_seconds
    sequences = load_sequences(data_dir)
    train_set, eval_set = split_sequences(sequences, recipe.eval_every)
    if not eval_set:
        raise CausalDraftError(
            f"{len(sequences)} generated sequences: evaluation holds out every {recipe.eval_every}th, so at least "
            f"{recipe.eval_every} are needed (more prompts or a larger --tokens)"
        )
    if recipe.init is not None:
        layer = load_layer(recipe.init, loaded.base_fingerprint, shape.vocab_size, shape.hidden_size)
        layer.requires_grad_(True)
        if layer.config.aux_layers != aux_layers:
            raise CausalDraftError(
                f"--init {recipe.init}: aux layers {layer.config.aux_layers}, the data has {aux_layers}"
            )
        wanted = recipe.draft_vocab or layer.config.draft_vocab  # unset: keep the layer's
        if wanted < layer.config.draft_vocab:
            raise CausalDraftError(
                f"--draft-vocab {wanted} is smaller than the --init layer's {layer.config.draft_vocab}: "
                "a vocabulary can only grow (leave --draft-vocab out to keep it)"
            )
        if wanted > layer.config.draft_vocab:  # grow by the most frequent ids it lacks
            extra = grown_vocabulary(layer.vocab_ids, train_set, shape.vocab_size, wanted)
            layer = widen_vocabulary(layer, extra, backend.lm_head_weight()).requires_grad_(True)
        config, vocab_ids = layer.config, layer.vocab_ids
    else:
        vocab_ids = draft_vocabulary(train_set, shape.vocab_size, recipe.draft_vocab or DEFAULT_DRAFT_VOCAB)
        config = eagle3_config(loaded, int(vocab_ids.numel()), aux_layers)
        layer = new_layer(config, vocab_ids, backend.lm_head_weight(), recipe.training.seed)
    with torch.inference_mode():
        embed = backend.embed(torch.arange(shape.vocab_size)).float()  # [vocab, hidden]
    t = recipe.training
    checkpoint = work / (
        f"ckpt-eagle3-v{config.draft_vocab}-s{t.seed}-e{t.epochs}-r{t.rows_per_batch}-t{t.steps}"
        f"-c{t.context}-lr{t.lr}{init_tag(recipe.init)}{order}"
        f"-d{run_digest(t, layer.vocab_ids, torch.cat([sequence.tokens for sequence in train_set]))}.pt"
    )
    started = time.perf_counter()
    history = train_layer(layer, train_set, embed, t, checkpoint)
    timings["train_s_this_run"] = time.perf_counter() - started
    started = time.perf_counter()
    evaluation = evaluate_layer(layer, eval_set, embed, t.steps, t.context)
    timings["evaluate_s"] = time.perf_counter() - started
    started = time.perf_counter()
    calibration = calibrate_layer(layer, eval_set, embed, t.steps, t.context)
    layer.config = calibration.fitted(layer.config)
    timings["calibrate_s"] = time.perf_counter() - started
    held_tokens = torch.cat([seq.tokens[seq.prompt_length :] for seq in eval_set])
    summary: dict[str, object] = {
        "command": recipe.command,
        **(
            {}
            if recipe.init is None
            else {"init": str(recipe.init), "init_training": read_config(recipe.init)[1].get("training")}
        ),
        "response_tokens": tokens,
        "sequences": len(sequences),
        "train_sequences": len(train_set),
        "eval_sequences": len(eval_set),
        "ttt_steps": t.steps,
        "epochs": t.epochs,
        "optimizer_steps": len(history),
        "first_loss": round(history[0], 4),
        "last_loss": round(sum(history[-20:]) / len(history[-20:]), 4),
        "eval_vocab_coverage": round(float(torch.isin(held_tokens, vocab_ids).float().mean()), 4),
        "evaluation": evaluation.summary(),
        "calibration": calibration.summary(),
        "seconds": {name: round(value, 1) for name, value in timings.items()},
    }
    save_layer(layer, recipe.out, {"training": summary})
    return summary
