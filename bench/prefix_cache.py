"""What kept prompt prefixes save (causaldraft/prefix.py): requests that share a long system prompt, each
run by an engine that keeps prefixes and by one that reads every prompt whole, alternating, in one process.
Prints, per engine, the mean prompt-reading ms, the mean request seconds and tokens/s, the prompt tokens
copied, and checks that both engines wrote the same tokens.

    .venv/bin/python bench/prefix_cache.py --system-tokens 1024 --questions 8 --max-new-tokens 128

The system prompt is the first ``--system-tokens`` tokens of ``--system-file`` (default: docs/design.md);
the questions are the first turns of ``--prompts`` (default: bench/prompts/mt-bench-8.jsonl).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import causaldraft
from causaldraft.decode import GenerationStats
from causaldraft.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--system-file", type=Path, default=ROOT / "docs" / "design.md")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=Path, default=ROOT / "bench" / "prompts" / "mt-bench-8.jsonl")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    engines = {
        "kept": causaldraft.load(loaded=loaded, drafter=args.drafter),
        "read": causaldraft.load(loaded=loaded, drafter=args.drafter, prefix_cache_mb=0),
    }
    tokenizer = engines["kept"].tokenizer
    system_ids = tokenizer.encode(args.system_file.read_text(), add_special_tokens=False)[: args.system_tokens]
    system = "Answer the user's question; this document is for reference:\n" + tokenizer.decode(system_ids)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    questions = [row["turns"][0] for row in rows[: args.questions]]
    for engine in engines.values():  # warm-up, and the kept engine's first copy of the system prompt
        engine.generate([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], max_new_tokens=4)
    results: dict[str, list[GenerationStats]] = {name: [] for name in engines}
    identical = True
    for index, question in enumerate(questions):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        order = list(engines) if index % 2 == 0 else list(reversed(engines))
        tokens = {}
        for name in order:
            result = engines[name].generate(messages, max_new_tokens=args.max_new_tokens)
            results[name].append(result.stats)
            tokens[name] = result.token_ids
        identical &= tokens["kept"] == tokens["read"]
    prompt_tokens = len(engines["kept"].encode([{"role": "system", "content": system},
                                                {"role": "user", "content": questions[0]}]))  # fmt: skip
    print(f"{loaded.dtype}, drafter {engines['kept'].drafter_name}, {len(questions)} questions, "
          f"prompts of ~{prompt_tokens} tokens, {args.max_new_tokens} new tokens at most")  # fmt: skip
    print("engine  prompt ms  request s  tokens/s  copied tokens")
    for name, stats in results.items():
        new_tokens = sum(item.new_tokens for item in stats)
        seconds = sum(item.wall_s for item in stats)
        print(f"{name:6s}  {1000 * statistics.mean(item.prefill_s for item in stats):9.1f}  "
              f"{statistics.mean(item.wall_s for item in stats):9.3f}  {new_tokens / seconds:8.1f}  "
              f"{statistics.mean(item.cached_prompt_tokens for item in stats):13.0f}")  # fmt: skip
    print("identical tokens:", identical)


if __name__ == "__main__":
    main()
