#!/bin/bash
# stop 44: the int4 run again, right after the three runs of final.sh
cd /work/main
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s44/final-int4-2
