#!/bin/bash
# stop 45: the command on this stop's code (cc8568f, after CI, nothing else running)
cd /work/main
.venv/bin/causaldraft bench --prompts bench/prompts/mt-bench-8.jsonl --compile --max-new-tokens 256 --no-progress --methods ar,lookup,markov:dynamic,eagle3:dynamic,llamacpp --dtype int4 --out runs/s45/final2-int4
