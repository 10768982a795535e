#!/bin/bash
# stop 51: what the drafters accept in bf16 when the budget is not cut by the cost model (16 nodes every step)
cd /work/main
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress \
  --methods ar,markov:dynamic,eagle3:dynamic --dtype bfloat16 --no-adapt --no-fallback --max-nodes 16 \
  --out runs/s51/fixed16-bfloat16
