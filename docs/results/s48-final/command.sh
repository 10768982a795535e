#!/bin/bash
# stop 48: the command on the final code (the Markov and Medusa heads retrained on 500k tokens)
cd /work/main
for dtype in bfloat16 int4; do
  .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress \
    --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype $dtype --out /work/runs48/final-$dtype
done
