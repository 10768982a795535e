"""``causaldraft train-heads``: flags derived from the recipe's frozen configs."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import TypeVar

from causaldraft.drafters.heads import HEAD_KINDS
from causaldraft.errors import CausalDraftError
from causaldraft.train.eagle3_recipe import Eagle3Recipe, run_eagle3_recipe
from causaldraft.train.eagle3_train import Eagle3TrainConfig
from causaldraft.train.feature_data import FeatureGenConfig
from causaldraft.train.recipe import HEADS_DATA, Recipe, run_recipe
from causaldraft.train.trainer import TrainConfig

T = TypeVar("T")


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    recipe = Recipe(model="default", prompts=(), kind="markov", out=Path("."))
    generation, training, eagle = HEADS_DATA, TrainConfig(), Eagle3TrainConfig()
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
    parser.add_argument("--lr", type=float, default=None,
                        help=f"learning rate (default: {training.lr}; eagle3: {eagle.lr})")
    parser.add_argument("--data-temperature", type=float, default=0.0,
                        help="eagle3: answer the prompts sampled at this temperature (0: greedily), seeded by "
                        "--data-seed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=recipe.dtype,
                        help="the target's dtype in the data passes (default: %(default)s)")
    parser.add_argument("--init", type=Path, default=None,
                        help="eagle3: start from this trained layer (same target) instead of from scratch")
    # fmt: on
    sizes: tuple[tuple[str, type, object, str], ...] = (
        ("--tokens", int, generation.tokens, "response tokens to generate"),
        ("--seed", int, training.seed, "initialisation and batch order"),
        ("--data-seed", int, generation.seed, "order of the prompts answered (another seed draws other prompts)"),
        ("--max-new-tokens", int, generation.max_new_tokens, "longest answer"),
        ("--gen-batch-size", int, generation.batch_size, "answers generated at once"),
        ("--threads", int, generation.threads, "torch threads for data passes"),
    )
    for flag, kind, default, text in sizes:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    # flags of one kind only: given for the other kind, they are refused (``refuse_other_kinds``)
    for flag, kind, default, text in (
        ("--num-heads", int, recipe.num_heads, "markov/medusa: heads (draft depth)"),
        ("--steps", int, training.steps, "markov/medusa: training steps"),
        ("--batch-size", int, training.batch_size, "markov/medusa: rows per step"),
        ("--epochs", float, eagle.epochs, "eagle3: passes over the data"),
        ("--ttt-steps", int, eagle.steps, "eagle3: unrolled draft depths trained"),
        ("--rows-per-batch", int, eagle.rows_per_batch, "eagle3: rows per step"),
        ("--context", int, eagle.context, "eagle3: prompt rows kept per sequence"),
    ):
        parser.add_argument(flag, type=kind, default=None, help=f"{text} (default: {default})")
    parser.set_defaults(func=run)


HEADS_ONLY = ("num_heads", "steps", "batch_size")
EAGLE3_ONLY = ("epochs", "ttt_steps", "rows_per_batch", "context", "init")


def refuse_other_kinds(args: argparse.Namespace) -> None:
    """A flag of the other kind of drafter is refused rather than silently unused."""
    other = HEADS_ONLY if args.heads == "eagle3" else EAGLE3_ONLY
    given = [name for name in other if getattr(args, name) is not None]
    if args.heads != "eagle3" and args.data_temperature != 0.0:
        given.append("data_temperature")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        which = "--heads markov/medusa" if args.heads == "eagle3" else "--heads eagle3"
        raise CausalDraftError(f"{flags} {'applies' if len(given) == 1 else 'apply'} to {which} only")


def resolved(value: T | None, default: T) -> T:
    return default if value is None else value


def run(args: argparse.Namespace) -> int:
    for flag, path in (("--out", args.out), ("--work", args.work)):
        if path is not None and path.exists() and not path.is_dir():
            raise CausalDraftError(f"{flag} {path} is a file; give a directory (made if missing)")
    refuse_other_kinds(args)
    if args.heads == "eagle3":
        return run_eagle3(args)
    generation = FeatureGenConfig(tokens=args.tokens, max_new_tokens=args.max_new_tokens, seed=args.data_seed,
                                  batch_size=args.gen_batch_size, threads=args.threads)  # fmt: skip
    defaults = TrainConfig()
    training = TrainConfig(steps=resolved(args.steps, defaults.steps),
                           batch_size=resolved(args.batch_size, defaults.batch_size),
                           lr=resolved(args.lr, defaults.lr), seed=args.seed)  # fmt: skip
    recipe = Recipe(
        model=args.model, prompts=tuple(args.prompts), kind=args.heads, out=args.out,
        num_heads=resolved(args.num_heads, Recipe.num_heads),
        draft_vocab=resolved(args.draft_vocab, Recipe.draft_vocab),
        work=args.work, dtype=args.dtype,
        generation=generation, training=training, command=shlex.join(["causaldraft", *sys.argv[1:]]),
    )  # fmt: skip
    summary = run_recipe(recipe)
    print(json.dumps(summary, indent=2))
    return 0


def run_eagle3(args: argparse.Namespace) -> int:
    """eagle3 shares the data flags with the heads; --epochs, --ttt-steps, --rows-per-batch and --context
    are its own, and --lr has a default of its own."""
    defaults = Eagle3TrainConfig()
    generation = FeatureGenConfig(tokens=args.tokens, max_new_tokens=args.max_new_tokens,
                                  batch_size=args.gen_batch_size, threads=args.threads, seed=args.data_seed,
                                  temperature=args.data_temperature)  # fmt: skip
    training = Eagle3TrainConfig(epochs=resolved(args.epochs, defaults.epochs),
                                 rows_per_batch=resolved(args.rows_per_batch, defaults.rows_per_batch),
                                 steps=resolved(args.ttt_steps, defaults.steps),
                                 context=resolved(args.context, defaults.context),
                                 lr=resolved(args.lr, defaults.lr), seed=args.seed)  # fmt: skip
    recipe = Eagle3Recipe(
        model=args.model, prompts=tuple(args.prompts), out=args.out, draft_vocab=args.draft_vocab, work=args.work,
        dtype=args.dtype, generation=generation, training=training,
        command=shlex.join(["causaldraft", *sys.argv[1:]]), init=args.init,
    )  # fmt: skip
    summary = run_eagle3_recipe(recipe)
    print(json.dumps(summary, indent=2))
    return 0
