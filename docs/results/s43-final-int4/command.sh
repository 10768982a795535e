#!/bin/bash
cd /work/main
B=".venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress"
$B --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s43/final-int4 > runs/s43/final-int4.log 2>&1
