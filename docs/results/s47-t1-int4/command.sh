#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 128 --no-progress --dtype int4 --temperature 1 --seed 0"
$B --methods ar,lookup,markov:dynamic,eagle3:dynamic --out runs/s47/t1-int4 > runs/s47/t1-int4.log 2>&1
echo done > runs/s47/t1int4.done
