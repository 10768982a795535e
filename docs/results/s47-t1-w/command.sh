#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 128 --no-progress --dtype bfloat16 --temperature 1 --seed 0"
for W in 3 8 16; do
$B --methods ar,eagle3:dynamic --width $W --out runs/s47/t1-w$W > runs/s47/t1-w$W.log 2>&1
done
echo done > runs/s47/t1w.done
