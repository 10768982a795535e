#!/bin/bash
cd /work/main
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress \
  --methods ar,eagle3:dynamic,markov:dynamic --dtype bfloat16 --temperature 1 --seed 0 --out /work/runs48/final-t1-bfloat16
