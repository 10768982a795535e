#!/bin/bash
# stop 55: seeded T=1 sampling, the bf16 LM head screened (default) against CAUSALDRAFT_SCREENED_HEAD=off (the oneDNN
# head of stop 54), alternating, same code, mt-bench-8, 128 tokens, compiled graphs
out=${OUT:-/tmp/ab55-t1}
for round in 1 2; do
  for side in screened off; do
    if [ $side = off ]; then switch=off; else switch=on; fi
    CAUSALDRAFT_SCREENED_HEAD=$switch .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl \
      --compile --max-new-tokens 128 --no-progress --methods ar,eagle3:dynamic --temperature 1 --seed 0 \
      --dtype bfloat16 --out $out/$side-$round > /dev/null 2>&1
  done
done
