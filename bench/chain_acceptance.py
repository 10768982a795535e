"""A drafter alone in real decoding: a fixed chain (no adaptation, no prompt-lookup merge, no fallback) on the
first turn of each question, and how often each depth is accepted given the ones before it.

``bench/drafter_accuracy.py`` measures top-1 per depth on held-out training sequences, teacher-forced; this
measures the same drafter on prompts it was not trained on, in the engine's own decode loop (so a mismatch
between how a drafter is trained and how it is fed shows up as a gap between the two). Greedy, or seeded
Gumbel sampling at T > 0 (the draft guesses the very token the target samples).

    .venv/bin/python bench/chain_acceptance.py --drafter eagle3 --temperatures 0,1
    .venv/bin/python bench/chain_acceptance.py --drafter markov --dtype float32 --no-compile
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import causaldraft
from causaldraft.bench.prompts import read_questions


def depth_rates(accepted: Counter[int], depth: int) -> list[tuple[float | None, int]]:
    """(share of steps that reached depth d and had it accepted, steps that reached it) for d = 1..depth.
    Example: accepted {0: 6, 1: 2, 2: 2} gives d1 (0.4, 10), d2 (0.5, 4)."""
    rates: list[tuple[float | None, int]] = []
    for d in range(1, depth + 1):
        reached = sum(count for taken, count in accepted.items() if taken >= d - 1)
        passed = sum(count for taken, count in accepted.items() if taken >= d)
        rates.append((passed / reached if reached else None, reached))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts/mt-bench-8.jsonl"))
    parser.add_argument("--drafter", default="eagle3")
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    questions = [question.turns[0] for question in read_questions(args.prompts)]
    engine = causaldraft.load(
        "default", dtype=args.dtype, compile=not args.no_compile, drafter=args.drafter, tree="chain",
        depth=args.depth, adapt=False, fallback=False, lookup_merge=False,
    )  # fmt: skip
    for temperature in (float(t) for t in args.temperatures.split(",")):
        accepted: Counter[int] = Counter()
        for seed, question in enumerate(questions):
            result = engine.generate(question, chat=True, max_new_tokens=args.max_new_tokens,
                                     temperature=temperature, seed=seed)  # fmt: skip
            accepted.update(step.accepted for step in result.stats.steps if step.nodes > 1)
        steps = sum(accepted.values())
        mean = sum(taken * count for taken, count in accepted.items()) / max(steps, 1)
        shown = ", ".join(f"d{d} {rate:.2f} ({reached})" if rate is not None else f"d{d} -"
                          for d, (rate, reached) in enumerate(depth_rates(accepted, args.depth), start=1))  # fmt: skip
        print(f"{args.drafter} chain of {args.depth}, {args.dtype}, T={temperature}: {steps} steps, "
              f"accepted drafts per step {mean:.2f}; {shown}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
