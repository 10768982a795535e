#!/bin/bash
# stop 55: the bf16 LM head screened (default) against CAUSALDRAFT_SCREENED_HEAD=off (the oneDNN head of stop 54),
# alternating, same code, mt-bench-8, 128 tokens, T=0, compiled graphs
out=${OUT:-/tmp/ab55}
for round in 1 2; do
  for side in screened off; do
    if [ $side = off ]; then switch=off; else switch=on; fi
    CAUSALDRAFT_SCREENED_HEAD=$switch .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl \
      --compile --max-new-tokens 128 --no-progress --methods ar,lookup,markov:dynamic,eagle3:dynamic \
      --dtype bfloat16 --out $out/$side-$round > /dev/null 2>&1
  done
done
