"""The bf16 LM head three ways in one process, interleaved (docs/screened-head.md): screened (the default where the
Q8_0 kernel runs), the same head without its screen (every logit through ``bf16_mm``) and oneDNN's packed head (the
default before stop 55). One engine per drafter; its head is swapped between generations, so every variant decodes
the same prompts with the same calibrated tree budgets, in rotating order, on a machine whose speed drifts.

    .venv/bin/python bench/screened_head.py --drafters none,eagle3 --temperature 0
    .venv/bin/python bench/screened_head.py --drafters none,eagle3 --temperature 1 --seed 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from causaldraft.api import load
from causaldraft.models.native import NativeLlama
from causaldraft.models.packed import packed_head
from causaldraft.models.screened_head import ScreenedHead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="bench/prompts/mt-bench-8.jsonl")
    parser.add_argument("--drafters", default="none,eagle3")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    questions = [json.loads(line)["turns"][0] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    options: dict[str, object] = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed is not None:
        options["seed"] = args.seed
    for drafter in args.drafters.split(","):
        engine = load("default", dtype="bfloat16", drafter=drafter)
        backend = engine.decoder.target
        assert isinstance(backend, NativeLlama) and isinstance(backend.lm_head, ScreenedHead)
        screened = backend.lm_head
        onednn = packed_head(screened.weight)
        assert onednn is not None
        heads = {"screened": (screened, True), "dense": (screened, False), "onednn": (onednn, True)}
        seconds: dict[str, list[float]] = {name: [] for name in heads}
        outputs: dict[str, list[list[int]]] = {name: [] for name in heads}
        order = list(heads)
        engine.generate([{"role": "user", "content": questions[0]}], max_new_tokens=16)  # warm-up
        for round_index in range(args.rounds):
            for question in questions:
                messages = [{"role": "user", "content": question}]
                for name in order:
                    head, screening = heads[name]
                    backend.lm_head = head
                    screened.screening = screening
                    started = time.perf_counter()
                    tokens = engine.generate(messages, **options).token_ids  # type: ignore[arg-type]
                    seconds[name].append((time.perf_counter() - started) / len(tokens))
                    if round_index == 0:
                        outputs[name].append(tokens)
                order = order[1:] + order[:1]  # rotate who goes first
        backend.lm_head, screened.screening = screened, True
        same = all(outputs[name] == outputs["screened"] for name in heads)
        print(f"{drafter} T={args.temperature}: ms per token, median over {len(seconds['screened'])} answers"
              f" (mean); the same tokens in all three: {same}")  # fmt: skip
        for name in heads:
            median, mean = 1e3 * statistics.median(seconds[name]), 1e3 * statistics.mean(seconds[name])
            print(f"  {name:9s} {median:6.2f} ({mean:.2f})")


if __name__ == "__main__":
    main()
