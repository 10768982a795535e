#!/bin/bash
# stop 47: the command on this stop's code (nothing else running)
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress"
$B --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s47/final-int4 > runs/s47/final-int4.log 2>&1
$B --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype bfloat16 --out runs/s47/final-bfloat16 > runs/s47/final-bfloat16.log 2>&1
$B --methods ar,eagle3:dynamic,markov:dynamic --dtype bfloat16 --temperature 1 --seed 0 --out runs/s47/final-t1-bf16 > runs/s47/final-t1-bf16.log 2>&1
.venv/bin/causaldraft bench --prompts runs/s45/specbench-15.jsonl --compile --max-new-tokens 256 --no-progress --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s47/final-specbench-int4 > runs/s47/final-specbench-int4.log 2>&1
echo done > runs/s47/final.done
