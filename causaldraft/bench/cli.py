"""``causaldraft bench``: registered by causaldraft.cli when this module exists."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from causaldraft.bench.harness import DEFAULT_BUDGETS, BenchConfig
from causaldraft.bench.methods import parse_methods
from causaldraft.errors import CausalDraftError
from causaldraft.flags import add_draft_options, add_model_flags, engine_config

DEFAULT_OUT = "bench-out"


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = commands.add_parser("bench", help="compare methods on a Spec-Bench / MT-bench prompt file")
    bench.add_argument("--prompts", required=True, help="jsonl with question_id, category, turns")
    methods = (
        "comma-separated: hf, hf-lookup, ar, llamacpp, auto|lookup|draft|medusa|markov|eagle3[:chain|static|dynamic]"
    )
    bench.add_argument("--methods", required=True, help=methods)
    add_model_flags(bench)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--limit", type=int, default=None, help="first N questions (after --categories)")
    bench.add_argument("--categories", default=None, help="comma-separated categories to keep")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--warmup", type=int, default=1, help="warm-up generations per method")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    bench.add_argument("--profile", action="store_true", help="also sweep the tree budget of tree methods")
    bench.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), help="budgets for --profile")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    threads = "torch CPU threads (default: torch's); an engine drops to one while other processes slow it"
    bench.add_argument("--threads", type=int, default=None, help=threads)
    add_draft_options(bench)
    bench.set_defaults(func=run)


def parse_budgets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise CausalDraftError(f"--budgets must be comma-separated integers, got {text!r}") from error


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    engine = engine_config(args)
    if args.prefix_cache_mb is None:  # each request from an empty cache, as the llama.cpp baseline (llm.reset())
        engine = replace(engine, prefix_cache_mb=0)
    categories = tuple(part.strip() for part in (args.categories or "").split(",") if part.strip())
    return BenchConfig(prompts=args.prompts, methods=tuple(parse_methods(args.methods)), temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, limit=args.limit, categories=categories,
                       repeats=args.repeats, warmup=args.warmup, seed=args.seed, profile=args.profile,
                       budgets=parse_budgets(args.budgets), engine=engine)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from causaldraft.bench.harness import run_bench
    from causaldraft.bench.report import prepare_out, write_outputs

    config = config_from_args(args)
    prepare_out(args.out)
    if args.threads is not None:
        if args.threads < 1:
            raise CausalDraftError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    bench_run = run_bench(config, progress=not args.no_progress)
    results = write_outputs(bench_run, args.out)
    methods = results["methods"]
    assert isinstance(methods, dict)
    for name, entry in methods.items():
        if "error" in entry:
            print(f"{name}: FAILED: {entry['error']}", file=sys.stderr)
        else:
            shown = {key: entry[key] for key in ("tokens_per_s", "mean_accepted", "speedup_vs_hf", "speedup_vs_ar",
                                                 "exact_match_vs_ar")}  # fmt: skip
            print(f"{name}: {json.dumps(shown)}")
    for question, why in bench_run.skipped.items():
        print(f"question {question} left out for every method: {why}", file=sys.stderr)
    print(f"wrote {args.out}/results.json, outputs.jsonl, steps.jsonl, report.md and plots")
    if bench_run.interrupted:
        print("causaldraft: interrupted: the results hold the questions every method had finished", file=sys.stderr)
        return 130
    return 0 if len(bench_run.errors) < len(config.methods) else 1
