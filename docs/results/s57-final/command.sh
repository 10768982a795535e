#!/bin/bash
# stop 57: the command on the final code (int4, bf16; then seeded T=1 in bf16)
cd /work/main
for dtype in int4 bfloat16; do
  .venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress \
    --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype $dtype --out runs/s57/final-$dtype
done
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress \
  --methods ar,eagle3:dynamic,markov:dynamic --dtype bfloat16 --temperature 1 --seed 0 --out runs/s57/final-t1-bfloat16
