"""Real decoding on MT-bench first turns: plain vs markov/medusa heads (with and without lookup).

Usage: .venv/bin/python bench/heads_eval.py [--prompts 8] [--max-new-tokens 256] [--heads-root DIR]
Prints one JSON line per method (mean accepted length, tokens/s) and a summary with the
markov/medusa ratio of accepted drafts per step (mean accepted - 1) at equal, fixed tree budgets.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from causaldraft.api import load
from causaldraft.models.loading import load_model

QUESTIONS = Path(__file__).resolve().parent / "prompts" / "mt-bench-8.jsonl"  # repository default


def pick_prompts(count: int) -> list[str]:
    """Round-robin over categories so a small count still spans them all."""
    by_category: dict[str, list[str]] = {}
    for line in QUESTIONS.read_text().splitlines():
        record = json.loads(line)
        by_category.setdefault(record["category"], []).append(record["turns"][0])
    picked: list[str] = []
    for index in range(10):
        for prompts in by_category.values():
            if len(picked) < count and index < len(prompts):
                picked.append(prompts[index])
    return picked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--heads-root", default=None, help="dir with markov/ and medusa/ (default: shipped)")
    parser.add_argument("--methods", default="none,markov:dynamic,markov:nolookup,medusa:nolookup")
    args = parser.parse_args()
    target = load_model("default", "native", "bfloat16")
    prompts = pick_prompts(args.prompts)
    methods = {
        "none": {"drafter": "none"},
        "lookup": {"drafter": "lookup"},
        "markov:dynamic": {"drafter": "markov"},
        "medusa:dynamic": {"drafter": "medusa"},
        "markov:fixed": {"drafter": "markov", "adapt": False, "fallback": False},
        # the ablation: fixed, equal budgets, no lookup merge, no fallback
        "markov:nolookup": {"drafter": "markov", "lookup_merge": False, "adapt": False, "fallback": False},
        "medusa:nolookup": {"drafter": "medusa", "lookup_merge": False, "adapt": False, "fallback": False},
    }
    results = {}
    for name in args.methods.split(","):
        options = dict(methods[name])
        if args.heads_root and options["drafter"] in ("markov", "medusa"):
            options["heads"] = str(Path(args.heads_root) / str(options["drafter"]))
        engine = load(loaded=target, compile=False, **options)  # type: ignore[arg-type]
        engine.generate(prompts[0], max_new_tokens=16, chat=True)  # warm-up
        tokens = forwards = speculated = nodes = 0
        wall = draft = 0.0
        outputs = []
        started = time.perf_counter()
        for prompt in prompts:
            result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, chat=True)
            tokens += result.stats.new_tokens
            forwards += result.stats.target_forwards
            wall += result.stats.wall_s
            speculated += sum(step.speculated and step.nodes > 1 for step in result.stats.steps)
            nodes += sum(step.nodes for step in result.stats.steps)
            draft += sum(step.draft_s for step in result.stats.steps)
            outputs.append(result.token_ids)
        results[name] = {
            "method": name,
            "mean_accepted": round(tokens / forwards, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "new_tokens": tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "speculative_steps": round(speculated / forwards, 3),
            "mean_nodes": round(nodes / forwards, 2),
            "draft_ms_per_step": round(1000 * draft / forwards, 2),
            "outputs": outputs,
        }
        print(json.dumps({k: v for k, v in results[name].items() if k != "outputs"}), flush=True)
    if "none" in results:
        for name, record in results.items():
            same = sum(a == b for a, b in zip(record["outputs"], results["none"]["outputs"], strict=True))
            speedup = round(record["tokens_per_s"] / results["none"]["tokens_per_s"], 2)
            print(json.dumps({"method": name, "identical_to_plain": f"{same}/{len(prompts)}", "speedup": speedup}))
    if "markov:nolookup" in results and "medusa:nolookup" in results:
        markov = results["markov:nolookup"]["mean_accepted"] - 1
        medusa = results["medusa:nolookup"]["mean_accepted"] - 1
        print(json.dumps({"markov_over_medusa_drafts_per_step": round(markov / max(medusa, 1e-9), 3)}))


if __name__ == "__main__":
    main()
