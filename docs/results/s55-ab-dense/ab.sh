#!/bin/bash
# stop 55: the screened head against the same head without its screen (CAUSALDRAFT_SCREENED_HEAD=dense: every logit
# through bf16_mm) and the oneDNN head of stop 54 (=off), bf16, mt-bench-8, 128 tokens; greedy, then seeded T=1
out=${OUT:-/tmp/ab55-dense}
for round in 1 2; do
  for side in on dense off; do
    CAUSALDRAFT_SCREENED_HEAD=$side .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl \
      --compile --max-new-tokens 128 --no-progress --methods ar,eagle3:dynamic --dtype bfloat16 \
      --out $out/t0-$side-$round > /dev/null 2>&1
    CAUSALDRAFT_SCREENED_HEAD=$side .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl \
      --compile --max-new-tokens 128 --no-progress --methods ar,eagle3:dynamic --dtype bfloat16 \
      --temperature 1 --seed 0 --out $out/t1-$side-$round > /dev/null 2>&1
  done
done
