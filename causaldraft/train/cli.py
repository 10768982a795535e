"""``causaldraft train-heads``: flags derived from the recipe's frozen configs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from causaldraft.drafters.heads import HEAD_KINDS
from causaldraft.errors import CausalDraftError
from causaldraft.train.data import GenerationConfig
from causaldraft.train.eagle3_recipe import Eagle3Recipe, run_eagle3_recipe
from causaldraft.train.eagle3_train import Eagle3TrainConfig
from causaldraft.train.feature_data import FeatureGenConfig
from causaldraft.train.recipe import Recipe, run_recipe
from causaldraft.train.trainer import TrainConfig


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    recipe = Recipe(model="default", prompts=(), kind="markov", out=Path("."))
    generation, training, eagle = GenerationConfig(), TrainConfig(), Eagle3TrainConfig()
    parser = commands.add_parser("train-heads", help="train markov/medusa heads or an eagle3 layer (self-distillation)")
    # fmt: off
    parser.add_argument("--model", default="default",
                        help="the target: default, a checkpoint directory or .gguf (default: %(default)s)")
    parser.add_argument("--prompts", nargs="+", required=True, type=Path, help="prompt files (.json/.jsonl/.txt)")
    parser.add_argument("--heads", choices=(*HEAD_KINDS, "eagle3"), default="markov",
                        help="what to train (default: %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="directory the trained drafter is written to")
    parser.add_argument("--work", type=Path, default=None,
                        help="cache of data/features/checkpoints (default: under $CAUSALDRAFT_HOME/train)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help=f"draft vocabulary size (default {recipe.draft_vocab}; eagle3 with --init: the starting "
                        "layer's, and a larger size grows it)")
    parser.add_argument("--lr", type=float, default=training.lr,
                        help=f"learning rate (default: %(default)s; eagle3: {eagle.lr})")
    parser.add_argument("--data-temperature", type=float, default=0.0,
                        help="eagle3: answer the prompts sampled at this temperature (0: greedily), seeded by "
                        "--data-seed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=recipe.dtype,
                        help="the target's dtype in the data passes (default: %(default)s)")
    parser.add_argument("--init", type=Path, default=None,
                        help="eagle3: start from this trained layer (same target) instead of from scratch")
    # fmt: on
    sizes: tuple[tuple[str, type, object, str], ...] = (
        ("--num-heads", int, recipe.num_heads, "markov/medusa: heads (draft depth)"),
        ("--tokens", int, generation.tokens, "response tokens to generate"),
        ("--steps", int, training.steps, "markov/medusa: training steps"),
        ("--batch-size", int, training.batch_size, "markov/medusa: rows per step"),
        ("--seed", int, training.seed, "initialisation and batch order"),
        ("--data-seed", int, generation.seed, "order of the prompts answered (another seed draws other prompts)"),
        ("--max-new-tokens", int, generation.max_new_tokens, "longest answer"),
        ("--gen-batch-size", int, generation.batch_size, "answers generated at once"),
        ("--threads", int, generation.threads, "torch threads for data passes"),
        ("--epochs", float, eagle.epochs, "eagle3: passes over the data"),
        ("--ttt-steps", int, eagle.steps, "eagle3: unrolled draft depths trained"),
        ("--rows-per-batch", int, eagle.rows_per_batch, "eagle3: rows per step"),
        ("--context", int, eagle.context, "eagle3: prompt rows kept per sequence"),
    )
    for flag, kind, default, text in sizes:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--out", args.out), ("--work", args.work)):
        if path is not None and path.exists() and not path.is_dir():
            raise CausalDraftError(f"{flag} {path} is a file; give a directory (made if missing)")
    if args.heads == "eagle3":
        return run_eagle3(args)
    if args.init is not None:
        raise CausalDraftError("--init applies to --heads eagle3 only")
    if args.data_temperature != 0.0:
        raise CausalDraftError("--data-temperature applies to --heads eagle3 only")
    generation = GenerationConfig(tokens=args.tokens, max_new_tokens=args.max_new_tokens,
                                  batch_size=args.gen_batch_size, threads=args.threads,
                                  seed=args.data_seed)  # fmt: skip
    training = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    recipe = Recipe(
        model=args.model, prompts=tuple(args.prompts), kind=args.heads, out=args.out,
        num_heads=args.num_heads, draft_vocab=Recipe.draft_vocab if args.draft_vocab is None else args.draft_vocab,
        work=args.work, dtype=args.dtype,
        generation=generation, training=training, command=shlex.join(["causaldraft", *sys.argv[1:]]),
    )  # fmt: skip
    summary = run_recipe(recipe)
    print(json.dumps(summary, indent=2))
    return 0


def run_eagle3(args: argparse.Namespace) -> int:
    """eagle3 keeps the heads' flags; --steps and --batch-size (heads only) are replaced by
    --epochs and --rows-per-batch, --lr is shared."""
    defaults = Eagle3TrainConfig()
    batch = args.gen_batch_size if args.gen_batch_size != GenerationConfig().batch_size else None
    generation = FeatureGenConfig(tokens=args.tokens, max_new_tokens=args.max_new_tokens,
                                  batch_size=batch or FeatureGenConfig().batch_size,
                                  threads=max(args.threads, 2), seed=args.data_seed,
                                  temperature=args.data_temperature)  # fmt: skip
    lr = args.lr if args.lr != TrainConfig().lr else defaults.lr
    training = Eagle3TrainConfig(epochs=args.epochs, rows_per_batch=args.rows_per_batch, steps=args.ttt_steps,
                                 context=args.context, lr=lr, seed=args.seed)  # fmt: skip
    recipe = Eagle3Recipe(
        model=args.model, prompts=tuple(args.prompts), out=args.out, draft_vocab=args.draft_vocab, work=args.work,
        dtype=args.dtype, generation=generation, training=training,
        command=shlex.join(["causaldraft", *sys.argv[1:]]), init=args.init,
    )  # fmt: skip
    summary = run_eagle3_recipe(recipe)
    print(json.dumps(summary, indent=2))
    return 0
