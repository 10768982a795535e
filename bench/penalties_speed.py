"""What penalties (and a logit bias) cost speculative decoding: the first turns of a prompt file, plain decoding and
each drafter, with and without penalties, alternating in one process; tokens/s, mean accepted, and whether each
drafter's tokens equal plain decoding's under the same penalties (they must: penalties.py).

    .venv/bin/python bench/penalties_speed.py --dtype int4 --drafters lookup,eagle3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import causaldraft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="bench/prompts/mt-bench-8.jsonl")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--drafters", default="lookup,eagle3")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--penalties", default='{"frequency_penalty": 0.5, "presence_penalty": 0.3, '
                        '"repetition_penalty": 1.1}', help="a JSON object of request options")  # fmt: skip
    args = parser.parse_args()
    questions = [json.loads(line)["turns"][0] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    penalties = json.loads(args.penalties)
    engines = {name: causaldraft.load(model="default", dtype=args.dtype, drafter=name)
               for name in ("none", *args.drafters.split(","))}  # fmt: skip
    for options in ({}, penalties):
        expected: list[list[int]] = []
        for name, engine in engines.items():
            engine.generate(questions[0], chat=True, max_new_tokens=16, **options)  # warm-up
            tokens, seconds, passes, same = 0, 0.0, 0, True
            for index, question in enumerate(questions):
                started = time.perf_counter()
                result = engine.generate(question, chat=True, max_new_tokens=args.max_new_tokens, **options)
                seconds += time.perf_counter() - started
                tokens += len(result.token_ids)
                passes += result.stats.target_forwards
                if name == "none":
                    expected.append(result.token_ids)
                same = same and result.token_ids == expected[index]
            label = "penalized" if options else "plain    "
            print(
                f"{label} {name:8s} {tokens / seconds:7.1f} tokens/s  mean accepted {tokens / passes:.2f}  "
                f"equal to plain decoding: {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
