#!/bin/bash
# stop 46: bf16 runs again after the bf16 product choice was timed again (oneDNN), nothing else running
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress"
$B --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype bfloat16 --out runs/s46/final2-bfloat16 > runs/s46/final2-bfloat16.log 2>&1
$B --methods ar,eagle3:dynamic,markov:dynamic --dtype bfloat16 --temperature 1 --seed 0 --out runs/s46/final2-t1-bf16 > runs/s46/final2-t1-bf16.log 2>&1
echo done > runs/s46/final2.done
