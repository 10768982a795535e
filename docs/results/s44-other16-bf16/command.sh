#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-other16.jsonl --compile --max-new-tokens 256 --no-progress"
$B --methods ar,lookup,eagle3:dynamic,markov:dynamic --dtype bfloat16 --out runs/s44/other16-bf16
