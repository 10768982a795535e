"""Is the eagle3 layer fed in decoding what it is fed in training? A replay on real prompts.

Each question's first turn is decoded with an eagle3 chain (no adaptation, no lookup merge, no fallback); at every
step the output of the draft row that proposes the root's children is kept (``RootRecorder``). Then one
teacher-forced layer pass over prompt + output, with the features of one plain target pass (what training
computes), gives that row again (``teacher_forced_rows``). The script prints how often the two rows' top guesses
agree, their largest difference, and the depth-1 acceptance at those steps.

Stop 37 (fp32 eager, mt-bench-8, 128 tokens, chain of 1): 759 steps, agreement 1.000, acceptance 0.335 both ways;
so a gap between teacher-forced accuracy and decode-loop acceptance is the prompts and step selection, not feeding.
bf16 compiled: 769 steps, agreement 0.975, acceptance 0.315 decoded and 0.319 teacher-forced: the layer's own
products differ (a step's few rows run through Q8_0 / int8 weights, ``models/packed.DraftLinear``; the whole
sequence at once through packed bf16), which drafts need not match.

    .venv/bin/python bench/eagle3_replay.py --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

import causaldraft
from causaldraft.bench.prompts import read_questions
from causaldraft.drafters.eagle3 import Eagle3Drafter, RootRecorder, teacher_forced_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=Path, default=Path("bench/prompts/mt-bench-8.jsonl"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true", help="compiled target graphs (bf16, int4)")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--heads", default=None, help="eagle3 directory (default: the shipped layer)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    questions = [question.turns[0] for question in read_questions(args.prompts)]
    engine = causaldraft.load(
        "default", dtype=args.dtype, compile=args.compile, drafter="eagle3", tree="chain", depth=args.depth,
        adapt=False, fallback=False, lookup_merge=False, heads=args.heads,
    )  # fmt: skip
    inner = engine.decoder.drafter
    assert isinstance(inner, Eagle3Drafter)
    recorder = RootRecorder(inner)
    engine.decoder = dataclasses.replace(engine.decoder, drafter=recorder)
    steps = agree = decoded_right = forced_right = 0
    largest = 0.0
    for question in questions:
        result = engine.generate(question, chat=True, max_new_tokens=args.max_new_tokens)
        tokens = engine.encode(question, chat=True) + result.token_ids
        forced = teacher_forced_rows(inner, tokens)
        with torch.inference_mode():
            for n, row in recorder.roots.items():
                if n >= len(tokens):
                    continue  # the step after the last token
                guesses = [int(inner.layer.vocab_ids[int(inner.project(inner.layer.norm(r)).float().argmax())])
                           for r in (row, forced[n - 2])]  # fmt: skip
                largest = max(largest, float((row.float() - forced[n - 2].float()).abs().max()))
                steps += 1
                agree += guesses[0] == guesses[1]
                decoded_right += guesses[0] == tokens[n]
                forced_right += guesses[1] == tokens[n]
    print(f"eagle3 chain of {args.depth}, {args.dtype}{' compiled' if args.compile else ''}: {steps} steps; "
          f"top guess of the decode loop == teacher-forced {agree / max(steps, 1):.3f} (largest row difference "
          f"{largest:.2e}); depth-1 acceptance {decoded_right / max(steps, 1):.3f} decoded, "
          f"{forced_right / max(steps, 1):.3f} teacher-forced")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
