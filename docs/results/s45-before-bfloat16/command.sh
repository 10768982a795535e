#!/bin/bash
# stop 45: the command (code of stop 44, b1d765b; nothing else running)
cd /work/main
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype bfloat16 --out runs/s45/final-bfloat16
