#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-other16.jsonl --compile --max-new-tokens 256 --no-progress"
$B --methods lookup,eagle3:dynamic --dtype bfloat16 --temperature 1 --seed 0 --out runs/s44/other16-t1-bf16
