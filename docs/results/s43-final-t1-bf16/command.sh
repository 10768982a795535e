#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress"
$B --methods ar,eagle3:dynamic,markov:dynamic --dtype bfloat16 --temperature 1 --seed 0 --out runs/s43/final-t1-bf16 > runs/s43/final-t1-bf16.log 2>&1
